"""`dflash --help` and every command's help as a new user reads them in an 80-column
terminal: no value type after a flag (typer >= 0.29's Rich panels print `--force <bool>`,
even `--help <bool>`), and text that wraps whole. `-h` everywhere, `--version` (and the
chat's), and help that loads neither mlx-lm nor torch (it answers in well under a second)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from app.cli.main import app

GROUP = typer.main.get_command(app)
SUBCOMMANDS = [f"{name} {sub}" for name, command in GROUP.commands.items() for sub in getattr(command, "commands", {})]
COMMANDS = ["", *GROUP.commands, *SUBCOMMANDS]  # "": `dflash --help` itself; "bench speed", ...


def help_text(command: str) -> str:
    """`dflash COMMAND --help` as an 80-column terminal shows it: click formats help to the
    terminal's width less 2 (CliRunner alone would force 80)."""
    result = CliRunner().invoke(app, [*command.split(), "--help"], terminal_width=78)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_no_type_after_a_flag(command):
    text = help_text(command)
    assert "<bool>" not in text, text
    assert any(
        line.split() == ["-h,", "--help", "Show", "this", "message", "and", "exit."] for line in text.splitlines()
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_help_fits_and_breaks_no_option_name(command):
    lines = help_text(command).splitlines()
    assert max(map(len, lines)) <= 80
    broken = [line for line in lines if re.search(r"--[\w-]*-$", line)]  # "--no-" / "kernels"
    assert not broken, broken


def test_convert_help_reads_whole():
    text = help_text("convert")
    lines = text.splitlines()
    # every paragraph of the description and every option's help, whole and in order
    flat = " ".join(text.split())
    convert = GROUP.commands["convert"]
    for paragraph in [*convert.help.split("\n\n"), *(p.help for p in convert.params if p.help)]:
        assert " ".join(paragraph.split()) in flat, paragraph
    # a phrase that broke in the middle ("every tensor's name," / "shape and dtype"), and two more
    for phrase in ("name, shape and dtype", "Quantize the linear layers.", "Replace OUTPUT_DIR if it exists."):
        assert any(phrase in line for line in lines), phrase
    assert "{SOURCE} {OUTPUT_DIR}" in lines[0]  # the names its help text uses


@pytest.mark.parametrize("command", COMMANDS)
def test_h_is_help_everywhere(command):
    result = CliRunner().invoke(app, [*command.split(), "-h"], terminal_width=78)
    assert result.exit_code == 0 and result.output == help_text(command)


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and re.fullmatch(r"mlx-dflash \S+ \(mlx \S+, mlx-lm \S+\)\n", result.output)


def test_chat_version_and_h(capsys):
    from app.chat.main import build_parser

    for flag, words in (("--version", "mlx-dflash "), ("-h", "usage: dflash-chat")):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([flag])
        assert info.value.code == 0 and capsys.readouterr().out.startswith(words)


def test_help_loads_no_heavy_module():
    """`dflash --help` and a command's help import the engine's light modules alone:
    no mlx-lm (which loads transformers and torch, 3-5 s)."""
    check = (
        "import sys\n"
        "from app.cli.main import app\n"
        "for args in (['--help'], ['generate', '--help'], ['bench', 'speed', '-h'], ['--version']):\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, args\n"
        "heavy = sorted(m for m in ('mlx_lm', 'transformers', 'torch', 'converters.convert') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
