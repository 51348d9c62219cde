"""The gated-delta replay kernel, checked against its exact fallback.

As in test_kernels.py: off Apple GPUs the shipped Metal text runs in the C++ emulator
(compiled once per session), on a Mac also on the GPU (skipped elsewhere, with the
reason), and deliberately broken copies of it (a missing barrier, wrong indices) must
fail. Inputs look like the layer's: k of unit norm (mlx-lm's `normalize_qk`), decays
and write strengths in (0, 1).
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.kernels import metal_ready
from dflash_mlx.kernels.replay import (
    GATED_DELTA_REPLAY,
    MAX_TOKENS,
    gated_delta_replay,
    gated_delta_replay_launch,
    gated_delta_replay_reference,
)
from metal_emu import EMULATOR, MetalKernel
from kernel_checks import BARRIER, NOT_ON_METAL, RUNNERS, broken

# (batch, tokens, key heads, value heads, Dk, Dv, input dtype)
TOKEN_SWEEP = [(1, t, 2, 4, 48, 7, mx.float32) for t in range(1, MAX_TOKENS + 1)]  # Dk, Dv: partial tiles
SHAPES = [
    (1, 6, 2, 4, 16, 16, mx.float32),  # the tiny hybrid targets' layers (Dk < one simdgroup)
    (1, 9, 1, 1, 32, 32, mx.float16),
    (2, 3, 1, 3, 100, 9, mx.float16),
    (1, 16, 2, 2, 128, 12, mx.float16),  # Qwen3.5's key size
    (1, 4, 1, 2, 256, 5, mx.float32),  # the largest key size the kernel takes
    (1, 5, 4, 4, 33, 3, mx.bfloat16),
]
CASES = TOKEN_SWEEP + SHAPES
BROKEN_CASE = (1, 5, 2, 4, 48, 7, mx.float32)
MUTANTS = {
    "no barrier after staging": broken(BARRIER, "", 1, kernel=GATED_DELTA_REPLAY),
    "key head of the value head's index": broken("n % Hv / (Hv / Hk)", "n % Hk", kernel=GATED_DELTA_REPLAY),
    "first token's write strength": broken("* bs[t]", "* bs[0]", kernel=GATED_DELTA_REPLAY),
}


def problem(batch, tokens, hk, hv, dk, dv, dtype, seed=0):
    """(state, k, v, g, beta): state float32, g float32 (as mlx-lm computes it), the rest in `dtype`."""
    mx.random.seed(seed)
    k = mx.random.normal((batch, tokens, hk, dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    state = mx.random.normal((batch, hv, dv, dk))
    v = mx.random.normal((batch, tokens, hv, dv))
    g = mx.random.uniform(0.5, 1.0, (batch, tokens, hv))
    beta = mx.random.uniform(0.0, 1.0, (batch, tokens, hv))
    return state, k.astype(dtype), v.astype(dtype), g, beta.astype(dtype)


def launch_of(case):
    return gated_delta_replay_launch(*problem(*case))


def run(runner: str, args, kernel=GATED_DELTA_REPLAY, seed=0) -> mx.array:
    launch = gated_delta_replay_launch(*args)
    if runner == "metal":
        from dflash_mlx.kernels.launch import run_metal

        return run_metal(kernel, launch)[0]
    return MetalKernel.of(kernel)(
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
        seed=seed,
    )[0]


def assert_close(state: mx.array, args, label: str = "") -> None:
    """Within float32 rounding of the reference (the state's entries are of order 1)."""
    ref = gated_delta_replay_reference(*args)
    assert state.shape == ref.shape and state.dtype == ref.dtype == mx.float32, label
    np.testing.assert_allclose(np.array(state), np.array(ref), rtol=1e-5, atol=1e-5, err_msg=label)


@pytest.fixture(scope="module", autouse=True)
def compiled_once():
    """Every instantiation used here, in one g++ run (cached on disk)."""
    wanted = []
    for kernel, case in [(GATED_DELTA_REPLAY, c) for c in CASES] + [(m, BROKEN_CASE) for m in MUTANTS.values()]:
        launch, k = launch_of(case), MetalKernel.of(kernel)
        wanted.append((k, k.args(launch.inputs, launch.template, launch.output_dtypes)))
    EMULATOR.prepare(wanted)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("mlx.core.", ""))
def test_replay_kernel_matches_the_reference(runner, case):
    args = problem(*case)
    assert_close(run(runner, args), args, str(case))


@pytest.mark.parametrize("runner", RUNNERS)
def test_replay_interleavings_do_not_change_the_result(runner):
    args = problem(*BROKEN_CASE)
    outs = [np.array(run(runner, args, seed=s)) for s in range(3)]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_broken_replay_kernels_are_caught(runner, mutant):
    if runner == "metal" and "barrier" in mutant:
        pytest.skip("a missing barrier need not show on real hardware; the emulator's thread order makes it show")
    args = problem(*BROKEN_CASE)
    for seed in range(3 if runner == "emulator" else 1):
        with pytest.raises(AssertionError, match="Mismatched elements"):
            assert_close(run(runner, args, MUTANTS[mutant], seed=seed), args, mutant)


def test_replay_wrapper_falls_back_exactly_off_metal():
    args = problem(1, 3, 1, 2, 16, 4, mx.float32)
    want = gated_delta_replay_reference(*args)
    assert mx.array_equal(gated_delta_replay(*args, use_kernel=False), want).item()
    if not metal_ready():
        assert mx.array_equal(gated_delta_replay(*args), want).item()
    empty = [a[:, :0] for a in args[1:]]
    assert gated_delta_replay(args[0], *empty, use_kernel=False) is args[0]


@pytest.mark.skipif(not metal_ready(), reason=NOT_ON_METAL)
def test_replay_wrapper_on_metal_chains_launches():
    """More tokens than one launch stages: the wrapper chains launches through the state."""
    args = problem(1, MAX_TOKENS + 5, 2, 4, 128, 16, mx.bfloat16)
    assert_close(gated_delta_replay(*args, use_kernel=True), args)


@pytest.mark.parametrize(
    "field, change", [("k", lambda a: (a[0], a[1][:, :2], *a[2:])), ("g", lambda a: (*a[:3], a[3][..., :1], a[4]))]
)
def test_replay_wrapper_rejects_mismatched_shapes(field, change):
    with pytest.raises(ValueError, match=field):
        gated_delta_replay(*change(problem(1, 3, 1, 2, 16, 4, mx.float32)), use_kernel=False)
