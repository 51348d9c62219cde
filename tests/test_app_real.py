"""dflash-chat end to end with the real built-in default model and its drafter.

Set DFLASH_CHAT_SCREENSHOT=assets/chat.svg to also save a screenshot of the session, and
DFLASH_CHAT_DRAFT=PATH to use another drafter than the shipped default.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)


async def _chat(prompt: str, screenshot: str | None) -> tuple:
    from app.chat.app import ChatApp
    from app.chat.widgets import Note, StatsPanel
    from app.chat.engine import Settings

    app = ChatApp(draft=os.environ.get("DFLASH_CHAT_DRAFT"), settings=Settings(max_tokens=48))
    async with app.run_test(size=(100, 34)) as pilot:

        async def until(condition, timeout):
            deadline = time.monotonic() + timeout
            while not condition():
                assert time.monotonic() < deadline, "timed out"
                await pilot.pause(0.1)

        # first use imports the default model from its GGUF
        await until(lambda: app.state in ("ready", "no model"), 600)
        errors = [str(n.content) for n in app.query(Note) if n.has_class("error")]
        assert app.state == "ready" and not errors, errors
        app.query_one("#prompt").text = prompt
        await pilot.press("enter")
        await until(lambda: app.state == "ready" and len(app.messages) == 2, 600)
        await pilot.pause(0.3)
        panel = app.query_one(StatsPanel)
        stats = " ".join(str(panel.query_one(f"#stats-{k}").content) for k in ("speed", "blocks"))
        summary = [str(n.content) for n in app.query(Note) if n.has_class("summary")]
        if screenshot:
            path = Path(screenshot)
            app.save_screenshot(path.name, str(path.parent))
        return app.messages[-1]["content"], stats, summary, app.last


def test_real_default_model_chat():
    reply, stats, summary, last = asyncio.run(
        _chat("What is the capital of France?", os.environ.get("DFLASH_CHAT_SCREENSHOT"))
    )
    assert reply.strip()
    tps = re.search(r"([\d.]+) tok/s", stats)
    tau = re.search(r"τ\s+([\d.]+)", stats)
    assert tps and float(tps.group(1)) > 0, stats
    assert tau and float(tau.group(1)) >= 1.0, stats
    assert last.cycles > 0 and last.drafted_tokens > 0
    assert len(summary) == 1 and "τ" in summary[0] and "tok/s" in summary[0]
