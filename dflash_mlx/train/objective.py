"""What a drafter learns: anchored blocks, their block-parallel forward, and the loss.

For a sequence (prompt + the target's own answer) and its target features:
1. Anchors are sampled inside the answer. Anchor a makes the block
   [token a, MASK x (B-1)] at positions a .. a+B-1; its context is positions < a.
2. Every block of a batch is one row of ONE drafter forward: each row attends to its
   sequence's context keys before its anchor and to its own block (both ways). The
   drafter's own layers compute it (`Attention.context_kv`, `DecoderLayer`), with the
   anchors as per-row RoPE offsets, so training computes exactly what inference does.
3. Block position k (k >= 1) predicts the token at a + k; the loss is cross-entropy
   weighted by w_k = exp(-(k - 1) / gamma), normalised, optionally mixed with a
   distillation term against the target's own top-k distribution at that position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..drafter import Drafter


def default_gamma(block_size: int) -> float:
    """The paper's loss decay: 7 for B=16, 5 for B=10, 4 for B=8 (interpolated otherwise)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, 4.0 + (block_size - 8) * 3.0 / 8.0)


def loss_weights(block_size: int, gamma: Optional[float] = None) -> mx.array:
    """Per block position weights (B,): 0 for position 0 (input only), exp(-(k-1)/gamma) for
    k >= 1, normalised to sum to 1."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    k = np.arange(block_size, dtype=np.float64)
    w = np.where(k >= 1, np.exp(-(k - 1) / gamma), 0.0)
    return mx.array((w / w.sum()).astype(np.float32))


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, rng: np.random.Generator) -> np.ndarray:
    """Sorted distinct anchor positions in the answer: prompt_len <= a <= seq_len - 2 (the
    block's first token is an answer token and at least one label follows)."""
    lo, hi = prompt_len, seq_len - 2
    if hi < lo:
        return np.zeros((0,), dtype=np.int64)
    n = hi - lo + 1
    picks = rng.choice(n, size=min(num_anchors, n), replace=False)
    return np.sort(picks + lo)


@dataclass
class Batch:
    """Blocks of S sequences, A anchors each (rows = S * A blocks of B tokens)."""

    tokens: mx.array  # (S, L) padded sequences
    anchors: mx.array  # (S, A)
    block_tokens: mx.array  # (S*A, B) [token at anchor, MASK ...]
    labels: mx.array  # (S*A, B) token at anchor + k (0 where invalid)
    valid: mx.array  # (S*A, B) float, 1 where the label exists and the block is real
    features: Optional[mx.array] = None  # (S, L, k * hidden) target layer outputs
    teacher_ids: Optional[mx.array] = None  # (S*A, B, K) the target's top-K tokens per label
    teacher_logits: Optional[mx.array] = None  # (S*A, B, K) and their logits


def make_batch(seqs: Sequence[tuple[list[int], int]], block_size: int, num_anchors: int, mask_token_id: int,
               rng: np.random.Generator) -> tuple[Optional[Batch], list[int], np.ndarray]:
    """Pad sequences and sample anchors (short answers repeat their last block, weight 0).
    Returns the batch (None if no sequence has room for a block), the indices of the kept
    sequences and the label positions (S, A, B) for gathering per-position data."""
    B = block_size
    chosen = [sample_anchors(p, len(t), num_anchors, rng) for t, p in seqs]
    keep = [i for i, a in enumerate(chosen) if len(a)]
    if not keep:
        return None, [], np.zeros((0, 0, B), dtype=np.int64)
    seqs = [seqs[i] for i in keep]
    chosen = [chosen[i] for i in keep]
    S, A = len(seqs), max(len(a) for a in chosen)
    L = max(len(t) for t, _ in seqs)
    tokens = np.zeros((S, L), dtype=np.int32)
    anchors = np.zeros((S, A), dtype=np.int32)
    real = np.zeros((S, A), dtype=bool)
    for i, ((t, _), a) in enumerate(zip(seqs, chosen)):
        tokens[i, : len(t)] = t
        anchors[i, : len(a)] = a
        anchors[i, len(a) :] = a[-1]
        real[i, : len(a)] = True
    lengths = np.array([len(t) for t, _ in seqs])[:, None, None]
    pos = anchors[:, :, None] + np.arange(B)[None, None]  # (S, A, B)
    valid = (pos < lengths) & real[:, :, None] & (np.arange(B) >= 1)[None, None]
    pos = np.minimum(pos, L - 1)
    labels = np.take_along_axis(tokens, pos.reshape(S, -1), axis=1).reshape(S, A, B)
    labels = np.where(valid, labels, 0)
    block = np.full((S, A, B), mask_token_id, dtype=np.int32)
    block[:, :, 0] = np.take_along_axis(tokens, anchors, axis=1)
    batch = Batch(tokens=mx.array(tokens), anchors=mx.array(anchors),
                  block_tokens=mx.array(block.reshape(S * A, B)), labels=mx.array(labels.reshape(S * A, B)),
                  valid=mx.array(valid.reshape(S * A, B).astype(np.float32)))
    return batch, keep, pos


def context_mask(anchors: mx.array, ctx_len: int, block_size: int) -> mx.array:
    """Boolean mask (S*A, 1, 1, ctx_len + B): block row j sees context positions < its
    anchor, and its whole block (bidirectional, as at inference)."""
    ctx_ok = mx.arange(ctx_len)[None] < anchors.reshape(-1, 1)  # (S*A, L)
    own = mx.ones((ctx_ok.shape[0], block_size), dtype=mx.bool_)
    return mx.concatenate([ctx_ok, own], axis=-1)[:, None, None]


def block_forward(drafter: Drafter, features: mx.array, block_embeddings: mx.array, anchors: mx.array) -> mx.array:
    """Every block of every sequence in one forward.
    features (S, L, k*hidden); block_embeddings (S*A, B, hidden); anchors (S, A).
    Returns normed hidden states (S*A, B, hidden)."""
    cfg = drafter.config
    if any(t != "full_attention" for t in cfg.layer_types) or cfg.is_causal:
        raise NotImplementedError("training supports full-attention, non-causal drafters only")
    S, A = anchors.shape
    rows = mx.repeat(mx.arange(S), A)  # the sequence each block row belongs to
    offsets = anchors.reshape(-1)
    context = drafter.project_context(features)
    mask = context_mask(anchors, features.shape[1], block_embeddings.shape[1])
    h = block_embeddings
    for layer in drafter.layers:
        k, v = layer.self_attn.context_kv(context, 0)
        h = layer(h, (k[rows], v[rows]), offsets, mask)
    return drafter.norm(h)


def distill_loss(logits: mx.array, teacher_ids: mx.array, teacher_logits: mx.array) -> mx.array:
    """Cross-entropy of the student against the target's top-K distribution (softmax over
    those K tokens), per position. logits (N, V); teacher_* (N, K). With a one-hot
    teacher it equals the hard-label cross-entropy."""
    p = mx.softmax(teacher_logits.astype(mx.float32), axis=-1)
    student = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -(p * mx.take_along_axis(student, teacher_ids, axis=-1)).sum(axis=-1)


def block_acceptance(correct: np.ndarray, valid: np.ndarray, block_size: int) -> tuple[float, int]:
    """Sum over full blocks of 1 + the run of correct predictions from position 1 (the
    acceptance length each block would get in greedy decoding), and the block count."""
    c = np.asarray(correct).reshape(-1, block_size)[:, 1:]
    v = np.asarray(valid).reshape(-1, block_size)[:, 1:]
    full = v.all(axis=1)
    run = np.cumprod(c[full] > 0.5, axis=1).sum(axis=1)
    return float((1 + run).sum()), int(full.sum())
