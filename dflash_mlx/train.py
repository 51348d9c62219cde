"""DFlash drafter training: the target is frozen; the drafter learns to fill blocks.

One training step, for a batch of sequences (prompt + the target's own answer):
1. The frozen target runs once over the whole sequences; the outputs of the chosen layers
   are the context features (no gradient flows into the target).
2. Anchors are sampled inside each answer. Anchor a makes the block
   [token a, MASK x (B-1)] at positions a .. a+B-1; its context is positions < a.
3. All blocks of a sequence go through the drafter in ONE forward. The keys of every layer
   are [context K/V of all positions] + [K/V of all block tokens]; a block-wise boolean mask
   lets block j see the context strictly before its anchor and its own block (both ways),
   nothing else. This is exactly what inference computes for that block.
4. Block position k (k >= 1) predicts the token at a + k (same-position labels); the loss is
   cross-entropy weighted by w_k = exp(-(k - 1) / gamma), normalised.

The drafter's own modules (fc, hidden_norm, q/k/v/o projections, q/k norms, RoPE, MLPs)
compute every step, so training and inference compute the same function; a test checks a
single block against `Drafter.append_context` + `Drafter.__call__`.

Data-parallel training over several processes uses `mx.distributed` (`mlx.launch`): each
rank takes its own share of every batch and gradients are averaged with an all-sum.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .drafter import Drafter, DrafterConfig, default_target_layer_ids, load_drafter_dir, save_drafter
from .target import Target

# ----------------------------------------------------------------------------- config


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


def default_mask_token_id(tokenizer: Any) -> int:
    """A special token that the target never writes: the highest-id special token that is
    not BOS / EOS / PAD and does not appear in the chat template."""
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    avoid = {getattr(tokenizer, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id")}
    avoid |= set(getattr(tokenizer, "eos_token_ids", []) or [])
    template = getattr(tokenizer, "chat_template", None) or ""
    candidates = []
    for i in sorted(specials):
        if i in avoid:
            continue
        text = tokenizer.convert_ids_to_tokens(i) if hasattr(tokenizer, "convert_ids_to_tokens") else ""
        if text and text in template:
            continue
        candidates.append(i)
    if not candidates:
        raise ValueError("no unused special token in this tokenizer: pass --mask-token-id")
    return candidates[-1]


def make_config(target: Target, *, num_layers: int = 5, target_layer_ids: Optional[Sequence[int]] = None,
                block_size: int = 16, mask_token_id: int, intermediate_size: Optional[int] = None,
                num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None) -> DrafterConfig:
    """A drafter config for `target`: hidden size, head dims, RoPE and vocabulary follow the
    target; depth, feature layers and block size are the paper's defaults unless given."""
    args = target.model.args
    heads = num_heads or args.num_attention_heads
    ids = list(target_layer_ids) if target_layer_ids else default_target_layer_ids(target.num_layers, num_layers)
    return DrafterConfig(
        hidden_size=args.hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=num_kv_heads or getattr(args, "num_key_value_heads", None) or heads,
        intermediate_size=intermediate_size or args.intermediate_size, vocab_size=args.vocab_size,
        num_target_layers=target.num_layers, target_layer_ids=ids, mask_token_id=int(mask_token_id),
        block_size=block_size, head_dim=getattr(args, "head_dim", None) or args.hidden_size // heads,
        rms_norm_eps=getattr(args, "rms_norm_eps", 1e-6), rope_theta=getattr(args, "rope_theta", 10000.0),
        rope_scaling=getattr(args, "rope_scaling", None),
        max_position_embeddings=getattr(args, "max_position_embeddings", None) or 40960,
    )


# ----------------------------------------------------------------------------- anchors and mask


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, rng: np.random.Generator
                   ) -> np.ndarray:
    """Sorted distinct anchor positions in the answer: prompt_len <= a <= seq_len - 2 (the
    block's first token is an answer token and at least one label follows)."""
    lo, hi = prompt_len, seq_len - 2
    if hi < lo:
        return np.zeros((0,), dtype=np.int64)
    n = hi - lo + 1
    picks = rng.choice(n, size=min(num_anchors, n), replace=False)
    return np.sort(picks + lo)


def block_mask(anchors: mx.array, ctx_len: int, block_size: int) -> mx.array:
    """Boolean mask (S, 1, A*B, ctx_len + A*B) for anchors (S, A): the query at block j sees
    context keys at positions < anchors[j] and the B keys of block j; nothing else."""
    S, A = anchors.shape
    B = block_size
    q_block = mx.arange(A * B) // B                                   # (A*B,)
    ctx_pos = mx.arange(ctx_len)                                      # (L,)
    ctx_ok = ctx_pos[None, None, :] < mx.repeat(anchors, B, axis=1)[:, :, None]  # (S, A*B, L)
    own = q_block[:, None] == q_block[None, :]                        # (A*B, A*B)
    own = mx.broadcast_to(own[None], (S, A * B, A * B))
    return mx.concatenate([ctx_ok, own], axis=-1)[:, None]


def block_positions(anchors: mx.array, block_size: int) -> mx.array:
    """Absolute positions (S, A*B) of the block tokens."""
    return (anchors[:, :, None] + mx.arange(block_size)[None, None]).reshape(anchors.shape[0], -1)


# ----------------------------------------------------------------------------- forward


def target_features(target: Target, tokens: mx.array, layer_ids: Sequence[int]) -> mx.array:
    """Concatenated outputs of `layer_ids` for a (S, L) batch (right padding is harmless under
    the causal mask). Layers above the deepest id are skipped. No gradient."""
    h = target.embed(tokens)
    last = max(layer_ids)
    masks = target._masks(h, [None] * target.num_layers)
    captured = {}
    for i, layer in enumerate(target.layers[: last + 1]):
        h = layer(h, masks[i], None)
        if i in layer_ids:
            captured[i] = h
    return mx.stop_gradient(mx.concatenate([captured[i] for i in layer_ids], axis=-1))


def _blockwise(attn, t: mx.array, n_heads: int, S: int, A: int, B: int) -> mx.array:
    """(S, A*B, n*hd) -> (S*A, n, B, hd): one batch row per block, for per-block RoPE offsets."""
    return t.reshape(S * A, B, n_heads, -1).transpose(0, 2, 1, 3)


def _unblock(t: mx.array, S: int, A: int) -> mx.array:
    """(S*A, n, B, hd) -> (S, n, A*B, hd)."""
    _, n, B, hd = t.shape
    return t.reshape(S, A, n, B, hd).transpose(0, 2, 1, 3, 4).reshape(S, n, A * B, hd)


def _attention(attn, x: mx.array, ctx: mx.array, anchors: mx.array, mask: mx.array) -> mx.array:
    S, N, _ = x.shape
    A = anchors.shape[1]
    B = N // A
    offsets = anchors.reshape(-1)
    # Context keys at their own positions 0..L-1; the same projections as inference.
    ctx_k = attn.rope(attn.k_norm(attn._heads(attn.k_proj(ctx), attn.n_kv_heads)), offset=0)
    ctx_v = attn._heads(attn.v_proj(ctx), attn.n_kv_heads)
    q = attn.rope(attn.q_norm(_blockwise(attn, attn.q_proj(x), attn.n_heads, S, A, B)), offset=offsets)
    k = attn.rope(attn.k_norm(_blockwise(attn, attn.k_proj(x), attn.n_kv_heads, S, A, B)), offset=offsets)
    v = _blockwise(attn, attn.v_proj(x), attn.n_kv_heads, S, A, B)
    keys = mx.concatenate([ctx_k, _unblock(k, S, A)], axis=2)
    values = mx.concatenate([ctx_v, _unblock(v, S, A)], axis=2)
    out = mx.fast.scaled_dot_product_attention(_unblock(q, S, A), keys, values, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(S, N, -1))


def drafter_train_forward(drafter: Drafter, features: mx.array, block_embeddings: mx.array,
                          anchors: mx.array) -> mx.array:
    """All blocks of every sequence in one forward.
    features (S, L, k*hidden); block_embeddings (S, A*B, hidden); anchors (S, A).
    Returns normed hidden states (S, A*B, hidden)."""
    cfg = drafter.config
    if any(t != "full_attention" for t in cfg.layer_types):
        raise NotImplementedError("training drafters with sliding-window layers is not supported")
    ctx = drafter.hidden_norm(drafter.fc(features))
    mask = block_mask(anchors, features.shape[1], cfg.block_size)
    h = block_embeddings
    for layer in drafter.layers:
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), ctx, anchors, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)


def head_weight(target: Target) -> Optional[mx.array]:
    """The (vocab, hidden) output matrix when it is a plain float matrix, else None."""
    layer = target.body.embed_tokens if target.tied else target.model.lm_head
    w = getattr(layer, "weight", None)
    if w is None or hasattr(layer, "scales"):
        return None
    return w


@dataclass
class Batch:
    tokens: mx.array        # (S, L) padded sequences
    anchors: mx.array       # (S, A)
    block_tokens: mx.array  # (S, A*B) [token at anchor, MASK ...]
    labels: mx.array        # (S, A*B) token at anchor + k (0 where invalid)
    valid: mx.array         # (S, A*B) float, 1 where the label exists and the block is real
    features: Optional[mx.array] = None


def make_batch(seqs: Sequence[tuple[list[int], int]], block_size: int, num_anchors: int,
               mask_token_id: int, rng: np.random.Generator) -> Optional[Batch]:
    """Pad sequences, sample anchors (blocks of short answers are repeated with weight 0)."""
    B = block_size
    chosen = [sample_anchors(p, len(t), num_anchors, rng) for t, p in seqs]
    keep = [i for i, a in enumerate(chosen) if len(a)]
    if not keep:
        return None
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
        anchors[i, len(a):] = a[-1]
        real[i, : len(a)] = True
    lengths = np.array([len(t) for t, _ in seqs])[:, None, None]
    pos = anchors[:, :, None] + np.arange(B)[None, None]                 # (S, A, B)
    valid = (pos < lengths) & real[:, :, None] & (np.arange(B) >= 1)[None, None]
    labels = np.take_along_axis(tokens, np.minimum(pos, L - 1).reshape(S, -1), axis=1).reshape(S, A, B)
    labels = np.where(valid, labels, 0)
    block = np.full((S, A, B), mask_token_id, dtype=np.int32)
    block[:, :, 0] = np.take_along_axis(tokens, anchors, axis=1)
    return Batch(tokens=mx.array(tokens), anchors=mx.array(anchors),
                 block_tokens=mx.array(block.reshape(S, A * B)), labels=mx.array(labels.reshape(S, A * B)),
                 valid=mx.array(valid.reshape(S, A * B).astype(np.float32)))


def loss_fn(drafter: Drafter, target: Target, batch: Batch, weights: mx.array,
            vocab: Optional[mx.array] = None, head: Optional[mx.array] = None
            ) -> tuple[mx.array, tuple[mx.array, mx.array, mx.array]]:
    """Position-weighted cross-entropy. With `vocab` (sorted token ids) and `head`, logits
    are computed over that vocabulary only (a cheaper loss for small machines); labels
    must lie in it. Returns (loss, (per-position correct, per-position count, weight sum))."""
    B = drafter.config.block_size
    S = batch.tokens.shape[0]
    emb = mx.stop_gradient(target.embed(batch.block_tokens))
    h = drafter_train_forward(drafter, batch.features, emb, batch.anchors)
    labels = batch.labels
    if vocab is not None:
        logits = h @ head[vocab].T
        labels = mx.array(np.searchsorted(np.array(vocab), np.array(labels)).astype(np.int32))
        labels = mx.minimum(labels, vocab.shape[0] - 1)
    else:
        logits = target.lm_head(h)
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")      # (S, A*B)
    w = mx.tile(weights, (1, ce.shape[1] // B)) * batch.valid
    loss = (ce * w).sum() / mx.maximum(w.sum(), 1e-9)
    correct = (mx.argmax(logits, axis=-1) == labels).astype(mx.float32) * batch.valid
    per_pos_correct = correct.reshape(S, -1, B).sum(axis=(0, 1))
    per_pos_count = batch.valid.reshape(S, -1, B).sum(axis=(0, 1))
    return loss, (mx.stop_gradient(per_pos_correct), per_pos_count, mx.stop_gradient(correct))


def block_acceptance(correct: mx.array, valid: mx.array, block_size: int) -> tuple[float, int]:
    """Sum over full blocks of 1 + the run of correct predictions from position 1 (the
    acceptance length each block would get in greedy decoding), and the block count."""
    c = np.array(correct).reshape(-1, block_size)[:, 1:]
    v = np.array(valid).reshape(-1, block_size)[:, 1:]
    full = v.all(axis=1)
    run = np.cumprod(c[full] > 0.5, axis=1).sum(axis=1)
    return float((1 + run).sum()), int(full.sum())


# ----------------------------------------------------------------------------- loop


@dataclass
class TrainArgs:
    data: str
    out: str
    model: Optional[str] = None
    num_layers: int = 5
    target_layer_ids: Optional[list[int]] = None
    block_size: int = 16
    mask_token_id: Optional[int] = None
    intermediate_size: Optional[int] = None
    gamma: Optional[float] = None
    batch_size: int = 4            # sequences per step (over all ranks)
    num_anchors: int = 32          # blocks per sequence
    max_len: int = 1024
    epochs: float = 1.0
    max_steps: Optional[int] = None
    time_limit: Optional[float] = None  # seconds; the schedule is planned for max_steps
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup: float = 0.04
    weight_decay: float = 0.01
    adam_beta2: float = 0.95       # 0.999 lets the huge first gradients freeze later steps
    grad_clip: float = 1.0
    loss_vocab: str = "full"       # "full", or "data": the data's tokens + sampled negatives
    negatives: int = 4096          # with loss_vocab "data": other tokens drawn afresh each step
    checkpoint_every: int = 200    # steps
    checkpoint_minutes: float = 5.0
    seed: int = 0
    resume: bool = False
    log_every: int = 10
    progress: bool = True
    cache_features: bool = True
    fc_init: str = "rms"           # "rms": scale fc's input columns by 1 / RMS of each feature


def _save_checkpoint(out: Path, drafter: Drafter, optimizer: optim.Optimizer, state: dict) -> None:
    save_drafter(drafter, out)   # the output directory is always a loadable drafter
    ck = out / "checkpoint"
    ck.mkdir(parents=True, exist_ok=True)
    # not *.safetensors: the checkpoint directory itself stays a loadable drafter
    mx.savez(str(ck / "optimizer.npz"), **dict(tree_flatten(optimizer.state)))
    save_drafter(drafter, ck)
    (ck / "state.json").write_text(json.dumps(state, indent=2) + "\n")


def train(args: TrainArgs, log: Callable[[str], None] = print) -> dict:
    """Train a drafter; returns the final stats. Writes `args.out` (config.json +
    model.safetensors, loadable by `load_draft`), `args.out/checkpoint/` and `train_log.jsonl`."""
    from .data import load_sequences
    from .loading import load

    group = mx.distributed.init()
    rank, world = group.rank(), group.size()
    out = Path(args.out)
    model, tokenizer = load(args.model)
    model.freeze()
    probe = Target(model)
    mask_id = args.mask_token_id if args.mask_token_id is not None else default_mask_token_id(tokenizer)
    cfg = make_config(probe, num_layers=args.num_layers, target_layer_ids=args.target_layer_ids,
                      block_size=args.block_size, mask_token_id=mask_id,
                      intermediate_size=args.intermediate_size)
    target = Target(model, cfg.target_layer_ids)
    B = cfg.block_size
    weights = loss_weights(B, args.gamma)[None]

    def read_data() -> list[tuple[list[int], int]]:
        # train.jsonl is append-only, so indices stay valid when it grows during training
        return [(t[: args.max_len], p) for t, p in load_sequences(args.data) if p < min(len(t), args.max_len) - 1]

    seqs = read_data()
    if not seqs:
        raise ValueError(f"no usable sequences in {args.data}")
    per_step = args.batch_size
    steps_per_epoch = max(1, len(seqs) // per_step)
    total = args.max_steps or max(1, int(math.ceil(args.epochs * steps_per_epoch)))

    head = None
    if args.loss_vocab == "data":
        head = head_weight(target)
        if head is None:
            raise ValueError("--loss-vocab data needs a float (unquantized) output matrix")
    elif args.loss_vocab != "full":
        raise ValueError("--loss-vocab must be 'full' or 'data'")

    def data_vocab() -> Optional[mx.array]:
        if head is None:
            return None
        return mx.array(np.array(sorted({int(x) for t, _ in seqs for x in t} | {mask_id}), dtype=np.int32))

    vocab_box = [data_vocab()]

    state = {"step": 0, "epoch": 0, "pos": 0, "epoch_size": len(seqs), "seen": 0, "elapsed": 0.0, "config": cfg.to_dict(),
             "args": asdict(args)}
    if args.resume and (out / "checkpoint" / "state.json").is_file():
        drafter = load_drafter_dir(out / "checkpoint")
        cfg = drafter.config
        state.update(json.loads((out / "checkpoint" / "state.json").read_text()))
        log(f"resuming from step {state['step']}")
    else:
        drafter = Drafter(cfg)
        mx.random.seed(args.seed)
        mx.eval(drafter.parameters())
    optimizer = optim.AdamW(learning_rate=args.lr, betas=[0.9, args.adam_beta2], weight_decay=args.weight_decay)
    if args.resume and (out / "checkpoint" / "optimizer.npz").is_file():
        optimizer.init(drafter.trainable_parameters())
        opt_state = tree_unflatten(list(mx.load(str(out / "checkpoint" / "optimizer.npz")).items()))
        optimizer.state = opt_state
    if world > 1:
        # the same initial weights everywhere
        params = tree_flatten(drafter.parameters())
        synced = [(k, mx.distributed.all_sum(v) / world) for k, v in params]
        drafter.load_weights(synced)
        mx.eval(drafter.parameters())

    n_params = sum(v.size for _, v in tree_flatten(drafter.parameters()))
    if rank == 0:
        log(f"{len(seqs)} sequences, {sum(len(t) for t, _ in seqs)} tokens; drafter {cfg.num_hidden_layers} "
            f"layers, {n_params / 1e6:.1f}M params, features {cfg.target_layer_ids}, B={B}, "
            f"mask {mask_id}; {total} steps of {per_step} sequences x {args.num_anchors} blocks"
            + (f"; loss vocab {vocab_box[0].shape[0]} tokens" if head is not None else "")
            + (f"; {world} ranks" if world > 1 else ""))

    vocab_rng = np.random.default_rng(args.seed + 7 + rank)

    def step_vocab() -> Optional[mx.array]:
        """The data's tokens plus `negatives` others drawn afresh every step: tokens that
        never occur in the data still get pushed down, or the full-vocabulary argmax at
        inference would pick them."""
        base = vocab_box[0]
        if base is None or args.negatives <= 0:
            return base
        n_vocab = cfg.vocab_size
        extra = vocab_rng.choice(n_vocab, size=min(n_vocab, args.negatives + base.shape[0]), replace=False)
        return mx.array(np.union1d(np.array(base), extra).astype(np.int32))

    step_vocab_box = [None]

    def step_loss(d, batch):
        return loss_fn(d, target, batch, weights, step_vocab_box[0], head)

    value_and_grad = nn.value_and_grad(drafter, step_loss)
    feature_cache: dict[int, np.ndarray] = {}

    def features_for(idx: list[int], L: int) -> mx.array:
        """Target features of sequences idx, padded to L (kept in memory as float16 so later
        epochs skip the target forward)."""
        missing = [i for i in idx if i not in feature_cache]
        if missing:
            toks = np.zeros((len(missing), max(len(seqs[i][0]) for i in missing)), dtype=np.int32)
            for r, i in enumerate(missing):
                toks[r, : len(seqs[i][0])] = seqs[i][0]
            f = np.array(target_features(target, mx.array(toks), cfg.target_layer_ids).astype(mx.float16))
            for r, i in enumerate(missing):
                feature_cache[i] = f[r, : len(seqs[i][0])]
        rows = [feature_cache[i] for i in idx]
        if not args.cache_features:
            for i in missing:
                feature_cache.pop(i, None)
        return _stack(rows, L)

    fresh = not (args.resume and (out / "checkpoint" / "state.json").is_file())
    if fresh and args.fc_init == "rms":
        # Data-dependent init: a few feature dims carry huge, nearly constant values (and
        # position 0 is an attention sink), which would swamp fc + hidden_norm at the start.
        # Scaling each input column by 1 / that feature's RMS (positions >= 1, same data on
        # every rank) lets the context vectors differ from token to token from step one.
        probe_idx = list(range(min(8, len(seqs))))
        f = features_for(probe_idx, max(len(seqs[i][0]) for i in probe_idx))
        rows = np.concatenate([np.array(f[r, 1: len(seqs[i][0])]) for r, i in enumerate(probe_idx)])
        rms = np.sqrt((rows.astype(np.float64) ** 2).mean(axis=0)) + 1e-3
        scale = rms / rms.mean()
        # ... and project out the features' common (mean) direction, which would otherwise
        # make every context vector, and so every attention output, nearly the same.
        u = (rows / scale).mean(axis=0)
        u = u / max(np.linalg.norm(u), 1e-9)
        w = np.array(drafter.fc.weight, dtype=np.float64) / scale[None]
        drafter.fc.weight = mx.array((w - np.outer(w @ u, u)).astype(np.float32))
        mx.eval(drafter.parameters())

    log_file = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        log_file = open(out / "train_log.jsonl", "a")
    rng = np.random.default_rng(args.seed + 1000 * state["step"] + rank)

    def epoch_order(e: int, n: int) -> list[int]:
        order = list(range(n))
        random.Random(args.seed + e).shuffle(order)
        return order

    def lr_at(step: int, elapsed: float) -> float:
        """Warmup then cosine over the run's progress (steps, or time under --time-limit)."""
        frac = step / total
        if args.time_limit:
            frac = max(frac, elapsed / args.time_limit) if args.max_steps else elapsed / args.time_limit
        frac = min(frac, 1.0)
        if frac < args.warmup:
            return args.lr * max(frac / args.warmup, 0.01)
        t = (frac - args.warmup) / max(1e-9, 1 - args.warmup)
        lo = args.lr * args.min_lr_ratio
        return lo + 0.5 * (args.lr - lo) * (1 + math.cos(math.pi * t))

    t_start = time.perf_counter() - state["elapsed"]
    last_ck = time.perf_counter()
    acc_c = np.zeros(B)
    acc_n = np.zeros(B)
    tau_sum = tau_n = 0.0
    loss_avg = None
    history = []

    progress = None
    if args.progress and rank == 0:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        progress = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            TimeRemainingColumn(), TextColumn("{task.description}"))
        task = progress.add_task("", total=total, completed=state["step"])
        progress.start()
    try:
        while state["step"] < total or (args.time_limit and not args.max_steps):
            if state["pos"] + per_step > state["epoch_size"] and state["pos"] > 0:
                # next epoch: pick up sequences appended to the data meanwhile
                state["epoch"] += 1
                state["pos"] = 0
                grown = read_data()
                if len(grown) > len(seqs):
                    seqs[:] = grown
                    vocab_box[0] = data_vocab()
                    if rank == 0:
                        log(f"epoch {state['epoch']}: {len(seqs)} sequences")
                state["epoch_size"] = len(seqs)
            order = epoch_order(state["epoch"], state["epoch_size"])
            idx = [order[(state["pos"] + j) % state["epoch_size"]] for j in range(per_step)]
            state["pos"] += per_step
            idx = idx[rank::world]                      # this rank's share
            optimizer.learning_rate = lr_at(state["step"], time.perf_counter() - t_start)
            batch = make_batch([seqs[i] for i in idx], B, args.num_anchors, cfg.mask_token_id, rng)
            if batch is None:
                state["step"] += 1
                continue
            L = batch.tokens.shape[1]
            batch.features = features_for(idx_kept(idx, seqs, batch), L)
            step_vocab_box[0] = step_vocab()
            (loss, (pc, pn, correct)), grads = value_and_grad(drafter, batch)
            if world > 1:
                grads = nn.average_gradients(grads)
                loss = mx.distributed.all_sum(loss) / world
                pc, pn = mx.distributed.all_sum(pc), mx.distributed.all_sum(pn)
            grads, gnorm = optim.clip_grad_norm(grads, args.grad_clip)
            optimizer.update(drafter, grads)
            mx.eval(drafter.parameters(), optimizer.state, loss, pc, pn, correct, gnorm)
            state["step"] += 1
            state["seen"] += len(idx) * world
            lv = loss.item()
            loss_avg = lv if loss_avg is None else 0.95 * loss_avg + 0.05 * lv
            acc_c += np.array(pc)
            acc_n += np.array(pn)
            t, n = block_acceptance(correct, batch.valid, B)
            tau_sum += t
            tau_n += n
            elapsed = time.perf_counter() - t_start
            state["elapsed"] = elapsed
            if rank == 0:
                acc = acc_c / np.maximum(acc_n, 1)
                desc = (f"loss {loss_avg:.3f} | acc@1 {acc[1]:.2f} @2 {acc[2]:.2f} @4 {acc[min(4, B - 1)]:.2f} "
                        f"@{B - 1} {acc[B - 1]:.2f} | tau~{tau_sum / max(tau_n, 1):.2f} | "
                        f"lr {optimizer.learning_rate.item():.1e}")
                if progress is not None:
                    progress.update(task, completed=state["step"], description=desc)
                if state["step"] % args.log_every == 0 or state["step"] == total:
                    rec = {"step": state["step"], "elapsed": round(elapsed, 1), "loss": round(loss_avg, 4),
                           "acc": [round(float(a), 3) for a in acc[1:]],
                           "train_tau": round(tau_sum / max(tau_n, 1), 3), "grad_norm": round(gnorm.item(), 3),
                           "lr": optimizer.learning_rate.item(), "seqs_seen": state["seen"]}
                    history.append(rec)
                    if log_file:
                        log_file.write(json.dumps(rec) + "\n")
                        log_file.flush()
                    if progress is None:
                        log(f"step {state['step']}/{total} {elapsed:.0f}s {desc}")
                    acc_c[:] = 0
                    acc_n[:] = 0
                    tau_sum = tau_n = 0.0
                due = (state["step"] % args.checkpoint_every == 0
                       or time.perf_counter() - last_ck > args.checkpoint_minutes * 60)
                if due:
                    _save_checkpoint(out, drafter, optimizer, state)
                    last_ck = time.perf_counter()
            if args.time_limit and elapsed > args.time_limit:
                if rank == 0:
                    log(f"time limit reached at step {state['step']}")
                break
    finally:
        if progress is not None:
            progress.stop()
    if rank == 0:
        _save_checkpoint(out, drafter, optimizer, state)
        if log_file:
            log_file.close()
    return {"step": state["step"], "elapsed": state["elapsed"], "history": history, "drafter": drafter}


def idx_kept(idx: list[int], seqs, batch: Batch) -> list[int]:
    """Indices of the sequences make_batch kept (those with at least one anchor)."""
    kept = [i for i in idx if len(seqs[i][0]) - 2 >= seqs[i][1]]
    assert len(kept) == batch.tokens.shape[0]
    return kept


def _stack(rows: list[np.ndarray], L: int) -> mx.array:
    out = np.zeros((len(rows), L, rows[0].shape[-1]), dtype=np.float16)
    for r, f in enumerate(rows):
        out[r, : len(f)] = f[:L]
    return mx.array(out).astype(mx.float32)
