"""Two parts of a long-run training step, each computed two ways side by side in one run
(median of 9, forward and backward), at the long run's shapes (4 sequences of ~346 tokens,
64 blocks of 8 each, SmolLM2's 9 query and 3 KV heads, ~2,900 sampled vocabulary columns):

- attention: every block over a copy of its sequence's context (`mx.repeat` per block, then
  masked `scaled_dot_product_attention`, the old `block_forward`) against `SequenceContext`,
  which keeps each sequence's context once;
- the loss: each term with its own logsumexp (mlx's `cross_entropy` beside `distill_loss`)
  against the one logsumexp `position_loss` shares between them.

    python -m benchmarks.train_step   # from the repository root, on an idle machine
"""

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.kernels.choice import seconds
from dflash_mlx.train.objective import SequenceContext, distill_loss, position_loss

S, A, B, L, H, KV, D = 4, 64, 8, 346, 9, 3, 64  # sequences, blocks each, block, context, heads
N, VOCAB, HIDDEN, K = S * A, 2914, 576, 8


def ms(f, *args) -> float:
    """Median ms of f's value and gradients with respect to all its arguments."""
    grad = mx.value_and_grad(lambda *a: f(*a).sum(), argnums=tuple(range(len(args))))
    return seconds(lambda: mx.eval(grad(*args)), 9) * 1e3


def attention_ms() -> tuple[float, float]:
    """(per-block copies, SequenceContext) for one layer's attention."""
    keys = mx.random.split(mx.random.key(0), 6)
    q = mx.random.normal((N, H, B, D), key=keys[0])
    k, v = (mx.random.normal((N, KV, B, D), key=key) for key in keys[1:3])
    ctx_k, ctx_v = (mx.random.normal((S, KV, L, D), key=key) for key in keys[3:5])
    anchors = mx.sort(mx.random.randint(1, L, (S, A), key=keys[5]), axis=-1)
    visible = mx.arange(L) < anchors[..., None]  # (S, A, L)
    mask = mx.concatenate([visible.reshape(N, L), mx.ones((N, B), dtype=mx.bool_)], axis=-1)[:, None, None]

    def copies(q, k, v, ctx_k, ctx_v):
        keys = mx.concatenate([mx.repeat(ctx_k, A, axis=0), k], axis=2)
        values = mx.concatenate([mx.repeat(ctx_v, A, axis=0), v], axis=2)
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5, mask=mask)

    def shared(q, k, v, ctx_k, ctx_v):
        return SequenceContext(ctx_k, ctx_v, visible).attend(q, k, v, D**-0.5)

    return ms(copies, q, k, v, ctx_k, ctx_v), ms(shared, q, k, v, ctx_k, ctx_v)


def loss_ms() -> tuple[float, float]:
    """(a logsumexp per term, one shared) for the head and both loss terms."""
    keys = mx.random.split(mx.random.key(1), 5)
    h = mx.random.normal((N, B, HIDDEN), key=keys[0])
    head = mx.random.normal((VOCAB, HIDDEN), key=keys[1]) * HIDDEN**-0.5
    labels = mx.random.randint(0, VOCAB, (N, B), key=keys[2])
    teacher_ids = mx.random.randint(0, VOCAB, (N, B, K), key=keys[3])
    teacher_logits = mx.random.normal((N, B, K), key=keys[4])

    def apart(h):
        logits = h @ head.T
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")
        kd = distill_loss(logits.reshape(N * B, VOCAB), teacher_ids.reshape(N * B, K), teacher_logits.reshape(N * B, K))
        return 0.5 * ce + 0.5 * kd.reshape(N, B)

    def shared(h):
        return position_loss(h @ head.T, labels, teacher_ids, teacher_logits, 0.5)

    return ms(apart, h), ms(shared, h)


def main() -> int:
    """Print the table."""
    rows = [("attention (one layer)", "a context copy per block", "SequenceContext", *attention_ms())]
    rows.append(("head + loss terms", "a logsumexp per term", "one shared", *loss_ms()))
    print("| part | before | after | before ms | after ms |\n|---|---|---|---:|---:|")
    for part, before, after, old, new in rows:
        print(f"| {part} | {before} | {after} | {old:.1f} | {new:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
