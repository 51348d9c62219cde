"""Runs `mx.fast.metal_kernel` kernels on the CPU, to test their logic where Metal cannot run.

`MetalKernel` takes the same arguments as `mx.fast.metal_kernel` and is called the same
way. It writes the kernel's source exactly as MLX does (mlx/backend/metal/custom_kernel.cpp
and mlx/fast.cpp: the header, `template <...>` from the template arguments, a
`[[kernel]] void custom_kernel_<name>_<template>_<dtypes>(...)` signature whose
parameters are the inputs (`const device T*`, `const constant T*` below 8 elements,
`const constant T&` for scalars), `<input>_shape` / `_strides` / `_ndim` when the
source mentions them, the outputs, then the thread-position attributes the source
mentions, in MLX's order; the body; the explicit instantiation), prepends
`metal_emu.h` instead of MLX's Metal prelude, and compiles it with g++ (unknown
`[[...]]` attributes are ignored). So the kernel text under test is the one shipped.

All the instantiations a test session needs are compiled in one g++ run (`prepare`), and
the shared library is cached in a temporary directory under the hash of its source.
What the emulator cannot catch is listed at the top of metal_emu.h.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

HEADER = Path(__file__).with_name("metal_emu.h")
HEADERS = [HEADER, HEADER.with_name("metal_emu_threads.h"), HEADER.with_name("metal_emu_types.h")]
CACHE = Path(tempfile.gettempdir()) / "dflash-metal-emu"

#: MLX's `get_type_string`, and how each dtype crosses to numpy (bfloat16 as its bits).
TYPES = {
    mx.bool_: ("bool", np.bool_),
    mx.uint8: ("uint8_t", np.uint8),
    mx.uint16: ("uint16_t", np.uint16),
    mx.uint32: ("uint32_t", np.uint32),
    mx.uint64: ("uint64_t", np.uint64),
    mx.int8: ("int8_t", np.int8),
    mx.int16: ("int16_t", np.int16),
    mx.int32: ("int32_t", np.int32),
    mx.int64: ("int64_t", np.int64),
    mx.float16: ("float16_t", np.float16),
    mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.float32: ("float", np.float32),
}

#: The attributes MLX passes when their names occur in the source, in MLX's order.
ATTRIBUTES = [
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
]
MAX_CONSTANT_ARRAY_SIZE = 8
GXX_FLAGS = ["-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-attributes"]
#: One exported entry point per instantiation: runs the grid, returns 0 or 1 with the error in `err`.
LAUNCHER = """
extern "C" int launch_{i}(void** b, const uint32_t* grid, const uint32_t* tg, uint64_t seed, char* err, int n) {{
  std::string e = emu::launch(grid, tg, seed, [&](const emu::Ids& id) {{ {call}; }});
  std::snprintf(err, n, "%s", e.c_str());
  return e.empty() ? 0 : 1;
}}
"""


class KernelError(RuntimeError):
    """The emulated kernel failed (a divergent barrier, a deadlock, an exception)."""


@dataclass(frozen=True)
class _Args:
    """What an instantiation depends on: template arguments and how inputs are passed."""

    template: tuple[tuple[str, Any], ...]
    inputs: tuple[tuple[mx.Dtype, str], ...]  # (dtype, "s" scalar | "c" constant (< 8 elements) | "" device)
    outputs: tuple[mx.Dtype, ...]


def _template_value(v: Any) -> str:
    if isinstance(v, mx.Dtype):
        return TYPES[v][0]
    return str(int(v))  # MLX streams bools as 0/1


class MetalKernel:
    """`mx.fast.metal_kernel(...)`'s object, emulated: call it with the same keywords
    (plus `seed`, which picks the thread interleaving)."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        emulator: Optional["Emulator"] = None,
    ):
        if atomic_outputs:
            raise NotImplementedError("atomic outputs are not emulated")
        self.name, self.source, self.header = name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.ensure_row_contiguous = ensure_row_contiguous
        parts = ("shape", "strides", "ndim")
        self.shape_infos = [tuple(f"{n}_{part}" in source for part in parts) for n in input_names]
        self.attributes = [(a, t) for a, t in ATTRIBUTES if a in source]
        self.namespace = "k_" + hashlib.sha1((name + header + source).encode()).hexdigest()[:12]
        self.emulator = emulator or EMULATOR

    @classmethod
    def of(cls, kernel: Any, **kwargs: Any) -> "MetalKernel":
        """From a `dflash_mlx.kernels.KernelSource`."""
        return cls(
            kernel.name,
            kernel.input_names,
            kernel.output_names,
            kernel.source,
            kernel.header,
            kernel.ensure_row_contiguous,
            **kwargs,
        )

    def args(self, inputs: Sequence[mx.array], template: Sequence[tuple[str, Any]], output_dtypes) -> _Args:
        return _Args(
            tuple((n, v) for n, v in template), tuple((_dtype(a), _kind(a)) for a in inputs), tuple(output_dtypes)
        )

    def function_name(self, a: _Args) -> str:
        """MLX's kernel name: custom_kernel_<name>[_<template>]_<input dtypes>_<output dtypes>."""
        name = "custom_kernel_" + self.name
        if a.template:
            name += "_" + re.sub(r"<|>|(, )", "_", self._template_def(a))[:-1]
        for dtype, kind in a.inputs:
            name += "_" + TYPES[dtype][0] + kind
        return name + "".join("_" + TYPES[d][0] for d in a.outputs)

    def _template_def(self, a: _Args) -> str:
        return "<" + ", ".join(_template_value(v) for _, v in a.template) + ">"

    def kernel_source(self, a: _Args) -> str:
        """The kernel as MLX writes it (without MLX's Metal prelude)."""
        name, lines = self.function_name(a), []
        if a.template:
            kinds = [
                "typename" if isinstance(v, mx.Dtype) else "bool" if isinstance(v, bool) else "int"
                for _, v in a.template
            ]
            lines.append("template <" + ", ".join(f"{k} {n}" for k, (n, _) in zip(kinds, a.template)) + ">")
        params, index = [], 0
        for (dtype, kind), n, (shape, strides, nd) in zip(a.inputs, self.input_names, self.shape_infos):
            where = "device" if kind == "" else "constant"
            params.append(f"  const {where} {TYPES[dtype][0]}{'&' if kind == 's' else '*'} {n} [[buffer({index})]]")
            index += 1
            extras = [
                (shape, f"const constant int* {n}_shape"),
                (strides, f"const constant int64_t* {n}_strides"),
                (nd, f"const constant int& {n}_ndim"),
            ]
            for wanted, decl in extras if kind != "s" else []:
                if wanted:
                    params.append(f"  {decl} [[buffer({index})]]")
                    index += 1
        for dtype, n in zip(a.outputs, self.output_names):
            params.append(f"  device {TYPES[dtype][0]}* {n} [[buffer({index})]]")
            index += 1
        params += [f"  {t} {attr} [[{attr}]]" for attr, t in self.attributes]
        lines.append(f"[[kernel]] void {name}(\n" + ",\n".join(params) + ") {")
        text = self.header + "\n".join(lines) + "\n" + self.source + "\n}\n"
        if a.template:
            spec = name + self._template_def(a)
            text += f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({spec}) {spec};\n'
        return text

    def call_expression(self, a: _Args) -> str:
        """C++ that calls the instantiation with buffers `b[i]` and thread ids `id`."""
        args, i = [], 0
        for (dtype, kind), (shape, strides, nd) in zip(a.inputs, self.shape_infos):
            t = TYPES[dtype][0]
            args.append(f"*(const {t}*)b[{i}]" if kind == "s" else f"(const {t}*)b[{i}]")
            i += 1
            for wanted, t in zip((shape, strides, nd), ("const int*", "const int64_t*", "const int&")):
                if wanted and kind != "s":
                    args.append(f"*(const int*)b[{i}]" if t == "const int&" else f"({t})b[{i}]")
                    i += 1
        for dtype in a.outputs:
            args.append(f"({TYPES[dtype][0]}*)b[{i}]")
            i += 1
        args += [f"id.{attr}" for attr, _ in self.attributes]
        spec = self.function_name(a) + (self._template_def(a) if a.template else "")
        return f"{self.namespace}::{spec}({', '.join(args)})"

    def __call__(
        self,
        *,
        inputs,
        template=(),
        grid,
        threadgroup,
        output_shapes,
        output_dtypes,
        init_value=None,
        seed: int = 0,
        verbose: bool = False,
    ) -> list[mx.array]:
        a = self.args(inputs, template, output_dtypes)
        buffers = []  # numpy arrays the kernel reads and writes, in signature order
        for x, (shape, strides, nd) in zip(inputs, self.shape_infos):
            host = _to_numpy(x)
            host = np.ascontiguousarray(host) if self.ensure_row_contiguous else host
            buffers.append(host)
            if x.ndim > 0:
                item = host.itemsize
                for wanted, arr in (
                    (shape, np.array(host.shape, np.int32)),
                    (strides, np.array([s // item for s in host.strides], np.int64)),
                    (nd, np.array(host.ndim, np.int32)),
                ):
                    if wanted:
                        buffers.append(arr)
        outs = []
        for shape, dtype in zip(output_shapes, output_dtypes):
            out = np.empty(shape, TYPES[dtype][1])
            if init_value is None:  # MLX leaves outputs uninitialised: make unwritten ones show (NaN)
                out.view(np.uint8).fill(0xFF)
            else:
                out.fill(init_value)
            outs.append(out)
        self.emulator.run(self, a, buffers + outs, grid, threadgroup, seed)
        return [_from_numpy(o, d) for o, d in zip(outs, output_dtypes)]


def _dtype(x: Any) -> mx.Dtype:
    """An input's MLX dtype (inputs may be numpy arrays, to pass non-contiguous views)."""
    return mx.array(np.zeros((), x.dtype)).dtype if isinstance(x, np.ndarray) else x.dtype


def _kind(x: Any) -> str:
    """How MLX passes an input: "s" a scalar (by reference), "c" in `constant` memory, "" in `device`."""
    return "s" if x.ndim == 0 else "c" if x.size < MAX_CONSTANT_ARRAY_SIZE else ""


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    return np.array(x.view(mx.uint16)) if x.dtype == mx.bfloat16 else np.array(x)


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(a).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(a)


class Emulator:
    """Compiles instantiations (in batches, one g++ run each) and runs them."""

    def __init__(self, cache: Path = CACHE):
        self.cache = cache
        self.compiled: dict[tuple[str, _Args], tuple[ctypes.CDLL, str]] = {}

    def prepare(self, wanted: Sequence[tuple[MetalKernel, _Args]]) -> None:
        """Compile every instantiation not compiled yet, all in one shared library."""
        pending = {(k.namespace, a): (k, a) for k, a in wanted if (k.namespace, a) not in self.compiled}
        todo = list(pending.values())
        if not todo:
            return
        parts = [f'#include "{HEADER}"\n']
        by_kernel: dict[str, list] = {}
        for k, a in todo:
            by_kernel.setdefault(k.namespace, [k]).append(a)
        for ns, (k, *insts) in by_kernel.items():
            body = k.header + "".join(k.kernel_source(a)[len(k.header) :] for a in insts)
            parts.append(f"namespace {ns} {{\n{body}\n}}  // namespace {ns}\n")
        for i, (k, a) in enumerate(todo):
            parts.append(LAUNCHER.format(i=i, call=k.call_expression(a)))
        lib = self._build("".join(parts))
        for i, (k, a) in enumerate(todo):
            self.compiled[(k.namespace, a)] = (lib, f"launch_{i}")

    def _build(self, code: str) -> ctypes.CDLL:
        digest = hashlib.sha1("".join([code] + [h.read_text() for h in HEADERS]).encode()).hexdigest()[:16]
        self.cache.mkdir(parents=True, exist_ok=True)
        so = self.cache / f"{digest}.so"
        if not so.exists():
            cpp = self.cache / f"{digest}.cpp"
            cpp.write_text(code)
            tmp = so.with_suffix(".so.tmp")
            cmd = ["g++", *GXX_FLAGS, str(cpp), "-o", str(tmp)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode:
                raise KernelError(f"g++ failed on {cpp}:\n{result.stderr[-4000:]}")
            tmp.replace(so)
        return ctypes.CDLL(str(so))

    def run(self, kernel: MetalKernel, a: _Args, buffers: list[np.ndarray], grid, threadgroup, seed: int) -> None:
        self.prepare([(kernel, a)])
        lib, symbol = self.compiled[(kernel.namespace, a)]
        fn = getattr(lib, symbol)
        pointers = (ctypes.c_void_p * len(buffers))(*[b.ctypes.data for b in buffers])
        err = ctypes.create_string_buffer(1024)
        dims = [(ctypes.c_uint32 * 3)(*[int(v) for v in d]) for d in (grid, threadgroup)]
        if fn(pointers, dims[0], dims[1], ctypes.c_uint64(seed), err, len(err)):
            raise KernelError(err.value.decode())


#: The session's emulator: instantiations compiled once per process (and cached on disk).
EMULATOR = Emulator()
