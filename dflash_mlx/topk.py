"""The columns of each row's k largest entries, through blocks of the row.

The k largest entries of a row lie in the k blocks (of `BLOCK` columns) with the largest
maxima: a block holding one of them has a maximum at least that entry, and only blocks
holding one of the k - 1 larger entries can rank above it. So a partition over the
V / BLOCK block maxima, then one over the k * BLOCK entries of the chosen blocks, find
what one partition over all V columns finds (the same values; among equal values, maybe
other columns). On MLX's CPU backend that is ~20x faster for a 49K vocabulary; the teacher
pass of training, the drafter's tree candidates, DFlash2's selector (decoding and training)
and the server's logprobs use it.
"""

from __future__ import annotations

import mlx.core as mx

BLOCK = 64  # columns per block: V / 64 maxima and k * 64 candidates are both small


def top_k_columns(x: mx.array, k: int) -> mx.array:
    """The columns (..., k) of the k largest entries of each row of x (..., V), in no
    order, as `mx.argpartition(-x, k - 1, axis=-1)[..., :k]` gives them. k <= V."""
    V = x.shape[-1]
    whole = V // BLOCK * BLOCK  # the columns in whole blocks; the rest join the candidates
    if whole < 4 * k * BLOCK:  # too few blocks for the second partition to be much smaller
        return mx.argpartition(-x, k - 1, axis=-1)[..., :k]
    lead = x.shape[:-1]
    blocks = x[..., :whole].reshape(*lead, whole // BLOCK, BLOCK)  # (..., V / BLOCK, BLOCK)
    best = mx.argpartition(-blocks.max(axis=-1), k - 1, axis=-1)[..., :k]  # (..., k) blocks
    values = mx.take_along_axis(blocks, best[..., None], axis=-2).reshape(*lead, k * BLOCK)
    columns = (best[..., None] * BLOCK + mx.arange(BLOCK)).reshape(*lead, k * BLOCK)
    if whole < V:
        values = mx.concatenate([values, x[..., whole:]], axis=-1)
        rest = mx.broadcast_to(mx.arange(whole, V), (*lead, V - whole))
        columns = mx.concatenate([columns, rest.astype(columns.dtype)], axis=-1)
    picked = mx.argpartition(-values, k - 1, axis=-1)[..., :k]  # (..., k) of the candidates
    return mx.take_along_axis(columns, picked, axis=-1)
