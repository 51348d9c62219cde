"""The drafts of the tests' scripted adversaries (`tiny_drafters.ScriptedDrafter`,
`smollm2_drafters.Scripted`, `batch_rows.RowScripted`): each knows the true continuation
and proposes it, corrupted where its error pattern says, so that a test chooses which
drafts are accepted and every acceptance length (every rollback) runs."""

from __future__ import annotations

from typing import Callable

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx


def scripted_logits(
    truth: list[int], corrupt: Callable[[int, int], bool], cycle: int, start: int, n: int, vocab: int
) -> mx.array:
    """One-hot logits (n, vocab), 10 on the proposed token and -10 elsewhere, of drafts
    k = 1..n of a block whose first token sits at position `start`: the true token
    `truth[start + k]` (0 past its end), or the next id where `corrupt(cycle, k)` says."""
    tokens = []
    for k in range(1, n + 1):
        true = truth[start + k] if start + k < len(truth) else 0
        tokens.append((true + 1) % vocab if corrupt(cycle, k) else true)
    return mx.where(mx.arange(vocab)[None] == mx.array(tokens)[:, None], 10.0, -10.0)
