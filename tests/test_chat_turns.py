"""Pilot tests of the chat's turns around loading, stopping and regenerating, over the
scripted fake backend: what the history, /stats and the transcript hold afterwards."""

from __future__ import annotations

import threading

from chat_pilot import REPLY, make_app, notes, run_async, say, until
from fake_engine import FakeBackend


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
