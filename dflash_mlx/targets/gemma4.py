"""Gemma 4 (mlx-lm `gemma4`, `gemma4_text`): sliding-window and full-attention layers,
embeddings scaled by sqrt(hidden), optional per-layer input embeddings, K/V shared by
the last `num_kv_shared_layers` layers (they have no cache of their own), and tanh
soft-capping of the final logits."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma4_text import logit_softcap

from ..rollback import Checkpoint
from ..target import Target


class Gemma4Target(Target):
    """The adapter of Gemma 4 targets (see the module docstring)."""

    def __init__(self, model: nn.Module, capture_layers: Sequence[int] = ()):
        super().__init__(model, capture_layers)
        self.window = self.body.window_size
        self.softcap = getattr(self.lm, "final_logit_softcapping", None)

    def layer_kinds(self) -> list[str]:
        """Each layer's mask kind, from its `layer_type`."""
        return ["sliding" if layer.layer_type == "sliding_attention" else "full" for layer in self.layers]

    def lm_head(self, hidden: mx.array) -> mx.array:
        """Logits as the model computes them: the output layer, then the tanh soft cap."""
        logits = self.head(hidden)
        return logit_softcap(self.softcap, logits) if self.softcap is not None else logits

    def _per_layer_inputs(self, tokens: mx.array, h: mx.array) -> list[Optional[mx.array]]:
        """Each layer's extra input (1, L, per_layer_hidden), or None (models without them)."""
        body = self.body
        if not body.hidden_size_per_layer_input:
            return [None] * len(self.layers)
        inputs = body._project_per_layer_inputs(h, body._get_per_layer_inputs(tokens))
        return [inputs[:, :, i, :] for i in range(len(self.layers))]

    def forward(
        self, tokens: mx.array, cache: Sequence[Any], capture: bool = True, checkpoint: Optional[Checkpoint] = None
    ) -> tuple[mx.array, Optional[mx.array]]:
        """As `Target.forward`; the K/V-sharing layers read the last K/V (and rope offset)
        of the earlier layer of their kind (`previous_kvs`), as the model does."""
        h = self.embed(tokens) * self.body.embed_scale
        per_layer = self._per_layer_inputs(tokens, h)
        cache = list(cache) + [None] * (len(self.layers) - len(cache))
        shared: list[tuple[Any, Any]] = [(None, None)] * len(self.layers)
        captured = {}
        wanted = set(self.capture_layers) if capture else set()
        masks = self._masks(h, cache)
        for i, (layer, c, mask, source) in enumerate(zip(self.layers, cache, masks, self.body.previous_kvs)):
            kvs, offset = shared[source]
            h, kvs, offset = layer(h, mask, c, per_layer_input=per_layer[i], shared_kv=kvs, offset=offset)
            shared[i] = (kvs, offset)
            if i in wanted:
                captured[i] = h
        return self.body.norm(h), self._features(captured)
