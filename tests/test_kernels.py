"""The custom Metal kernels, checked against their exact fallbacks.

Off Apple GPUs the kernels run in the C++ emulator (metal_emu.py), which compiles the very
source text the wrappers ship, once per session. On a Mac the same sweeps also run the
real kernels through `mx.fast.metal_kernel` (skipped elsewhere, with the reason).
Deliberately broken copies of the shipped text (a missing barrier, a wrong index) must
fail, or the emulator would prove nothing.
"""

from __future__ import annotations

import itertools

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.kernels import VERIFY_QMM, KernelSource, metal_ready, verify_qmm, verify_qmm_launch
from dflash_mlx.kernels.launch import run_metal
from dflash_mlx.kernels.qmm import verify_qmm_reference
from kernel_checks import BARRIER, RUNNERS, broken
from metal_emu import EMULATOR, KernelError, MetalKernel

#: Error allowed relative to sum_k |x| |w|: the rounding of one output in the dtype, and then some.
TOLERANCE = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1.6e-2}

ROW_SWEEP = [(m, mx.float16, 4, 64, 320, 37) for m in range(1, 17)]  # K: 1.25 chunks; N: 2 tiles + 5
FORMATS = [
    (3, dtype, bits, gs, 384, 13)
    for dtype, bits, gs in itertools.product((mx.float16, mx.bfloat16, mx.float32), (4, 8), (32, 64, 128))
]
TAILS = [(2, mx.float32, 4, 32, 32, 1), (7, mx.bfloat16, 8, 32, 544, 9), (16, mx.float32, 8, 128, 640, 3)]
CASES = ROW_SWEEP + FORMATS + TAILS
BROKEN_CASE = (4, mx.float32, 4, 32, 544, 12)


def problem(rows, dtype, bits, gs, k, n, seed=0):
    """x (rows, k) and a quantized (n, k) weight, in `dtype`."""
    mx.random.seed(seed)
    x = mx.random.normal((rows, k)).astype(dtype)
    q, s, b = mx.quantize(mx.random.normal((n, k)).astype(dtype), group_size=gs, bits=bits)
    return x, q, s, b, gs, bits


def assert_close(y, args, label=""):
    """y within the dtype's rounding of mx.quantized_matmul on the same arguments."""
    x, q, s, b, gs, bits = args
    ref = verify_qmm_reference(*args)
    assert y.shape == ref.shape and y.dtype == ref.dtype, label
    ref = ref.astype(mx.float32)
    scale = mx.abs(x.astype(mx.float32)) @ mx.abs(mx.dequantize(q, s, b, gs, bits).astype(mx.float32)).T
    err = mx.abs(y.astype(mx.float32) - ref)
    bound = TOLERANCE[x.dtype] * scale + 1e-6
    bad = int(mx.sum(~(err <= bound)).item())  # NaN counts as bad
    assert bad == 0, f"{label}: {bad} of {err.size} outputs off (worst {mx.max(err / bound).item():.3g} x tolerance)"


def emulated(kernel: KernelSource, args, seed=0):
    launch = verify_qmm_launch(*args)
    return MetalKernel.of(kernel)(
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
        seed=seed,
    )[0]


def run(runner: str, args, kernel: KernelSource = VERIFY_QMM, seed=0):
    if runner == "metal":
        return run_metal(kernel, verify_qmm_launch(*args))[0]
    return emulated(kernel, args, seed)


MUTANTS = {
    "no barrier after staging": broken(BARRIER, "", 1),
    "no barrier before restaging": broken(BARRIER, "", 2),
    "group of the chunk, not the lane": broken("scales[n * KG + k / GS]", "scales[n * KG + k0 / GS]"),
    "row stride N - 1": broken("y[m * N + n]", "y[m * (N - 1) + n]"),
    "a lane's second float4 read as its first": broken("xs[m][2 * lane + 1], hi", "xs[m][2 * lane], hi"),
    "staged float4 one value off": broken("float(x[at + 3])", "float(x[at + 2])"),
}


@pytest.fixture(scope="session", autouse=True)
def compiled_once():
    """Every instantiation the tests use, compiled in one g++ run (cached on disk)."""
    wanted = []
    for kernel, case in [(VERIFY_QMM, c) for c in CASES + [BROKEN_CASE]] + [(m, BROKEN_CASE) for m in MUTANTS.values()]:
        launch = verify_qmm_launch(*problem(*case))
        k = MetalKernel.of(kernel)
        wanted.append((k, k.args(launch.inputs, launch.template, launch.output_dtypes)))
    wanted += [(k, k.args(*a)) for k, a in _misc_instances()]
    EMULATOR.prepare(wanted)


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace("mlx.core.", ""))
def test_verify_qmm_matches_quantized_matmul(runner, case):
    args = problem(*case)
    assert_close(run(runner, args), args, str(case))


@pytest.mark.parametrize("runner", RUNNERS)
def test_interleavings_do_not_change_the_result(runner):
    """Any thread order gives the same output, bit for bit: the shipped kernel has no race."""
    args = problem(*BROKEN_CASE)
    outs = [np.array(run(runner, args, seed=s)) for s in range(3)]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    assert_close(mx.array(outs[0]), args)


RACES = "a missing barrier need not show on real hardware; the emulator's seeded thread order makes it show"


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_broken_kernels_are_caught(runner, mutant):
    """A missing barrier or a wrong index gives wrong outputs, for every thread order tried."""
    if runner == "metal" and "barrier" in mutant:
        pytest.skip(RACES)
    args = problem(*BROKEN_CASE)
    for seed in range(3 if runner == "emulator" else 1):
        with pytest.raises(AssertionError, match="outputs off"):
            assert_close(run(runner, args, MUTANTS[mutant], seed=seed), args, mutant)


def test_wrapper_falls_back_exactly_off_metal():
    args = problem(5, mx.bfloat16, 4, 64, 256, 10)
    x = args[0].reshape(1, 5, 256)
    y = verify_qmm(x, *args[1:], use_kernel=False)
    assert y.shape == (1, 5, 10)
    assert mx.array_equal(y[0], verify_qmm_reference(*args)).item()
    if not metal_ready():
        assert mx.array_equal(verify_qmm(x, *args[1:]), y).item()


@pytest.mark.parametrize(
    "change, field",
    [(dict(bits=3), "bits"), (dict(group_size=16), "group_size"), (dict(rows=17), "rows"), (dict(k_cut=32), "w must")],
)
def test_wrapper_rejects_what_the_kernel_cannot_take(change, field):
    x, q, s, b, gs, bits = problem(change.get("rows", 2), mx.float16, 4, 64, 128, 8)
    if "k_cut" in change:
        x = x[:, : change["k_cut"] * 2]
    with pytest.raises(ValueError, match=field):
        verify_qmm(x, q, s, b, change.get("group_size", gs), change.get("bits", bits), use_kernel=False)


# -------------------------------------------------------------- the emulator itself
SHAPES_SOURCE = """
    uint i = thread_position_in_grid.x;
    // a transposed (non-contiguous) input read through its strides
    uint r = i / inp_shape[1], c = i % inp_shape[1];
    out[i] = float(inp[r * inp_strides[0] + c * inp_strides[1]]) * scale + inp_ndim;
"""
SIMD_SOURCE = """
    uint t = thread_index_in_threadgroup;
    float v = float(inp[t]);
    out[t * 5 + 0] = simd_sum(v);
    out[t * 5 + 1] = simd_shuffle_down(v, ushort(1));
    out[t * 5 + 2] = simd_prefix_exclusive_sum(v);
    out[t * 5 + 3] = simd_max(v);
    out[t * 5 + 4] = simd_broadcast(v, ushort(2)) + threads_per_threadgroup.x;
"""
DIVERGENT_SOURCE = """
    if (thread_position_in_threadgroup.x == 3) { return; }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = 1.0f;
"""
SHAPES_KERNEL = MetalKernel("strided", ["inp", "scale"], ["out"], SHAPES_SOURCE, ensure_row_contiguous=False)
SIMD_KERNEL = MetalKernel("simd", ["inp"], ["out"], SIMD_SOURCE)
DIVERGENT_KERNEL = MetalKernel("divergent", ["inp"], ["out"], DIVERGENT_SOURCE)
STRIDED = np.arange(12, dtype=np.float32).reshape(3, 4).T  # (4, 3), strides (1, 4)
SIMD_INPUT = np.random.default_rng(0).normal(size=48).astype(np.float32)


def _misc_instances():
    scale = mx.array(2.0)
    return [
        (SHAPES_KERNEL, ([mx.array(STRIDED), scale], [], [mx.float32])),
        (SIMD_KERNEL, ([mx.array(SIMD_INPUT)], [], [mx.float32])),
        (DIVERGENT_KERNEL, ([mx.array(SIMD_INPUT)], [], [mx.float32])),
    ]


def mlx_written_source(kernel: MetalKernel, inputs, template, output_shapes, output_dtypes, tmp_path, capfd) -> str:
    """The kernel source MLX itself writes, printed with verbose=True while it traces an export
    (MLX records a metal_kernel in an export even where Metal cannot run)."""
    real = mx.fast.metal_kernel(
        name=kernel.name,
        input_names=kernel.input_names,
        output_names=kernel.output_names,
        source=kernel.source,
        header=kernel.header,
        ensure_row_contiguous=kernel.ensure_row_contiguous,
    )

    def call(*arrays):
        return real(
            inputs=list(arrays),
            template=template,
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
            verbose=True,
        )

    capfd.readouterr()
    mx.export_function(str(tmp_path / "kernel.mlxfn"), call, *inputs)
    printed = capfd.readouterr().out.split("```\n", 1)[1]
    return printed[: printed.rindex("\n```")]


@pytest.mark.parametrize("case", [BROKEN_CASE, (16, mx.bfloat16, 8, 128, 128, 1)], ids=["float32", "tiny-bf16"])
def test_emulator_writes_the_source_mlx_writes(case, tmp_path, capfd):
    """Byte for byte, MLX's own signature, template and instantiation around the shipped body."""
    launch = verify_qmm_launch(*problem(*case))
    kernel = MetalKernel.of(VERIFY_QMM)
    ours = kernel.kernel_source(kernel.args(launch.inputs, launch.template, launch.output_dtypes))
    theirs = mlx_written_source(
        kernel, launch.inputs, launch.template, launch.output_shapes, launch.output_dtypes, tmp_path, capfd
    )
    assert ours == theirs
    scalar = [mx.array(STRIDED), mx.array(2.0)]
    ours = SHAPES_KERNEL.kernel_source(SHAPES_KERNEL.args(scalar, [], [mx.float32]))
    assert ours == mlx_written_source(SHAPES_KERNEL, scalar, [], [(12,)], [mx.float32], tmp_path, capfd)


def test_emulator_writes_mlx_signature():
    """Scalars by reference, small arrays in `constant`, shape/strides/ndim when named, attributes by name."""
    a = SHAPES_KERNEL.args([mx.array(STRIDED), mx.array(2.0)], [], [mx.float32])
    text = SHAPES_KERNEL.kernel_source(a)
    assert "[[kernel]] void custom_kernel_strided_float_floats_float(" in text
    for line in [
        "const device float* inp [[buffer(0)]]",
        "const constant int* inp_shape [[buffer(1)]]",
        "const constant int64_t* inp_strides [[buffer(2)]]",
        "const constant int& inp_ndim [[buffer(3)]]",
        "const constant float& scale [[buffer(4)]]",
        "device float* out [[buffer(5)]]",
        "uint3 thread_position_in_grid [[thread_position_in_grid]]",
    ]:
        assert line in text
    (out,) = SHAPES_KERNEL(
        inputs=[STRIDED, mx.array(2.0)],
        grid=(12, 1, 1),
        threadgroup=(8, 1, 1),
        output_shapes=[(12,)],
        output_dtypes=[mx.float32],
    )
    assert np.array_equal(np.array(out), STRIDED.reshape(-1) * 2 + 2)


def test_emulator_simd_functions_partial_simdgroup():
    """48 threads: a full simdgroup and one of 16 lanes (Metal's non-uniform threadgroup)."""
    (out,) = SIMD_KERNEL(
        inputs=[mx.array(SIMD_INPUT)],
        grid=(48, 1, 1),
        threadgroup=(48, 1, 1),
        output_shapes=[(48 * 5,)],
        output_dtypes=[mx.float32],
    )
    got = np.array(out).reshape(48, 5)
    for lo, hi in ((0, 32), (32, 48)):
        v = SIMD_INPUT[lo:hi]
        np.testing.assert_allclose(got[lo:hi, 0], v.sum(), rtol=1e-5)
        np.testing.assert_array_equal(got[lo : hi - 1, 1], v[1:])
        np.testing.assert_allclose(got[lo:hi, 2], np.concatenate([[0], np.cumsum(v)[:-1]]), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got[lo:hi, 3], v.max())
        np.testing.assert_array_equal(got[lo:hi, 4], v[2] + 48)


def test_emulator_reports_a_divergent_barrier():
    with pytest.raises(KernelError, match="returned"):
        DIVERGENT_KERNEL(
            inputs=[mx.array(SIMD_INPUT)],
            grid=(48, 1, 1),
            threadgroup=(16, 1, 1),
            output_shapes=[(48,)],
            output_dtypes=[mx.float32],
        )
