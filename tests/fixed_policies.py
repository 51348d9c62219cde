"""What the block-size policy tests fix so that a run does not depend on the machine:
`rows_cost`, a CPU-shaped cost per verified row that stands in for a cycle's wall time."""

from __future__ import annotations

from dflash_mlx.policy import Width


def rows_cost(width: Width) -> float:
    """A plain step 1; a drafted cycle 1.6 + 0.05 per row verified (trees and chains alike)."""
    return 1.0 if width.size == 1 else 1.6 + 0.05 * width.size
