"""gpt-oss (mlx-lm `gpt_oss`): MoE blocks with attention sinks, alternating sliding-window
(`RotatingKVCache`) and full-attention layers, named by the model's `layer_types`."""

from __future__ import annotations

from typing import Sequence

import mlx.nn as nn

from ..target import Target


class GptOssTarget(Target):
    """The adapter of gpt-oss targets (see the module docstring)."""

    def __init__(self, model: nn.Module, capture_layers: Sequence[int] = ()):
        super().__init__(model, capture_layers)
        self.window = self.body.window_size

    def layer_kinds(self) -> list[str]:
        """Each layer's mask kind, from the model's `layer_types`."""
        return ["sliding" if kind == "sliding_attention" else "full" for kind in self.body.layer_types]
