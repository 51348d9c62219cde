"""Which runs, a custom kernel or MLX's own op, per shape and row count, on this machine.

A custom kernel is only worth shipping where it beats MLX: `mx.quantized_matmul` already
has a one-row kernel (qmv), a few-row one on newer chips (qmv_wide) and a tiled one with
simdgroup MMA (qmm), so `verify_qmm` may lose on some Macs at some M. So on first use on
a Mac both are timed for the model's own shapes at the row counts the loop uses, the
faster is kept per (shape, rows), and the timings are cached per chip, MLX version and
model under `cache_dir()/kernel-choice/` (written all at once, `atomic.py`). The timer
is a parameter, so the decision is tested off a Mac with a fake one. A shape nobody timed
keeps the kernel (the wrappers' behaviour before any timing).
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import mlx.core as mx

from ..atomic import atomic_directory
from ..defaults import cache_dir

REPEATS = 5
FILE = "choice.json"


@dataclass(frozen=True)
class Step:
    """One thing to time: the custom kernel's or MLX's own computation of `key`."""

    key: str  # the shape and row count, e.g. "qmm 576x1536 4b g64 bfloat16 M8"
    custom: bool  # the custom kernel (True) or MLX's own op (False)
    run: Callable[[], None]  # computes and evaluates it


Timer = Callable[[Step], float]


def seconds(run: Callable[[], None], repeats: int = REPEATS) -> float:
    """Median wall time of `run()` (which evaluates what it computes) after two warm-ups."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        run()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def median_seconds(step: Step) -> float:
    """The default timer: `seconds(step.run)`."""
    return seconds(step.run)


def qmm_key(n: int, k: int, bits: int, group_size: int, dtype: mx.Dtype, rows: int) -> str:
    """The choice's key for x (rows, k) times an (n, k) affine-quantized weight."""
    return f"qmm {n}x{k} {bits}b g{group_size} {str(dtype).split('.')[-1]} M{rows}"


def replay_key(hk: int, hv: int, dv: int, dk: int, dtype: mx.Dtype, tokens: int) -> str:
    """The choice's key for a gated-delta replay of `tokens` tokens."""
    return f"replay hk{hk} hv{hv} dv{dv} dk{dk} {str(dtype).split('.')[-1]} T{tokens}"


_chosen: dict[str, bool] = {}  # key -> the kernel won; a property of this machine, so process-wide


def kernel_wins(key: str) -> bool:
    """Whether the custom kernel is to run for `key` (True where nothing was timed)."""
    return _chosen.get(key, True)


def decide(pairs: Iterable[tuple[Step, Step]], timer: Timer = median_seconds) -> dict[str, dict]:
    """Time each (kernel, MLX) pair of steps: {key: {"kernel_s", "mlx_s", "kernel": faster}}."""
    timings = {}
    for custom, own in pairs:
        kernel_s, mlx_s = timer(custom), timer(own)
        timings[custom.key] = {"kernel_s": kernel_s, "mlx_s": mlx_s, "kernel": kernel_s < mlx_s}
    return timings


def adopt(timings: dict[str, dict]) -> None:
    """Make `timings`' decisions the ones `kernel_wins` answers from now on."""
    _chosen.update({key: bool(t["kernel"]) for key, t in timings.items()})


def machine() -> str:
    """This chip and MLX version, as a directory name ("apple-m2-pro-mlx0.32.4")."""
    chip = str(mx.device_info().get("device_name", "unknown"))
    return re.sub(r"[^a-z0-9.]+", "-", f"{chip} mlx{mx.__version__}".lower()).strip("-")


def cache_path(keys: list[str]) -> Path:
    """Where the timings of a model with these keys are kept on this machine: the model is
    named by its shapes, so two checkpoints of one architecture share one timing."""
    model = hashlib.sha1("\n".join(sorted(keys)).encode()).hexdigest()[:16]
    return cache_dir() / "kernel-choice" / machine() / model


def load_or_time(pairs: list[tuple[Step, Step]], timer: Timer = median_seconds) -> dict[str, dict]:
    """The cached timings for these pairs' keys, else theirs timed now and cached; adopted."""
    path = cache_path([custom.key for custom, _ in pairs])
    if (path / FILE).is_file():
        timings = json.loads((path / FILE).read_text())
    else:
        timings = decide(pairs, timer)
        with atomic_directory(path, overwrite=True) as tmp:
            (tmp / FILE).write_text(json.dumps(timings, indent=1))
    adopt(timings)
    return timings
