"""Quantized drafters decode losslessly, and no drafter is computed in an overflowing float16.

The shipped drafter goes through `convert_drafter` with -q at 4 and 8 bits (what
`dflash convert -q --q-bits N` runs) and decodes a held-out prompt with the real default
target: greedy output must equal `mlx_lm.stream_generate`'s token for token (quantizing
the drafter may cost acceptance, never a token). The dtype policy
(`loading.safe_compute_dtype`, applied by `load_draft`) is checked on a float16 target:
the shipped drafter cast to float16 stays float16, and the same drafter with weights
scaled until its activations pass float16's range is cast to bfloat16, with one line.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from app.cli.bench.speed import draft_milliseconds
from converters.convert import convert_drafter
from converters.options import ConvertOptions
from dflash_mlx import load_draft, stream_generate
from dflash_mlx.defaults import shipped_drafter_dir
from dflash_mlx.loading import FLOAT16_MAX, FLOAT16_MARGIN
from dflash_mlx.drafters import load_drafter_dir, save_drafter
from dflash_mlx.targets import make_target

from conftest import heldout_prompts

MAX_TOKENS = 16


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_drafter_is_lossless(default_model, tmp_path, bits):
    model, tokenizer = default_model
    out = convert_drafter(
        str(shipped_drafter_dir()), tmp_path / f"q{bits}", ConvertOptions(quantize=True, q_bits=bits), log=print
    )
    drafter = load_draft(str(out), model=model)
    assert drafter.fc.bits == bits  # really quantized, not the float drafter
    (prompt,) = heldout_prompts(tokenizer, 1)
    ref = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)]
    got = [r.token for r in stream_generate(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS)]
    assert got == ref
    assert draft_milliseconds(model, drafter, context=16, repeats=2) > 0  # `dflash bench` times it too


@pytest.fixture(scope="module")
def float16_target(default_model_dir):
    """A fresh load of the default target, cast to float16."""
    model, _ = mlx_lm.load(str(default_model_dir))
    model.set_dtype(mx.float16)
    return model


def float16_drafter_dir(tmp_path, scale: float):
    """The shipped drafter in float16 with its MLP output weights times `scale`, saved."""
    drafter = load_drafter_dir(shipped_drafter_dir())
    drafter.set_dtype(mx.float16)
    mlp = drafter.layers[0].mlp
    mlp.down_proj.weight = mlp.down_proj.weight * scale
    return save_drafter(drafter, tmp_path / f"f16-x{scale:g}")


def test_float16_drafter_that_fits_stays_float16(float16_target, tmp_path, capsys):
    drafter = load_draft(str(float16_drafter_dir(tmp_path, 1.0)), model=float16_target)
    assert drafter.norm.weight.dtype == mx.float16
    assert capsys.readouterr().err == ""


def test_float16_drafter_that_overflows_gets_the_safe_dtype(float16_target, tmp_path, capsys):
    path = float16_drafter_dir(tmp_path, 1e4)
    target = make_target(float16_target, load_drafter_dir(path).config.target_layer_ids)
    probe = load_drafter_dir(path)
    features = target.forward(mx.array([[1, 2, 3, 4]]), make_prompt_cache(float16_target))[1]
    assert probe.activation_peak(features, target.embed(mx.array([[4, 16, 16]]))) > FLOAT16_MAX / FLOAT16_MARGIN
    drafter = load_draft(str(path), model=float16_target)
    assert drafter.norm.weight.dtype == mx.bfloat16
    assert drafter.layers[0].mlp.down_proj.weight.dtype == mx.bfloat16
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "bfloat16" in err[0]
