"""`verify_qmm`: a few rows times an MLX affine-quantized weight, each weight read once.

A DFlash verify multiplies 2-16 rows (the block) by every weight matrix of the target.
MLX's quantized matmul is tuned for one row (qmv) or many (qmm); in between it reads the
weights more than once, and on a Mac weight reads are the cost. The Metal kernel
(verify_qmm.metal) stages each chunk of the rows in threadgroup memory and applies every
weight it reads to all of them. Elsewhere (and as the reference in tests) the exact
fallback is `mx.quantized_matmul` itself.
"""

from __future__ import annotations

import mlx.core as mx

from .choice import kernel_wins, qmm_key
from .launch import KernelSource, Launch, metal_ready, run_metal

MAX_ROWS = 16
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
FLOAT_TYPES = (mx.float16, mx.bfloat16, mx.float32)
COLUMNS_PER_THREADGROUP = 16  # SGS * COLS in the kernel: x is staged once for 16 columns
THREADS_PER_THREADGROUP = 128  # SGS * SIMD

VERIFY_QMM = KernelSource.from_file("verify_qmm", ("x", "w", "scales", "biases"), ("y",))


def check_args(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int) -> None:
    """Raise ValueError naming the first argument the kernel cannot take."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if x.dtype not in FLOAT_TYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    rows, k = x.size // max(x.shape[-1], 1), x.shape[-1]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"x must have 1..{MAX_ROWS} rows, got {rows}")
    if k % group_size:
        raise ValueError(f"x's last dimension ({k}) must be a multiple of group_size ({group_size})")
    if w.dtype != mx.uint32 or w.ndim != 2 or w.shape[1] * 32 != k * bits:
        raise ValueError(f"w must be uint32 (N, {k * bits // 32}), got {w.dtype} {w.shape}")
    groups = (w.shape[0], k // group_size)
    for name, a in (("scales", scales), ("biases", biases)):
        if a is None or tuple(a.shape) != groups:
            raise ValueError(f"{name} must have shape {groups}, got {None if a is None else a.shape}")


def result_dtype(x: mx.array, scales: mx.array) -> mx.Dtype:
    """The dtype `mx.quantized_matmul` returns (x's and the scales' promoted; nothing is computed)."""
    return (mx.zeros((), x.dtype) + mx.zeros((), scales.dtype)).dtype


def verify_qmm_launch(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> Launch:
    """The `mx.fast.metal_kernel` call for x (M, K) @ dequantize(w).T -> (M, N)."""
    rows, n = x.shape[0], w.shape[0]  # rows is the kernel's compile-time row count: no padding
    tiles = -(-n // COLUMNS_PER_THREADGROUP)
    dtype = result_dtype(x, scales)
    return Launch(
        inputs=[x, w, scales, biases],
        template=[("T", dtype), ("BITS", bits), ("GS", group_size), ("MB", rows)],
        grid=(tiles * THREADS_PER_THREADGROUP, 1, 1),
        threadgroup=(THREADS_PER_THREADGROUP, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[dtype],
    )


def verify_qmm_reference(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """The exact pure-MLX result: `mx.quantized_matmul` (x @ dequantize(w).T)."""
    return mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)


def verify_qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int = 64,
    bits: int = 4,
    use_kernel: bool | None = None,
) -> mx.array:
    """x (..., K) with at most 16 rows in all, times the affine-quantized w (N, K * bits / 32)
    transposed: (..., N), the same as `mx.quantized_matmul(x, w, scales, biases)` within
    the dtype's rounding. The Metal kernel runs when `use_kernel` (default: on a Metal GPU
    where it was checked and won for this shape and row count, choice.py); otherwise
    `mx.quantized_matmul` does."""
    check_args(x, w, scales, biases, group_size, bits)
    if use_kernel is None:
        key = qmm_key(w.shape[0], x.shape[-1], bits, group_size, scales.dtype, x.size // x.shape[-1])
        use_kernel = metal_ready() and kernel_wins(key)
    if not use_kernel:
        return verify_qmm_reference(x, w, scales, biases, group_size, bits)
    lead = x.shape[:-1]
    launch = verify_qmm_launch(x.reshape(-1, x.shape[-1]), w, scales, biases, group_size, bits)
    (y,) = run_metal(VERIFY_QMM, launch)
    return y.reshape(*lead, w.shape[0])
