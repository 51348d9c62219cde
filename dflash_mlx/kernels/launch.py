"""What a custom Metal kernel is, apart from where it runs.

A kernel is its Metal source text plus the arguments of one `mx.fast.metal_kernel` call
(`Launch`). Keeping the two as plain data lets the same text and the same launch go to
the GPU on a Mac and to the C++ emulator that tests it on Linux (tests/metal_emu.py):
what is tested is what ships.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

HERE = Path(__file__).parent


@dataclass(frozen=True)
class KernelSource:
    """The arguments of `mx.fast.metal_kernel` (MLX writes the signature from them)."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str  # the kernel body
    header: str = ""
    ensure_row_contiguous: bool = True

    @classmethod
    def from_file(cls, name: str, inputs: Sequence[str], outputs: Sequence[str], **kwargs: Any) -> "KernelSource":
        """The kernel whose body is `<name>.metal` beside this module."""
        return cls(name, tuple(inputs), tuple(outputs), (HERE / f"{name}.metal").read_text(), **kwargs)


@dataclass
class Launch:
    """One call of a kernel: the arguments of a `mx.fast.metal_kernel` object's `__call__`."""

    inputs: list[mx.array]
    template: list[tuple[str, Any]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]


def metal_ready() -> bool:
    """Whether a kernel would run on a Metal GPU now (Apple silicon, GPU as the default device)."""
    return mx.metal.is_available() and mx.default_device() == mx.gpu


@functools.lru_cache(maxsize=None)
def _compiled(kernel: KernelSource):
    return mx.fast.metal_kernel(
        name=kernel.name,
        input_names=list(kernel.input_names),
        output_names=list(kernel.output_names),
        source=kernel.source,
        header=kernel.header,
        ensure_row_contiguous=kernel.ensure_row_contiguous,
    )


def run_metal(kernel: KernelSource, launch: Launch) -> list[mx.array]:
    """Run `launch` on the GPU (MLX compiles each template instantiation once)."""
    return _compiled(kernel)(
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
    )
