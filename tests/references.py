"""The runs that tests compare: mlx-lm's own greedy decoding (the reference every
lossless test checks against)."""

from __future__ import annotations

from typing import Any, Sequence

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step as mlx_lm_generate_step


def greedy_reference(model: nn.Module, prompt: Sequence[int], n: int, **kw: Any) -> list[int]:
    """mlx-lm's own greedy decoding: the first `n` tokens of `mlx_lm.generate.generate_step`
    on `prompt`; `kw` go to it (`kv_bits`, `quantized_kv_start`, ...)."""
    steps = mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n, **kw)
    return [int(token) for token, _ in steps]
