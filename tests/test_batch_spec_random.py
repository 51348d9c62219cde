"""Random schedules through a speculating batch: requests join (one-token prompts among
them), are cancelled, are handed out and back in with their caches and records, while
cycles of random widths run; every request's text equals its solo text."""

from __future__ import annotations

import random

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import pytest

from dflash_mlx.batch_spec import BatchSpeculator
from dflash_mlx.sampling import SamplingParams

from references import target_alone
from batch_rows import BLOCK, PATTERNS, SAMPLED, join_row, row_prompt, scripted_drafter
from tiny_targets import tiny_target


def _requests(rng: random.Random) -> list[tuple[int, int, SamplingParams, int]]:
    """2-6 requests: (prompt length, max tokens, sampling, drafter error pattern)."""
    samplings = [SamplingParams(), SamplingParams(), *SAMPLED]
    return [
        (rng.choice([1, 1, 2, 5, 8, 13]), rng.randint(1, 20), rng.choice(samplings), rng.randrange(len(PATTERNS)))
        for _ in range(rng.randint(2, 6))
    ]


def _solo(model, k: int, length: int, n: int, sampling: SamplingParams) -> list[int]:
    return target_alone(model, row_prompt(length, k), n + BLOCK, sampling)


def _schedule(model, seed: int) -> None:
    rng = random.Random(seed)
    requests = _requests(rng)
    solo = [_solo(model, k, length, n, s) for k, (length, n, s, _) in enumerate(requests)]
    drafter = scripted_drafter(model)
    spec, waiting, owner, out = BatchSpeculator(model, drafter), list(range(len(requests))), {}, {}
    for _ in range(300):
        if not waiting and not len(spec):
            break
        if waiting and (not len(spec) or rng.random() < 0.3):
            k = waiting.pop(0)
            length, _, sampling, pattern = requests[k]
            uid, draft = join_row(spec, model, drafter, row_prompt(length, k), sampling)
            drafter.watch(draft, row_prompt(length, k) + solo[k], PATTERNS[pattern])
            owner[uid], out[k] = k, []
            continue
        event, uid = rng.random(), rng.choice(list(owner))
        if event < 0.05:  # a cancel
            spec.remove(uid)
            owner.pop(uid)
            continue
        if event < 0.12:  # handed out (caches, drafter context, records) and back in
            (cache, last), draft, records = spec.extract(uid), spec.context(uid), spec.contexts[uid].records
            spec.remove(uid)
            k = owner.pop(uid)
            owner[spec.add(cache, last, requests[k][2], draft=draft, records=records)] = k
            continue
        speculates = event < 0.6 and spec.speculation_refusal() is None
        for c in spec.speculate(rng.randint(2, BLOCK)) if speculates else spec.cycle():
            k = owner[c.uid]
            out[k] += c.tokens
            if len(out[k]) >= requests[k][1]:
                out[k] = out[k][: requests[k][1]]
                spec.remove(c.uid)
                owner.pop(c.uid)
    assert not waiting and not len(spec), f"seed {seed}: the schedule did not finish"
    for k, tokens in out.items():
        assert tokens == solo[k][: len(tokens)], f"seed {seed} request {k} {requests[k][:2]}: not its solo text"


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_random_schedules_keep_each_rows_solo_text(family):
    model = tiny_target(family, scale=2.0)
    for seed in range(8):
        _schedule(model, seed)
