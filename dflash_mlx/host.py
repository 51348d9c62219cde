"""The engine's one door between the device and the host.

On a GPU, `mx.async_eval` queues work and returns; every blocking read (`mx.eval`,
`.item()`, `.tolist()`, `np.array` of an array) waits until the device has finished what
it reads, and the device then idles until the host queues more. A decoding cycle should
block once (mlx-lm's `generate_step` reads step n after it has queued step n + 1), and queue
whatever it can before its host bookkeeping. So the decoding engine reads the device only
here (`read`, `wait`) and queues only here (`queue`); `tests/test_host_syncs.py` checks
that no engine module reads the device another way, and counts the reads per cycle.

A `Watch` (`watching`) counts the blocking reads and times the host's idle gaps: the
seconds from a read that drained the device until the next work is queued, during which
nothing runs there (`dflash bench host`). A read made while later work is queued behind
it (`behind=True`: a pipelined plain step) leaves the device busy and opens no gap.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import mlx.core as mx


@dataclass
class Watch:
    """Blocking reads counted, and the host's idle seconds after each read that drained
    the device (until the next `queue`, or the next read, which queues its own work)."""

    reads: int = 0
    idle: float = 0.0
    gaps: list[float] = field(default_factory=list)
    _drained: Optional[float] = None  # when the device last went idle, while it still is

    def queued(self) -> None:
        """Work was queued: an open gap closes."""
        if self._drained is not None:
            gap, self._drained = time.perf_counter() - self._drained, None
            self.idle += gap
            self.gaps.append(gap)

    def blocked(self, behind: bool) -> None:
        """A blocking read returned (`behind`: later work was queued, the device stays busy)."""
        self.reads += 1
        self._drained = None if behind else time.perf_counter()

    def close(self) -> None:
        """Stop timing: a gap still open ends here."""
        self.queued()


_watch: Optional[Watch] = None


@contextmanager
def watching() -> Iterator[Watch]:
    """Count and time the engine's reads inside the block (one watch at a time)."""
    global _watch
    previous, _watch = _watch, Watch()
    try:
        yield _watch
    finally:
        _watch.close()
        _watch = previous


def queue(*arrays: Any) -> None:
    """Start computing `arrays` (arrays or trees of them) without waiting: `mx.async_eval`."""
    mx.async_eval(*arrays)
    if _watch is not None:
        _watch.queued()


def wait(*arrays: Any, behind: bool = False) -> None:
    """Compute `arrays` and wait for them (`mx.eval`): one blocking read."""
    if _watch is not None:
        _watch.queued()  # the read queues what it evaluates
    mx.eval(*arrays)
    if _watch is not None:
        _watch.blocked(behind)


def read(*arrays: mx.array, behind: bool = False) -> Any:
    """The arrays' values on the host (`.tolist()`: a Python scalar for a 0-d array; a list
    of values for several arrays), after one blocking read that waits for all of them."""
    if _watch is not None:
        _watch.queued()  # the read queues what it evaluates
    if len(arrays) > 1:
        mx.eval(*arrays)
    values = [a.tolist() for a in arrays]
    if _watch is not None:
        _watch.blocked(behind)
    return values[0] if len(arrays) == 1 else values
