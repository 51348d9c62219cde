"""Hybrid gated-delta targets with kernels on: the verify records a tape of the recurrence
inputs (kernels/tape.py) and a rollback replays the recurrence alone. Checked against
the module replay (kernels off) and mlx-lm's greedy decoding, float32, on the tiny
random qwen3_5 / qwen3_5_moe / qwen3_next instances; the replay runs as its exact
fallback, and once as the shipped Metal kernel in the emulator (test_kernel_replay.py
checks the kernel itself over a sweep of shapes).
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.cache import make_prompt_cache as make_target_cache

from dflash_mlx.kernels import tape
from dflash_mlx.kernels.replay import GATED_DELTA_REPLAY, gated_delta_replay_launch
from dflash_mlx.rollback import Checkpoint
from dflash_mlx.target import Target
from dflash_mlx.targets import make_target
from metal_emu import MetalKernel
from references import dflash_tokens, greedy_reference
from tiny_drafters import BLOCK, PATTERNS, ScriptedDrafter, prompt_of, random_drafter
from tiny_targets import tiny_target

HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]


@pytest.fixture
def rewinds(monkeypatch):
    """Counts the rollbacks that went through a tape (our own class, spied on)."""
    calls = []
    real = tape.Tape.rewind

    def counting(self, cache, drop):
        calls.append(drop)
        return real(self, cache, drop)

    monkeypatch.setattr(tape.Tape, "rewind", counting)
    return calls


def verify_and_rollback(target: Target, model, prompt, block, drop) -> tuple[list, Checkpoint]:
    cache = make_target_cache(model)
    target.forward(mx.array(prompt)[None], cache, capture=False)
    checkpoint = Checkpoint(cache, target.replay)
    out = target.forward(mx.array(block)[None], cache, capture=False, checkpoint=checkpoint)[0]
    checkpoint.rollback(drop)
    return [cache, out], checkpoint


def emulated_replay(state, t: tape.Tape, keep: int) -> mx.array:
    """The shipped replay kernel, in the emulator, on the tape's first `keep` tokens."""
    launch = gated_delta_replay_launch(state, t.k[:, :keep], t.v[:, :keep], t.g[:, :keep], t.beta[:, :keep])
    return MetalKernel.of(GATED_DELTA_REPLAY)(
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
    )[0]


@pytest.mark.parametrize("name", HYBRIDS)
def test_tape_rollback_equals_module_replay(name, rewinds):
    """Same verify output bit for bit; after every rollback size, the same conv window and
    state as the module replay (1e-5), through the fallback and through the emulated kernel."""
    model = tiny_target(name)
    own, taped = make_target(model), make_target(model).use_kernels()
    assert taped.kernels and not own.kernels
    prompt, block = prompt_of(7, 3), prompt_of(BLOCK, 4)
    for drop in range(1, BLOCK):
        (want, want_out), _ = verify_and_rollback(own, model, prompt, block, drop)
        (got, got_out), checkpoint = verify_and_rollback(taped, model, prompt, block, drop)
        assert mx.array_equal(want_out, got_out).item()
        assert sorted(checkpoint.tapes) == [i for i, k in enumerate(taped.kinds) if k == "linear"]
        for i, (a, b) in enumerate(zip(got, want)):
            if isinstance(a, ArraysCache):
                for x, y in zip(a.cache, b.cache):
                    np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5, rtol=1e-5)
                if drop == 2:
                    state = emulated_replay(checkpoint.states[i][1], checkpoint.tapes[i], BLOCK - drop)
                    np.testing.assert_allclose(np.array(state), np.array(b[1]), atol=1e-5, rtol=1e-5)
    assert len(rewinds) == (BLOCK - 1) * len(checkpoint.tapes)


@pytest.mark.parametrize("name", HYBRIDS)
def test_greedy_with_tape_rollback_is_token_identical(name, rewinds):
    model = tiny_target(name, scale=2.0)
    target = make_target(model)
    prompt = prompt_of(9, 1)
    ref = greedy_reference(model, prompt, 24)
    assert dflash_tokens(model, prompt, random_drafter(target, 1), 24, block_size=BLOCK, kernels=True)[0] == ref
    drafter = ScriptedDrafter(target, prompt + ref + [0] * BLOCK, lambda c, k: PATTERNS[c % len(PATTERNS)](k))
    assert dflash_tokens(model, prompt, drafter, 24, block_size=BLOCK, kernels=True)[0] == ref
    assert len(set(rewinds)) > 2  # rollbacks of several sizes went through the tape


def test_tape_stays_off_where_it_cannot_record():
    """Kernels off, non-hybrid targets and padded caches keep the module path."""
    model = tiny_target("qwen3_5")
    assert not make_target(model).use_kernels(False).kernels
    assert not make_target(tiny_target("qwen3_moe")).use_kernels().kernels
    layer = next(layer for layer in make_target(model).layers if layer.is_linear)
    padded = ArraysCache(2, left_padding=[1])
    assert tape.takes(layer, None, ArraysCache(2)) and not tape.takes(layer, None, padded)
    assert not tape.takes(layer, mx.array([[True]]), ArraysCache(2))
