"""The version line of `dflash --version` and `dflash-chat --version`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

__all__ = ["version_line"]


def version_line() -> str:
    """mlx-dflash's version and the MLX stack's: `mlx-dflash 0.1.0 (mlx 0.32.4, mlx-lm 0.32.2)`."""

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:  # a checkout run without installing it
            return "not installed"

    return f"mlx-dflash {of('mlx-dflash')} (mlx {of('mlx')}, mlx-lm {of('mlx-lm')})"
