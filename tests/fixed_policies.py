"""What the block-size policy tests fix so that a run does not depend on the machine:
`ScriptedPolicy`, block sizes from a fixed sequence, and `rows_cost`, a CPU-shaped cost
per verified row that stands in for a cycle's wall time."""

from __future__ import annotations

import itertools

from dflash_mlx.policy import BlockSizePolicy, Width
from smollm2_drafters import BLOCK


def rows_cost(width: Width) -> float:
    """A plain step 1; a drafted cycle 1.6 + 0.05 per row verified (trees and chains alike)."""
    return 1.0 if width.size == 1 else 1.6 + 0.05 * width.size


class ScriptedPolicy(BlockSizePolicy):
    """Block sizes from a fixed sequence (cycled), still capped by the tokens left;
    `max_size`: the default target tests' `BLOCK` unless given."""

    def __init__(self, sizes, max_size: int = BLOCK):
        super().__init__(max_size)
        self.sizes = itertools.cycle(sizes)

    def choose(self, limit=None) -> int:
        return min(next(self.sizes), limit or self.max_size)
