"""Continuous batching (`dflash_mlx/batch.py`): each row's text equals its solo text.

Tiny random float32 targets of every batched family (tests/tiny_targets.py). Requests
with different prompt lengths and max_tokens join mid-way (one prefilled in chunks
between steps), leave at their own ends or are cancelled; each row's tokens must equal
* greedy: mlx-lm's own `generate_step` on that prompt alone, and our loop's
  (`dflash_mlx.speculative.generate_step`, no drafter);
* seeded T > 0 with top-p / top-k: our loop on that request alone, same seed.
Broken batches (two rows' seeds swapped, a cache merged into the wrong row) must give
other text, so the comparisons can fail. An extracted row continues exactly, alone in
mlx-lm's loop or joined again; random schedules on the sliding-window and hybrid families
(prompts past the window, rows extracted and added back) keep every text. Quantized KV
caches and unknown families are refused.
"""

from __future__ import annotations

import random

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from dflash_mlx.batch import BATCHED_FAMILIES, BatchDecoder, batchable, cache_length, refusal
from dflash_mlx.sampling import SamplingParams

from batch_rows import SAMPLED, prefill, row_prompt
from references import dflash_tokens, greedy_reference
from tiny_targets import VOCAB, tiny_target


# (prompt length, max tokens, step it joins at, step it is cancelled at or None)
SCHEDULE = [(5, 12, 0, None), (13, 6, 0, None), (1, 9, 2, None), (20, 10, 3, None), (9, 14, 4, 7)]


def _models():
    return {f: tiny_target(f, scale=2.0) for f in ("llama", "qwen3", "qwen3_5", "gpt_oss")}


@pytest.fixture(scope="module")
def models():
    return _models()


def _join(decoder: BatchDecoder, model, prompt: list[int], sampling: SamplingParams, between=None) -> int:
    """Prefill `prompt` but its last token in chunks of 4, calling `between` after each
    chunk (a batch step), and add it to the batch."""
    cache = make_prompt_cache(model)
    for _ in prefill(model, prompt[:-1], cache, chunk=4):
        if between is not None and len(decoder):
            between()
    return decoder.add(cache, prompt[-1], sampling)


def run_schedule(model, samplings, swap=False, wrong_cache=False) -> dict[int, list[int]]:
    """Decode SCHEDULE's requests in one batch; each request's tokens by its index. `swap`:
    request 0 and 1 trade sampling; `wrong_cache`: request 3 joins with request 2's cache."""
    decoder, out, uid_of, left = BatchDecoder(model), {}, {}, {}
    samplings = [samplings[1], samplings[0], *samplings[2:]] if swap else samplings
    prompts = [row_prompt(length, k) for k, (length, *_) in enumerate(SCHEDULE)]
    for step in range(40):
        for k, (_, max_tokens, joins, _) in enumerate(SCHEDULE):
            if joins == step:
                prompt = prompts[2][:-1] + prompts[3][-1:] if wrong_cache and k == 3 else prompts[k]

                def between():  # the batch steps on while request k prefills
                    _collect(decoder, decoder.step(), uid_of, out, left)

                uid_of[_join(decoder, model, prompt, samplings[k], between)] = k
                left[k], out[k] = max_tokens, []
        if not len(decoder) and step > max(s[2] for s in SCHEDULE):
            return out
        for uid in list(decoder.uids):
            if SCHEDULE[uid_of[uid]][3] == step:  # cancelled
                decoder.remove(uid)
        if len(decoder):
            _collect(decoder, decoder.step(), uid_of, out, left)
    raise AssertionError("the schedule did not finish")


def _collect(decoder, drawn, uid_of, out, left) -> None:
    for uid, token, _ in drawn:
        k = uid_of[uid]
        out[k].append(token)
        left[k] -= 1
        if left[k] == 0:
            decoder.remove(uid)


def _expected_length(k: int, out: dict[int, list[int]]) -> int:
    return len(out[k]) if SCHEDULE[k][3] is not None else SCHEDULE[k][1]


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5", "gpt_oss"])
def test_greedy_rows_equal_their_solo_text(models, family):
    model = models[family]
    out = run_schedule(model, [SamplingParams()] * len(SCHEDULE))
    for k, (length, max_tokens, _, cancel) in enumerate(SCHEDULE):
        prompt, n = row_prompt(length, k), _expected_length(k, out)
        assert len(out[k]) == n and (cancel is None or 0 < n < max_tokens)
        assert out[k] == greedy_reference(model, prompt, n), f"{family} request {k}: batched text differs from mlx-lm's"
        assert out[k] == dflash_tokens(model, prompt, None, n, sampling=SamplingParams())[0], f"{family} request {k}"


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_5", "gpt_oss"])
def test_seeded_rows_equal_their_solo_text(models, family):
    model = models[family]
    samplings = [SAMPLED[k % len(SAMPLED)] for k in range(len(SCHEDULE))]
    samplings[4] = SamplingParams()  # a greedy row among sampled ones
    out = run_schedule(model, samplings)
    for k, (length, *_) in enumerate(SCHEDULE):
        alone = dflash_tokens(model, row_prompt(length, k), None, _expected_length(k, out), sampling=samplings[k])[0]
        assert out[k] == alone, f"{family} request {k}: batched text differs from its solo text"


def test_broken_batches_are_caught(models):
    """Rows that trade seeds, or a cache merged into the wrong row, give other text."""
    model = models["llama"]
    samplings = [SAMPLED[k % len(SAMPLED)] for k in range(len(SCHEDULE))]
    right = run_schedule(model, samplings)
    swapped = run_schedule(model, samplings, swap=True)
    assert swapped[0] != right[0] and swapped[1] != right[1]
    assert all(swapped[k] == right[k] for k in range(2, len(SCHEDULE)))
    wrong = run_schedule(model, samplings, wrong_cache=True)
    assert wrong[3] != right[3] and all(wrong[k] == right[k] for k in (0, 1, 2))


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gpt_oss"])
def test_an_extracted_row_continues_exactly(models, family):
    model = models[family]
    prompts = [row_prompt(11, 1), row_prompt(4, 2)]
    decoder = BatchDecoder(model)
    uids = [_join(decoder, model, p, SamplingParams()) for p in prompts]
    first = [decoder.step() for _ in range(12)]
    cache, last = decoder.extract(uids[0])
    rest = greedy_reference(model, [last], 8, prompt_cache=cache)
    again = BatchDecoder(model)
    uid = again.add(decoder.extract(uids[0])[0], last, SamplingParams())
    rejoined = [again.step()[0].token for _ in range(8)]
    solo = greedy_reference(model, prompts[0], 20)
    assert [step[0].token for step in first] == solo[:12] and last == solo[11]
    assert rest == solo[12:] and rejoined == solo[12:] and uid == 0


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_row_that_fed_nothing_extracts_as_a_fresh_cache(models, family):
    """A one-token prompt before its first step: mlx-lm's batch caches hold no state yet."""
    model = models[family]
    decoder = BatchDecoder(model)
    cache, last = decoder.extract(_join(decoder, model, [5], SamplingParams()))
    assert last == 5 and cache_length(cache) == 0
    again = BatchDecoder(model)
    again.add(cache, last, SamplingParams())
    assert [again.step()[0].token for _ in range(6)] == greedy_reference(model, [5], 6)


def test_logprobs_per_row_and_ids(models):
    model = models["qwen3"]
    decoder = BatchDecoder(model)
    a = _join(decoder, model, row_prompt(6, 1), SamplingParams())
    cache = make_prompt_cache(model)
    list(prefill(model, row_prompt(9, 2)[:-1], cache))
    b = decoder.add(cache, row_prompt(9, 2)[-1], SamplingParams(0.8, seed=5), logprobs=True)
    drawn = decoder.step()
    assert [d.uid for d in drawn] == [a, b] and drawn[0].logprobs is None
    assert drawn[1].logprobs.shape == (VOCAB,) and abs(float(mx.logsumexp(drawn[1].logprobs))) < 1e-4
    decoder.remove(a)
    assert decoder.uids == [b] and len(decoder.step()) == 1
    with pytest.raises(KeyError):
        decoder.remove(a)


@pytest.mark.parametrize("family", [f for f in BATCHED_FAMILIES if f not in ("llama", "qwen3", "qwen3_5", "gpt_oss")])
def test_every_batched_family_decodes_exactly(family):
    model = tiny_target(family, scale=2.0)
    out = run_schedule(model, [SamplingParams()] * len(SCHEDULE))
    for k, (length, *_) in enumerate(SCHEDULE):
        assert out[k] == greedy_reference(model, row_prompt(length, k), _expected_length(k, out)), (
            f"{family} request {k}"
        )


def test_refused_caches_and_families(models):
    model = models["llama"]
    assert batchable(model)
    quantized = [QuantizedKVCache() for _ in make_prompt_cache(model)]
    assert "QuantizedKVCache has no batch form" in refusal(model, quantized)
    with pytest.raises(ValueError, match="QuantizedKVCache"):
        BatchDecoder(model).add(quantized, 1, SamplingParams())
    with pytest.raises(ValueError, match="layers"):
        BatchDecoder(model).add(make_prompt_cache(model)[:1], 1, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        BatchDecoder(model).step()


def _random_requests(rng: random.Random) -> list[dict]:
    """3-6 requests: prompts of 1 to 30 tokens (past the window of 8), 1-20 new tokens,
    greedy or seeded, joining at steps 0-15."""
    requests = []
    for _ in range(rng.randint(3, 6)):
        greedy = rng.random() < 0.4
        sampling = SamplingParams() if greedy else SamplingParams(rng.choice([0.7, 1.0]), 0.9, 20, rng.randrange(99))
        prompt = [rng.randrange(VOCAB) for _ in range(rng.choice([1, 2, 8, 9, 30]))]
        requests.append(dict(prompt=prompt, n=rng.randint(1, 20), joins=rng.randint(0, 15), sampling=sampling))
    return requests


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4_text", "qwen3_5"])
def test_random_schedules_with_extract_round_trips(models, family):
    """Random joins and leaves; now and then a row is extracted, removed and added again
    (a hand-off and back): every request's text still equals its solo text."""
    model = models.get(family) or tiny_target(family, scale=2.0)
    rng = random.Random(family)
    for _ in range(2):
        requests, decoder, owner = _random_requests(rng), BatchDecoder(model), {}
        out = {k: [] for k in range(len(requests))}
        for step in range(40):
            for k, r in enumerate(requests):
                if r["joins"] == step:
                    owner[_join(decoder, model, r["prompt"], r["sampling"])] = k
            if len(decoder) and rng.random() < 0.2:
                uid = rng.choice(decoder.uids)
                (cache, last), k = decoder.extract(uid), owner.pop(uid)
                decoder.remove(uid)
                owner[decoder.add(cache, last, requests[k]["sampling"])] = k
            for uid, token, _ in decoder.step() if len(decoder) else []:
                out[owner[uid]].append(token)
                if len(out[owner[uid]]) == requests[owner[uid]]["n"]:
                    decoder.remove(uid)
        for k, r in enumerate(requests):
            assert out[k] == dflash_tokens(model, r["prompt"], None, r["n"], sampling=r["sampling"])[0], (
                f"{family} request {k}: {r}"
            )
