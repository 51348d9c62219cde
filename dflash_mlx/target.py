"""The target adapter: an mlx-lm model's forward that also returns chosen layers' outputs.

mlx-lm models return logits only. Instead of wrapping or patching the user's model, we
run its own submodules (embedding, decoder layers, final norm, lm_head) in the same
order its `__call__` does, and keep the outputs of the layers the drafter reads.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from .kernels import decoder

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class Target:
    """A read-only view of an mlx-lm decoder: `forward` gives final hidden states and the
    concatenated outputs of `capture_layers` (HF `hidden_states[i + 1]` for each i)."""

    kernels = False  # verify projections through the custom kernel: see `use_kernels`

    def __init__(self, model: nn.Module, capture_layers: Sequence[int] = ()):
        model_type = getattr(model, "model_type", None) or getattr(model.args, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        self.model = model
        self.body = model.model
        self.layers = self.body.layers
        self.capture_layers = list(capture_layers)
        self.tied = getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head")
        self.sliding_window = getattr(self.body, "sliding_window", None)

    def use_kernels(self, on: bool = True) -> "Target":
        """With `on`, verify-sized forwards (2..16 tokens) of a quantized model run their
        projections through the custom kernel (kernels/decoder.py); other forwards, and
        models it does not know, run the model's own modules. Returns self."""
        self.kernels = on and decoder.supports(self.layers)
        return self

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return self.model.args.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.args.vocab_size

    def embed(self, tokens: mx.array) -> mx.array:
        return self.body.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        """Logits from final (normed) hidden states, as the model's own head computes them."""
        if self.tied:
            embed = self.body.embed_tokens
            return decoder.as_linear(embed, hidden) if self.kernels else embed.as_linear(hidden)
        return decoder.linear(self.model.lm_head, hidden) if self.kernels else self.model.lm_head(hidden)

    def head_rows(self, ids: mx.array) -> mx.array:
        """The output matrix's rows for token `ids` (n, hidden), dequantized if needed:
        `h @ head_rows(ids).T` are those tokens' logits."""
        if self.tied:
            return self.body.embed_tokens(ids)  # an embedding lookup dequantizes its rows
        head = self.model.lm_head
        if hasattr(head, "scales"):
            biases = head.biases[ids] if getattr(head, "biases", None) is not None else None
            return mx.dequantize(head.weight[ids], head.scales[ids], biases, group_size=head.group_size,
                                 bits=head.bits)
        return head.weight[ids]

    def _masks(self, h: mx.array, cache: Sequence[Any]) -> list[Any]:
        sliding = [getattr(layer, "use_sliding", False) for layer in self.layers]
        full = create_attention_mask(h, cache[sliding.index(False)] if False in sliding else None)
        if not any(sliding):
            return [full] * len(self.layers)
        window = create_attention_mask(h, cache[sliding.index(True)], window_size=self.sliding_window)
        return [window if s else full for s in sliding]

    def forward(self, tokens: mx.array, cache: Sequence[Any], capture: bool = True
                ) -> tuple[mx.array, Optional[mx.array]]:
        """tokens: (1, L). Returns (normed hidden (1, L, hidden), features (1, L, k * hidden) or None)."""
        h = self.embed(tokens)
        captured = {}
        wanted = set(self.capture_layers) if capture else set()
        explicit = self.kernels and decoder.MIN_ROWS <= tokens.shape[1] <= decoder.MAX_ROWS
        for i, (layer, c, mask) in enumerate(zip(self.layers, cache, self._masks(h, cache))):
            h = decoder.decoder_layer(layer, h, mask, c) if explicit else layer(h, mask, c)
            if i in wanted:
                captured[i] = h
        features = (mx.concatenate([captured[i] for i in self.capture_layers], axis=-1)
                    if captured else None)
        return self.body.norm(h), features
