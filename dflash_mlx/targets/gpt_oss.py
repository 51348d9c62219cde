"""gpt-oss (mlx-lm `gpt_oss`): MoE blocks with attention sinks, alternating sliding-window
(`RotatingKVCache`) and full-attention layers, named by the model's `layer_types`."""

from __future__ import annotations

from ..target import Target


class GptOssTarget(Target):
    def __init__(self, model, capture_layers=()):
        super().__init__(model, capture_layers)
        self.window = self.body.window_size

    def layer_kinds(self) -> list[str]:
        return ["sliding" if kind == "sliding_attention" else "full" for kind in self.body.layer_types]
