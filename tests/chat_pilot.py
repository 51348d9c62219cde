"""Driving dflash-chat in tests: the app over the scripted fake backend (`fake_engine.py`)
with its default reply, an async test run on its own event loop, and the pilot's steps
(type and send a prompt, wait for a condition or for the answer, read the notes)."""

from __future__ import annotations

import asyncio
import functools
import time

from app.chat.app import ChatApp
from app.chat.widgets import Note
from fake_engine import FakeBackend, fake_engine_factory

REPLY = "The answer| is **4**.| Two plus two| makes four."


def run_async(test):
    """Run an async test function on a fresh event loop (no pytest-asyncio needed)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return wrapper


def make_app(backend: FakeBackend | None = None, **kwargs) -> ChatApp:
    """The chat app over the fake engine on `backend` (by default, one that replies `REPLY`)."""
    return ChatApp(engine_factory=fake_engine_factory(backend or FakeBackend([REPLY])), **kwargs)


async def until(pilot, condition, timeout: float = 5.0) -> None:
    """Wait, pausing the pilot, until `condition()` holds (an AssertionError after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.02)


async def say(pilot, text: str) -> None:
    """Type `text` into the prompt and press enter."""
    pilot.app.query_one("#prompt").text = text
    await pilot.press("enter")


async def answered(pilot, text: str) -> None:
    """Send a prompt and wait for its reply to finish."""
    await until(pilot, lambda: pilot.app.state == "ready")
    replies = len(pilot.app.messages)
    await say(pilot, text)
    await until(pilot, lambda: pilot.app.state == "ready" and len(pilot.app.messages) > replies)


def notes(app, kind: str | None = None) -> list[str]:
    """The texts of the app's notes (of class `kind` if given)."""
    return [str(n.content) for n in app.query(Note) if kind is None or n.has_class(kind)]
