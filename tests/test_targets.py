"""Every supported target family, on tiny random mlx-lm instances (`tiny_targets.py`):

* greedy output token-identical to mlx-lm's own greedy decoding (`mlx_lm.generate.
  generate_step`, what `mlx_lm.stream_generate` yields tokens from), with a random
  drafter and with scripted adversaries (every draft wrong, the first wrong, the last
  wrong, one in the middle wrong, all right), so that a rollback runs in nearly every
  cycle, with prompts longer than the sliding window (it wraps during the prompt and
  again during the output);
* multi-turn reuse of one PromptCache (a continued conversation, then an edited one
  that the recurrent / wrapped caches cannot rewind to: they start over);
* the rollback itself: after a verify and a rollback of 0..B-1 tokens, every layer's
  cache equals a cache that only ever saw the accepted tokens (1e-5, float32).

Exact sampling (chi-square) through rollbacks on a hybrid gated-delta family is
test_targets_sampling.py.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache
from mlx_lm.models.cache import make_prompt_cache as make_target_cache

from dflash_mlx import PromptCache
from dflash_mlx.drafter import DrafterConfig
from dflash_mlx.rollback import Checkpoint
from dflash_mlx.targets import make_target
from references import dflash_tokens, greedy_reference
from fixed_policies import ScriptedPolicy
from tiny_drafters import BLOCK, MASK, PATTERNS, ScriptedDrafter, drafter_config, prompt_of, random_drafter
from tiny_targets import FAMILIES, WINDOW, tiny_target

# (prompt length, tokens generated): shorter than, about, and far longer than the window.
LENGTHS = [(5, 30), (WINDOW + 1, 24), (3 * WINDOW + 3, 30)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """Weights x2: sharper, more varied greedy continuations than the init's."""
    model = tiny_target(request.param, scale=2.0)
    return request.param, model, make_target(model)


@pytest.fixture(scope="module", params=FAMILIES)
def plain_family(request):
    """The init's own scale: activations of order 1, where 1e-5 is float32 rounding."""
    model = tiny_target(request.param)
    return request.param, model, make_target(model)


def test_adapter_per_family(family):
    name, model, target = family
    kinds = {
        "qwen3_moe": {"full"},
        "gpt_oss": {"sliding", "full"},
        "gemma4_text": {"sliding", "full"},
        "gemma4": {"sliding", "full"},
    }.get(name, {"linear", "full"})
    assert set(target.kinds) == kinds and len(target.kinds) == target.num_layers
    cache = make_target_cache(model)
    tokens = mx.array(prompt_of(WINDOW + 5, 1))[None]
    hidden, _ = target.forward(tokens, cache, capture=False)
    want = model(tokens, make_target_cache(model))
    np.testing.assert_allclose(np.array(target.lm_head(hidden)), np.array(want), atol=1e-5, rtol=1e-5)


def test_greedy_lossless(family):
    name, model, target = family
    seen = set()
    for i, (length, n) in enumerate(LENGTHS):
        prompt = prompt_of(length, i)
        ref = greedy_reference(model, prompt, n)
        assert dflash_tokens(model, prompt, random_drafter(target, i), n, block_size=BLOCK)[0] == ref, (name, length)
        drafter = ScriptedDrafter(
            target, prompt + ref + [0] * BLOCK, lambda c, k, i=i: PATTERNS[(c + i) % len(PATTERNS)](k)
        )
        got, stats = dflash_tokens(model, prompt, drafter, n, block_size=BLOCK)
        assert got == ref, (name, length)
        seen.update(stats.accepted_lengths)
        # Plain steps (pipelined) mixed with blocks of every size.
        drafter = ScriptedDrafter(target, prompt + ref + [0] * BLOCK, lambda c, k: PATTERNS[c % 3](k))
        policy = ScriptedPolicy([1, 3, 1, 1, BLOCK, 2, 5], max_size=BLOCK)
        assert dflash_tokens(model, prompt, drafter, n, policy=policy)[0] == ref, (name, length, "mixed sizes")
    assert {1, BLOCK // 2, BLOCK - 1, BLOCK} <= seen  # every kind of rollback ran, and none


@pytest.mark.parametrize("kind", ["random", "scripted"])
def test_multi_turn_reuse(family, kind):
    """Turn 2 continues turn 1 (nothing to rewind); turn 3 edits turn 2's reply (back to
    the common prefix: trimmed; a gated-delta cache goes back to the end of turn 2's
    prompt; a wrapped window starts over); turn 4 edits an early token."""
    name, model, target = family
    if kind == "random":
        drafter = random_drafter(target, 7)
    else:  # one drafter for every turn (a new one would reset the drafter's context)
        drafter = ScriptedDrafter(target, [], lambda c, k: PATTERNS[c % len(PATTERNS)](k))
    cache = PromptCache(model, drafter)
    recurrent = any(isinstance(c, ArraysCache) for c in cache.target)
    rotating = any(isinstance(c, RotatingKVCache) for c in cache.target)
    prompt, reply, cached = prompt_of(WINDOW + 4, 11), [], []
    for turn in range(4):
        if turn == 1:
            prompt = prompt + reply + prompt_of(3, 12)
        elif turn == 2:
            prompt = prompt + reply[:1] + [(reply[1] + 1) % MASK] + reply[2:] + prompt_of(2, 13)
        elif turn == 3:
            prompt = prompt[:3] + [(prompt[3] + 1) % MASK] + prompt[4:]
        ref = greedy_reference(model, prompt, 16)
        drafter.truth = prompt + ref + [0] * BLOCK
        stats = dflash_mlx.speculative.GenerationStats()
        reply = dflash_tokens(model, prompt, drafter, 16, block_size=BLOCK, prompt_cache=cache, stats=stats)[0]
        assert reply == ref, (name, turn)
        cached.append(stats.prompt_cached)
        if turn == 1:
            second = len(prompt)
    assert cached[1] >= second - 4
    assert cached[2] == (0 if rotating else second if recurrent else second + 1)
    assert cached[3] == (0 if rotating or recurrent else 3)


def _window(c) -> tuple[np.ndarray, np.ndarray]:
    """What a rotating cache can still show attention: its last max_size - 1 entries in
    temporal order (a KV cache: all of them)."""
    if isinstance(c, RotatingKVCache):
        keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)
        n = min(c.offset, c.max_size - 1)
        return np.array(keys[..., -n:, :]), np.array(values[..., -n:, :])
    return np.array(c.keys[..., : c.offset, :]), np.array(c.values[..., : c.offset, :])


def assert_same_cache(got, want) -> None:
    for a, b in zip(got, want):
        assert type(a) is type(b)
        if isinstance(a, ArraysCache):
            for x, y in zip(a.cache, b.cache):
                np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5, rtol=1e-5)
            continue
        assert a.offset == b.offset
        for x, y in zip(_window(a), _window(b)):
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prompt_length", [5, 3 * WINDOW + 1])
def test_rollback_equals_a_cache_that_saw_only_the_accepted_tokens(plain_family, prompt_length):
    name, model, target = plain_family
    prompt, block = prompt_of(prompt_length, 3), prompt_of(BLOCK, 4)
    for drop in range(BLOCK):
        cache = make_target_cache(model)
        target.forward(mx.array(prompt)[None], cache, capture=False)
        checkpoint = Checkpoint(cache, target.replay)
        target.forward(mx.array(block)[None], cache, capture=False, checkpoint=checkpoint)
        checkpoint.rollback(drop)
        fresh = make_target_cache(model)
        target.forward(mx.array(prompt)[None], fresh, capture=False)
        target.forward(mx.array(block[: BLOCK - drop])[None], fresh, capture=False)
        assert_same_cache(cache, fresh)
        # ... and the next steps see the same thing (one token, then a block).
        for step in ([7], [9, 10, 11]):
            a = target.lm_head(target.forward(mx.array(step)[None], cache, capture=False)[0])
            b = target.lm_head(target.forward(mx.array(step)[None], fresh, capture=False)[0])
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)


def test_drafter_config_fields_round_trip():
    """gemma-4's dflash_config fields survive export (z-lab's layout) and reload; sliding
    layers come from `use_sliding_window` / `max_window_layers` as transformers derives them."""
    from dflash_mlx.config import parse_config

    target = make_target(tiny_target("qwen3"))
    raw = drafter_config(target).to_dict()
    raw.update(num_hidden_layers=3, use_sliding_window=True, max_window_layers=1, sliding_window=5)
    raw["dflash_config"].update(input_embedding_scale=8.0, output_multiplier=0.5, final_logit_softcapping=30.0)
    cfg, _ = parse_config(raw)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    again = DrafterConfig.from_dict(cfg.to_dict())
    assert (again.input_embedding_scale, again.output_multiplier, again.final_logit_softcapping) == (8.0, 0.5, 30.0)
    assert again.layer_types == cfg.layer_types and again.sliding_window == 5
