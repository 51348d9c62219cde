"""mlx-dflash: DFlash block-diffusion speculative decoding on MLX.

The public names load on first use (PEP 562): `from dflash_mlx import DecodeOptions`
imports `options.py` alone, not mlx-lm, transformers and torch, so that the command
line's help and argument checks answer at once.
"""

import importlib
from typing import Any

from .blas import preload as _preload_blas

_preload_blas()  # must run before the first `import mlx`

#: Each public name, by the module that defines it.
_HOMES = {
    "cache": ("PromptCache",),
    "config": ("parse_layer_ids",),
    "cycles": ("PREFILL_STEP",),
    "defaults": ("cache_dir", "default_model_path", "shipped_drafter_dir"),
    "pair": ("Pair",),
    "policy": ("BlockSizePolicy", "Width"),
    "tree_policy": ("TreePolicy",),
    "drafter": ("Drafter", "DrafterConfig"),
    "drafter2": ("Drafter2", "Drafter2Config"),
    "drafters": ("save_drafter",),
    "errors": ("EXPECTED_ERRORS", "one_line"),
    "loading": ("context_length", "load", "load_draft"),
    "messages": ("apply_chat_template", "read_prompt_sources", "user_messages"),
    "options": ("DecodeOptions", "OptionError"),
    "sequence": ("Sequence",),
    "speculative": (
        "GenerationResponse",
        "format_stats",
        "generate",
        "generate_step",
        "make_policy",
        "make_prompt_cache",
        "stream_generate",
    ),
    "sampling": ("SamplingParams",),
    "stats": ("GenerationStats", "histogram", "tau"),
}
_MODULES = {name: module for module, names in _HOMES.items() for name in names}

__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module the first time it is asked for."""
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'dflash_mlx' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The package's names, the public ones not yet imported included."""
    return sorted({*globals(), *__all__})
