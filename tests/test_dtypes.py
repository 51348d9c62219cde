"""The whole loop on the dtypes Macs run: a bfloat16 target and drafter, 4- and 8-bit targets.

Real default target (SmolLM2-135M-Instruct) loaded fresh and cast or quantized with
mlx-lm's own API (`mlx_lm.utils.quantize_model`, as `mlx_lm.convert -q` does), the
shipped drafter, held-out prompts (assets/prompts/heldout.jsonl, kept out of training),
reference = `mlx_lm.stream_generate` on the same model. Quantized float32 targets must be
token-identical. In bfloat16 a batched verify may round differently from a one-token
step, so where a token differs the test shows the target's own top-2 margin at that
position is below NEAR_TIE (a near-tie, where either token is the target's greedy choice
up to rounding) and that our token is the runner-up; anything else fails.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.utils import quantize_model

from dflash_mlx import stream_generate
from dflash_mlx.defaults import shipped_drafter_dir
from dflash_mlx.drafters import load_drafter_dir

from conftest import heldout_prompts

pytestmark = pytest.mark.slow
HELDOUT = 2  # prompts
MAX_TOKENS = 24
NEAR_TIE = 0.5  # logits: bfloat16 keeps 8 bits, so a logit near 16 rounds in steps of 0.125


def target_as(default_model_dir, kind: str):
    """A fresh load of the default target: "bfloat16", or quantized to "4bit" / "8bit"."""
    model, tokenizer = mlx_lm.load(str(default_model_dir))
    if kind == "bfloat16":
        model.set_dtype(mx.bfloat16)
    else:
        model, _ = quantize_model(model, {}, group_size=64, bits=int(kind[0]))
    mx.eval(model.parameters())
    return model, tokenizer


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (a length difference counts), or None."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if i == len(a) == len(b) else i


def top2_margin(model, tokens: list[int]) -> tuple[float, list[int]]:
    """The target's own top-1 minus top-2 logit after `tokens`, and those two tokens."""
    logits = model(mx.array([tokens]))[0, -1].astype(mx.float32)  # (vocab,)
    top = mx.argsort(-logits)[:2].tolist()
    return (logits[top[0]] - logits[top[1]]).item(), top


@pytest.mark.parametrize("kind", ["4bit", "8bit", "bfloat16"])
def test_loop_matches_mlx_lm_on_the_same_model(default_model_dir, kind):
    model, tokenizer = target_as(default_model_dir, kind)
    drafter = load_drafter_dir(shipped_drafter_dir())
    if kind == "bfloat16":
        drafter.set_dtype(mx.bfloat16)
    longest = 0
    for prompt in heldout_prompts(tokenizer, HELDOUT):
        ref = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)]
        responses = list(stream_generate(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS))
        got = [r.token for r in responses]
        longest = max(longest, *responses[-1].stats.accepted_lengths)
        at = first_difference(got, ref)
        if at is None:
            continue
        assert kind == "bfloat16", f"{kind}: token {at} differs: ours {got[at:]} vs mlx-lm {ref[at:]}"
        margin, top = top2_margin(model, prompt + ref[:at])
        assert margin < NEAR_TIE and got[at] in top, f"token {at}: not a near-tie (margin {margin:.3f}, top-2 {top})"
    assert longest > 1, "no drafted token was ever accepted: the verify path did not run"
