"""Custom Metal kernels (`mx.fast.metal_kernel`) for the verify path, each with an exact
pure-MLX fallback that runs off Apple GPUs and serves as the reference in tests."""

from .launch import KernelSource, Launch, metal_ready
from .qmm import VERIFY_QMM, verify_qmm, verify_qmm_launch, verify_qmm_reference

__all__ = [
    "KernelSource",
    "Launch",
    "VERIFY_QMM",
    "metal_ready",
    "verify_qmm",
    "verify_qmm_launch",
    "verify_qmm_reference",
]
