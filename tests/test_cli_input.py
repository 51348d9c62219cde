"""Every `dflash` value is checked before any work starts (issue 44): one line on stderr
naming the flag, exit code 1, no traceback.

* Checks that need nothing loaded come first: given beside a `--model` that does not
  exist, the error names the bad flag, not the model (so nothing was loaded before it).
* Checks that need the model or the drafter (the context, the drafter's B) come right
  after loading, before any decoding.
* `generate -p -` reads the prompt from stdin, as `cache-prompt -p -` does.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from app.cli.main import app
from app.model_thread import describe_error
from dflash_mlx import DecodeOptions, OptionError

NOWHERE = "/nonexistent/dir"
NO_MODEL = ["--model", "/nonexistent/model"]  # loading it would fail: the error must not be about it

# (arguments, words the one line must contain)
BEFORE_LOADING = [
    (["bench", "speed", "--json", f"{NOWHERE}/x.json"], ["--json", NOWHERE]),
    (["bench", "context", "--json", f"{NOWHERE}/x.json"], ["--json", NOWHERE]),
    (["bench", "verify-cost", "--json", f"{NOWHERE}/x.json"], ["--json", NOWHERE]),
    (["bench", "kernels", "--json", f"{NOWHERE}/x.json"], ["--json", NOWHERE]),
    (["eval", "--json", f"{NOWHERE}/x.json"], ["--json", NOWHERE]),
    (["eval", "--replay", "--answers", f"{NOWHERE}/x.json"], ["--answers", NOWHERE]),
    (["eval", "--answers", "answers.json"], ["--answers", "--replay"]),
    (["eval", "--seed", "-1"], ["--seed", "-1"]),
    (["eval", "--replay", "--temp", "0", "--temp", "1"], ["--temp", "--replay", "greedy"]),
    (["eval", "--replay", "--seed", "3"], ["--seed", "--replay"]),
    (["bench", "speed", "-m", "0"], ["--max-tokens", "0"]),
    (["bench", "speed", "--fixed", "4,x"], ["--fixed must be comma-separated integers", "4,x"]),
    (["bench", "speed", "--tree-budget", "a"], ["--tree-budget must be comma-separated integers"]),
    (["bench", "context", "--lengths", "512,lots"], ["--lengths must be comma-separated integers"]),
    (["bench", "context", "--lengths", "512,0"], ["--lengths", "512,0"]),
    (["bench", "context", "--lengths", "-5"], ["--lengths", "-5"]),
    (["bench", "context", "--lengths", ""], ["--lengths"]),
    (["bench", "speed", "--lookup-rows", "0,-1"], ["--lookup-rows", "-1"]),
    (["bench", "speed", "--tree-budget", "-1"], ["--tree-budget", "-1"]),
    (["bench", "context", "--plot", f"{NOWHERE}/x.png"], ["--plot", NOWHERE]),
    (["bench", "concurrency", "2", "--plot", f"{NOWHERE}/x.png"], ["--plot", NOWHERE]),
    (["cache-prompt", "-p", "prefix", "-o", f"{NOWHERE}/x"], ["--output", NOWHERE]),
    (["cache-prompt", "-p", "prefix", "-o", "prefix.cache"], ["--output", ".safetensors", "prefix.cache"]),
    (["generate", "-p", ""], ["--prompt is empty"]),
    (["generate", "-p", "  "], ["--prompt is empty"]),
    (["generate", "-p", "hi", "--no-draft", "--draft", "/nope"], ["--no-draft", "--draft"]),
    (["generate", "-p", "hi", "--no-draft", "--draft-vocab", "none"], ["--no-draft", "--draft-vocab"]),
    (["serve", "--no-draft", "--draft", "/nope"], ["--no-draft", "--draft"]),
    (["eval", "--limit", "0"], ["--limit", "0"]),
    (["draft-vocab", "-d", NOWHERE, "-o", "vocab.txt", "--size", "10"], ["--out", "vocab.txt"]),
    (["draft-vocab", "-d", NOWHERE, "-o", f"{NOWHERE}/v.json", "--size", "10"], ["--out", NOWHERE]),
    (["draft-vocab", "-d", NOWHERE, "-o", "v.json"], ["--size", "--coverage"]),
    (["draft-vocab", "-d", NOWHERE, "-o", "v.json", "--coverage", "1.5"], ["--coverage", "1.5"]),
    (["draft-vocab", "-d", NOWHERE, "-o", "v.json", "--size", "0"], ["--size", "0"]),
    (["generate", "-p", "hi", "-m", "0"], ["--max-tokens", "0"]),
    (["generate", "-p", "hi", "--block-size", "1"], ["--block-size", "or omitted (adaptive)", "1"]),
    (["generate", "-p", "hi", "--seed", "-1"], ["--seed", "or omitted", "-1"]),
    (["generate", "-p", "hi", "--system", "Be brief.", "--raw"], ["--system", "--raw"]),
    (["generate", "-p", "hi", "--system", "S", "--prompt-cache-file", "x"], ["--system", "--prompt-cache-file"]),
]

TRAIN = ["train", "-d", NOWHERE, "-o", f"{NOWHERE}/run", "--resume-from", NOWHERE]  # the flag's error comes first
# (a bad `dflash train` value, words its one line must contain)
TRAIN_VALUES = [
    (["--num-layers", "0"], ["--num-layers", "0"]),
    (["--block-size", "1"], ["--block-size", "1"]),
    (["--mask-token-id", "-1"], ["--mask-token-id", "-1"]),
    (["--intermediate-size", "0"], ["--intermediate-size", "0"]),
    (["--gamma", "0"], ["--gamma", "0"]),
    (["--init", "hot"], ["--init", "hot"]),
    (["--arch", "dflash3"], ["--arch", "dflash3"]),
    (["--arch", "dflash2", "--conv-kernel-size", "0"], ["--conv-kernel-size", "0"]),
    (["--selector-weight", "-1"], ["--selector-weight", "-1"]),
    (["--distill", "1.5"], ["--distill", "1.5"]),
    (["--top-k", "0"], ["--top-k", "0"]),
    (["--feature-chunk", "-2"], ["--feature-chunk", "-2"]),
    (["--feature-chunk", "2"], ["--feature-chunk must be 0 or at least --batch-size"]),
    (["--batch-size", "0"], ["--batch-size", "0"]),
    (["--num-anchors", "0"], ["--num-anchors", "0"]),
    (["--max-len", "1"], ["--max-len", "1"]),
    (["--epochs", "0"], ["--epochs", "0"]),
    (["--max-steps", "0"], ["--max-steps", "0"]),
    (["--time-limit", "-5"], ["--time-limit", "-5"]),
    (["--core-hours", "0"], ["--core-hours", "0"]),
    (["--lr", "nan"], ["--lr", "nan"]),
    (["--warmup", "1.5"], ["--warmup", "1.5"]),
    (["--weight-decay", "-1"], ["--weight-decay", "-1"]),
    (["--adam-beta2", "1"], ["--adam-beta2", "1"]),
    (["--grad-clip", "0"], ["--grad-clip", "0"]),
    (["--loss-vocab", "some"], ["--loss-vocab", "some"]),
    (["--negatives", "-1"], ["--negatives", "-1"]),
    (["--checkpoint-every", "0"], ["--checkpoint-every", "0"]),
    (["--checkpoint-minutes", "0"], ["--checkpoint-minutes", "0"]),
    (["--eval-minutes", "-1"], ["--eval-minutes", "-1"]),
    (["--eval-prompts", "-1"], ["--eval-prompts", "-1"]),
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--threads", "0"], ["--threads", "0"]),
    (["--target-layer-ids", "1,x"], ["--target-layer-ids", "1,x"]),
]


def _assert_one_line(result, words) -> None:
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and "None" not in lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.mark.parametrize("args,words", BEFORE_LOADING, ids=[" ".join(a) for a, _ in BEFORE_LOADING])
def test_checked_before_loading(args, words):
    result = CliRunner().invoke(app, [*args, *NO_MODEL])
    _assert_one_line(result, words)


@pytest.mark.parametrize("values,words", TRAIN_VALUES, ids=[" ".join(v) for v, _ in TRAIN_VALUES])
def test_every_train_value_is_checked_before_any_work(values, words):
    """A bad `dflash train` value is named before the data, the resume point or the model is looked at."""
    result = CliRunner().invoke(app, [*TRAIN, *values, *NO_MODEL])
    _assert_one_line(result, words)


DATA_VALUES = [
    (["data", "-n", "0"], ["--num-prompts", "0"]),
    (["data", "--heldout", "-1"], ["--heldout", "-1"]),
    (["data", "-m", "0"], ["--max-tokens", "0"]),
    (["data", "-b", "0"], ["--batch-size", "0"]),
    (["data", "--temp", "-1"], ["--temp", "-1"]),
    (["data", "--turns", "0"], ["--turns", "0"]),
    (["instructions", "-n", "0"], ["--num-instructions", "0"]),
    (["instructions", "-n", "2", "-m", "0"], ["--max-tokens", "0"]),
    (["instructions", "-n", "2", "-b", "0"], ["--batch-size", "0"]),
    (["instructions", "-n", "2", "--temp", "-1"], ["--temp", "-1"]),
    (["instructions", "-n", "2", "--near", "0"], ["--near", "0"]),
]


@pytest.mark.parametrize("values,words", DATA_VALUES, ids=[" ".join(v) for v, _ in DATA_VALUES])
def test_data_and_instructions_values_are_checked_before_any_work(values, words, tmp_path):
    """`dflash data` and `dflash instructions`: a bad value is named before the held-out set,
    the prompts or the model are looked at, and nothing is written."""
    out = tmp_path / "out"
    held = ["--heldout", str(tmp_path / "heldout.jsonl")] if values[0] == "instructions" else []
    result = CliRunner().invoke(app, [*values, "-o", str(out / "x.jsonl"), *held, *NO_MODEL])
    _assert_one_line(result, words)
    assert not out.exists()


def test_curves_checks_its_plot_before_reading_the_runs(tmp_path):
    """`dflash curves RUN --plot PNG`: an unwritable PNG is named before the runs are read
    (here there are none: the error must not be about them)."""
    result = CliRunner().invoke(app, ["curves", str(tmp_path / "no-run"), "--plot", f"{NOWHERE}/x.png"])
    _assert_one_line(result, ["--plot", NOWHERE])


@pytest.mark.parametrize("bench", [["context"], ["concurrency", "2"]])
def test_a_plot_without_matplotlib_is_refused_before_loading(bench, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, as where it is absent
    result = CliRunner().invoke(app, ["bench", *bench, "--plot", str(tmp_path / "x.png"), *NO_MODEL])
    _assert_one_line(result, ["matplotlib"])


def test_a_model_directory_without_config(tmp_path):
    result = CliRunner().invoke(app, ["generate", "-p", "hi", "--model", str(tmp_path)])
    _assert_one_line(result, ["--model", str(tmp_path), "config.json"])
    assert "Errno" not in result.stderr


def test_bench_with_options_first_runs_speed_with_them():
    """`dflash bench -m 0` is `dflash bench speed -m 0` (speed is the default subcommand):
    its options are checked as speed's, in one line; `dflash bench --help` lists the subcommands."""
    result = CliRunner().invoke(app, ["bench", "-m", "0", *NO_MODEL])
    _assert_one_line(result, ["--max-tokens", "0"])
    assert "No such option" not in result.output
    listed = CliRunner().invoke(app, ["bench", "--help"])
    assert listed.exit_code == 0 and "concurrency" in listed.output and "verify-cost" in listed.output


def test_an_option_error_names_its_flag_where_a_model_thread_reports_it():
    """`dflash serve --block-size 99` fails when the worker loads the drafter: named by the flag."""
    with pytest.raises(OptionError) as info:
        DecodeOptions(block_size=1)
    assert describe_error(info.value) == "--block-size must be an integer >= 2 or omitted (adaptive), got 1"


# --------------------------------------------------------------------------- the default model


@pytest.mark.parametrize(
    "args,words",
    [
        (["generate", "-p", "hi", "-m", "100000000"], ["--max-tokens", "context", "8192", "100000000"]),
        (["bench", "speed", "--fixed", "4,99", "--no-reference"], ["--fixed", "2..8", "4,99"]),
        (["bench", "speed", "--fixed", "1", "--no-reference"], ["--fixed", "2..8"]),
    ],
    ids=["generate -m past the context", "bench --fixed past B", "bench --fixed below 2"],
)
def test_checked_once_loaded(default_model_dir, args, words):
    result = CliRunner().invoke(app, [*args, "--model", str(default_model_dir)])
    _assert_one_line(result, words)
    assert result.stdout == ""


def test_generate_refuses_a_system_prompt_for_a_model_without_chat_template(default_model_dir, tmp_path):
    """--system goes into the chat template: a model without one refuses it once loaded, before decoding."""
    import json

    bare = tmp_path / "no-template"
    bare.mkdir()
    for f in default_model_dir.iterdir():
        if f.name != "tokenizer_config.json":
            (bare / f.name).symlink_to(f)
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["generate", "-p", "hi", "-m", "4", "--system", "Be brief.", "--model", str(bare)])
    _assert_one_line(result, ["--system", "chat template"])
    assert result.stdout == ""


def test_serve_names_the_block_size_flag(default_model_dir):
    """The worker loads the pair, then refuses a block size past the drafter's: one line, the flag."""
    command = [sys.executable, "-m", "app.cli", "serve", "--model", str(default_model_dir), "--port", "0"]
    proc = subprocess.run([*command, "--block-size", "99"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--block-size must be at most the drafter's block size 8, got 99" in proc.stderr


def test_generate_reads_the_prompt_from_stdin(default_model_dir):
    base = ["generate", "--model", str(default_model_dir), "-m", "4"]
    given = CliRunner().invoke(app, [*base, "-p", "Name a colour."])
    piped = CliRunner().invoke(app, [*base, "-p", "-"], input="Name a colour.\n")
    assert given.exit_code == 0 and piped.exit_code == 0, (given.output, piped.output)
    assert given.stdout.strip() and piped.stdout == given.stdout
    assert (
        "Prompt: " in piped.stderr
        and piped.stderr.split("Prompt: ")[1].split(",")[0] == (given.stderr.split("Prompt: ")[1].split(",")[0])
    )  # the same number of prompt tokens
    empty = CliRunner().invoke(app, [*base, "-p", "-"], input="")
    _assert_one_line(empty, ["--prompt is empty", "stdin"])
