"""Hybrid gated-delta targets: mlx-lm `qwen3_5`, `qwen3_5_moe` (Qwen3.5 / 3.6) and
`qwen3_next` (Qwen3-Coder-Next). Every `full_attention_interval`-th layer is softmax
attention with a `KVCache`; the others are gated delta nets (`linear_attn`) with an
`ArraysCache` (conv window + recurrent state) and the SSM mask. MoE variants differ only
inside `layer.mlp`, which the layer's own call runs."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_ssm_mask

from ..target import Target


class HybridTarget(Target):
    def layer_kinds(self) -> list[str]:
        return ["linear" if layer.is_linear else "full" for layer in self.layers]

    def replay(self, layer: int, inputs: mx.array, cache: Any) -> None:
        """Rebuild a gated-delta layer's conv window and state from its inputs (the
        decoder layer's input: the mixer sees it through `input_layernorm`)."""
        block = self.layers[layer]
        block.linear_attn(block.input_layernorm(inputs), create_ssm_mask(inputs, cache), cache)
