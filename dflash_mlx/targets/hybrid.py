"""Hybrid gated-delta targets: mlx-lm `qwen3_5`, `qwen3_5_moe` (Qwen3.5 / 3.6) and
`qwen3_next` (Qwen3-Coder-Next). Every `full_attention_interval`-th layer is softmax
attention with a `KVCache`; the others are gated delta nets (`linear_attn`) with an
`ArraysCache` (conv window + recurrent state) and the SSM mask. MoE variants differ only
inside `layer.mlp`, which the layer's own call runs.

With kernels on, a verify's gated-delta layers run through kernels/tape.py, which records
their recurrence inputs, so that a rollback replays the recurrence alone
(`gated_delta_replay`) instead of the mixer module; everything else is unchanged."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.base import create_ssm_mask

from ..distributed import world_size
from ..kernels import tape
from ..rollback import Checkpoint
from ..target import Target


class HybridTarget(Target):
    """The adapter of hybrid gated-delta targets (see the module docstring)."""

    def layer_kinds(self) -> list[str]:
        """Each layer's mask kind: "linear" for a gated-delta layer, else "full"."""
        return ["linear" if layer.is_linear else "full" for layer in self.layers]

    def use_kernels(self, on: bool = True) -> "HybridTarget":
        """With `on`, verify forwards record the gated-delta layers' tapes (where the layer
        is one kernels/tape.py knows) and quantized projections go through `verify_qmm`
        (in one process: a sharded layer all-reduces inside its own call)."""
        self.kernels = on and world_size() == 1 and tape.any_supported(self.layers)
        self.tune_kernels()
        return self

    def layer_forward(
        self, i: int, h: mx.array, mask: Any, cache: Any, explicit: bool, checkpoint: Optional[Checkpoint]
    ) -> mx.array:
        """A recurrent layer of a kernel-path verify records its tape; the others run their own call."""
        layer = self.layers[i]
        if explicit and checkpoint is not None and tape.takes(layer, mask, cache):
            h, checkpoint.tapes[i] = tape.decoder_layer(layer, h, cache)
            return h
        return super().layer_forward(i, h, mask, cache, False, checkpoint)

    def replay(self, layer: int, inputs: mx.array, cache: Any) -> None:
        """Rebuild a gated-delta layer's conv window and state from its inputs (the
        decoder layer's input: the mixer sees it through `input_layernorm`)."""
        block = self.layers[layer]
        block.linear_attn(block.input_layernorm(inputs), create_ssm_mask(inputs, cache), cache)
