"""Every `dflash` / `dflash-chat` command line shown in README.md parses: the command and
each of its options exist and the values convert, checked by the commands' own parsers
without running anything. Three cheap ones also run end to end on the default model.

The README writes optional parts as ``[--flag VALUE]``: each line is parsed without them
and with all of them, placeholders (``N``, ``FILE|none``) replaced by values of their type.
Paths need not exist to parse. Only parsed, not run: `bench` (minutes), `convert` (a Hub
download), `serve` (it blocks), and `data`, `instructions`, `train`, `draft-vocab` (a data
set and hours of CPU).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from app.chat.main import app_from_args
from app.cli.main import app
from dflash_mlx.defaults import shipped_drafter_dir

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```(?:sh|bash)\n(.*?)^```", re.M | re.S)
OPTIONAL = re.compile(r"\[([^\[\]]*)\]")
PLACEHOLDERS = {"N": "8", "FILE|none": "none"}
GROUP = typer.main.get_command(app)


def readme_commands() -> list[str]:
    """Each line of README's sh / bash blocks that runs `dflash` or `dflash-chat`."""
    lines = [line.strip() for block in BLOCK.findall((ROOT / "README.md").read_text()) for line in block.splitlines()]
    return [line for line in lines if line.startswith(("dflash ", "dflash-chat "))]


def variants(line: str) -> tuple[list[str], list[str]]:
    """The line's words without its optional groups, and with all of them (comments dropped)."""
    bare = shlex.split(OPTIONAL.sub("", line), comments=True)
    full = shlex.split(OPTIONAL.sub(r"\1", line), comments=True)
    return bare, [PLACEHOLDERS.get(word, word) for word in full]


def readme_line(prefix: str) -> list[str]:
    """The words, optional groups left out, of the first README command starting with `prefix`."""
    line = next(line for line in readme_commands() if line.startswith(prefix + " "))
    return variants(line)[0]


def test_readme_shows_every_command():
    shown = {variants(line)[0][1] for line in readme_commands() if line.startswith("dflash ")}
    assert shown == set(GROUP.commands)
    assert any(line.startswith("dflash-chat ") for line in readme_commands())


@pytest.mark.parametrize("line", readme_commands())
def test_readme_command_parses(line):
    for program, *args in variants(line):
        if program == "dflash-chat":
            app_from_args(args)  # argparse and the option checks; the app is built, not run
        else:
            name, *rest = args
            assert name in GROUP.commands, f"no command {name!r}"
            command, path = GROUP.commands[name], f"dflash {name}"
            while rest and rest[0] in getattr(command, "commands", {}):  # a subcommand: `bench speed`
                command, path, rest = command.commands[rest[0]], f"{path} {rest[0]}", rest[1:]
            command.make_context(path, rest)  # parses and converts, runs nothing


def run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_readme_generate_runs(default_model_dir):
    assert "Generation: 4 tokens" in run(*readme_line("dflash generate")[1:], "-m", "4")


def test_readme_export_runs(tmp_path):
    paths = {"./my-drafter": str(shipped_drafter_dir()), "./my-drafter-zlab": str(tmp_path / "zlab")}
    run(*(paths.get(word, word) for word in readme_line("dflash export")[1:]))
    assert {p.name for p in (tmp_path / "zlab").iterdir()} >= {"config.json", "model.safetensors"}


def test_readme_eval_runs(default_model_dir):
    paths = {
        "runs/my-drafter": str(shipped_drafter_dir()),
        "assets/prompts/heldout.jsonl": str(ROOT / "assets/prompts/heldout.jsonl"),
    }
    words = [paths.get(word, word) for word in readme_line("dflash eval")[1:]]
    assert "tau" in run(*words, "--limit", "1", "-m", "4", "--temp", "0")
