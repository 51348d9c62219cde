"""Custom Metal kernels (`mx.fast.metal_kernel`) for the verify path, each with an exact
pure-MLX fallback that runs off Apple GPUs and serves as the reference in tests."""

from .launch import KernelSource, Launch, metal_ready
from .qmm import VERIFY_QMM, verify_qmm, verify_qmm_launch, verify_qmm_reference
from .replay import GATED_DELTA_REPLAY, gated_delta_replay, gated_delta_replay_reference

__all__ = [
    "GATED_DELTA_REPLAY",
    "KernelSource",
    "Launch",
    "VERIFY_QMM",
    "gated_delta_replay",
    "gated_delta_replay_reference",
    "metal_ready",
    "verify_qmm",
    "verify_qmm_launch",
    "verify_qmm_reference",
]
