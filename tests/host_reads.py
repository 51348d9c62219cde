"""MLX's blocking calls counted while the engine runs: the reads made through
`dflash_mlx/host.py` (one per host call), and strays, any other blocking call from the
engine's code or mlx-lm's. The `calls` fixture (conftest.py) wraps `mx.eval`,
`array.item`, `array.tolist` and the conversions `__array__`, `__bool__`, `__int__`,
`__float__`, `__index__` for one test."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import dflash_mlx
import mlx.core as mx
import mlx_lm

from dflash_mlx import host

ENGINE, MLX_LM = Path(dflash_mlx.__file__).parent, Path(mlx_lm.__file__).parent
HOST = str(ENGINE / "host.py")
BLOCKING = ("item", "tolist", "__array__", "__bool__", "__int__", "__float__", "__index__")


class Calls:
    """MLX's blocking calls seen while `counting`: reads (from host.py, one per host call)
    and strays (from anywhere else in the engine or in mlx-lm), by file and line."""

    def __init__(self):
        self.on, self.reads, self.strays = False, 0, []
        self._host: Optional[object] = None  # the frame of the host call that read last (kept alive)

    def seen(self, frame) -> None:
        if not self.on:
            return
        path = frame.f_code.co_filename
        if path == HOST:
            if frame is not self._host:
                self.reads, self._host = self.reads + 1, frame
        elif Path(path).is_relative_to(ENGINE) or Path(path).is_relative_to(MLX_LM):
            self.strays.append(f"{Path(path).name}:{frame.f_lineno}")

    @contextmanager
    def counting(self) -> Iterator[host.Watch]:
        """Count one cycle: this object's tallies start at zero; yields the host's watch."""
        self.reads, self.strays, self._host, self.on = 0, [], None, True
        try:
            with host.watching() as watch:
                yield watch
        finally:
            self.on, self._host = False, None


def count_calls(monkeypatch) -> Calls:
    """Wrap MLX's blocking calls for this test; the tally they feed."""
    counted = Calls()

    def wrapped(fn):
        def call(*args, **kwargs):
            counted.seen(sys._getframe(1))
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(mx, "eval", wrapped(mx.eval))
    for name in BLOCKING:
        monkeypatch.setattr(mx.array, name, wrapped(getattr(mx.array, name)))
    return counted
