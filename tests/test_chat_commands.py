"""Pilot tests of the chat's flags, input and commands (issue 44) over the scripted fake backend,
and of the words its `/stats` and `dflash generate` use for what the cycles verified."""

from __future__ import annotations

import threading

import pytest
from textual import events

from fake_engine import FakeBackend
from chat_pilot import REPLY, answered, make_app, notes, run_async, say, until

from app.chat import commands
from app.chat.engine import Settings
from app.chat.main import app_from_args, main
from app.chat.session import shape
from app.chat.widgets import Reply, Summary
from dflash_mlx import DecodeOptions
from dflash_mlx import format_stats
from dflash_mlx.speculative import GenerationResponse
from dflash_mlx.stats import GenerationStats


def _response(stats: GenerationStats) -> GenerationResponse:
    return GenerationResponse(
        text="",
        token=0,
        logprobs=None,
        from_draft=False,
        prompt_tokens=10,
        prompt_tps=100.0,
        generation_tokens=60,
        generation_tps=20.0,
        peak_memory=0.5,
        finish_reason="stop",
        stats=stats,
    )


def test_stats_tell_chains_from_trees():
    """Trees are not block sizes: a drafter of B=8 never shows a block of 17 (issue 44)."""
    stats = GenerationStats(block_size=8, adaptive=True)
    for _ in range(52):
        stats.record(8, 5)
    stats.record(17, 3, tree=True)
    stats.record(8, 7, guessed=True)
    text = format_stats(_response(stats))
    assert "Block size of the chains (adaptive, 1..8): histogram [0, 0, 0, 0, 0, 0, 0, 53]" in text
    assert "Widths: chain 8: 53, tree 16: 1" in text
    assert "in 1 chain\n" in text + "\n" and "chains verified its guess" not in text
    words = [shape(width, n) for width, n in stats.widths.items()]
    assert words == ["53 chains of 8 tokens", "1 tree of 16 nodes"]
    assert shape("plain", 2) == "2 plain steps"


@run_async
async def test_stats_command_names_the_cycles():
    app = make_app(FakeBackend([REPLY]))
    async with app.run_test() as pilot:
        await answered(pilot, "hi")
        await say(pilot, "/stats")
        await until(pilot, lambda: "Session:" in notes(app)[-1])
        assert "Cycles verified: 4 chains of 8 tokens" in notes(app)[-1]
        assert "Block sizes chosen" not in notes(app)[-1]


@run_async
async def test_baseline_offers_no_draft_colouring():
    app = make_app()
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        panel = app.query_one("StatsPanel")
        assert "ctrl+d" in str(panel.border_subtitle)
        assert any(b.binding.action == "toggle_tint" for b in app.active_bindings.values())
        await say(pilot, "/baseline")
        await pilot.pause(0.05)
        assert "ctrl+d" not in str(panel.border_subtitle) and "drafted" not in str(panel.border_subtitle)
        assert app.check_action("toggle_tint", ()) is False
        await pilot.press("ctrl+d")
        assert app.tint is False
        await say(pilot, "/baseline")
        await pilot.pause(0.05)
        assert "ctrl+d" in str(panel.border_subtitle)


@run_async
async def test_block_above_the_drafters_b_is_refused():
    """`/block 99` for a drafter of B=8: one line naming the limit, the old value kept, and the
    next message answered on the same KV cache (issue 44)."""
    backend = FakeBackend([REPLY])
    app = make_app(backend)
    async with app.run_test() as pilot:
        await answered(pilot, "hi")
        await say(pilot, "/block 4")
        await say(pilot, "/block 99")
        await pilot.pause(0.05)
        [error] = notes(app, "error")
        assert "/block must be at most the drafter's block size 8, got 99" in error and "\n" not in error
        assert app.settings.options.block_size == 4
        await answered(pilot, "and now?")
        call = backend.calls[-1]
        assert call["block_size"] == 4 and 0 < call["prefilled"] < len(call["prompt"])  # the cache was kept
        assert backend.calls[-1]["prompt_cache"] is backend.calls[0]["prompt_cache"]
        assert [m["role"] for m in app.messages] == ["user", "assistant"] * 2


@run_async
async def test_block_size_flag_above_b_ends_the_app_after_loading():
    app = make_app(settings=Settings(DecodeOptions(block_size=99)))
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.return_code is not None)
        assert app.return_code == 1
        [message] = [str(m) for m in app._exit_renderables]
        assert message == "dflash-chat: error: --block-size must be at most the drafter's block size 8, got 99"


@run_async
async def test_enter_sends_shift_enter_and_ctrl_j_start_a_line_and_a_paste_keeps_every_line():
    backend = FakeBackend([REPLY])
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        box = app.query_one("#prompt")
        await pilot.press("a", "shift+enter", "b", "ctrl+j", "c")
        assert box.text == "a\nb\nc"
        box.clear()
        app.post_message(events.Paste("first line\nsecond line\nthird line"))  # a terminal's paste
        await pilot.pause(0.05)
        assert box.text == "first line\nsecond line\nthird line"
        await pilot.press("enter")
        await until(pilot, lambda: app.state == "ready" and len(app.messages) == 2)
        assert app.messages[0]["content"] == "first line\nsecond line\nthird line" and box.text == ""
        assert "first line\nsecond line\nthird line" in "".join(chr(t) for t in backend.calls[0]["prompt"])


@run_async
async def test_a_message_sent_during_a_reply_is_queued_and_sent_after_it():
    gate = threading.Event()
    backend = FakeBackend([REPLY, "Second| answer."], gate=gate)
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        await say(pilot, "first")
        await until(pilot, lambda: backend.waiting.is_set())
        await say(pilot, "second")
        await pilot.pause(0.05)
        assert "Queued" in notes(app)[-1] and app.query_one("#prompt").text == ""
        gate.set()
        await until(pilot, lambda: app.state == "ready" and len(app.messages) == 4, timeout=10)
        assert [m["content"] for m in app.messages[::2]] == ["first", "second"]
        assert app.messages[3]["content"] == "Second answer."


@run_async
async def test_up_and_down_recall_what_was_sent():
    app = make_app()
    async with app.run_test() as pilot:
        await answered(pilot, "one")
        await say(pilot, "/temp 0.5")
        box = app.query_one("#prompt")
        await pilot.press("t", "w")  # being written: kept while the history is shown
        await pilot.press("up")
        assert box.text == "/temp 0.5"
        await pilot.press("up")
        assert box.text == "one"
        await pilot.press("up")  # the oldest stays
        assert box.text == "one"
        await pilot.press("down", "down")
        assert box.text == "tw"
        await pilot.press("ctrl+j", "o", "up")  # a second line: Up moves to the first line first
        assert box.text == "tw\no" and box.cursor_location[0] == 0


def _prompt(call: dict) -> str:
    return "".join(chr(t) for t in call["prompt"])


@run_async
async def test_system_max_and_top_p_reach_the_next_reply():
    backend = FakeBackend([REPLY])
    app = make_app(backend)
    async with app.run_test() as pilot:
        await answered(pilot, "hi")
        for line in ("/system You are terse.", "/max 7", "/top-p 0.9", "/max 0", "/top-p 2", "/max x"):
            await say(pilot, line)
        await pilot.pause(0.05)
        errors = notes(app, "error")
        assert errors[0] == "Usage: /max N (most tokens per reply): /max must be an integer >= 1, got 0."
        assert "/top-p must be in (0, 1], got 2.0" in errors[1] and errors[2].startswith("Usage: /max N")
        await answered(pilot, "again")
        call = backend.calls[-1]
        assert (call["max_tokens"], call["top_p"]) == (7, 0.9)
        assert _prompt(call).startswith("<system>You are terse.</system><user>hi</user>")
        assert call["prefilled"] == len(call["prompt"]) - 1  # a new start: nothing after "<" is reused
        await say(pilot, "/system")
        await pilot.pause(0.05)
        assert notes(app)[-1] == "System prompt: You are terse."
        await say(pilot, "/system off")
        await answered(pilot, "plain")
        assert _prompt(backend.calls[-1]).startswith("<user>hi</user>")
        await say(pilot, "/help")
        await pilot.pause(0.05)
        shown = app.query("Markdown.help").last().source
        for command in ("/system", "/regenerate", "/max N", "/top-p X", "/save [FILE]", "Shift+Enter", "Ctrl+J"):
            assert command in shown


@run_async
async def test_regenerate_answers_the_last_message_again():
    backend = FakeBackend(["First| try.", "Second| try."])
    app = make_app(backend)
    async with app.run_test() as pilot:
        await answered(pilot, "hi")
        await say(pilot, "/regenerate")
        await until(pilot, lambda: len(backend.calls) == 2 and app.state == "ready" and len(app.messages) == 2)
        assert app.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Second try."}]
        assert backend.calls[1]["prompt"] == backend.calls[0]["prompt"]
        assert [r.text for r in app.query(Reply)] == ["Second try."] and len(app.query(Summary)) == 1
        assert "First try." not in app.transcript_markdown() and "Second try." in app.transcript_markdown()


@run_async
async def test_regenerate_with_nothing_to_redo_says_so():
    app = make_app()
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        await say(pilot, "/regenerate")
        await pilot.pause(0.05)
        assert notes(app, "error") == ["No reply to regenerate yet."]


@run_async
async def test_save_without_a_name_writes_the_conversation_under_the_apps_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    app = make_app()
    async with app.run_test() as pilot:
        await answered(pilot, "hi")
        await say(pilot, "/temp 0.5")
        await say(pilot, "/save")
        await until(pilot, lambda: "Transcript saved to" in notes(app)[-1])
        [path] = (tmp_path / "transcripts").glob("chat-*.md")
        assert str(path) in notes(app)[-1]
        saved = path.read_text()
        assert "### You\n\nhi" in saved and "### Assistant" in saved
        assert "/temp" not in saved and "temperature" not in saved.lower() and "Loaded" not in saved


def test_help_names_where_save_writes():
    assert f"a new file in {commands.transcripts_dir()}" in commands.HELP


def test_cli_max_tokens_below_one_is_one_line_naming_the_flag():
    with pytest.raises(SystemExit) as info:
        main(["--max-tokens", "0"])
    assert str(info.value.code) == "dflash-chat: error: --max-tokens must be an integer >= 1, got 0"


def test_cli_flags():
    app = app_from_args(
        [
            "--model",
            "m",
            "--draft",
            "d",
            "--temp",
            "0.5",
            "--top-p",
            "0.9",
            "--block-size",
            "8",
            "--max-tokens",
            "64",
            "--system",
            "hi",
        ]
    )
    assert (app.model_path, app.draft_path, app.system) == ("m", "d", "hi")
    assert app.settings == Settings(DecodeOptions(temp=0.5, top_p=0.9, block_size=8), max_tokens=64)
    default = app_from_args([])
    assert default.model_path is None and default.draft_path is None
    assert default.settings == Settings()
    assert app_from_args(["--no-draft", "--top-k", "20"]).settings == Settings(DecodeOptions(top_k=20), baseline=True)
    assert app_from_args(["--no-kernels"]).settings == Settings(DecodeOptions(kernels=False))


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--top-p", "2"], ["--top-p", "2"]),
        (["--top-k", "-3"], ["--top-k"]),
        (["--block-size", "1"], ["--block-size"]),
        (["--temp", "-1"], ["--temp"]),
    ],
)
def test_cli_bad_options_exit_with_one_line(flags, words):
    with pytest.raises(SystemExit) as info:
        main(flags)
    message = str(info.value.code)
    assert "\n" not in message and message.startswith("dflash-chat: error: ")
    assert all(w in message for w in words)


@run_async
async def test_no_kernels_reaches_the_generator():
    """--no-kernels arrives at stream_generate as kernels=False; by default kernels=None (on on Apple GPUs)."""
    backend = FakeBackend([REPLY, REPLY])
    for argv, want in (([], None), (["--no-kernels"], False)):
        app = make_app(backend, settings=app_from_args(argv).settings)
        async with app.run_test() as pilot:
            await answered(pilot, "hi")
        assert backend.calls[-1]["kernels"] is want


@run_async
async def test_file_pastes_a_file_into_the_message(tmp_path):
    """`/file PATH TEXT` sends TEXT with the file below it; a missing file is one error line."""
    doc = tmp_path / "notes.py"
    doc.write_text("def add(a, b):\n    return a + b\n", encoding="utf-8")
    backend = FakeBackend([REPLY])
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        await say(pilot, f"/file {doc} What does this do?")
        await until(pilot, lambda: app.state == "ready" and app.messages[-1]["role"] == "assistant")
        sent = app.messages[-2]["content"]
        assert sent == "What does this do?\n\nnotes.py:\n```\ndef add(a, b):\n    return a + b\n```"
        await say(pilot, f"/file {tmp_path / 'missing.txt'}")
        await until(pilot, lambda: notes(app, "error"))
        assert "Could not read" in notes(app, "error")[-1] and len(app.messages) == 2
