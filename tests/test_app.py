"""Pilot tests of dflash-chat over a scripted fake backend (the real worker-thread Engine)."""

from __future__ import annotations

import re
import threading

import pytest
from textual.content import Content
from textual.geometry import Region
from textual.widgets import Static
from textual.widgets.markdown import MarkdownFence

from chat_pilot import REPLY, answered, make_app, notes, run_async, say, until
from fake_engine import FakeBackend

from app.chat.widgets import DRAFT_STYLE, TARGET_STYLE, Reply, StatsPanel, Summary, UserMessage


def stats_text(app) -> str:
    panel = app.query_one(StatsPanel)
    return " ".join(str(panel.query_one(f"#stats-{k}").content) for k in ("speed", "blocks"))


@run_async
async def test_prompt_streams_reply_as_markdown():
    backend = FakeBackend([REPLY])
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        await pilot.press(*"hi", "enter")
        await until(pilot, lambda: app.state == "ready" and app.messages[-1]["role"] == "assistant")
        assert app.messages == [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": REPLY.replace("|", "")},
        ]
        [reply] = app.query(Reply)
        assert reply.text == REPLY.replace("|", "")
        await pilot.pause(0.1)
        assert "**4**" in reply.query_one("Markdown").source
        assert [m.source for m in app.query(UserMessage)] == ["hi"]
        # one-line summary under the reply
        [summary] = notes(app, "summary")
        assert "84.2 tok/s" in summary and "τ" in summary and "4 blocks" in summary
        # every model call ran on one thread that is not the UI's
        assert len(backend.threads) == 1 and threading.get_ident() not in backend.threads


@run_async
async def test_stats_update_while_generating():
    gate = threading.Event()
    backend = FakeBackend([REPLY], gate=gate, free_tokens=3)
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        await say(pilot, "add 2 and 2")
        await until(
            pilot, lambda: backend.waiting.is_set() and app.last is not None and app.last.generation_tokens == 3
        )
        await pilot.pause(0.05)
        live = stats_text(app)
        assert "generating" in live and "84.2 tok/s" in live and "τ" in live
        assert "drafted" in live and "peak 0.61 GB" in live
        assert app.reply is not None and app.reply.text == "The answer is "
        gate.set()
        await until(pilot, lambda: app.state == "ready")
        final = stats_text(app)
        assert "ready" in final and "accepted 5 (18%)" in final and "4 from target" in final
        assert app.last.accepted_lengths == (2, 2, 3, 2)


@run_async
async def test_escape_stops_and_keeps_partial_reply():
    gate = threading.Event()
    backend = FakeBackend([REPLY, "Sure."], gate=gate, free_tokens=2)
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        await say(pilot, "count")
        await until(pilot, lambda: backend.waiting.is_set())
        await pilot.press("escape")
        assert app.state == "stopping"
        gate.set()
        await until(pilot, lambda: app.state == "ready")
        assert app.messages[-1] == {"role": "assistant", "content": "The answer is "}
        assert "stopped" in notes(app, "summary")[-1]
        # the conversation goes on, reusing the cache that holds the partial reply
        backend.gate = None
        await answered(pilot, "go on")
        assert app.messages[-1]["content"] == "Sure."
        assert backend.calls[1]["prompt_cache"] is backend.calls[0]["prompt_cache"]


@run_async
async def test_follows_the_reply_unless_scrolled_up():
    long = "|".join(f"Line {i} of a long answer.\n\n" for i in range(40))
    gate = threading.Event()
    backend = FakeBackend([long, "Short."], gate=gate, free_tokens=60)
    app = make_app(backend)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.state == "ready")
        await say(pilot, "a long answer please")
        await until(pilot, lambda: backend.waiting.is_set())
        transcript = app.transcript
        await until(pilot, lambda: 0 < transcript.max_scroll_y == transcript.scroll_y)
        transcript.scroll_home(animate=False)  # the user scrolls up to read
        await pilot.pause(0.05)
        gate.set()
        await until(pilot, lambda: app.state == "ready")
        await pilot.pause(0.2)
        assert transcript.scroll_y == 0 and transcript.max_scroll_y > 20
        # sending a new message brings the view back to the bottom
        await answered(pilot, "thanks")
        await pilot.pause(0.2)
        assert transcript.scroll_y == transcript.max_scroll_y > 20


@run_async
async def test_multi_turn_prefills_only_the_new_message():
    backend = FakeBackend([REPLY, "Six."])
    app = make_app(backend, system="Be brief.")
    async with app.run_test() as pilot:
        await answered(pilot, "2+2?")
        await answered(pilot, "and 3+3?")
        first, second = backend.calls
        assert first["prompt_cache"] is second["prompt_cache"]
        assert first["prefilled"] == len(first["prompt"])
        assert second["prefilled"] < len(second["prompt"]) - len(first["prompt"]) + 20
        assert backend.calls[0]["prompt"][: len("<system>")] == [ord(c) for c in "<system>"]
        first_summary, second_summary = notes(app, "summary")
        assert "reused" not in first_summary
        reused = len(second["prompt"]) - second["prefilled"]
        assert f"prompt {second['prefilled']} tok (+{reused} reused)" in second_summary


@run_async
async def test_clear_resets_conversation_and_cache():
    backend = FakeBackend([REPLY])
    app = make_app(backend)
    async with app.run_test() as pilot:
        await answered(pilot, "hello")
        await say(pilot, "/clear")
        await until(pilot, lambda: not app.query(Reply))
        assert app.messages == [] and not app.query(UserMessage)
        assert any("cleared" in n for n in notes(app))
        await answered(pilot, "hello")
        assert backend.calls[1]["prompt_cache"] is not backend.calls[0]["prompt_cache"]
        assert backend.calls[1]["prefilled"] == len(backend.calls[1]["prompt"])


@run_async
async def test_model_not_found_shows_message_and_app_stays_usable():
    backend = FakeBackend(load_error=FileNotFoundError("no such model: ./nowhere"))
    app = make_app(backend, model="./nowhere")
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "no model")
        [error] = notes(app, "error")
        assert "Could not load model ./nowhere" in error and "no such model" in error
        await say(pilot, "/help")
        await pilot.pause(0.05)
        assert app.query(".help")
        await say(pilot, "hi")
        await until(pilot, lambda: len(notes(app, "error")) == 2)
        assert "No model is loaded" in notes(app, "error")[-1]
        assert app.messages == [] and app.state == "no model"
        # a working model can be loaded from inside the app
        backend.load_error = None
        await say(pilot, "/load")
        await answered(pilot, "hi")
        assert app.messages[-1]["role"] == "assistant"


@run_async
async def test_failed_load_keeps_the_working_model():
    """`/load /nonexistent` after a good load: one error line, the model that was there
    stays loaded (the next message is answered by it), and a later good /load works."""
    backend = FakeBackend([REPLY])
    app = make_app(backend)
    async with app.run_test() as pilot:
        await answered(pilot, "hi")
        backend.load_error = FileNotFoundError("no such model: /nonexistent")
        await say(pilot, "/load /nonexistent")
        await until(pilot, lambda: notes(app, "error"))
        [error] = notes(app, "error")
        assert "Could not load model /nonexistent" in error and "keeping the current model" in error
        await until(pilot, lambda: app.state == "ready")
        assert app.model_name is not None and "no model" not in app.sub_title
        await answered(pilot, "and again?")
        assert [m["role"] for m in app.messages] == ["user", "assistant", "user", "assistant"]
        backend.load_error = None
        await say(pilot, "/load")
        await until(pilot, lambda: len(notes(app)) and "Loaded" in notes(app)[-1])
        await answered(pilot, "still there?")


@run_async
async def test_drafter_misfit_falls_back_to_target_only():
    backend = FakeBackend([REPLY], draft_error=ValueError("drafter hidden size 1024 does not match the target's 576"))
    app = make_app(backend)
    async with app.run_test() as pilot:
        await answered(pilot, "hi")
        [error] = notes(app, "error")
        assert "does not match" in error and "target-only" in error
        assert backend.calls[0]["draft_model"] is None
        assert "baseline" in notes(app, "summary")[-1]


@run_async
async def test_out_of_memory_during_generation():
    backend = FakeBackend([REPLY], generate_error=MemoryError("[malloc] could not allocate 9 GB"))
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        await say(pilot, "write a novel")
        await until(pilot, lambda: notes(app, "error"))
        await until(pilot, lambda: app.state == "ready")
        assert notes(app, "error")[-1].startswith("Out of memory")
        assert app.messages == [] and not app.query(Reply)
        backend.generate_error = None
        await answered(pilot, "a haiku then")
        assert app.messages[-1]["role"] == "assistant"


@run_async
async def test_commands_change_settings(tmp_path):
    backend = FakeBackend([REPLY])
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        for line in ("/temp 0.7", "/block 4", "/baseline"):
            await say(pilot, line)
        await answered(pilot, "hi")
        call = backend.calls[-1]
        assert (call["temp"], call["block_size"], call["draft_model"]) == (0.7, 4, None)
        await say(pilot, "/baseline")
        await answered(pilot, "again")
        assert backend.calls[-1]["draft_model"] is not None
        assert backend.calls[-1]["prompt_cache"] is backend.calls[0]["prompt_cache"]
        await say(pilot, "/temp hot")
        await say(pilot, "/nope")
        errors = notes(app, "error")
        assert "Usage: /temp" in errors[0] and "Unknown command /nope" in errors[1]
        await say(pilot, "/stats")
        await pilot.pause(0.05)
        assert "Session: 2 replies" in notes(app)[-1]
        target = tmp_path / "chat.md"
        await say(pilot, f"/save {target}")
        await pilot.pause(0.05)
        saved = target.read_text()
        assert "### You\n\nhi" in saved and "### Assistant" in saved and "**4**" in saved


# Blocks of tokens ("|"): all but each block's last token are accepted drafts (fake_engine).
MARKDOWN_REPLY = "## Tides| and moons\n\nThe sea is **very| deep**.\n\n```python\nprint('sea')\nx| = 1|\n```\n"


def colours(reply: Reply) -> dict[str, str]:
    """Each word the reply's Markdown shows -> 'draft' or 'target', by its tint."""
    named = {DRAFT_STYLE: "draft", TARGET_STYLE: "target"}
    out = {}
    for widget in reply.query(Static):
        content = widget.content
        if isinstance(content, Content):
            for word in re.finditer(r"\w+", content.plain):
                styles = [named[s.style] for s in content.spans if s.style in named and s.start <= word.start() < s.end]
                out[word.group()] = styles[-1] if styles else "none"
    return out


@run_async
async def test_ctrl_d_colours_drafted_tokens_in_the_rendered_markdown():
    app = make_app(FakeBackend([MARKDOWN_REPLY]))
    async with app.run_test() as pilot:
        await answered(pilot, "the sea?")
        reply = app.query_one(Reply)
        assert set(colours(reply).values()) == {"none"}
        await pilot.press("ctrl+d")
        # still Markdown: a heading without its "##", bold text, a code block without its fence
        [heading] = reply.query("MarkdownH2")
        assert heading.content.plain == "Tides and moons"
        [fence] = reply.query(MarkdownFence)
        assert fence.code == "print('sea')\nx = 1"
        [paragraph] = [p for p in reply.query("MarkdownParagraph") if "sea" in p.content.plain]
        assert paragraph.content.plain == "The sea is very deep."
        assert any(s.style == ".strong" for s in paragraph.content.spans)
        # and each word takes the colour of the token it came from
        assert colours(reply) == {
            **dict.fromkeys(["Tides", "very", "x", "1"], "target"),
            **dict.fromkeys(["and", "moons", "The", "sea", "is", "deep", "print"], "draft"),
        }
        await pilot.press("ctrl+d")
        assert set(colours(reply).values()) == {"none"} and reply.query(MarkdownFence)


@run_async
async def test_a_reply_written_while_tinted_is_coloured():
    app = make_app(FakeBackend([REPLY]))
    async with app.run_test() as pilot:
        await pilot.press("ctrl+d")
        await answered(pilot, "hi")
        words = colours(app.query_one(Reply))
        assert (words["The"], words["answer"], words["4"], words["makes"]) == ("draft", "target", "target", "draft")
        assert any(
            s.style == ".strong" for p in app.query_one(Reply).query("MarkdownParagraph") for s in p.content.spans
        )


@run_async
async def test_baseline_resets_the_stats_panel():
    """/baseline switches mode: the panel drops the other mode's numbers until a reply in the new mode."""
    app = make_app(FakeBackend([REPLY]))
    async with app.run_test() as pilot:
        await answered(pilot, "hi")
        assert "τ  2.25" in stats_text(app) and "drafted 28" in stats_text(app)
        for mode in ("on", "off"):
            await say(pilot, "/baseline")
            await until(pilot, lambda mode=mode: f"Baseline {mode}" in notes(app)[-1])
            panel = stats_text(app)
            assert "tok/s" not in panel and "τ" not in panel and "drafted" not in panel and "peak" not in panel
            assert "ready" in panel
            await answered(pilot, "again")
            expected = "baseline: every token comes from the target" if mode == "on" else "drafted 28"
            assert expected in stats_text(app)


def shown_lines(widget) -> list[str]:
    """The non-blank lines a widget shows on screen."""
    return [line.text.strip() for line in widget.render_lines(Region(0, 0, *widget.size)) if line.text.strip()]


@run_async
async def test_figures_wrap_whole_at_a_narrow_width():
    """At 40 columns the stats lines and the summary wrap between figures, never inside one."""
    app = make_app(FakeBackend([REPLY]))
    async with app.run_test(size=(40, 40)) as pilot:
        await answered(pilot, "hi")
        await pilot.pause(0.1)
        panel = app.query_one(StatsPanel)
        for widget in (panel.query_one("#stats-speed"), panel.query_one("#stats-blocks"), app.query_one(Summary)):
            lines = shown_lines(widget)
            assert len(lines) > 1, lines  # it did wrap
            for unit in widget.units:
                assert any(unit.plain.strip() in line for line in lines), (unit.plain, lines)
        assert "peak 0.61 GB" in shown_lines(panel.query_one("#stats-speed"))


@pytest.mark.parametrize("key", ["ctrl+q", "ctrl+c"])
@run_async
async def test_quit_keys_exit_and_stop_the_worker(key):
    gate = threading.Event()
    backend = FakeBackend([REPLY], gate=gate, free_tokens=2)
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        await say(pilot, "hi")
        await until(pilot, lambda: backend.waiting.is_set())
        engine = app.engine
        gate.set()
        await pilot.press(key)
        await pilot.pause(0.1)
    assert app.return_code == 0
    assert not engine._thread.is_alive()


def test_snapshot_main_screen(snap_compare):
    backend = FakeBackend(
        [
            "DFlash drafts a whole| block of tokens in one| pass; the target **verifies**| them at once.",
        ]
    )
    app = make_app(backend, system="Be brief.")

    async def run_before(pilot):
        pilot.app.query_one("#prompt").cursor_blink = False  # a blinking cursor is not deterministic
        await answered(pilot, "How does DFlash make decoding faster?")
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(100, 30), run_before=run_before)


def test_snapshot_multi_turn_coloured(snap_compare):
    backend = FakeBackend(
        [
            "Speculative decoding| lets a small| model guess| ahead.",
            "Because the target checks a| whole block in one| forward pass,|"
            " and accepted| guesses cost almost nothing.",
        ]
    )
    app = make_app(backend)

    async def run_before(pilot):
        pilot.app.query_one("#prompt").cursor_blink = False
        await answered(pilot, "What is speculative decoding?")
        await answered(pilot, "Why is it faster?")
        await pilot.press("ctrl+d")
        await pilot.pause(0.2)

    assert snap_compare(app, terminal_size=(100, 30), run_before=run_before)
