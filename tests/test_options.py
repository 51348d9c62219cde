"""`DecodeOptions`: every field checked once, when built, with one line naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_mlx.options import DecodeOptions, OptionError

BAD = [
    ("temp", -0.5),
    ("temp", float("nan")),
    ("temp", "hot"),
    ("top_p", 0),
    ("top_p", 2),
    ("top_p", True),
    ("top_k", -3),
    ("top_k", 1.5),
    ("seed", -1),
    ("seed", 1.5),
    ("block_size", 1),
    ("block_size", 0),
    ("block_size", 4.0),
    ("kernels", "yes"),
    ("profile", None),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_field_is_one_line_naming_it(name, value):
    with pytest.raises(OptionError) as info:
        DecodeOptions(**{name: value})
    message = str(info.value)
    assert info.value.field == name and message.startswith(name + " ") and repr(value) in message
    assert "\n" not in message
    assert info.value.named("--flag").startswith("--flag ")


def test_good_values_pass_and_keywords_build_on_options():
    base = DecodeOptions(temp=0.7, top_p=0.9, top_k=50, seed=3, block_size=4, kernels=False, profile=True)
    assert DecodeOptions.of(base, temp=0.0) == DecodeOptions(0.0, 0.9, 50, 3, 4, False, True)
    assert DecodeOptions.of() == DecodeOptions()
    with pytest.raises(TypeError, match="max_token"):
        DecodeOptions.of(max_token=3)
    assert base.sampling().temp == 0.7 and base.sampling().top_k == 50


def test_the_block_size_is_resolved_against_the_drafter():
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=8))
    adaptive, fixed = DecodeOptions(), DecodeOptions(block_size=4)
    assert (adaptive.block_limit(drafter), adaptive.adaptive(drafter)) == (8, True)
    assert (fixed.block_limit(drafter), fixed.adaptive(drafter)) == (4, False)
    assert adaptive.block_limit(None) == 1 and not adaptive.adaptive(None)
    assert adaptive.fixed(drafter).block_size == 8 and fixed.fixed(drafter) is fixed
    assert adaptive.fixed(None) == adaptive
    with pytest.raises(OptionError, match="block_size must be at most the drafter's block size 8, got 9"):
        DecodeOptions(block_size=9).block_limit(drafter)


def test_quantized_kv_start_is_mlx_lms():
    """Written out in options.py so that `dflash --help` loads no mlx-lm; it must not drift."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START

    assert DecodeOptions().quantized_kv_start == DEFAULT_QUANTIZED_KV_START
