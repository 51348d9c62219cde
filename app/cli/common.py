"""What every `dflash` command shares: expected failures as one line, the checks of the
values several commands take, and shared help."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import typer

from dflash_mlx import EXPECTED_ERRORS, DecodeOptions, OptionError, one_line

from app.flags import flag_error

SHARDING_HELP = "Under mlx.launch: shard the target by mlx-lm's tensor or pipeline parallelism (default: auto)."


def one_line_errors(fn: Callable) -> Callable:
    """Turn expected failures into one clear line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OptionError as e:  # named by its flag: --top-p, --block-size, ...
            typer.secho(f"error: {flag_error(e)}", err=True, fg="red")
            raise typer.Exit(1) from None
        except EXPECTED_ERRORS as e:
            typer.secho(f"error: {one_line(e)}", err=True, fg="red")
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            typer.secho("interrupted", err=True, fg="red")
            raise typer.Exit(130) from None

    return wrapper


def prompt_text(prompt: str, flag: str = "--prompt") -> str:
    """The text `flag` gives: its value, or '-' for stdin less its final newline (as a
    shell's `$(...)` drops it, so `echo TEXT | ... -p -` equals `-p TEXT`). Empty is refused."""
    text = sys.stdin.read().removesuffix("\n") if prompt == "-" else prompt
    if not text.strip():
        raise ValueError(f"{flag} is empty" + (" (stdin gave nothing)" if prompt == "-" else ""))
    return text


def positive(value: Optional[int], flag: str) -> None:
    """Refuse a count below 1 (None: not given)."""
    if value is not None and value < 1:
        raise ValueError(f"{flag} must be a positive integer, got {value}")


def not_negative(value: Optional[float], flag: str) -> None:
    """Refuse a value below 0, or NaN (None: not given)."""
    if value is not None and not value >= 0:
        raise ValueError(f"{flag} must be at least 0, got {value}")


def integers(text: str, flag: str) -> list[int]:
    """A comma-separated list of integers ('' for none)."""
    try:
        return [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def counts(text: str, flag: str) -> list[int]:
    """A comma-separated list of integers >= 1, at least one (context lengths, client counts)."""
    values = integers(text, flag)
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must be integers >= 1, got {text!r}")
    return values


def option_values(text: str, flag: str, name: str) -> list[int]:
    """Comma-separated values of the `DecodeOptions` field `name` ('' for none), each
    checked by its rule and named by `flag` (a bench runs one method per value)."""
    values = integers(text, flag)
    for value in values:
        try:
            DecodeOptions(**{name: value})
        except OptionError as e:
            raise ValueError(e.named(flag, none="omitted")) from None
    return values


def writable_directory(path: Path, flag: str) -> Path:
    """`path` as a directory files may be written in (made if missing, its parent must
    exist), before any work; a one-line error otherwise."""
    path = path.expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{flag} {path} is a file: give a directory")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{flag} {path}: the directory {path.parent} does not exist")
    path.mkdir(exist_ok=True)
    if not os.access(path, os.W_OK):
        raise PermissionError(f"{flag} {path} is not writable")
    return path


def writable(path: Optional[Path], flag: str) -> None:
    """Refuse a file `flag` names that could not be written (None: not given), before any work."""
    if path is None:
        return
    folder = path.expanduser().absolute().parent
    if path.is_dir():
        raise IsADirectoryError(f"{flag} {path} is a directory: give a file name")
    if not folder.is_dir():
        raise FileNotFoundError(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"{flag} {path}: the directory {folder} is not writable")


def plottable(path: Optional[Path], flag: str) -> None:
    """Refuse a `flag` PNG that could not be drawn (unwritable, or no matplotlib), before any work."""
    writable(path, flag)
    if path is not None:
        from dflash_mlx.train.curves import pyplot

        pyplot()


def write_json(report: dict, path: Optional[Path]) -> None:
    """A command's report as JSON at `path` (None: nowhere), checked by `writable` before the work."""
    if path is not None:
        path.write_text(json.dumps(report, indent=2) + "\n")


def check_pair(
    model: Optional[str], draft: Optional[str] = None, no_draft: bool = False, draft_vocab: Optional[str] = None
) -> None:
    """Refuse a contradictory or broken choice of target and drafter before anything loads:
    --no-draft beside --draft or --draft-vocab, or a local --model directory that is not a
    model's (`dflash_mlx.loading.check_model_dir`)."""
    if no_draft:
        given = [flag for flag, value in (("--draft", draft), ("--draft-vocab", draft_vocab)) if value is not None]
        if given:
            raise ValueError(f"--no-draft decodes without a drafter: drop {given[0]} or --no-draft")
    if model is not None and Path(model).expanduser().is_dir():
        from dflash_mlx.loading import check_model_dir

        try:
            check_model_dir(Path(model).expanduser())
        except FileNotFoundError as e:
            raise FileNotFoundError(f"--model {e}") from None
