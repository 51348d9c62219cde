"""The exponential moving average of the drafter's weights (`dflash train --ema DECAY`).

Late in a run the weights wander about their optimum with each batch's noise, and their
average drafts better than the last of them: on the long run the mean of four checkpoints
over 256 steps measured a held-out tau of 2.14 against the last checkpoint's 2.11, about a
core-hour's worth of training. `WeightAverage` keeps
ema = decay * ema + (1 - decay) * weights after every optimiser step, in float32 whatever
the drafter's dtype (at decay 0.998 a step moves it 0.2% of the way to the weights, below
bfloat16's resolution).

While it is on, the held-out evaluations measure the average and the delivered drafter is
the average; the checkpoint keeps the raw weights, which training goes on from, and the
average beside them (`AVERAGE_FILE`), so that `--resume` continues it exactly.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from ..drafter import Drafter

AVERAGE_FILE = "average.npz"  # in the checkpoint, beside optimizer.npz (the resume point keeps it in float16)


def _trainable(drafter: Drafter) -> dict[str, mx.array]:
    return dict(tree_flatten(drafter.trainable_parameters()))


class WeightAverage:
    """The average of a drafter's trainable weights (flat names -> float32 arrays)."""

    def __init__(self, decay: float, weights: dict[str, mx.array]):
        self.decay = decay
        self.weights = weights

    @classmethod
    def of(cls, decay: float, drafter: Drafter) -> "WeightAverage":
        """An average that starts at the drafter's current weights."""
        return cls(decay, {k: v.astype(mx.float32) for k, v in _trainable(drafter).items()})

    def update(self, drafter: Drafter) -> None:
        """Fold in the drafter's weights after an optimiser step."""
        d = self.decay
        self.weights = {k: d * self.weights[k] + (1 - d) * v.astype(mx.float32) for k, v in _trainable(drafter).items()}
        mx.eval(self.weights)

    def save(self, path: Path) -> None:
        """Write the average (float32) to `path`, an .npz file."""
        mx.savez(str(path), **self.weights)

    def delivered(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """A drafter's flat `weights` with the averaged ones in their place, in their dtype."""
        return {**weights, **{k: v.astype(weights[k].dtype) for k, v in self.weights.items()}}

    @contextmanager
    def in_use(self, drafter: Drafter) -> Iterator[Drafter]:
        """The drafter with the average in place of its weights until the block ends, then
        its own (raw) weights again, exactly: the optimiser goes on from those."""
        raw = drafter.trainable_parameters()
        drafter.update(tree_unflatten(list(self.delivered(_trainable(drafter)).items())))
        try:
            yield drafter
        finally:
            drafter.update(raw)


def start_average(
    decay: Optional[float], drafter: Drafter, checkpoint: Optional[Path], log: Callable[[str], None]
) -> Optional[WeightAverage]:
    """The run's weight average: None without `decay` (no --ema); the one `checkpoint` keeps
    (a resumed run); else one that starts at the drafter's current weights, which a resumed
    run says in one line (a checkpoint of a run without --ema keeps none, nor does one
    restored from a resume point saved before session 27)."""
    if decay is None:
        return None
    if checkpoint is not None and (checkpoint / AVERAGE_FILE).is_file():
        return WeightAverage(decay, dict(mx.load(str(checkpoint / AVERAGE_FILE))))
    if checkpoint is not None:
        log("--ema: the checkpoint keeps no weight average: it starts from the weights")
    return WeightAverage.of(decay, drafter)
