"""What the engine uses when the caller names nothing: the cache directory, the shipped
drafter and the default target model.

The default target is built by a converter (the GGUF importer), which sits above the
engine, so the engine does not import it: it keeps a *provider* hook instead. The
converters register theirs (`converters/default_model.py`); until one is registered,
the first call imports the module named by `DEFAULT_MODEL_PROVIDER`, which registers
itself. The engine therefore imports and runs without the converters, and an app can
register another default.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Callable, Optional

__all__ = [
    "DEFAULT_MODEL_PROVIDER",
    "SHIPPED_DRAFTER",
    "cache_dir",
    "default_model_path",
    "register_default_model",
    "shipped_asset",
    "shipped_drafter_dir",
]

#: The module that provides the default target model when no provider is registered.
DEFAULT_MODEL_PROVIDER = "converters.default_model"
#: The drafter shipped for the default target (a data folder under `assets/`).
SHIPPED_DRAFTER = "smollm2-135m-dflash-b8"

_provider: Optional[Callable[[], Path]] = None


def cache_dir() -> Path:
    """Where mlx-dflash keeps imported models and other downloads.

    ``$DFLASH_HOME`` if set, else ``$XDG_CACHE_HOME/mlx-dflash``, else
    ``~/.cache/mlx-dflash``. The directory is not created here.
    """
    home = os.environ.get("DFLASH_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mlx-dflash"


def shipped_asset(name: str) -> Path:
    """A folder of shipped data (``assets/<name>``) beside the package in a checkout or an
    editable install, else the copy a wheel installs under ``<prefix>/share/mlx-dflash``.
    Returns the checkout location when neither exists (the caller reports it)."""
    checkout = Path(__file__).resolve().parent.parent / "assets" / name
    installed = Path(sys.prefix) / "share" / "mlx-dflash" / name
    return next((p for p in (checkout, installed) if p.is_dir()), checkout)


def shipped_drafter_dir() -> Path:
    """The shipped drafter's directory (`shipped_asset`)."""
    return shipped_asset(SHIPPED_DRAFTER)


def register_default_model(provider: Callable[[], Path]) -> None:
    """Make `provider()` (which returns a model directory) the default target model."""
    global _provider
    _provider = provider


def default_model_path() -> Path:
    """The default target model's directory, from the registered provider (importing
    `DEFAULT_MODEL_PROVIDER` first if none is registered).

    Raises:
        RuntimeError: no provider could be found (one line: pass a model path instead).
    """
    if _provider is None:
        try:
            importlib.import_module(DEFAULT_MODEL_PROVIDER)
        except ImportError as e:
            raise RuntimeError(
                f"no default model: {DEFAULT_MODEL_PROVIDER} cannot be imported ({e}); pass a model path or Hub repo"
            ) from None
    if _provider is None:
        raise RuntimeError(f"no default model: {DEFAULT_MODEL_PROVIDER} registered none; pass a model path")
    return _provider()
