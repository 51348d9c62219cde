"""What undoing a batched verify costs, the two ways a batch of KV caches can do it (issue 43).

After one verify of W tokens per row, each row keeps its own prefix, so its rejected
tokens must leave the shared slot axis of mlx-lm's `BatchKVCache`:
(a) roll them into the row's left padding (by slices, `roll_rows`, as the speculating batch
    first did; mlx-lm's `prepare(right_padding=...)` / `finalize()` gather, timed beside):
    one copy of every layer's keys and values per cycle that rows reject differently;
(b) leave them where they are as masked holes (`holes.HoleKVCache`, what the speculating
    batch does): no copy, but every later forward attends over the holes too. Timed as the
    extra attention of one verify per slot (from a span of 2,048 more slots), times the slots the
    holes add, HOLES per cycle, summed over 64 cycles.
B = 4 rows, SmolLM2-135M's attention shapes (30 layers, 9 query / 3 KV heads of 64,
float32), W = 8, at 1K and 8K tokens of context. Medians of REPEATS.

Run: flock /tmp/dflash-cpu.lock nice -n 10 env OPENBLAS_NUM_THREADS=1 \
     .venv/bin/python benchmarks/concurrency/rollback_cost.py
"""

from __future__ import annotations

import time

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from dflash_mlx.kernels.choice import seconds

ROWS, LAYERS, HEADS, KV_HEADS, DIM = 4, 30, 9, 3, 64
WIDTH = 8
HOLES = 4  # slots per cycle that (b) leaves behind beyond what (a) keeps
CYCLES = 64
CONTEXTS = (1024, 8192)
REPEATS = 5
DROPS = [7, 3, 0, 5]  # the rows' rejected drafts in the timed verify


def batch_caches(context: int) -> list[BatchKVCache]:
    """Every layer's batch cache: ROWS rows of `context` tokens, W more verified on top."""
    caches = []
    for _ in range(LAYERS):
        c = BatchKVCache([0] * ROWS)
        c.update_and_fetch(*(mx.random.normal((ROWS, KV_HEADS, context, DIM)) for _ in range(2)))
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def mlx_lm_rollback(caches: list[BatchKVCache], drops: list[int]) -> None:
    """(a) as mlx-lm's own batch caches would: trim the fewest, roll the rest by a gather."""
    for c in caches:
        c.trim(min(drops))
        c.prepare(right_padding=[d - min(drops) for d in drops])
        c.finalize()


def roll_rows(c: BatchKVCache, shifts: list[int]) -> None:
    """Roll row r of a batch cache right by shifts[r] slots along its whole buffer, so that
    its last shifts[r] held tokens wrap into its left padding: what mlx-lm's
    `prepare(right_padding=...)` / `finalize()` do, here by slices and one concatenation
    instead of a gather (about 2.5x faster on a CPU)."""
    size = c.keys.shape[2]

    def rolled(x: mx.array) -> mx.array:  # (B, kv_heads, size, head_dim)
        rows = [
            mx.concatenate([x[r : r + 1, :, size - k :], x[r : r + 1, :, : size - k]], axis=2) if k else x[r : r + 1]
            for r, k in enumerate(shifts)
        ]
        return mx.concatenate(rows, axis=0)

    c.keys, c.values = rolled(c.keys), rolled(c.values)
    shift = mx.array(shifts)
    c.offset = c.offset - shift
    c.left_padding = c.left_padding + shift


def by_slices(caches: list[BatchKVCache], drops: list[int]) -> None:
    """(a) by slices (what the speculating batch did before it left holes)."""
    for c in caches:
        c.trim(min(drops))
        roll_rows(c, [d - min(drops) for d in drops])


def roll_seconds(context: int, rollback=by_slices) -> float:
    """(a): one verify's rollback, every layer (the verify's own write not timed)."""
    caches = batch_caches(context)
    new = [mx.random.normal((ROWS, KV_HEADS, WIDTH, DIM)) for _ in range(2)]
    mx.eval(new)

    def run():
        for c in caches:
            c.update_and_fetch(*new)
        mx.eval([c.state for c in caches])
        tic = time.perf_counter()
        rollback(caches, DROPS)
        mx.eval([c.state for c in caches])
        run.seconds = time.perf_counter() - tic
        for c in caches:  # the same cache length for every repeat
            c.trim(WIDTH - min(DROPS))

    times = []
    for _ in range(REPEATS + 1):
        run()
        times.append(run.seconds)
    return sorted(times[1:])[REPEATS // 2]


def attention_seconds(slots: int) -> float:
    """One verify's attention, every layer: W queries per row over `slots` masked key slots."""
    q = mx.random.normal((ROWS, HEADS, WIDTH, DIM))
    k, v = (mx.random.normal((ROWS, KV_HEADS, slots, DIM)) for _ in range(2))
    mask = mx.random.uniform(shape=(ROWS, 1, WIDTH, slots)) < 0.9  # (B, 1, W, slots)
    mx.eval(q, k, v, mask)

    def run():
        outs = [mx.fast.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5, mask=mask) for _ in range(LAYERS)]
        mx.eval(outs)

    return seconds(run, REPEATS)


def holes_seconds(context: int, span: int = 2048) -> float:
    """(b): the extra attention over CYCLES cycles of holes (HOLES more slots each cycle:
    cycle n attends over n * HOLES of them). The cost of one more slot comes from a span
    of `span` slots: the difference of two timings, well above the timer's noise."""
    per_slot = (attention_seconds(context + span) - attention_seconds(context)) / span
    return per_slot * HOLES * CYCLES * (CYCLES - 1) / 2


def main() -> None:
    print(f"B = {ROWS} rows, SmolLM2-135M attention shapes (float32), verify of {WIDTH}, rows rejecting {DROPS}")
    print(f"(a) roll into left padding: a copy per cycle; (b) masked holes: {HOLES} more slots per cycle")
    print(
        f"| context | (a) per cycle (ms) | (a) mlx-lm's gather (ms) | (a) {CYCLES} cycles (ms) "
        f"| (b) {CYCLES} cycles (ms) | (b) / (a) |"
    )
    print("|---|---|---|---|---|---|")
    for context in CONTEXTS:
        roll, gather = roll_seconds(context), roll_seconds(context, mlx_lm_rollback)
        holes = holes_seconds(context)
        print(
            f"| {context} | {1e3 * roll:.2f} | {1e3 * gather:.2f} | {1e3 * CYCLES * roll:.1f} | "
            f"{1e3 * holes:.1f} | {holes / (CYCLES * roll):.2f}x |"
        )


if __name__ == "__main__":
    main()
