"""What every `dflash` command shares: expected failures as one line, the checks of the
values several commands take, and shared help."""

from __future__ import annotations

import functools
from typing import Callable

import typer

from dflash_mlx import EXPECTED_ERRORS, OptionError, one_line

from app.flags import flag_name

SHARDING_HELP = "Under mlx.launch: shard the target by mlx-lm's tensor or pipeline parallelism (default: auto)."


def one_line_errors(fn: Callable) -> Callable:
    """Turn expected failures into one clear line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OptionError as e:  # named by its flag: --top-p, --block-size, ...
            typer.secho(f"error: {e.named(flag_name(e.field))}", err=True, fg="red")
            raise typer.Exit(1) from None
        except EXPECTED_ERRORS as e:
            typer.secho(f"error: {one_line(e)}", err=True, fg="red")
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.secho("interrupted", err=True, fg="red")
            raise typer.Exit(130) from None

    return wrapper
