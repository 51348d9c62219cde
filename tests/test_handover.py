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
from test_batch import _prompt, mlx_alone, ours_alone
from tiny_targets import tiny_drafter_config, tiny_target

from dflash_mlx import make_prompt_cache
from dflash_mlx.batch import BatchDecoder, prefill
from dflash_mlx.drafter import Drafter
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.speculative import generate_step

GREEDY, SEEDED = SamplingParams(), SamplingParams(0.9, 0.9, 0, 11)


def alone(model, drafter, sequence, fed: list[int], at_least: int, p: SamplingParams) -> list[int]:
    """Decode `fed` speculatively on `sequence` for whole cycles until `at_least` tokens came."""
    out = []
    steps = generate_step(
        fed, model, drafter, prompt_cache=sequence, block_size=4, temp=p.temp, top_p=p.top_p, seed=p.seed
    )
    for committed, _, _ in steps:
        out += committed
        if len(out) >= at_least:
            break
    steps.close()
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gpt_oss", "gemma4_text"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_speculative_cache_joins_the_batch_and_comes_back_exactly(family, sampling):
    model = tiny_target(family, scale=2.0)
    mx.random.seed(1)
    drafter = Drafter(tiny_drafter_config(len(model.layers), 4))
    prompt, n = _prompt(40, 1), 32
    sequence = make_prompt_cache(model, drafter)
    tokens = alone(model, drafter, sequence, prompt, 9, sampling)
    fed = prompt + tokens
    held = sequence.cache.reuse(fed, with_drafter=True)
    assert held == len(fed) - 1 and sequence.cache.tokens == fed[:-1]  # nothing to prefill again

    decoder, other = BatchDecoder(model), make_target_cache(model)
    list(prefill(model, _prompt(7, 2)[:-1], other))
    decoder.add(other, _prompt(7, 2)[-1], GREEDY)
    row = decoder.add(sequence.cache.target, fed[-1], sampling)
    for _ in range(8):
        tokens += [d.token for d in decoder.step() if d.uid == row]
    tokens += alone(model, drafter, sequence, prompt + tokens, n - len(tokens), sampling)

    solo = mlx_alone(model, prompt, n) if sampling is GREEDY else ours_alone(model, prompt, n, sampling)
    assert tokens[:n] == solo
