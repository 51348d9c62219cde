"""What B rows of L tokens cost in one target forward, against B rows of one token.

Speculation inside a batch verifies L tokens per row; batching alone steps one token per
row. On this CPU a wider forward costs more per step, so whether a drafter can pay inside
a batch of B depends on this ratio (issue 43). Each row holds CONTEXT tokens of context
(a uniform-length mlx-lm cache; the batch cache's padding mask costs next to nothing);
each forward's tokens are trimmed off again so every repeat sees the same cache.

Run: flock /tmp/dflash-cpu.lock nice -n 10 env OPENBLAS_NUM_THREADS=1 \
     .venv/bin/python benchmarks/concurrency/verify_rows.py
"""

from __future__ import annotations

import time

import dflash_mlx
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

ROWS = (1, 4, 8, 16)
WIDTHS = (1, 4, 8)
CONTEXT = 256
REPEATS = 5


def seconds(model, cache, rows: int, width: int) -> float:
    """The median time of one forward of (rows, width) tokens on `cache`."""
    tokens = mx.random.randint(0, 1000, (rows, width))
    times = []
    for _ in range(REPEATS + 1):  # the first is a warm-up
        tic = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        times.append(time.perf_counter() - tic)
        for layer in cache:
            layer.trim(width)
    return sorted(times[1:])[REPEATS // 2]


def main() -> None:
    model, _ = dflash_mlx.load()
    dtype = tree_flatten(model.parameters())[0][1].dtype
    print(f"SmolLM2-135M ({dtype}), {CONTEXT} tokens of context per row, median of {REPEATS}")
    print("| rows B | B x 1 (ms) | " + " | ".join(f"B x {w} (ms, ratio)" for w in WIDTHS[1:]) + " |")
    print("|---|---|" + "---|" * (len(WIDTHS) - 1))
    for rows in ROWS:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.random.randint(0, 1000, (rows, CONTEXT)), cache=cache))
        base = seconds(model, cache, rows, 1)
        wide = [seconds(model, cache, rows, w) for w in WIDTHS[1:]]
        cells = " | ".join(f"{1e3 * t:.1f} ({t / base:.2f}x)" for t in wide)
        print(f"| {rows} | {1e3 * base:.1f} | {cells} |")


if __name__ == "__main__":
    main()
