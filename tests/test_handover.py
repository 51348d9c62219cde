"""The server's hand-over (`app/server/scheduler.py`) at the engine's level: a sequence's
own prompt cache, after decoding speculatively, joins a `BatchDecoder` with nothing
prefilled again, and the sequence goes back to decoding speculatively from that cache.

Tiny random float32 targets of the batched kinds of cache: plain attention (llama), a
hybrid with gated-delta layers (qwen3_5), sliding windows (gpt_oss, gemma4_text; the
prompt is longer than their window). A request decodes alone (chains of 4 verified by a
random drafter, so drafts are rejected and rolled back), stops at a cycle's end, joins a
batch beside another row for a few plain steps, and decodes alone again: its tokens must
equal mlx-lm's greedy decoding of its prompt alone (seeded: our loop's on its prompt
alone, same seed), and its cache must have held its every token at the join.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache as make_target_cache
from references import dflash_tokens, target_alone
from batch_rows import prefill, row_prompt
from tiny_targets import tiny_drafter_config, tiny_target

from dflash_mlx import make_prompt_cache
from dflash_mlx.batch import BatchDecoder, cache_length
from dflash_mlx.batch_spec import BatchSpeculator
from dflash_mlx.drafter import Drafter
from dflash_mlx.sampling import SamplingParams

GREEDY, SEEDED = SamplingParams(), SamplingParams(0.9, 0.9, 0, 11)
#: How a sequence decodes alone (`dflash_tokens`): whole cycles, blocks of 4, no limit to shrink them.
ALONE = dict(block_size=4, max_tokens=None, whole_cycles=True)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gpt_oss", "gemma4_text"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_speculative_cache_joins_the_batch_and_comes_back_exactly(family, sampling):
    model = tiny_target(family, scale=2.0)
    mx.random.seed(1)
    drafter = Drafter(tiny_drafter_config(len(model.layers), 4))
    prompt, n = row_prompt(40, 1), 32
    sequence = make_prompt_cache(model, drafter)
    tokens = dflash_tokens(model, prompt, drafter, 9, prompt_cache=sequence, sampling=sampling, **ALONE)[0]
    fed = prompt + tokens
    held = sequence.cache.reuse(fed, with_drafter=True)
    assert held == len(fed) - 1 and sequence.cache.tokens == fed[:-1]  # nothing to prefill again

    decoder, other = BatchDecoder(model), make_target_cache(model)
    list(prefill(model, row_prompt(7, 2)[:-1], other))
    decoder.add(other, row_prompt(7, 2)[-1], GREEDY)
    row = decoder.add(sequence.cache.target, fed[-1], sampling)
    for _ in range(8):
        tokens += [d.token for d in decoder.step() if d.uid == row]
    tokens += dflash_tokens(
        model, prompt + tokens, drafter, n - len(tokens), prompt_cache=sequence, sampling=sampling, **ALONE
    )[0]

    assert tokens[:n] == target_alone(model, prompt, n, sampling)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gpt_oss"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_speculating_row_goes_back_alone_from_the_batchs_caches(family, sampling):
    model = tiny_target(family, scale=2.0)
    mx.random.seed(1)
    drafter = Drafter(tiny_drafter_config(len(model.layers), 4))
    prompt, n = row_prompt(40, 1), 40
    sequence = make_prompt_cache(model, drafter)
    tokens = dflash_tokens(model, prompt, drafter, 5, prompt_cache=sequence, sampling=sampling, **ALONE)[0]
    fed = prompt + tokens
    assert sequence.cache.reuse(fed, with_drafter=True) == len(fed) - 1
    joined = sequence.cache.context_copy()[0].offset

    batch, other = BatchSpeculator(model, drafter), make_prompt_cache(model, drafter)
    list(prefill(model, row_prompt(9, 2)[:-1], other.cache.target, draft=(drafter, other.cache.draft)))
    batch.add(other.cache.target, row_prompt(9, 2)[-1], GREEDY, draft=other.cache.draft)
    row = batch.add(sequence.cache.target, fed[-1], sampling, draft=sequence.cache.context_copy())
    speculates = batch.speculation_refusal() is None
    assert speculates == (family != "gpt_oss")
    for width in (4, 1, 3, 4):
        done = batch.speculate(width) if speculates and width > 1 else batch.cycle()
        tokens += next(c.tokens for c in done if c.uid == row)
    assert sequence.cache.draft[0].offset == joined == cache_length(sequence.cache.target)  # left as it joined
    (target, last), draft = batch.extract(row), batch.context(row)
    assert last == tokens[-1] and cache_length(target) == len(prompt + tokens) - 1
    if speculates:
        assert draft[0].offset == cache_length(target)
        sequence.cache.take_over(target, draft, (prompt + tokens)[:-1])
        assert sequence.cache.reuse(prompt + tokens, with_drafter=True) == len(prompt + tokens) - 1  # nothing again
    batch.remove(row)
    tokens += dflash_tokens(
        model, prompt + tokens, drafter, n - len(tokens), prompt_cache=sequence, sampling=sampling, **ALONE
    )[0]

    assert tokens[:n] == target_alone(model, prompt, n, sampling)
