"""The conversation state a generation leaves behind (`PromptCache`) is exactly what a
fresh prefill would build: the drafter's context after mixed cycles, and a second turn
through a reused cache, token-identical to mlx-lm (float32, the real SmolLM2 target)."""

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache as make_target_cache

from dflash_mlx import PromptCache, stream_generate
from dflash_mlx.drafter import Drafter
from dflash_mlx.targets import make_target
from fixed_policies import ScriptedPolicy
from references import ours
from smollm2_drafters import BLOCK, PROMPTS, chat, drafter_config


def test_drafter_context_after_mixed_cycles_equals_a_prefill(default_model):
    """After plain steps and drafted blocks, the drafter's context holds exactly the
    features of the committed tokens, at their positions: as if they had been prefilled."""
    model, tokenizer = default_model
    mx.random.seed(3)
    drafter = Drafter(drafter_config())
    mx.eval(drafter.parameters())
    cache = PromptCache(model, drafter)
    prompt = chat(tokenizer, "Translate 'good morning' into Spanish and French.")
    policy = ScriptedPolicy([1, 3, 1, 1, BLOCK, 2, 1])
    *_, last = stream_generate(model, tokenizer, prompt, drafter, max_tokens=40, prompt_cache=cache, policy=policy)
    assert {1, 3, BLOCK} <= set(last.stats.block_sizes)
    cache.flush()  # features of the last plain steps wait for the next draft
    assert cache.draft_length == len(cache.tokens)
    _, features = make_target(model, drafter.config.target_layer_ids).forward(
        mx.array(cache.tokens)[None], make_target_cache(model)
    )
    fresh = drafter.make_cache()
    drafter.append_context(features, fresh)
    for got, want in zip(cache.draft, fresh):
        n = want.offset
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            np.testing.assert_allclose(np.array(a[..., :n, :]), np.array(b[..., :n, :]), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("block_size", [BLOCK, None])
def test_multi_turn_cache_reuse_is_lossless(default_model, block_size):
    """A second turn through a reused PromptCache equals a fresh generation, and only
    the new part of the prompt is prefilled (adaptive: the plain steps' features that
    wait for a draft at the end of a turn are kept too)."""
    model, tokenizer = default_model
    mx.random.seed(2)
    drafter = Drafter(drafter_config())
    mx.eval(drafter.parameters())
    cache = PromptCache(model, drafter)
    messages = [{"role": "user", "content": PROMPTS[2]}]
    first = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    reply = "".join(
        r.text
        for r in stream_generate(
            model, tokenizer, first, drafter, max_tokens=24, prompt_cache=cache, block_size=block_size
        )
    )
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": PROMPTS[3]}]
    second = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    progress = []
    reused, responses = ours(
        model,
        tokenizer,
        second,
        drafter,
        max_tokens=32,
        prompt_cache=cache,
        block_size=block_size,
        prompt_progress_callback=lambda done, total: progress.append((done, total)),
    )
    fresh = [r.token for r in mlx_lm.stream_generate(model, tokenizer, second, max_tokens=32)]
    assert reused == fresh
    assert progress == [(responses[-1].stats.prompt_cached, len(second)), (len(second), len(second))]
    assert responses[-1].stats.prompt_cached > len(first)  # the first turn's reply is reused too
    assert cache.tokens[: len(first)] == first
    # Toggling to target-only and back stays lossless on the same cache.
    third = second + [tokenizer.encode(" ok")[0]]
    assert ours(model, tokenizer, third, None, max_tokens=8, prompt_cache=cache)[0] == [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, third, max_tokens=8)
    ]
    assert ours(model, tokenizer, third, drafter, max_tokens=8, prompt_cache=cache, block_size=block_size)[0] == [
        r.token for r in mlx_lm.stream_generate(model, tokenizer, third, max_tokens=8)
    ]
