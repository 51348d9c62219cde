"""A quantized target KV cache (`kv_bits`) keeps the loop exact: greedy output equals
mlx-lm's own greedy decoding with the same quantized cache, in float32, with drafts
partly accepted (rollback trims a `QuantizedKVCache`), draft trees (`keep_rows` on its
packed arrays), and a quantization start inside the decode (the crossing cycle is cut
there, as mlx-lm quantizes after every one-token step).

8 bits: quantization rounds, so a 1e-5 float32 difference between a batched verify and
one-token steps can move a value to the next level (about 4% of packed key words did,
measured on this prompt); at 4 bits that step is 16x larger and flipped a near-tie
(margin 0.04) after 30 tokens. That is the bf16 trap again, not a rollback error.

A prompt cache quantized by an earlier turn is reused only where a fresh run would hold
the prefix quantized the same way: with `kv_bits` off, another quantization, or a start
past the prefix, the prompt is prefilled again (2 bits: the quantized prefix changes the
greedy text at once).
"""

from __future__ import annotations

import itertools

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from mlx_lm.models.cache import QuantizedKVCache

from dflash_mlx import make_prompt_cache
from dflash_mlx.drafter import Drafter
from dflash_mlx.options import OptionError
from dflash_mlx.speculative import generate_step
from conftest import smollm2_drafter_config
from references import dflash_tokens, greedy_reference
from smollm2_drafters import ScriptedDrafter, chat
from tiny_targets import tiny_target

N = 24
KV = dict(kv_bits=8, kv_group_size=64)


@pytest.mark.parametrize("offset", [None, 7], ids=["from-the-start", "mid-decode"])
def test_greedy_on_a_quantized_cache_is_mlx_lm_greedy(default_model, offset):
    model, tokenizer = default_model
    prompt = chat(tokenizer, "Write a haiku about the sea.")
    start = 0 if offset is None else len(prompt) + offset
    ref = greedy_reference(model, prompt, N, quantized_kv_start=start, **KV)
    drafter = ScriptedDrafter(prompt + ref + [0] * 16, lambda cycle, k: k == 3)  # 2 of 7 drafts accepted
    got, stats = dflash_tokens(model, prompt, drafter, N, quantized_kv_start=start, **KV, block_size=8)
    assert got == ref
    assert 3 in stats.accepted_lengths
    mx.random.seed(1)
    random = Drafter(smollm2_drafter_config())
    got, stats = dflash_tokens(model, prompt, random, N, quantized_kv_start=start, **KV, tree_budget=4)
    assert got == ref and any(stats.trees)


def test_bad_kv_settings_are_one_line():
    model = tiny_target("llama_swa")
    with pytest.raises(OptionError, match="kv_bits must be 2, 3, 4, 5, 6, 8"):
        list(itertools.islice(generate_step([1, 2, 3], model, kv_bits=7), 1))
    with pytest.raises(ValueError, match="sliding-window"):
        list(itertools.islice(generate_step([1, 2, 3], model, kv_bits=4), 1))


QUANTIZED = dict(kv_bits=2, quantized_kv_start=0)


def _quantized_first_turn(model, tokenizer):
    """A sequence whose cache a first turn (4 tokens, a scripted drafter) quantized to 2
    bits from the start; the drafter, and the second turn's prompt."""
    prompt = chat(tokenizer, "Write a haiku about the sea.")
    drafter = ScriptedDrafter(prompt + [0] * 32, lambda cycle, k: False)
    sequence = make_prompt_cache(model, drafter)
    first, _ = dflash_tokens(model, prompt, drafter, 4, prompt_cache=sequence, block_size=4, **QUANTIZED)
    assert isinstance(sequence.cache.target[0], QuantizedKVCache)
    return sequence, drafter, prompt + first + tokenizer.encode(" Now one about the moon.", add_special_tokens=False)


@pytest.mark.parametrize(
    "second",
    [{}, dict(kv_bits=8, quantized_kv_start=0), dict(kv_bits=2, quantized_kv_start=1000), dict(kv_bits=2)],
    ids=["kv-off", "other-bits", "start-past-the-prefix", "default-start"],
)
def test_a_quantized_prompt_cache_is_not_reused_where_a_fresh_run_holds_it_otherwise(default_model, second):
    model, tokenizer = default_model
    sequence, drafter, follow = _quantized_first_turn(model, tokenizer)
    ref = greedy_reference(model, follow, 12, **second)
    drafter.truth, drafter.corrupt = follow + ref + [0] * 16, lambda cycle, k: k == 3
    got, stats = dflash_tokens(model, follow, drafter, 12, prompt_cache=sequence, block_size=8, **second)
    assert got == ref and stats.prompt_cached == 0


def test_a_quantized_prompt_cache_is_reused_where_a_fresh_run_quantizes_it_alike(default_model):
    model, tokenizer = default_model
    sequence, drafter, follow = _quantized_first_turn(model, tokenizer)
    held = len(sequence.tokens)
    _, stats = dflash_tokens(model, follow, drafter, 2, prompt_cache=sequence, block_size=4, **QUANTIZED)
    assert stats.prompt_cached == held
