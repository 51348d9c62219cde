"""Which runs, a custom kernel or MLX's own op, per shape and row count, on this machine.

A custom kernel runs on a machine only once it has been checked there, and won there:

* checked: on the model's own shapes at the row counts the loop uses, its output on a
  calibration input (`Step.run`) is compared with MLX's own op on the same input: the same
  argmax in every row, and a max abs difference within `TOLERANCE[dtype]` times the
  reference's largest magnitude (at least 1). A kernel that fails is never used there.
* won: `mx.quantized_matmul` already has a one-row kernel (qmv), a few-row one on newer
  chips (qmv_wide) and a tiled one with simdgroup MMA (qmm), so `verify_qmm` may lose on
  some Macs at some M; both are timed, and the kernel runs only where it is faster.

The results are cached per chip, MLX version and model under `cache_dir()/kernel-choice/`
(written all at once, `atomic.py`). The timer and the check are parameters, so the decision
is tested off a Mac with fakes. A shape nobody checked runs MLX's op (`kernel_wins`).
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
FILE = "choice-checked.json"  # "choice.json" held timings of unchecked kernels: not read
#: The max abs difference a kernel may show against MLX's op, per dtype, relative to the
#: reference output's largest magnitude (at least 1): a few units of the dtype's rounding.
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 4e-2}


@dataclass(frozen=True)
class Step:
    """One thing to check and time: the custom kernel's or MLX's own computation of `key`."""

    key: str  # the shape and row count, e.g. "qmm 576x1536 4b g64 bfloat16 M8"
    custom: bool  # the custom kernel (True) or MLX's own op (False)
    run: Callable[[], mx.array]  # computes it on a fixed calibration input and evaluates it


Timer = Callable[[Step], float]
#: check(kernel step, MLX step) -> {"same_argmax", "max_abs_diff", "bound", "passed"}.
Check = Callable[[Step, Step], dict]


def evaluated(x: mx.array) -> mx.array:
    """`x`, evaluated (what a `Step.run` returns)."""
    mx.eval(x)
    return x


def compare_outputs(custom: Step, own: Step) -> dict:
    """The default check: run both steps once and compare their outputs (rows: every axis
    but the last): the same argmax in every row, and the max abs difference within
    `TOLERANCE` of the dtype times the reference's largest magnitude (at least 1)."""
    got, want = custom.run(), own.run()
    rows_got, rows_want = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
    same = bool(mx.array_equal(mx.argmax(rows_got, axis=-1), mx.argmax(rows_want, axis=-1)).item())
    diff = float(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item())
    scale = max(1.0, float(mx.abs(want.astype(mx.float32)).max().item()))
    bound = TOLERANCE.get(str(want.dtype).split(".")[-1], TOLERANCE["bfloat16"]) * scale
    return {"same_argmax": same, "max_abs_diff": diff, "bound": bound, "passed": same and diff <= bound}


def seconds(run: Callable[[], object], repeats: int = REPEATS) -> float:
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


_chosen: dict[str, bool] = {}  # key -> the kernel was checked and won; a property of this machine


def kernel_wins(key: str) -> bool:
    """Whether the custom kernel is to run for `key`: only where it was checked and won
    (a shape nobody checked runs MLX's op)."""
    return _chosen.get(key, False)


def decide(
    pairs: Iterable[tuple[Step, Step]], timer: Timer = median_seconds, check: Check = compare_outputs
) -> dict[str, dict]:
    """Check and time each (kernel, MLX) pair of steps: {key: {"kernel_s", "mlx_s", the
    check's fields, "kernel": checked and faster}}."""
    timings = {}
    for custom, own in pairs:
        checked = check(custom, own)
        kernel_s, mlx_s = timer(custom), timer(own)
        timings[custom.key] = {
            "kernel_s": kernel_s,
            "mlx_s": mlx_s,
            **checked,
            "kernel": bool(checked["passed"]) and kernel_s < mlx_s,
        }
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


def load_or_time(
    pairs: list[tuple[Step, Step]], timer: Timer = median_seconds, check: Check = compare_outputs
) -> dict[str, dict]:
    """The cached choice for these pairs' keys, else theirs checked and timed now and
    cached; adopted."""
    path = cache_path([custom.key for custom, _ in pairs])
    if (path / FILE).is_file():
        timings = json.loads((path / FILE).read_text())
    else:
        timings = decide(pairs, timer, check)
        with atomic_directory(path, overwrite=True) as tmp:
            (tmp / FILE).write_text(json.dumps(timings, indent=1))
    adopt(timings)
    return timings
