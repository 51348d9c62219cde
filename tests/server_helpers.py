"""Talking to `dflash serve` in tests: the chat route, prompts, a user turn, waiting for
the worker to go idle, and reading what comes back (a stream's server-sent events, a
/metrics sample); and a job whose events are scripted (`scripted`), for the stream
functions and body builders without a model."""

from __future__ import annotations

import asyncio
import json
import re
import time

from app.server.worker import Delta, Done, Job, Worker

CHAT = "/v1/chat/completions"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 10.",
    "Give me a short tip for learning the guitar.",
    "What is 17 times 23?",
    "Name two planets.",
    "Translate 'good morning' into Spanish.",
    "Explain photosynthesis in one sentence.",
]


def user(text: str) -> list[dict]:
    """The messages of one user turn `text`."""
    return [{"role": "user", "content": text}]


def wait_idle(worker: Worker, timeout: float = 60) -> None:
    """Wait until `worker` runs and queues nothing (an AssertionError after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while worker.running is not None or worker.waiting:
        assert time.monotonic() < deadline, "the worker stayed busy"
        time.sleep(0.02)


def sse(lines) -> tuple[list[dict], bool]:
    """The JSON events of a server-sent-event stream, and whether it ended with [DONE]."""
    events, done = [], False
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            assert not done, "data after [DONE]"
            if data == "[DONE]":
                done = True
            else:
                events.append(json.loads(data))
    return events, done


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples in a /metrics page."""
    return sum(float(v) for v in re.findall(rf"^dflash_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def scripted(req, texts: list[str], reason: str = "stop") -> Job:
    """A job whose events are `texts` as the worker would send them, then its `Done`."""
    job = Job(req, asyncio.get_running_loop())
    for text in texts:
        job.events.put_nowait(Delta(text))
    job.events.put_nowait(Done(reason, completion_tokens=len(texts), prompt_tokens=len(req.prompt)))
    return job


async def events(stream) -> list[tuple]:
    """The (event name or None, JSON data or "[DONE]") of each chunk of a server-sent stream."""
    out = []
    async for raw in stream:
        lines = raw.decode().strip().split("\n")
        name = lines[0][len("event: ") :] if lines[0].startswith("event: ") else None
        data = lines[-1][len("data: ") :]
        out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out
