"""`dflash adapt`: a tiny drafter for the real SmolLM2 target adapted on a few saved chat
transcripts (the chat's own /save format). The new drafter goes beside the old one and is
kept only where its tau on the held-back conversation rose; an interrupted run resumes and
ends as an uninterrupted one; decoding with the adapted drafter is lossless; bad input is
refused in one line before any work."""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

import dflash_mlx.loading as loading
from app.chat.session import Session
from app.cli.main import app
from conftest import smollm2_drafter_config
from dflash_mlx import load_draft
from dflash_mlx.drafter import Drafter
from dflash_mlx.drafters import load_drafter_dir, save_drafter
from dflash_mlx.train.adapt import adapt
from dflash_mlx.train.adapt_plan import RECORD, AdaptArgs
from dflash_mlx.train.loop import train
from dflash_mlx.train.transcripts import (
    append_conversation_log,
    conversation_log_record,
    read_conversations,
    read_transcript,
)
from references import ours
from smollm2_drafters import chat
from tiny_training import random_training_data, tiny_target, tiny_train_args

#: Three conversations of one kind of text: the target answers each "Banana, banana, ...".
REQUESTS = [
    "Repeat the word banana twenty times.",
    "Please repeat the word banana twenty times.",
    "Write the word banana twenty times.",
]
#: A run of a few seconds: 12 steps of 2 sequences, answers of 16 tokens, a checkpoint every step.
RUN = dict(
    minutes=None, max_steps=12, lr=3e-3, max_tokens=16, batch_size=2, num_anchors=8, progress=False, checkpoint_every=1
)


def digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def weights(path: Path) -> dict:
    return dict(tree_flatten(load_drafter_dir(path).parameters()))


@contextmanager
def loaded(default_model):
    """`load()` gives the already loaded SmolLM2 (the run loads nothing else)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "load", lambda path=None, **kw: default_model)
        yield


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Three transcripts saved by the chat's own writer (`Session.markdown`) and a random tiny drafter."""
    root = tmp_path_factory.mktemp("adapt")
    chats = root / "transcripts"
    chats.mkdir()
    for i, text in enumerate(REQUESTS):
        session = Session()
        session.ask(text)
        (chats / f"chat-{i}.md").write_text(session.markdown("default", "tiny", None))
    mx.random.seed(1)
    drafter = Drafter(smollm2_drafter_config())
    mx.eval(drafter.parameters())
    save_drafter(drafter, root / "tiny")
    return root, chats, root / "tiny"


@pytest.fixture(scope="module")
def kept(world, default_model):
    """An uninterrupted run: its result and log, and the old drafter's files before it."""
    root, chats, tiny = world
    before = digests(tiny)
    lines: list[str] = []
    with loaded(default_model):
        result = adapt(AdaptArgs(sources=[str(chats)], draft=str(tiny), **RUN), log=lines.append)
    return result, lines, before


def test_the_adapted_drafter_goes_beside_the_old_one_which_stays_as_it_was(world, kept):
    root, chats, tiny = world
    result, lines, before = kept
    out = root / "tiny-adapted"
    assert result["kept"] and result["out"] == str(out) and result["tau_after"] > result["tau_before"]
    assert lines[-1].startswith("kept: tau ") and lines[-1].endswith(f"on 1 held-back conversation -> {out}")
    assert digests(tiny) == before  # byte for byte
    record = json.loads((out / "config.json").read_text())[RECORD]
    assert record["sources"] == [str(chats)] and record["from"] == str(tiny)
    assert record["conversations"] == {"trained": 2, "heldback": 1} and record["steps"] == 12
    assert record["tau"] == {"before": result["tau_before"], "after": result["tau_after"]} and record["date"]
    assert load_drafter_dir(out).config.block_size == 8
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no scratch left


def test_an_interrupted_run_resumes_and_ends_as_an_uninterrupted_one(world, kept, default_model):
    root, chats, tiny = world
    out = root / "resumed"
    args = AdaptArgs(sources=[str(chats)], draft=str(tiny), out=str(out), log_every=1, **RUN)

    def stop_at_step_5(line: str) -> None:  # the step's log line comes before its checkpoint
        if line.startswith("step 5/"):
            raise KeyboardInterrupt

    with loaded(default_model), pytest.raises(KeyboardInterrupt):
        adapt(args, log=stop_at_step_5)
    scratch = root / ".resumed.adapt"
    assert not out.exists() and json.loads((scratch / "run/checkpoint/state.json").read_text())["step"] == 4
    lines: list[str] = []
    with loaded(default_model):
        result = adapt(args, log=lines.append)
    assert f"resuming the interrupted run in {scratch}" in lines
    assert not any(line.startswith("the target answers") for line in lines)  # its answers were kept
    assert [line.split()[1] for line in lines if line.startswith("step ")][0] == "5/12"
    assert result["line"].replace(str(out), "OUT") == kept[0]["line"].replace(str(root / "tiny-adapted"), "OUT")
    ours_, whole = weights(out), weights(root / "tiny-adapted")
    assert all(mx.array_equal(ours_[k], whole[k]).item() for k in whole)
    assert not scratch.exists()


def test_a_run_that_does_not_raise_tau_writes_nothing(world, kept, default_model):
    """A learning rate that moves no weight: tau stays, and OUT (here an earlier run's
    drafter) and the old drafter stay byte for byte."""
    root, chats, tiny = world
    out = root / "tiny-adapted"
    before_out, before_old = digests(out), digests(tiny)
    lines: list[str] = []
    with loaded(default_model):
        result = adapt(AdaptArgs(sources=[str(chats)], draft=str(tiny), **{**RUN, "lr": 1e-30}), log=lines.append)
    assert not result["kept"] and result["out"] is None and result["tau_after"] == result["tau_before"]
    assert lines[-1].startswith("not kept: tau ") and lines[-1].endswith(f"; {tiny} unchanged, nothing written")
    assert digests(out) == before_out and digests(tiny) == before_old
    assert not (root / ".tiny-adapted.adapt").exists()


def test_decoding_with_the_adapted_drafter_is_lossless(world, kept, default_model):
    model, tokenizer = default_model
    drafter = load_draft(str(world[0] / "tiny-adapted"), model=model)
    accepted = 0
    for text in (REQUESTS[0], "What is the capital of France?"):
        prompt = chat(tokenizer, text)
        tokens, responses = ours(model, tokenizer, prompt, drafter, max_tokens=20)
        assert tokens == [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=20)]
        accepted += responses[-1].stats.accepted_drafted_tokens
    assert accepted > 0  # the adapted drafter's drafts were taken


NOWHERE = "/nonexistent/dir"
NO_MODEL = ["--model", "/nonexistent/model"]  # loading it would fail: the error must come before


def bad_inputs(root: Path, chats: Path, tiny: Path) -> list[tuple[list[str], list[str]]]:
    """(arguments, words the one line must contain) of bad `dflash adapt` calls."""
    (root / "empty").mkdir(exist_ok=True)
    (root / "taken").mkdir(exist_ok=True)
    (root / "taken" / "notes.txt").write_text("mine\n")
    (root / "one").mkdir(exist_ok=True)
    (root / "one" / "chat.md").write_bytes((chats / "chat-0.md").read_bytes())
    draft = ["--draft", str(tiny)]
    return [
        ([NOWHERE, *draft], ["SOURCE", NOWHERE, "no such file"]),
        ([str(root / "empty"), *draft], ["SOURCE", "no conversations"]),
        (
            [str(chats), *draft, "--out", str(root / "taken")],
            ["--out", "taken", "not a drafter written by dflash adapt"],
        ),
        ([str(chats), *draft, "--out", str(tiny)], ["--out", "the drafter being adapted"]),
        ([str(chats), *draft, "--out", str(tiny / "mine")], ["--out", "the drafter being adapted"]),
        ([str(chats), *draft, "-m", "4096"], ["--max-tokens", "2048"]),
        ([str(chats), *draft, "--minutes", "0"], ["--minutes", "above 0"]),
        ([str(chats), *draft, "--minutes", "-3"], ["--minutes", "-3"]),
        ([str(chats), *draft, "--heldback", "1"], ["--heldback", "(0, 1)"]),
        ([str(chats), *draft, "--lr", "0"], ["--lr", "0"]),
        ([str(chats), *draft, "--max-steps", "0"], ["--max-steps", "0"]),
        ([str(chats), *draft, "--resume"], ["--resume", "holds none"]),
        ([str(root / "one"), *draft], ["SOURCE", "at least 2 conversations", "found 1"]),
        ([str(chats), "--draft", NOWHERE], ["--draft", "not found", NOWHERE]),
    ]


def test_bad_input_is_one_line_naming_the_flag_before_any_work(world):
    root, chats, tiny = world
    for args, words in bad_inputs(root, chats, tiny):
        before = sorted(p.name for p in root.iterdir())
        result = CliRunner().invoke(app, ["adapt", *args, *NO_MODEL])
        assert result.exit_code == 1, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.output)
        assert all(w in lines[0] for w in words), (args, lines[0])
        assert sorted(p.name for p in root.iterdir()) == before, args  # nothing written, no scratch


def test_transcripts_and_conversation_logs_read_back_as_conversations(tmp_path):
    """The chat's /save format reads back as its messages (system prompt in, summary lines
    out); a log's later requests join their conversation; a prompt seen before is left out."""
    session = Session()
    session.ask("Hi there")
    session.answer("Hello!\n\n*not a summary: the reply's own italics*")
    session.log.append(("summary", "3 tokens · 12.0 tok/s · τ 1.50 over 2 blocks · peak 0.40 GB"))
    session.ask("Tell me a joke")
    transcript = tmp_path / "chat.md"
    transcript.write_text(session.markdown("m", "d", "Be brief."))
    assert read_transcript(transcript) == [{"role": "system", "content": "Be brief."}, *session.messages]
    logs = tmp_path / "logs"
    first = [{"role": "user", "content": "Name a colour."}]
    later = [*first, {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    again = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    for messages, reply in ((first, "Blue."), (later, "Red."), (again, "Hey")):
        append_conversation_log(logs, conversation_log_record(messages, reply, "m"))
    written = append_conversation_log(logs, conversation_log_record(later, "Green.", "m"))
    written.write_bytes(written.read_bytes()[:-20])  # its last line being written
    conversations = read_conversations([transcript, logs])
    assert [len(c.prompts) for c in conversations] == [2, 2]  # "Hi there" again: seen in the transcript
    assert conversations[1].prompts[1] == tuple(later) and conversations[1].kind == "log"


def test_a_time_budget_shows_its_share_spent_not_steps(tmp_path, monkeypatch):
    """`dflash train` (and so adapt) with a time budget logs how much of it is spent: its
    step count is no budget."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    lines: list[str] = []
    train(tiny_train_args(data, tmp_path / "run", time_limit=0.5, log_every=1), log=lines.append)
    assert any("steps of 2 sequences x 4 blocks for 0.00833333 minutes;" in line for line in lines), lines
    steps = [line for line in lines if line.startswith("step ")]
    assert steps and all(line.split()[1].isdigit() and line.split()[2].endswith("%)") for line in steps), steps
