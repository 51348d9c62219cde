"""The decoding flags of every front end come from `DecodeOptions`' fields (`app/flags.py`):
the typer commands and the chat's argparse give the same options for the same flags, every
field has its flag on `dflash generate`, and the slash commands parse and describe values
by the same fields."""

from __future__ import annotations

from dataclasses import fields

import pytest
import typer
from typer.testing import CliRunner

from app.chat.main import app_from_args
from app.cli.main import app
from app.flags import decode_flags, describe, flag_name, parse_value
from dflash_mlx import DecodeOptions

CHAT_FLAGS = "--temp 0.5 --top-k 3 --block-size 4 --tree-budget 0 --no-kernels --kv-bits 4".split()


def _typer_options(names: tuple[str, ...], argv: list[str]) -> DecodeOptions:
    """The options a typer command given the flags of `names` receives for `argv`."""
    seen = {}
    command = typer.Typer()

    @command.command()
    @decode_flags(*names)
    def run(options: DecodeOptions = DecodeOptions()) -> None:
        seen["options"] = options

    result = CliRunner().invoke(command, argv)
    assert result.exit_code == 0, result.output
    return seen["options"]


def test_typer_and_argparse_agree():
    names = ("temp", "top_p", "top_k", "block_size", "kernels", "tree_budget", "lookup", "kv_bits")
    options = _typer_options(names, CHAT_FLAGS)
    assert options == DecodeOptions(temp=0.5, top_k=3, block_size=4, tree_budget=0, kernels=False, kv_bits=4)
    assert app_from_args(CHAT_FLAGS).settings.options == options
    assert _typer_options(names, []) == DecodeOptions() == app_from_args([]).settings.options


def test_generate_has_every_field():
    generate = typer.main.get_command(app).commands["generate"]
    flags = {opt for param in generate.params for opt in param.opts}
    assert {flag_name(f.name) for f in fields(DecodeOptions)} <= flags
    assert flag_name("kernels") == "--no-kernels" and flag_name("top_p") == "--top-p"


def test_slash_values():
    assert parse_value("block_size", "auto") is None and parse_value("tree_budget", "8") == 8
    assert parse_value("temp", "0.7") == 0.7
    with pytest.raises(ValueError):
        parse_value("temp", "auto")  # temp has no None
    assert describe("block_size", None) == "block size: auto (adaptive)"
    assert describe("tree_budget", 0) == "tree budget: 0 (chains only)"
