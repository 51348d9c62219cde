"""What a drafter learns: anchored blocks, their block-parallel forward, and the loss.

For a sequence (prompt + the target's own answer, or a conversation with several
answers) and its target features:
1. Anchors are sampled inside the answers (the target-written spans). Anchor a makes the
   block [token a, MASK x (B-1)] at positions a .. a+B-1; its context is positions < a;
   its labels stop where its answer ends.
2. Every block of a batch is one row of ONE drafter forward: each row attends to its
   sequence's context keys before its anchor and to its own block (both ways). The
   drafter's own layers compute it (`Attention.context_kv`, `DecoderLayer`), with the
   anchors as per-row RoPE offsets, so training computes exactly what inference does; only
   the attention's softmax over context and block runs sequence by sequence
   (`SequenceContext`), which keeps each sequence's context once.
3. Block position k (k >= 1) predicts the token at a + k; the loss is cross-entropy
   weighted by w_k = exp(-(k - 1) / gamma), normalised, optionally mixed with a
   distillation term against the target's own top-k distribution at that position.
4. A DFlash2 drafter's candidate selector is trained jointly, teacher-forced
   (`selector_loss`): at block position k >= 1 the candidates are the top-k of the
   drafter's own logits (a choice, so no gradient), scored as at inference (logit plus
   the low-rank edge from the predecessor) with the TRUE token before k as predecessor
   (the block's first token for k = 1). The term is the cross-entropy of those k scores
   toward the true token, added to the position's loss under the same weight w_k, and 0
   where the true token is not a candidate: the draft is wrong there whatever the
   selector picks, so there is nothing for it to learn. Teacher forcing is exact for
   acceptance: a block's accepted run only continues while every earlier pick was the
   true token, which is then the predecessor inference uses too. The gradient reaches the
   codebooks and projection, the drafter's hidden states, and the logits as unary scores.
   With a sampled loss vocabulary the candidates are the top-k of that subset: it holds
   the labels and the target's top tokens, the competitors that matter most.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ..drafter import Drafter
from ..drafter2 import CandidateSelector, Drafter2
from ..target import Target
from ..topk import top_k_columns


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


def sample_anchors(
    spans: Sequence[tuple[int, int]], num_anchors: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct anchor positions inside the target-written spans [start, end) of a
    sequence (a single-turn answer is one span; a conversation has one per assistant turn):
    start <= a <= end - 2, so the block's first token is the target's and at least one
    label follows. Returns the anchors and the end of each one's span (its labels stop
    there: what follows an answer, e.g. the user's next turn, is not the target's)."""
    ranges = [(s, e - 2) for s, e in spans if e - 2 >= s]
    if not ranges:
        return np.zeros((0,), dtype=np.int64), np.zeros((0,), dtype=np.int64)
    starts = np.concatenate([np.arange(lo, hi + 1) for lo, hi in ranges])
    ends = np.concatenate([np.full(hi - lo + 1, hi + 2) for lo, hi in ranges])
    picks = np.sort(rng.choice(len(starts), size=min(num_anchors, len(starts)), replace=False))
    return starts[picks].astype(np.int64), ends[picks].astype(np.int64)


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


def make_batch(
    seqs: Sequence[tuple[list[int], int | Sequence[tuple[int, int]]]],
    block_size: int,
    num_anchors: int,
    mask_token_id: int,
    rng: np.random.Generator,
) -> tuple[Optional[Batch], list[int], np.ndarray]:
    """Pad sequences and sample anchors (short answers repeat their last block, weight 0).
    A sequence comes with its target-written spans, or with its prompt length (one span:
    the answer to the end). Returns the batch (None if no sequence has room for a block),
    the indices of the kept sequences and the label positions (S, A, B) for gathering
    per-position data."""
    B = block_size
    chosen = [sample_anchors([(p, len(t))] if isinstance(p, int) else p, num_anchors, rng) for t, p in seqs]
    keep = [i for i, (a, _) in enumerate(chosen) if len(a)]
    if not keep:
        return None, [], np.zeros((0, 0, B), dtype=np.int64)
    seqs = [seqs[i] for i in keep]
    chosen = [chosen[i] for i in keep]
    S, A = len(seqs), max(len(a) for a, _ in chosen)
    L = max(len(t) for t, _ in seqs)
    tokens = np.zeros((S, L), dtype=np.int32)
    anchors = np.zeros((S, A), dtype=np.int32)
    ends = np.zeros((S, A), dtype=np.int64)  # where each anchor's span (its labels) ends
    real = np.zeros((S, A), dtype=bool)
    for i, ((t, _), (a, e)) in enumerate(zip(seqs, chosen)):
        tokens[i, : len(t)] = t
        anchors[i, : len(a)], ends[i, : len(a)] = a, e
        anchors[i, len(a) :], ends[i, len(a) :] = a[-1], e[-1]
        real[i, : len(a)] = True
    pos = anchors[:, :, None] + np.arange(B)[None, None]  # (S, A, B)
    valid = (pos < ends[:, :, None]) & real[:, :, None] & (np.arange(B) >= 1)[None, None]
    pos = np.minimum(pos, L - 1)
    labels = np.take_along_axis(tokens, pos.reshape(S, -1), axis=1).reshape(S, A, B)
    labels = np.where(valid, labels, 0)
    block = np.full((S, A, B), mask_token_id, dtype=np.int32)
    block[:, :, 0] = np.take_along_axis(tokens, anchors, axis=1)
    batch = Batch(
        tokens=mx.array(tokens),
        anchors=mx.array(anchors),
        block_tokens=mx.array(block.reshape(S * A, B)),
        labels=mx.array(labels.reshape(S * A, B)),
        valid=mx.array(valid.reshape(S * A, B).astype(np.float32)),
    )
    return batch, keep, pos


class SequenceContext:
    """The context of every block of a training batch, kept once per sequence: keys and
    values (S, kv_heads, L, head_dim) and the positions each block sees, those before its
    anchor (S, A, L). `attend` gives each block's queries one softmax over its sequence's
    visible context and its own block (both ways), what inference's attention over a cache
    computes, without a copy of the context per block: the (S*A, kv_heads, L, head_dim)
    copies and a masked attention over them took half of a long-run step on this CPU."""

    def __init__(self, keys: mx.array, values: mx.array, visible: mx.array):
        self.keys, self.values, self.visible = keys, values, visible

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Queries q (S*A, heads, B, head_dim) of the blocks, sequence by sequence, and the
        blocks' own keys and values (S*A, kv_heads, B, head_dim) -> (S*A, heads, B, head_dim)."""
        S, KV, L, D = self.keys.shape
        N, H, B, _ = q.shape
        A, G = N // S, H // KV  # query head h reads kv head h // G, as in grouped attention
        q = (q * scale).reshape(S, A, KV, G * B, D).transpose(0, 2, 1, 3, 4)  # (S, KV, A, G*B, D)
        k = k.reshape(S, A, KV, B, D).transpose(0, 2, 1, 3, 4)  # (S, KV, A, B, D)
        v = v.reshape(S, A, KV, B, D).transpose(0, 2, 1, 3, 4)
        seen = q.reshape(S, KV, A * G * B, D) @ self.keys.swapaxes(-1, -2)  # (S, KV, A*G*B, L)
        seen = mx.where(self.visible[:, None, :, None, :], seen.reshape(S, KV, A, G * B, L), -mx.inf)
        own = q @ k.swapaxes(-1, -2)  # (S, KV, A, G*B, B)
        p = mx.softmax(mx.concatenate([seen, own], axis=-1), axis=-1)
        out = (p[..., :L].reshape(S, KV, A * G * B, L) @ self.values).reshape(S, KV, A, G * B, D)
        out = out + p[..., L:] @ v  # (S, KV, A, G*B, D)
        return out.reshape(S, KV, A, G, B, D).transpose(0, 2, 1, 3, 4, 5).reshape(N, H, B, D)


def block_forward(drafter: Drafter, features: mx.array, block_embeddings: mx.array, anchors: mx.array) -> mx.array:
    """Every block of every sequence in one forward.
    features (S, L, k*hidden); block_embeddings (S*A, B, hidden); anchors (S, A).
    Returns normed hidden states (S*A, B, hidden)."""
    cfg = drafter.config
    if any(t != "full_attention" for t in cfg.layer_types) or cfg.is_causal:
        raise NotImplementedError("training supports full-attention, non-causal drafters only")
    offsets = anchors.reshape(-1)
    context = drafter.project_context(features)
    visible = mx.arange(features.shape[1]) < anchors[..., None]  # (S, A, L): strictly before the anchor
    h = block_embeddings
    for layer in drafter.layers:
        k, v = layer.self_attn.context_kv(context, 0)  # (S, kv_heads, L, head_dim)
        h = layer(h, SequenceContext(k, v, visible), offsets, None)
    return drafter.norm(h)


def distill_loss(
    logits: mx.array, teacher_ids: mx.array, teacher_logits: mx.array, lse: Optional[mx.array] = None
) -> mx.array:
    """Cross-entropy of the student against the target's top-K distribution (softmax over
    those K tokens), per position. logits (N, V); teacher_* (N, K); lse (N, 1): the logits'
    logsumexp where the caller has it. With a one-hot teacher it equals the hard-label
    cross-entropy. As lse - sum(p * logits) (p sums to 1): no (N, V) log-softmax is made."""
    p = mx.softmax(teacher_logits.astype(mx.float32), axis=-1)
    if lse is None:
        lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    return lse[:, 0] - (p * mx.take_along_axis(logits, teacher_ids, axis=-1)).sum(axis=-1)


def selector_loss(
    selector: CandidateSelector,
    hidden: mx.array,
    logits: mx.array,
    predecessors: mx.array,
    labels: mx.array,
    ids: Optional[mx.array] = None,
) -> tuple[mx.array, mx.array]:
    """The selector's teacher-forced loss (see the module docstring) and its picks.
    hidden (N, B, hidden) and logits (N, B, V) of the blocks; predecessors (N, B): the true
    token id before each position; labels (N, B): the true token as a column of `logits`;
    ids (V,): the token id of each column (None: column = token id). Returns the
    cross-entropy over the candidates (N, B), 0 where the label is not one, and the
    selector's pick (N, B) as a column of `logits`."""
    k = min(selector.top_k, logits.shape[-1])
    candidates = mx.stop_gradient(top_k_columns(logits, k))  # (N, B, k) columns
    tokens = candidates if ids is None else ids[candidates]
    query = selector.hidden_projection(hidden) * selector.predecessor_codebook[predecessors]  # (N, B, rank)
    edges = (selector.successor_codebook[tokens] * query[..., None, :]).sum(-1)  # (N, B, k)
    scores = mx.take_along_axis(logits, candidates, axis=-1) + edges
    is_label = candidates == labels[..., None]  # (N, B, k), at most one True per row
    ce = mx.logsumexp(scores, axis=-1) - mx.where(is_label, scores, 0.0).sum(-1)
    pick = mx.take_along_axis(candidates, mx.argmax(scores, axis=-1)[..., None], axis=-1)[..., 0]
    return mx.where(is_label.any(-1), ce, 0.0), pick


def position_loss(
    logits: mx.array, labels: mx.array, teacher_ids: mx.array, teacher_logits: mx.array, distill: float
) -> mx.array:
    """(1 - distill) * cross-entropy + distill * distillation at each position (N, B), of
    logits (N, B, V), labels (N, B) and the teacher's top-K (N, B, K). Both terms share one
    logsumexp: on MLX's CPU an exp over (N, B, V) costs more than the head."""
    N, B, V = logits.shape
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)  # (N, B, 1)
    per = lse[..., 0] - mx.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]  # cross-entropy
    if distill <= 0:
        return per
    ids, teacher = teacher_ids.reshape(N * B, -1), teacher_logits.reshape(N * B, -1)
    kd = distill_loss(logits.reshape(N * B, V), ids, teacher, lse.reshape(N * B, 1)).reshape(N, B)
    return (1 - distill) * per + distill * kd


def loss_fn(
    drafter: Drafter,
    target: Target,
    batch: Batch,
    weights: mx.array,
    distill: float,
    vocab: Optional[mx.array] = None,
    selector_weight: float = 1.0,
) -> tuple[mx.array, tuple[mx.array, mx.array]]:
    """Position-weighted (1 - distill) * cross-entropy + distill * distillation, plus
    selector_weight * the selector's loss for a DFlash2 drafter. With `vocab` (sorted ids),
    logits cover that vocabulary only (the head's rows for it, as a draft vocabulary uses
    them) and the batch's labels / teacher ids are indices into it. Returns (loss,
    (correct, valid)); correct: the drafter's greedy pick (the selector's, teacher-forced)
    is the label."""
    emb = mx.stop_gradient(target.embed(batch.block_tokens))
    h = block_forward(drafter, batch.features, emb, batch.anchors)  # (N, B, hidden)
    logits = h @ target.head_rows(vocab).T if vocab is not None else target.lm_head(h)
    per = position_loss(logits, batch.labels, batch.teacher_ids, batch.teacher_logits, distill)
    pick = mx.argmax(logits, axis=-1)
    if isinstance(drafter, Drafter2):
        label_ids = vocab[batch.labels] if vocab is not None else batch.labels
        truth = mx.concatenate([batch.block_tokens[:, :1], label_ids[:, 1:]], axis=1)  # (N, B) token ids
        predecessors = mx.concatenate([truth[:, :1], truth[:, :-1]], axis=1)  # block token 0 for k = 1
        sel, pick = selector_loss(drafter.candidate_selector, h, logits, predecessors, batch.labels, vocab)
        per = per + selector_weight * sel
    w = weights[None] * batch.valid
    loss = (per * w).sum() / mx.maximum(w.sum(), 1e-9)
    correct = (pick == batch.labels).astype(mx.float32) * batch.valid
    return loss, (mx.stop_gradient(correct), batch.valid)


def block_acceptance(correct: np.ndarray, valid: np.ndarray, block_size: int) -> tuple[float, int]:
    """Sum over full blocks of 1 + the run of correct predictions from position 1 (the
    acceptance length each block would get in greedy decoding), and the block count."""
    c = np.asarray(correct).reshape(-1, block_size)[:, 1:]
    v = np.asarray(valid).reshape(-1, block_size)[:, 1:]
    full = v.all(axis=1)
    run = np.cumprod(c[full] > 0.5, axis=1).sum(axis=1)
    return float((1 + run).sum()), int(full.sum())
