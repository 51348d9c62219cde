"""Pilot tests of the chat's turns around loading, stopping and regenerating, over the
scripted fake backend: what the history, /stats and the transcript hold afterwards."""

from __future__ import annotations

import threading

from chat_pilot import REPLY, answered, make_app, notes, run_async, say, until
from fake_engine import FakeBackend

from app.chat.engine import Settings
from app.chat.widgets import Reply, Summary
from dflash_mlx import DecodeOptions


@run_async
async def test_a_message_sent_while_the_model_loads_stays_in_the_history():
    """Sent before `Loaded`: answered once the model is there, and the history holds the
    question as well as the reply (the new conversation a load starts begins with it)."""
    loading = threading.Event()
    backend = FakeBackend([REPLY], load_gate=loading)
    app = make_app(backend)
    async with app.run_test() as pilot:
        await say(pilot, "hi")
        await pilot.pause(0.05)
        loading.set()
        await until(pilot, lambda: app.state == "ready" and app.messages and app.messages[-1]["role"] == "assistant")
        assert app.messages == [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": REPLY.replace("|", "")},
        ]
        assert "<user>hi</user>" in "".join(chr(t) for t in backend.calls[0]["prompt"])
        assert "### You\n\nhi" in app.transcript_markdown()
        assert not notes(app, "error")


@run_async
async def test_a_reply_stopped_before_it_began_is_not_counted():
    """Esc during the prefill: no reply, so /stats counts only the replies that came."""
    prefill = threading.Event()
    backend = FakeBackend([REPLY], prefill_gate=prefill)
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        await say(pilot, "hi")
        await until(pilot, lambda: backend.waiting.is_set())
        await pilot.press("escape")
        prefill.set()
        await until(pilot, lambda: app.state == "ready")
        assert "Stopped before the reply began" in notes(app)[-1] and app.messages == []
        backend.prefill_gate = None
        await answered(pilot, "hi again")
        await say(pilot, "/stats")
        await until(pilot, lambda: "Session:" in notes(app)[-1])
        assert "Session: 1 replies, 9 tokens" in notes(app)[-1]


@run_async
async def test_regenerate_removes_the_old_summary_below_a_note():
    """A /temp typed during the reply puts its note between the reply and its summary line:
    /regenerate still takes that summary away with the reply."""
    gate = threading.Event()
    backend = FakeBackend(["First| try.", "Second| try."], gate=gate)
    app = make_app(backend)
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        await say(pilot, "hi")
        await until(pilot, lambda: backend.waiting.is_set())
        await say(pilot, "/temp 0.5")
        gate.set()
        await until(pilot, lambda: app.state == "ready" and len(app.messages) == 2)
        await say(pilot, "/regenerate")
        await until(pilot, lambda: len(backend.calls) == 2 and app.state == "ready" and len(app.messages) == 2)
        assert [r.text for r in app.query(Reply)] == ["Second try."]
        assert len(app.query(Summary)) == 1 and "Temp: 0.5." in notes(app)


@run_async
async def test_a_slash_option_typed_while_loading_keeps_the_block_size_flags_error():
    """`dflash-chat --block-size 99` and a /temp typed before the drafter (B=8) has loaded:
    the app still ends with the one line naming --block-size, as without the /temp."""
    loading = threading.Event()
    app = make_app(FakeBackend([REPLY], load_gate=loading), settings=Settings(DecodeOptions(block_size=99)))
    async with app.run_test() as pilot:
        await say(pilot, "/temp 0.5")
        await pilot.pause(0.05)
        loading.set()
        await until(pilot, lambda: app.return_code is not None)
        assert app.return_code == 1
        [message] = [str(m) for m in app._exit_renderables]
        assert message == "dflash-chat: error: --block-size must be at most the drafter's block size 8, got 99"


@run_async
async def test_a_block_size_typed_while_loading_goes_back_to_auto_when_too_large():
    """`/block 12` before the drafter (B=8) has loaded: the user's, not the command line's,
    so it is named as /block and goes back to auto; the app goes on."""
    loading = threading.Event()
    app = make_app(FakeBackend([REPLY], load_gate=loading))
    async with app.run_test() as pilot:
        await say(pilot, "/block 12")
        await pilot.pause(0.05)
        loading.set()
        await until(pilot, lambda: app.state == "ready")
        assert app.return_code is None and app.settings.options.block_size is None
        assert "/block must be at most the drafter's block size 8, got 12: back to auto" in notes(app, "error")[-1]


@run_async
async def test_the_draft_vocab_flag_stays_with_its_drafter():
    """--draft-vocab is the vocabulary of the drafter given beside it: a /load of another
    drafter uses that drafter's own, and a /load of the first one takes the flag's again."""
    backend = FakeBackend([REPLY])
    app = make_app(backend, model="m", draft="d1", draft_vocab="d1-vocab.json")
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        for line in ("/load m d2", "/load other d1", "/load m d1"):
            await say(pilot, line)
            await until(pilot, lambda: app.state == "ready")
        assert backend.drafters == [("d1", "d1-vocab.json"), ("d2", None), ("d1", None), ("d1", "d1-vocab.json")]
