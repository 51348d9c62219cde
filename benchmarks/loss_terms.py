"""The training loss's head and terms, forward and backward, at the long run's shapes
(256 blocks of 8, a sampled vocabulary of ~2,900 columns, SmolLM2's 576-wide head): each
term with its own logsumexp (mlx's `cross_entropy` beside `distill_loss`) against the one
logsumexp `loss_fn` shares between them. Side by side in one run, median of 9.

    python -m benchmarks.loss_terms   # from the repository root, on an idle machine
"""

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.kernels.choice import seconds
from dflash_mlx.train.objective import distill_loss

BLOCKS, B, VOCAB, HIDDEN, K = 256, 8, 2914, 576, 8  # the long run's step (batch 4 x 64 anchors)


def main() -> int:
    """Print ms per forward and backward of each way, and the saving."""
    keys = mx.random.split(mx.random.key(0), 5)
    h = mx.random.normal((BLOCKS, B, HIDDEN), key=keys[0])
    head = mx.random.normal((VOCAB, HIDDEN), key=keys[1]) * HIDDEN**-0.5
    labels = mx.random.randint(0, VOCAB, (BLOCKS, B), key=keys[2])
    teacher_ids = mx.random.randint(0, VOCAB, (BLOCKS * B, K), key=keys[3])
    teacher_logits = mx.random.normal((BLOCKS * B, K), key=keys[4])

    def apart(h: mx.array) -> mx.array:
        logits = h @ head.T
        ce = nn.losses.cross_entropy(logits, labels, reduction="none")
        return (
            ce + distill_loss(logits.reshape(BLOCKS * B, VOCAB), teacher_ids, teacher_logits).reshape(BLOCKS, B)
        ).sum()

    def shared(h: mx.array) -> mx.array:
        logits = h @ head.T
        lse = mx.logsumexp(logits, axis=-1, keepdims=True)
        ce = lse[..., 0] - mx.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        kd = distill_loss(logits.reshape(BLOCKS * B, VOCAB), teacher_ids, teacher_logits, lse.reshape(BLOCKS * B, 1))
        return (ce + kd.reshape(BLOCKS, B)).sum()

    times = {
        name: seconds(lambda f=f: mx.eval(mx.value_and_grad(f)(h)), 9) * 1e3
        for name, f in [("apart", apart), ("shared", shared)]
    }
    print("| logsumexp | ms (forward + backward) |\n|---|---:|")
    print(f"| one per term | {times['apart']:.1f} |\n| one, shared | {times['shared']:.1f} |")
    print(f"saving: {times['apart'] - times['shared']:.1f} ms a step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
