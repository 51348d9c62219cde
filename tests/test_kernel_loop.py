"""The decoding loop with the verify kernels on: still lossless.

Off a Mac, `kernels=True` runs the explicit verify forward (dflash_mlx/kernels/decoder.py)
with `verify_qmm`'s exact fallback: the code path the loop takes on a Mac, minus the
kernel itself (tested in test_kernels.py). On a Mac the greedy loop runs the real Metal
kernel and is held to the same token identity. Tiny random
quantized targets built with mlx-lm's own classes, float32; reference: mlx-lm's greedy.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import make_prompt_cache as make_target_cache

from dflash_mlx.drafter import Drafter, DrafterConfig
from dflash_mlx.kernels import decoder, metal_ready
from dflash_mlx.targets import make_target
from references import dflash_tokens, greedy_reference
from tiny_targets import HIDDEN, VOCAB, tiny_target

LAYERS = 4
#: The fields these targets change in `tiny_targets.ARGS`, all families alike.
SIZES = dict(num_hidden_layers=LAYERS, rms_norm_eps=1e-5, rope_theta=10_000.0, max_position_embeddings=512)
FAMILIES = {  # model type: (bits, group size, its own changed fields)
    "llama": (4, 64, dict(attention_bias=False)),
    "qwen2": (8, 32, dict(tie_word_embeddings=True)),
    "qwen3": (4, 32, dict(tie_word_embeddings=True)),
}
PROMPT = [5, 17, 99, 3, 42, 42, 7, 180, 64, 1, 250, 9]
MAX_TOKENS = 24
#: How `dflash_tokens` decodes: blocks of 8 to the end (no limit: the last block runs past MAX_TOKENS).
DECODE = dict(block_size=8, max_tokens=None)


def kernel_target(model_type: str, quantize: bool = True) -> nn.Module:
    """A tiny `model_type` target with every parameter x3 (livelier than the default init:
    varied greedy text), quantized as FAMILIES says unless not `quantize`."""
    bits, group_size, fields = FAMILIES[model_type]
    model = tiny_target(model_type, seed=3, **SIZES, **fields)
    model.update(tree_map(lambda p: 3 * p, model.parameters()))
    if quantize:
        nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    return model


def tiny_drafter(block_size: int = 8) -> Drafter:
    config = DrafterConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        num_target_layers=LAYERS,
        target_layer_ids=[1, 2],
        mask_token_id=0,
        block_size=block_size,
    )
    mx.random.seed(1)
    drafter = Drafter(config)
    mx.eval(drafter.parameters())
    return drafter


class TruthDrafter(Drafter):
    """Proposes the reference continuation with draft 5 of every block wrong: four drafts
    accepted, then a rejection, so the verify's logits and the rollback both count."""

    def __init__(self, generated: list[int]):
        super().__init__(tiny_drafter().config)
        self.truth = PROMPT + generated + [0] * 16  # by position

    def propose(self, block, cache, target):
        start = cache[0].offset  # the position of block[0]
        tokens = [self.truth[start + k] for k in range(1, block.shape[1])]
        tokens = [(t + 1) % VOCAB if k == 5 else t for k, t in enumerate(tokens, 1)]
        return mx.where(mx.arange(VOCAB)[None] == mx.array(tokens)[:, None], 10.0, -10.0)


def _counted(monkeypatch, use_kernel: bool) -> list:
    """The shapes of the projections that go to verify_qmm (our own function, not the
    model's), each run with `use_kernel`."""
    calls = []
    real = decoder.verify_qmm

    def counting(x, *args, **kwargs):
        calls.append(x.shape)
        return real(x, *args, use_kernel=use_kernel)

    monkeypatch.setattr(decoder, "verify_qmm", counting)
    return calls


@pytest.fixture
def kernel_calls(monkeypatch):
    """verify_qmm's calls, run on its exact fallback: bit-exact checks, a Mac included (the
    kernel itself is checked in test_kernels.py)."""
    return _counted(monkeypatch, use_kernel=False)


@pytest.fixture
def metal_calls(monkeypatch):
    """verify_qmm's calls, run on the real Metal kernel where Metal is present (whatever
    the timing chose) and on the fallback elsewhere: the loop as a Mac runs it."""
    return _counted(monkeypatch, use_kernel=metal_ready())


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_explicit_layer_equals_the_models_own(model_type, kernel_calls):
    """Bit for bit, on a verify-sized block after a cached prefix (the fallback computes what the module does)."""
    model = kernel_target(model_type)
    own, explicit = make_target(model, [1, 2]), make_target(model, [1, 2]).use_kernels()
    assert explicit.kernels and not own.kernels
    caches = [make_target_cache(model), make_target_cache(model)]
    for target, cache in zip((own, explicit), caches):
        target.forward(mx.array([PROMPT]), cache)
    kernel_calls.clear()
    block = mx.array([[4, 8, 15, 16, 23, 42, 108, 7]])
    (h_own, f_own), (h_exp, f_exp) = (t.forward(block, c) for t, c in zip((own, explicit), caches))
    assert mx.array_equal(h_own, h_exp).item() and mx.array_equal(f_own, f_exp).item()
    assert mx.array_equal(own.lm_head(h_own), explicit.lm_head(h_exp)).item()
    assert len(kernel_calls) == 7 * LAYERS + 1  # every projection of every layer, and the head
    assert all(shape[-2] == 8 for shape in kernel_calls)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_greedy_with_kernels_is_token_identical(model_type, metal_calls):
    model = kernel_target(model_type)
    reference = greedy_reference(model, PROMPT, MAX_TOKENS)
    assert len(set(reference)) > MAX_TOKENS // 2, reference  # a varied text, not one token repeated
    got, _ = dflash_tokens(model, PROMPT, tiny_drafter(), MAX_TOKENS, kernels=True, **DECODE)
    assert got == reference  # random drafter: rejections
    assert metal_calls, "the verify never went through verify_qmm"
    got, stats = dflash_tokens(model, PROMPT, TruthDrafter(reference), MAX_TOKENS, kernels=True, **DECODE)
    assert got == reference
    assert set(stats.accepted_lengths[:-1]) == {5}  # the last block runs past the reference


def test_kernels_stay_off_where_they_cannot_help(kernel_calls):
    """Unquantized models run their own modules; by default the kernels are on only on Apple GPUs."""
    assert not make_target(kernel_target("qwen3", quantize=False)).use_kernels().kernels
    model = kernel_target("llama")
    got, _ = dflash_tokens(model, PROMPT, tiny_drafter(), MAX_TOKENS, kernels=False, **DECODE)
    assert got == greedy_reference(model, PROMPT, MAX_TOKENS)
    assert kernel_calls == []
    dflash_tokens(model, PROMPT, tiny_drafter(), MAX_TOKENS, **DECODE)
    assert bool(kernel_calls) == metal_ready()
