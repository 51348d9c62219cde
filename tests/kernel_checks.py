"""How the kernel tests run a shipped Metal kernel and break it: the runners (the C++
emulator everywhere, the real kernel through Metal on a Mac, skipped elsewhere with the
reason) and deliberately broken copies of the shipped text (`broken`; `BARRIER`, the
threadgroup barrier that mutants drop), which must fail, or the emulator proves nothing."""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import pytest

from dflash_mlx.kernels import VERIFY_QMM, KernelSource, metal_ready

NOT_ON_METAL = "no Metal GPU here (Apple silicon with the GPU as default device): the real kernels run only on a Mac"
RUNNERS = ["emulator", pytest.param("metal", marks=pytest.mark.skipif(not metal_ready(), reason=NOT_ON_METAL))]
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def broken(old: str, new: str, count: int = 1, kernel: KernelSource = VERIFY_QMM) -> KernelSource:
    """The shipped `kernel` with `old` replaced (its `count`-th occurrence only, 0: all)."""
    src = kernel.source
    assert old in src, f"the mutation's target {old!r} is not in the shipped source"
    if count == 0:
        mutated = src.replace(old, new)
    else:
        at = -1
        for _ in range(count):
            at = src.index(old, at + 1)
        mutated = src[:at] + new + src[at + len(old) :]
    return KernelSource(kernel.name + "_broken", kernel.input_names, kernel.output_names, mutated)


BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"
