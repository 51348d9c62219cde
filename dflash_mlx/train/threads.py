"""How many cores a long job uses: a fixed OpenBLAS thread count, or `auto`.

The development machines have two cores that a long job (data generation, training)
shares with tests and benchmarks. Those take turns through one advisory lock,
``/tmp/dflash-cpu.lock`` (CONTRIBUTING: ``flock /tmp/dflash-cpu.lock <command>``).
Under ``--threads auto`` a long job uses two OpenBLAS threads while nobody holds that
lock and one while somebody does (one thread per job beats two under contention,
DFLASH.md section 8). It looks with a non-blocking lock attempt that it releases at
once, every few seconds at most: it never holds the lock while it works, so whoever
waits for it is not kept waiting. ``$DFLASH_CPU_LOCK`` names another lock file.

Core-seconds (the CPU time of the training steps, every thread's) measure what a run
cost; the trainer keeps them in its checkpointed state.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from .. import blas

__all__ = ["CPU_LOCK", "ThreadControl", "lock_is_held", "parse_threads"]

CPU_LOCK = "/tmp/dflash-cpu.lock"


def parse_threads(value: Optional[str]) -> Optional[int | str]:
    """``--threads``: None (leave OpenBLAS as the environment set it), a positive
    integer, or ``"auto"``. Raises a one-line ValueError naming the option."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"--threads must be a positive integer or 'auto', got {value!r}")


def lock_is_held(path: str) -> bool:
    """Whether another process holds an exclusive flock on `path` (taken and released
    at once when free; the file is created if missing)."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


class ThreadControl:
    """Sets OpenBLAS's thread count for a job and, under ``auto``, follows the CPU lock.

    `poll()` is called between computations (a training step, a decode step); it returns
    the thread count in effect from then on."""

    def __init__(
        self,
        spec: Optional[int | str] = None,
        lock_path: Optional[str] = None,
        interval: float = 5.0,
        free: int = 2,
        busy: int = 1,
    ):
        self.auto = spec == "auto"
        self.lock_path = lock_path or os.environ.get("DFLASH_CPU_LOCK") or CPU_LOCK
        self.interval, self.free, self.busy = interval, free, busy
        self._last_check = -float("inf")
        self.threads = blas.num_threads() or 1
        if isinstance(spec, int):
            self._set(spec)
        elif self.auto:
            self.poll(force=True)

    def _set(self, n: int) -> None:
        if n == self.threads and blas.num_threads() in (n, None):
            return
        import mlx.core as mx

        mx.synchronize()  # no BLAS call may be running while OpenBLAS resizes its pool
        if blas.set_num_threads(n):
            self.threads = n

    def poll(self, force: bool = False) -> int:
        """Under ``auto``, and at most every `interval` seconds unless `force`: two
        threads while the CPU lock is free, one while another process holds it."""
        now = time.monotonic()
        if self.auto and (force or now - self._last_check >= self.interval):
            self._last_check = now
            self._set(self.busy if lock_is_held(self.lock_path) else self.free)
        return self.threads

    def describe(self) -> str:
        """How the job's threads are chosen, for its first log line."""
        how = f"auto ({self.free} while {self.lock_path} is free, else {self.busy})" if self.auto else "fixed"
        return f"{self.threads} OpenBLAS thread(s), {how}"
