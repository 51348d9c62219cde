"""Load a fast BLAS before MLX on Linux.

The Linux `mlx[cpu]` wheel links a reference BLAS: a 16-row verify then costs 16x a
one-token step and speculative decoding cannot win. Loading OpenBLAS into the global
symbol namespace before `mlx` is imported makes MLX's CPU matmuls use it (~25x faster),
with identical greedy outputs. Set DFLASH_NO_OPENBLAS=1 to skip this.
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
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    loaded = path
    return path
