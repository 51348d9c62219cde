"""Target adapters by mlx-lm model type, one small module per family (as mlx-lm has one
file per model): the plain decoders' adapter is `target.Target` itself; the hybrid
gated-delta, gpt-oss and gemma-4 families override only what their `__call__` does
differently (mask kinds, embedding scale, shared K/V, logit soft-capping). `make_target`
is how every caller gets an adapter."""

from __future__ import annotations

from typing import Sequence

import mlx.nn as nn

from ..target import Target
from .gemma4 import Gemma4Target
from .gpt_oss import GptOssTarget
from .hybrid import HybridTarget

ADAPTERS: dict[str, type[Target]] = {
    "llama": Target,
    "mistral": Target,
    "qwen2": Target,
    "qwen3": Target,
    "qwen3_moe": Target,
    "qwen3_5": HybridTarget,
    "qwen3_5_moe": HybridTarget,
    "qwen3_next": HybridTarget,
    "gpt_oss": GptOssTarget,
    "gemma4": Gemma4Target,
    "gemma4_text": Gemma4Target,
}
SUPPORTED_MODEL_TYPES = tuple(ADAPTERS)


def model_type(model: nn.Module) -> str:
    """mlx-lm's model type of `model` ("llama", "qwen3_5", ...)."""
    return getattr(model, "model_type", None) or getattr(model.args, "model_type", None)


def adapter_class(model: nn.Module) -> type[Target]:
    """The adapter for `model`'s type; a one-line ValueError naming the supported ones."""
    kind = model_type(model)
    if kind not in ADAPTERS:
        raise ValueError(f"model type {kind!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return ADAPTERS[kind]


def make_target(model: nn.Module, capture_layers: Sequence[int] = ()) -> Target:
    """The read-only adapter over `model` for its family, capturing `capture_layers`
    (a one-line ValueError for an unsupported model type)."""
    return adapter_class(model)(model, capture_layers)
