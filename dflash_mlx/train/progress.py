"""What a training run shows while it runs: running numbers between log lines, and the bar.

`Meter` keeps loss, per-position accuracy, the train-batch tau estimate and block positions
per second between two log lines; `StepBar` is the rich progress bar (or nothing), also
for data generation; `count_bar` counts through a one-off job (the feature pass)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np

if TYPE_CHECKING:
    from .checkpoint import TrainState


class Meter:
    """Running training numbers between two log lines."""

    def __init__(self, block_size: int):
        self.B = block_size
        self.loss: Optional[float] = None
        self.heldout: Optional[float] = None
        self.last = ""
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (after a log line)."""
        self.correct, self.count = np.zeros(self.B), np.zeros(self.B)
        self.tau_sum = self.blocks = 0.0
        self.gnorm = 0.0
        self.t0, self.pos0 = time.perf_counter(), None

    def add(self, out: dict) -> None:
        """Fold in one step's numbers (`Trainer.step`); the loss is a running average."""
        self.loss = out["loss"] if self.loss is None else 0.95 * self.loss + 0.05 * out["loss"]
        self.correct += out["correct"]
        self.count += out["count"]
        self.tau_sum += out["tau_sum"]
        self.blocks += out["blocks"]
        self.gnorm = out["grad_norm"]

    def _rate(self, st: TrainState) -> float:
        if self.pos0 is None:
            self.pos0 = st.positions
            self.t0 = time.perf_counter()
        return (st.positions - self.pos0) / max(time.perf_counter() - self.t0, 1e-9)

    def describe(self, st: TrainState, lr: float) -> str:
        """The progress line: loss, accuracy at a few positions, tau, speed, learning rate."""
        acc = self.correct / np.maximum(self.count, 1)
        B = self.B
        self.last = (
            f"loss {self.loss or 0:.3f} | acc@1 {acc[1]:.2f} @2 {acc[2]:.2f} @4 {acc[min(4, B - 1)]:.2f} "
            f"| tau~{self.tau_sum / max(self.blocks, 1):.2f}"
            + (f" held-out {self.heldout:.2f}" if self.heldout is not None else "")
            + f" | {self._rate(st):.0f} pos/s | lr {lr:.1e}"
        )
        return self.last

    def record(self, st: TrainState, lr: float) -> dict:
        """The numbers since the last reset as a `train_log.jsonl` record."""
        acc = self.correct / np.maximum(self.count, 1)
        return {
            "step": st.step,
            "elapsed": round(st.elapsed, 1),
            "loss": round(self.loss or 0.0, 4),
            "acc": [round(float(x), 3) for x in acc[1:]],
            "train_tau": round(self.tau_sum / max(self.blocks, 1), 3),
            "grad_norm": round(self.gnorm, 3),
            "lr": lr,
            "seqs_seen": st.seen,
            "positions": st.positions,
            "positions_per_s": round(self._rate(st), 1),
            "core_hours": round(st.core_seconds / 3600, 5),
        }


class StepBar:
    """A rich progress bar with a running description (training steps, answers written),
    or nothing."""

    def __init__(self, total: int, done: int, enabled: bool, label: str = "train", percent: bool = False):
        """`percent`: show the share done instead of "done/total" (a budget of time, not of steps)."""
        self.progress = None
        if enabled:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(
                TextColumn(f"[bold]{label}"),
                BarColumn(),
                TaskProgressColumn() if percent else MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.description}"),
            )
            self.task = self.progress.add_task("", total=total, completed=done)

    def __enter__(self) -> "StepBar":
        if self.progress:
            self.progress.start()
        return self

    def update(self, step: int, description: str) -> None:
        """Move the bar to `step` done, with `description` beside it."""
        if self.progress:
            self.progress.update(self.task, completed=step, description=description)

    def __exit__(self, *exc: Any) -> None:
        if self.progress:
            self.progress.stop()


@contextmanager
def count_bar(label: str, total: int, enabled: bool, log: Callable[[str], None]) -> Iterator[Callable[[int], None]]:
    """A rich bar over `total` items (or one log line), yielding `advance(done)`."""
    if not enabled:
        log(f"{label}: {total} sequences")
        yield lambda done: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()) as p:
        task = p.add_task("", total=total)
        yield lambda done: p.update(task, completed=done)
