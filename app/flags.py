"""The decoding flags of every front end, made from `DecodeOptions`' fields in one place.

`DecodeOptions` (dflash_mlx/options.py) holds each option's default, rule and meaning
(its `doc`); this module turns them into the `dflash` commands' typer options
(`decode_flags`), the chat's argparse arguments (`add_arguments`, `from_args`) and the
values of its slash commands (`parse_value`, `describe`). A field's flag is `--` and its
name with dashes (`--top-p`); a switch whose default is None (`kernels`: on where they
run) is `--no-NAME`; a true/false field (`profile`) is `--NAME`. A bad value is the
`OptionError` of `DecodeOptions`, which the front ends show named by its flag (`flag_name`).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import typing
from dataclasses import fields
from typing import Any, Callable, Sequence

from dflash_mlx import DecodeOptions, OptionError

__all__ = [
    "DRAFTING",
    "KV_CACHE",
    "SAMPLING",
    "WINDOW",
    "add_arguments",
    "decode_flags",
    "describe",
    "flag_error",
    "flag_name",
    "from_args",
    "help_text",
    "parse_value",
    "slash_help",
    "typer_parameter",
    "usage",
]

_FIELDS = {f.name: f for f in fields(DecodeOptions)}
_HINTS = typing.get_type_hints(DecodeOptions)

#: The groups of fields the commands take.
SAMPLING = ("temp", "top_p", "top_k", "seed")
DRAFTING = ("block_size", "kernels", "tree_budget", "lookup")
WINDOW = ("draft_window", "draft_sink")
KV_CACHE = ("kv_bits", "kv_group_size", "quantized_kv_start")
#: What a slash command takes for None, where a field allows it (adaptive, off, ...).
NONE_WORDS = ("auto", "default", "none")


def _kind(name: str) -> type:
    """The field's value type without Optional: float, int or bool."""
    hint = _HINTS[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _optional(name: str) -> bool:
    return type(None) in typing.get_args(_HINTS[name])


def _switch(name: str) -> bool:
    """A true/false/None field: None (the default) means on where it runs, `--no-NAME` turns it off."""
    return name in _HINTS and _kind(name) is bool and _optional(name)


def flag_name(name: str) -> str:
    """The command-line flag of field `name` (of `DecodeOptions` or a front end's own, such as
    the chat's `max_tokens`): `--top-p`; a switch's `--no-kernels`."""
    dashed = name.replace("_", "-")
    return f"--no-{dashed}" if _switch(name) else f"--{dashed}"


def flag_error(error: OptionError) -> str:
    """An `OptionError` as a command line says it: named by the flag, its None (which
    nobody can type) as leaving the flag out."""
    return error.named(flag_name(error.field), none="omitted")


def _doc(name: str, none: str) -> str:
    """The field's meaning, its None written as `none` (what gives it there)."""
    return _FIELDS[name].metadata["doc"].replace("None: ", f"{none}: ")


def help_text(name: str) -> str:
    """The help of field `name`'s flag: its meaning, a sentence."""
    doc = _doc(name, "default")
    return f"Turn off {doc}." if _switch(name) else f"{doc[0].upper()}{doc[1:]}."


def _from_flag(name: str, value: Any) -> Any:
    """The field's value from its flag's (a switch's flag given: False, else None)."""
    if _switch(name):
        return False if value else None
    return value


# --------------------------------------------------------------------------- typer


def typer_parameter(name: str, annotation: Any, default: Any, flags: Sequence[str], text: str) -> inspect.Parameter:
    """One typer option as a parameter of a command's signature, which typer reads its options from."""
    import typer

    option = typer.Option(default, *flags, help=text)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def _field_parameter(name: str) -> inspect.Parameter:
    """The typer option of field `name`."""
    flag = _kind(name) is bool
    default = False if flag else _FIELDS[name].default
    return typer_parameter(name, bool if flag else _HINTS[name], default, [flag_name(name)], help_text(name))


def decode_flags(*names: str) -> Callable[[Callable], Callable]:
    """Give a typer command the flags of these `DecodeOptions` fields in place of its
    `options` parameter, which receives them as one `DecodeOptions` (checked when built:
    a bad value raises `OptionError`)."""

    def wrap(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values()]
        at = [p.name for p in own].index("options")
        params = own[:at] + [_field_parameter(name) for name in names] + own[at + 1 :]

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            values = {name: _from_flag(name, kwargs.pop(name)) for name in names}
            return command(**kwargs, options=DecodeOptions(**values))

        run.__signature__ = signature.replace(parameters=params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return wrap


# --------------------------------------------------------------------------- argparse


def add_arguments(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    """Add the flags of these `DecodeOptions` fields to `parser` (`from_args` reads them)."""
    for name in names:
        if _kind(name) is bool:
            parser.add_argument(flag_name(name), dest=name, action="store_true", help=help_text(name))
        else:
            default = _FIELDS[name].default
            parser.add_argument(flag_name(name), dest=name, type=_kind(name), default=default, help=help_text(name))


def from_args(args: argparse.Namespace, names: Sequence[str]) -> DecodeOptions:
    """The `DecodeOptions` of parsed arguments (`add_arguments`); a bad value raises `OptionError`."""
    return DecodeOptions(**{name: _from_flag(name, getattr(args, name)) for name in names})


# --------------------------------------------------------------------------- slash commands


def usage(name: str) -> str:
    """What a slash command setting field `name` takes: `X` (a number), `N` (an integer), `N|auto`."""
    value = "N" if _kind(name) is int else "X"
    return f"{value}|auto" if _optional(name) else value


def slash_help(command: str, name: str) -> str:
    """The `/help` line of the slash command `command`, which sets field `name`."""
    return f"- `/{command} {usage(name)}` {_doc(name, 'auto')}"


def parse_value(name: str, text: str) -> Any:
    """A slash command's argument as field `name`'s value: a number, or None for
    "auto" (or "default", "none") where the field allows it. Raises ValueError."""
    if _optional(name) and text.lower() in NONE_WORDS:
        return None
    if _kind(name) is bool:
        raise ValueError(f"{name} is not set by a slash command")
    return _kind(name)(text)


def describe(name: str, value: Any) -> str:
    """Field `name` set to `value`, as a note says it: `block size: auto (adaptive)`."""
    shown = "auto" if value is None else f"{value:g}" if isinstance(value, float) else str(value)
    explained = dict(part.split(": ", 1) for part in _FIELDS[name].metadata["doc"].split("; ") if ": " in part)
    meaning = explained.get("None" if value is None else shown)
    return f"{name.replace('_', ' ')}: {shown}" + (f" ({meaning})" if meaning else "")
