"""Load a fast BLAS before MLX on Linux.

The Linux `mlx[cpu]` wheel links a reference BLAS: a 16-row verify then costs 16x a
one-token step and speculative decoding cannot win. Loading OpenBLAS into the global
symbol namespace before `mlx` is imported makes MLX's CPU matmuls use it (~25x faster),
with identical greedy outputs. Set DFLASH_NO_OPENBLAS=1 to skip this.

This is also the one place that changes OpenBLAS's thread count at runtime
(`set_num_threads`): long jobs use two threads while the machine is otherwise idle and
drop to one when another job wants a core (`dflash_mlx.train.threads`).
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys

log = logging.getLogger("dflash_mlx")

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)

loaded: str | None = None
_lib: ctypes.CDLL | None = None


def _find() -> str | None:
    found = [p for p in _CANDIDATES if os.path.exists(p)]
    # numpy and scipy wheels bundle their own OpenBLAS; fine as a last resort.
    for site in sys.path:
        found += sorted(glob.glob(os.path.join(site, "numpy.libs", "libscipy_openblas*.so")))
    return found[0] if found else None


def preload() -> str | None:
    """Load OpenBLAS globally (Linux only, once). Returns its path, or None."""
    global loaded
    if loaded or not sys.platform.startswith("linux") or os.environ.get("DFLASH_NO_OPENBLAS"):
        return loaded
    if "mlx.core" in sys.modules:
        log.warning("mlx was imported before dflash_mlx: OpenBLAS can no longer be preloaded")
        return None
    path = _find()
    if path is None:
        log.warning(
            "no OpenBLAS found: MLX's CPU backend will be slow "
            "(apt-get install libopenblas0-pthread, or set DFLASH_NO_OPENBLAS=1 to silence)"
        )
        return None
    global _lib
    _lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    loaded = path
    return path


def _symbol(name: str):
    """An OpenBLAS function of the loaded library (numpy's bundled copy prefixes and
    suffixes its names), or None."""
    if _lib is None:
        return None
    for candidate in (name, f"scipy_{name}64_", f"scipy_{name}"):
        fn = getattr(_lib, candidate, None)
        if fn is not None:
            return fn
    return None


def num_threads() -> int | None:
    """OpenBLAS's current thread count, or None when OpenBLAS was not loaded here."""
    fn = _symbol("openblas_get_num_threads")
    return int(fn()) if fn is not None else None


def set_num_threads(n: int) -> bool:
    """Set OpenBLAS's thread count (takes effect at the next BLAS call). Call it only
    between computations: no MLX work may be running (`mx.synchronize()` first). Returns
    False when OpenBLAS was not loaded here (nothing to change)."""
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    fn = _symbol("openblas_set_num_threads")
    if fn is None:
        return False
    fn(ctypes.c_int(int(n)))
    return True
