"""One argpartition over the vocabulary against `top_k_columns` (a partition over block
maxima, then one over the best blocks' entries), at the shapes where the project takes top-k
columns; and the whole teacher pass of training (SmolLM2's forward, LM head and top-8) of
one 2,048-token batch with each. Side by side in one run, median of the repeats.

    python -m benchmarks.top_k [--json FILE]   # from the repository root, on an idle machine
"""

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

import argparse
import json
from typing import Callable

import mlx.core as mx

from dflash_mlx import load
from dflash_mlx.kernels.choice import seconds
from dflash_mlx.targets import make_target
from dflash_mlx.topk import top_k_columns

LAYERS = [1, 8, 14, 21, 28]  # the long run's feature layers
SHAPES = [  # (where, shape, k)
    ("teacher pass, one batch (SmolLM2)", (12, 170, 49152), 8),
    ("tree candidates, B=8 (SmolLM2)", (7, 49152), 8),
    ("tree candidates, B=16, k=16 (SmolLM2)", (15, 49152), 16),
    ("tree candidates, B=16 (Qwen3)", (15, 151936), 8),
    ("server logprobs, top 5 (SmolLM2)", (49152,), 5),
]


def partition(x: mx.array, k: int) -> mx.array:
    """The one-partition way (what `top_k_columns` replaced)."""
    return mx.argpartition(-x, k - 1, axis=-1)[..., :k]


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    return seconds(lambda: mx.eval(fn()), repeats) * 1e3


def teacher_pass_ms(top: Callable[[mx.array, int], mx.array], repeats: int) -> float:
    """ms of the training's teacher pass over a (12, 170) batch with `top` for its top-8."""
    model, _ = load(None)
    target = make_target(model, LAYERS)
    tokens = mx.random.randint(100, 40_000, (12, 170), key=mx.random.key(0))

    def run() -> list[mx.array]:
        hidden, features = target.forward(tokens, [None] * target.num_layers)
        logits = target.lm_head(hidden).astype(mx.float32)
        return [features, top(logits, 8)]

    return median_ms(run, repeats)


def measure() -> list[list]:
    """The table's rows: where, shape, k, ms of argpartition and of top_k_columns, speed-up."""
    rows = []
    for where, shape, k in SHAPES:
        x = mx.random.normal(shape, key=mx.random.key(1))
        mx.eval(x)
        repeats = 5 if x.size > 10**7 else 51
        old, new = (median_ms(lambda f=f, x=x, k=k: f(x, k), repeats) for f in (partition, top_k_columns))
        rows.append([where, "x".join(map(str, shape)), k, old, new, old / new])
    old, new = teacher_pass_ms(partition, 5), teacher_pass_ms(top_k_columns, 5)
    rows.append(["whole teacher pass, one batch (SmolLM2)", "12x170 tokens", 8, old, new, old / new])
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the table (and write it as a BENCHMARKS render table with --json)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.top_k", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the table here (columns and rows)")
    args = parser.parse_args(argv)
    rows = measure()
    columns = [
        {"name": "where"},
        {"name": "shape"},
        {"name": "k", "align": "r"},
        {"name": "argpartition ms", "align": "r", "format": ".2f"},
        {"name": "top_k_columns ms", "align": "r", "format": ".2f"},
        {"name": "speed-up", "align": "r", "format": ".1f"},
    ]
    for row in rows:
        print(f"{row[0]:<42} {row[1]:>16} k={row[2]:<3} {row[3]:9.3f} ms {row[4]:9.3f} ms  x{row[5]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"columns": columns, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
