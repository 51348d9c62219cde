"""Several sequences decode through one model pair (`Pair`: the models, the kernel choice,
the capabilities, built once), each with its own state (`Sequence`: caches, tokens,
records, policy). Three generations advanced in turn, one cycle each, give exactly the
text each gives alone: nothing of one sequence leaks into another through the pair.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import pytest

from dflash_mlx import Pair, make_prompt_cache
from dflash_mlx.speculative import generate_step
from dflash_mlx.targets import make_target
from references import dflash_tokens, greedy_reference
from tiny_drafters import prompt_of, random_drafter
from tiny_targets import tiny_target

N = 24
#: Repeating prompts (prompt lookup's guesses get verified too) and a random one.
PROMPTS = [[5, 6, 7, 8] * 5, prompt_of(11, 1), [9, 3, 9, 4, 9, 3, 9] * 3]


def interleaved(model, drafter, prompts, **kw) -> list[list[int]]:
    """The first N tokens of each prompt's generation, advanced one cycle each in turn."""
    steps = [
        generate_step(p, model, drafter, max_tokens=N, prompt_cache=make_prompt_cache(model, drafter), **kw)
        for p in prompts
    ]
    out: list[list[int]] = [[] for _ in prompts]
    while any(len(t) < N for t in out):
        for tokens, step in zip(out, steps):
            if len(tokens) < N:
                tokens += next(step)[0]
    for step in steps:
        step.close()
    return [t[:N] for t in out]


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
@pytest.mark.parametrize(
    "kw",
    [{}, {"block_size": 4}, {"temp": 1.0, "seed": 7}, {"temp": 0.8, "seed": 3, "block_size": 5}],
    ids=["greedy-adaptive", "greedy-fixed", "seeded-adaptive", "seeded-fixed"],
)
def test_interleaved_sequences_equal_their_solo_text(name, kw):
    model = tiny_target(name, scale=2.0)
    drafter = random_drafter(make_target(model), 0)
    solo = [dflash_tokens(model, p, drafter, N, **kw)[0] for p in PROMPTS]
    pair = Pair.of(model, drafter)
    assert interleaved(model, drafter, PROMPTS, **kw) == solo
    assert Pair.of(model, drafter) is pair  # one pair served every generation
    if "temp" not in kw:
        assert solo == [greedy_reference(model, p, N) for p in PROMPTS]
