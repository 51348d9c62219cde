"""mlx-dflash: DFlash block-diffusion speculative decoding on MLX."""

from .blas import preload as _preload_blas

_preload_blas()  # must run before the first `import mlx`

from .config import parse_layer_ids  # noqa: E402
from .cycles import PREFILL_STEP  # noqa: E402
from .defaults import cache_dir, default_model_path, shipped_drafter_dir  # noqa: E402
from .drafter import Drafter, DrafterConfig  # noqa: E402
from .drafter2 import Drafter2, Drafter2Config  # noqa: E402
from .drafters import save_drafter  # noqa: E402
from .errors import EXPECTED_ERRORS, one_line  # noqa: E402
from .loading import load, load_draft  # noqa: E402
from .messages import apply_chat_template, read_prompt_sources, user_messages  # noqa: E402
from .options import DecodeOptions, OptionError  # noqa: E402
from .pair import Pair  # noqa: E402
from .policy import BlockSizePolicy, Width  # noqa: E402
from .speculative import (  # noqa: E402
    GenerationResponse,
    PromptCache,
    format_stats,
    generate,
    generate_step,
    make_policy,
    make_prompt_cache,
    stream_generate,
)
from .sampling import SamplingParams  # noqa: E402
from .stats import GenerationStats, histogram, tau  # noqa: E402
from .tree_policy import TreePolicy  # noqa: E402

__all__ = [
    "EXPECTED_ERRORS",
    "PREFILL_STEP",
    "BlockSizePolicy",
    "DecodeOptions",
    "Drafter",
    "Drafter2",
    "Drafter2Config",
    "DrafterConfig",
    "GenerationResponse",
    "OptionError",
    "GenerationStats",
    "Pair",
    "PromptCache",
    "SamplingParams",
    "TreePolicy",
    "Width",
    "apply_chat_template",
    "cache_dir",
    "default_model_path",
    "format_stats",
    "generate",
    "generate_step",
    "histogram",
    "load",
    "load_draft",
    "make_policy",
    "make_prompt_cache",
    "one_line",
    "parse_layer_ids",
    "read_prompt_sources",
    "save_drafter",
    "shipped_drafter_dir",
    "stream_generate",
    "tau",
    "user_messages",
]
