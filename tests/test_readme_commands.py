"""The command lines in README.md, docs/*.md and BENCHMARKS.md are real: every `dflash ...` and
`dflash-chat ...` line is parsed by the commands' own parsers (typer's click command for
`dflash`, the chat's argparse parser) without running anything, so a made-up, misspelt or
abbreviated flag, or a value of the wrong type, fails. The other way round, every `dflash`
command and flag, every `dflash-chat` flag and every chat slash command is shown somewhere in
README.md or docs/. Three cheap README lines also run end to end on the default model.

The docs write optional parts as ``[--flag VALUE]``: each line is parsed without them and
with all of them, placeholders (``M``, ``D``) replaced by values. A line ending in ``\\``
continues on the next. Lines are found in sh / bash blocks (also after ``ENV=1``, ``flock``
or ``mlx.launch ... .venv/bin/dflash``) and in inline code that starts with the command.
"""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

# Where the parsers live: the one place to change when the entry points move.
from app.chat.commands import SlashCommands  # the chat's `/name arg` -> `cmd_name(arg)`
from app.chat.main import build_parser as chat_parser  # `dflash-chat`'s argparse parser
from app.cli.main import app as dflash_app  # `dflash`'s typer app
from dflash_mlx.defaults import shipped_drafter_dir

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # where everything must be shown
PARSED = [*DOCS, ROOT / "BENCHMARKS.md"]  # where every command line must parse
FENCE = re.compile(r"^```(?:sh|bash)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`((?:dflash|dflash-chat) [^`]*)`")
RUNS = re.compile(r"(^|[\s/])dflash(-chat)?\s")
OPTIONAL = re.compile(r"\[([^\[\]]*)\]")
PLACEHOLDERS = {"M": "Qwen/Qwen3-4B", "D": "./qwen3-4b-dflash"}
PROGRAMS = ("dflash", "dflash-chat")
SHELL = {"|", "||", "&&", ";", "&", "<", ">", ">>", "2>&1"}  # the command ends at these
EAGER = {"--help", "-h", "--version"}  # print and exit while parsing: only checked to exist
GROUP = typer.main.get_command(dflash_app)


def command_lines(path: Path, inline: bool = True) -> list[tuple[str, str]]:
    """(where, line) for each line of `path`'s sh blocks that runs `dflash` or `dflash-chat`,
    and with `inline`, each inline code span that starts with one ("inline: ...")."""
    text = path.read_text()
    lines = [line for block in FENCE.findall(text) for line in block.replace("\\\n", " ").splitlines()]
    found = [(f"{path.name}: {line.strip()}", line) for line in lines if RUNS.search(line)]
    return found + [(f"{path.name}: inline: {span}", span) for span in INLINE.findall(text) if inline]


def invocation(line: str) -> list[str]:
    """The program and its words: from the `dflash` / `dflash-chat` word to the first shell
    operator or comment; "..." (an elision in prose) dropped."""
    words = shlex.split(line, comments=True)
    start = next(i for i, w in enumerate(words) if w.rsplit("/", 1)[-1] in PROGRAMS)
    out = [words[start].rsplit("/", 1)[-1]]
    for word in words[start + 1 :]:
        if word in SHELL:
            break
        if word != "...":
            out.append(PLACEHOLDERS.get(word, word))
    return out


def variants(line: str) -> list[list[str]]:
    """The invocation without its optional groups, and with all of them."""
    return [invocation(OPTIONAL.sub("", line)), invocation(OPTIONAL.sub(r"\1", line))]


ALL_LINES = [item for path in PARSED for item in command_lines(path)]
DOC_LINES = [line for path in DOCS for _, line in command_lines(path)]


def flags(words: list[str]) -> list[str]:
    """The option names among `words` (`--name=value` -> `--name`; `-` and negative numbers are values)."""
    return [w.split("=", 1)[0] for w in words if w.startswith("-") and w != "-" and not re.match(r"-\d", w)]


def resolve(words: list[str]) -> tuple[object, list[str], list[str]]:
    """(the click command, its path, the words left) for the words after `dflash`."""
    command, path, rest = GROUP, ["dflash"], list(words)
    while hasattr(command, "commands") and rest:
        default = getattr(command, "default_command", None)  # `dflash bench -m 32` is `bench speed -m 32`
        if rest[0].startswith("-") and (default is None or rest[0] in ("-h", "--help")):
            break
        name = default if rest[0].startswith("-") else rest.pop(0)
        assert name in command.commands, f"no command {' '.join(path)} {name!r}"
        command, path = command.commands[name], [*path, name]
    return command, path, rest


def option_names(command) -> set[str]:
    """Every spelling of every option of a click command (`--help` included)."""
    names = {name for p in command.params if p.param_type_name == "option" for name in p.opts + p.secondary_opts}
    return names | set(command.get_help_option_names(command.make_context("x", [], resilient_parsing=True)))


def chat_options() -> set[str]:
    return {name for action in chat_parser()._actions for name in action.option_strings}


def parse(words: list[str], mention: bool = False) -> None:
    """Parse one invocation with the real parser; fail on anything it would refuse. A
    `mention` (inline code in prose, often a command without its required options) is only
    checked for its command and option names."""
    program, *args = words
    if program == "dflash-chat":
        unknown = set(flags(args)) - chat_options()
        assert not unknown, f"dflash-chat has no option {sorted(unknown)[0]}"
        if mention:
            return
        parser = chat_parser()
        parser.allow_abbrev = False  # argparse would take `--temp` for `--temperature`; the docs must not
        try:
            parser.parse_args(args)
        except SystemExit as exc:
            raise AssertionError(f"dflash-chat refuses {args}") from exc
        return
    command, path, rest = resolve(args)
    unknown = set(flags(rest)) - option_names(command)
    assert not unknown, f"{' '.join(path)} has no option {sorted(unknown)[0]}"
    if not mention and not EAGER & set(rest):
        command.make_context(" ".join(path), rest)  # parses and converts the values; runs nothing


@pytest.mark.parametrize("where, line", ALL_LINES, ids=[where for where, _ in ALL_LINES])
def test_command_line_parses(where, line):
    for words in variants(line):
        parse(words, mention=": inline: " in where)


def test_lines_are_found():
    files = {where.split(":")[0] for where, _ in ALL_LINES}
    assert {"README.md", "cli.md", "chat.md", "BENCHMARKS.md"} <= files
    assert len(ALL_LINES) > 50


def leaves(command, path: tuple[str, ...] = ("dflash",)):
    """(path, command) for every command that runs: the group's leaves, and the group itself."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from leaves(sub, (*path, name))


def documented() -> dict[tuple[str, ...], set[str]]:
    """For each `dflash` command path shown in README / docs, the option names shown with it."""
    shown: dict[tuple[str, ...], set[str]] = {}
    for line in DOC_LINES:
        for program, *args in variants(line):
            if program == "dflash":
                _, path, rest = resolve(args)
                shown.setdefault(tuple(path), set()).update(flags(rest))
    return shown


def test_every_command_and_flag_is_documented():
    shown = documented()
    missing = []
    for path, command in leaves(GROUP):
        if hasattr(command, "commands") and path != ("dflash",):
            continue  # a group: its subcommands are what is documented
        if path not in shown and path != ("dflash",):
            missing.append(" ".join(path))
            continue
        for param in command.params:
            names = set(param.opts + param.secondary_opts) if param.param_type_name == "option" else set()
            if names and not names & shown.get(path, set()):
                missing.append(f"{' '.join(path)} {'/'.join(sorted(names))}")
    assert not missing, f"shown nowhere in README.md or docs/: {missing}"


def test_every_chat_flag_is_documented():
    shown = {flag for line in DOC_LINES for words in variants(line) if words[0] == "dflash-chat" for flag in words}
    missing = [
        "/".join(a.option_strings)
        for a in chat_parser()._actions
        if a.option_strings and "--help" not in a.option_strings and not set(a.option_strings) & shown
    ]
    assert not missing, f"dflash-chat options shown nowhere in README.md or docs/: {missing}"


def slash_commands() -> set[str]:
    """The chat's `/name` commands: its `cmd_name` methods, and the commands that set a decoding
    option where its module lists them in `OPTIONS` (`/temp`, `/block`, ...)."""
    methods = {name.removeprefix("cmd_") for name in dir(SlashCommands) if name.startswith("cmd_")}
    return methods | set(getattr(importlib.import_module(SlashCommands.__module__), "OPTIONS", {}))


def test_every_slash_command_is_documented_and_exists():
    text = "\n".join(path.read_text() for path in DOCS)
    missing = sorted(name for name in slash_commands() if not re.search(rf"`/{name}\b", text))
    assert not missing, f"chat commands shown nowhere in README.md or docs/: {missing}"
    chat = (ROOT / "docs" / "chat.md").read_text()
    made_up = sorted(set(re.findall(r"`/([a-z][a-z-]*)\b", chat)) - slash_commands())
    assert not made_up, f"docs/chat.md shows chat commands that do not exist: {made_up}"


def test_a_made_up_or_abbreviated_flag_fails():
    for words in (
        ["dflash", "generate", "-p", "x", "--max-token", "8"],  # abbreviated
        ["dflash", "generate", "-p", "x", "--speed", "2"],  # made up
        ["dflash", "generate", "-p", "x", "-m", "many"],  # not a number
        ["dflash-chat", "--tem", "0.7"],  # argparse alone would accept it
        ["dflash-chat", "--loud"],
        ["dflash", "nosuchcommand"],
    ):
        with pytest.raises(Exception):  # noqa: B017  (AssertionError or the parser's own error)
            parse(words)


PATH = re.compile(r"`((?:app|dflash_mlx|converters|tests|assets|benchmarks)/[\w./-]*)`")
MODULE = re.compile(r"python -m ((?:app|benchmarks|dflash_mlx|converters)(?:\.[a-z_]+)+)")


def test_files_and_modules_the_docs_name_exist():
    missing = []
    for path in PARSED:
        text = path.read_text()
        missing += [f"{path.name}: {name}" for name in PATH.findall(text) if not (ROOT / name).exists()]
        for module in MODULE.findall(text):
            base = ROOT / module.replace(".", "/")
            if not base.with_suffix(".py").is_file() and not (base / "__main__.py").is_file():
                missing += [f"{path.name}: python -m {module}"]
    assert not missing, f"named in the docs but not in the repository: {missing}"


def readme_line(prefix: str) -> list[str]:
    """The words after the program, optional groups left out, of README's first line starting `prefix`."""
    lines = [line for path in DOCS[:1] for _, line in command_lines(path)]
    line = next(line for line in lines if line.strip().startswith(prefix + " "))
    return variants(line)[0][1:]


def run(*args: str) -> str:
    result = CliRunner().invoke(dflash_app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


def test_readme_generate_runs(default_model_dir):
    assert "Generation: 4 tokens" in run(*readme_line("dflash generate"), "-m", "4")


def test_readme_export_runs(tmp_path):
    words = readme_line("dflash export")
    paths = {words[1]: str(shipped_drafter_dir()), words[2]: str(tmp_path / "zlab")}
    run(*(paths.get(word, word) for word in words))
    assert {p.name for p in (tmp_path / "zlab").iterdir()} >= {"config.json", "model.safetensors"}


EVAL = "dflash eval --draft runs/my-drafter --prompts heldout --temp 0"  # a line of docs/training.md


def test_docs_eval_runs(default_model_dir):
    lines = [line for _, line in command_lines(ROOT / "docs" / "training.md")]
    line = next(line for line in lines if line.split("#")[0].split() == EVAL.split())
    words = [str(shipped_drafter_dir()) if w == "runs/my-drafter" else w for w in variants(line)[0][1:]]
    assert "tau" in run(*words, "--limit", "1", "-m", "4")
