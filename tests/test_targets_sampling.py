"""Exact sampling through gated-delta rollbacks (chi-square, as in test_sampling.py).

A tiny random `qwen3_5` (hybrid: gated-delta and full-attention layers), temperature 0.5,
blocks of 3 with a random drafter: nearly every verify rejects a draft, so the
third token is drawn from a state rebuilt by the rollback (or from the residual of a
partly accepted block). The first three tokens must follow the target's exact joint
distribution p(t1) p(t2 | t1) p(t3 | t1, t2), computed by the model itself.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from dflash_mlx import PromptCache
from dflash_mlx.speculative import GenerationStats, generate_step
from dflash_mlx.targets import make_target
from chi_square import MIN_EXPECTED, assert_fits
from tiny_drafters import random_drafter
from tiny_targets import tiny_target

TEMP = 0.5
SAMPLES = 1200
PROMPT = [5, 9, 77, 130]


class Joint:
    """Exact probabilities of the first three sampled tokens, one forward per prefix."""

    def __init__(self, model):
        self.model, self.memo = model, {}

    def next(self, prefix: tuple[int, ...]) -> np.ndarray:
        if prefix not in self.memo:
            logits = self.model(mx.array([PROMPT + list(prefix)]))[0, -1]
            self.memo[prefix] = np.array(mx.softmax(logits / TEMP), dtype=np.float64)
        return self.memo[prefix]

    def cells(self, n: int) -> dict:
        """(t1, t2, t3) cells likely enough for a count of their own, and per (t1, t2)
        and per t1 a cell for the rest of that row."""
        cells = {}
        p1 = self.next(())
        for t1 in np.flatnonzero(p1 * n >= MIN_EXPECTED):
            named1 = 0.0
            p2 = self.next((int(t1),))
            for t2 in np.flatnonzero(p1[t1] * p2 * n >= MIN_EXPECTED):
                p12 = float(p1[t1] * p2[t2])
                p3 = self.next((int(t1), int(t2)))
                named = p3[p12 * p3 * n >= MIN_EXPECTED]
                for t3 in np.flatnonzero(p12 * p3 * n >= MIN_EXPECTED):
                    cells[(int(t1), int(t2), int(t3))] = p12 * float(p3[t3])
                cells[(int(t1), int(t2), None)] = p12 * max(0.0, 1.0 - float(named.sum()))
                named1 += float(p2[t2])
            cells[(int(t1), None, None)] = float(p1[t1]) * max(0.0, 1.0 - named1)
        return cells


def _cell(sample: tuple, cells: dict) -> tuple:
    t1, t2, _ = sample
    for key in (sample, (t1, t2, None), (t1, None, None)):
        if key in cells:
            return key
    return sample  # the pooled rest


def test_three_tokens_through_rollbacks_follow_the_target():
    model = tiny_target("qwen3_5", seed=3, scale=3.0)
    drafter = random_drafter(make_target(model), 8)
    cache = PromptCache(model, drafter)
    mx.random.seed(4)
    samples, stats = [], GenerationStats()
    for _ in range(SAMPLES):
        tokens = []
        for committed, _, _ in generate_step(
            PROMPT, model, drafter, block_size=3, max_tokens=3, temp=TEMP, prompt_cache=cache, stats=stats
        ):
            tokens += committed
            if len(tokens) >= 3:
                break
        samples.append(tuple(tokens[:3]))
    accepted = stats.accepted_lengths
    assert accepted.count(1) > len(accepted) // 2 and max(accepted) >= 2  # rollbacks, and some acceptance
    cells = Joint(model).cells(SAMPLES)
    assert sum(1 for k in cells if k[2] is not None) >= 10
    assert_fits([_cell(s, cells) for s in samples], cells, "qwen3_5, three tokens, blocks of 3")
