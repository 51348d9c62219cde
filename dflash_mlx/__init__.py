"""mlx-dflash: DFlash block-diffusion speculative decoding on MLX."""

from .blas import preload as _preload_blas

_preload_blas()  # must run before the first `import mlx`

from .adaptive import BlockSizePolicy, TreePolicy  # noqa: E402
from .drafter import Drafter, DrafterConfig  # noqa: E402
from .drafter2 import Drafter2, Drafter2Config  # noqa: E402
from .loading import load, load_draft  # noqa: E402
from .options import DecodeOptions, OptionError  # noqa: E402
from .speculative import (  # noqa: E402
    GenerationResponse,
    PromptCache,
    generate,
    generate_step,
    make_policy,
    make_prompt_cache,
    stream_generate,
)
from .sampling import SamplingParams  # noqa: E402
from .stats import GenerationStats, histogram  # noqa: E402

__all__ = [
    "BlockSizePolicy",
    "DecodeOptions",
    "Drafter",
    "Drafter2",
    "Drafter2Config",
    "DrafterConfig",
    "GenerationResponse",
    "OptionError",
    "GenerationStats",
    "PromptCache",
    "SamplingParams",
    "TreePolicy",
    "generate",
    "generate_step",
    "histogram",
    "load",
    "load_draft",
    "make_policy",
    "make_prompt_cache",
    "stream_generate",
]
