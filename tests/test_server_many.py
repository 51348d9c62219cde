"""`dflash serve` under many clients: 32 streams at once, decoded in batches (continuous
batching, `app/server/scheduler.py`), each get their solo answer (greedy and seeded
sampled alike), `/metrics` counts what was served, and a request
whose prompt and `max_tokens` do not fit the context gets a clear 400. A real uvicorn
server on loopback over the default model and drafter (`live`, `worker` in conftest).
"""

from __future__ import annotations

import asyncio

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import httpx
import pytest
from server_helpers import CHAT, PROMPTS, metric, sse, user, wait_idle

from app.server.openai_api import parse_request
from app.server.worker import Done, Job

pytestmark = pytest.mark.slow
STREAMS = 32
MAX_TOKENS = 4


def bodies() -> list[dict]:
    """32 requests: the 8 prompts greedy, and each again sampled under three seeds."""
    out = []
    for i in range(STREAMS):
        body = {"messages": user(PROMPTS[i % len(PROMPTS)]), "max_tokens": MAX_TOKENS, "temperature": 0}
        if i >= len(PROMPTS):
            body.update(temperature=0.8, seed=i)
        out.append(body)
    return out


async def stream_all(live: str, requests: list[dict]) -> list[str]:
    """Every request streamed at once; their texts."""
    async with httpx.AsyncClient(base_url=live, timeout=600) as http:

        async def one(body: dict) -> str:
            async with http.stream("POST", CHAT, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                events, done = sse([line async for line in r.aiter_lines()])
            assert done and events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
            return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])

        return await asyncio.wait_for(asyncio.gather(*(one(b) for b in requests)), 600)


def test_32_streams_each_equal_their_solo_answer(live, worker):
    wait_idle(worker)
    requests = bodies()
    with httpx.Client(base_url=live, timeout=120) as http:
        before = http.get("/metrics").text
        solo = [http.post(CHAT, json=b).json()["choices"][0]["message"]["content"] for b in requests]
    assert asyncio.run(stream_all(live, requests)) == solo
    after = httpx.get(f"{live}/metrics").text
    assert metric(after, "requests_total") - metric(before, "requests_total") == 2 * STREAMS
    assert metric(after, "completion_tokens_total") > metric(before, "completion_tokens_total")
    assert metric(after, "tau") >= 1 and metric(after, "cycles_total") > 0
    assert metric(after, "queue_waiting") == 0
    steps = metric(after, "batch_steps_total") - metric(before, "batch_steps_total")
    rows = metric(after, "batch_rows_total") - metric(before, "batch_rows_total")
    assert steps > 0 and rows > steps  # they ran batched: steps of several rows
    assert "# TYPE dflash_prompt_cache_hits_total counter" in after


def test_prompt_and_max_tokens_must_fit_the_context(live, worker):
    context = worker.info.context_length
    body = {"messages": user("hi"), "max_tokens": context - 5}
    r = httpx.post(f"{live}{CHAT}", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert f"'max_tokens' {context - 5}" in r.json()["error"]["message"]
    r = httpx.post(f"{live}/v1/messages", json={**body, "model": "claude"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    rejected = metric(httpx.get(f"{live}/metrics").text, "requests_rejected_total")
    assert rejected >= 2


def test_requests_start_in_arrival_order(worker):
    """Equal requests sent at once join the batch, and so end, in the order they came."""
    wait_idle(worker)

    async def run() -> list[int]:
        loop, order = asyncio.get_running_loop(), []
        bodies = [{"messages": user(p), "max_tokens": 2, "temperature": 0} for p in PROMPTS[:6]]
        jobs = [Job(parse_request(b, worker.info, chat=True), loop) for b in bodies]
        for job in jobs:
            worker.submit(job)

        async def finished(i: int, job: Job) -> None:
            while not isinstance(await job.events.get(), Done):
                pass
            order.append(i)

        await asyncio.gather(*(finished(i, job) for i, job in enumerate(jobs)))
        return order

    assert asyncio.run(run()) == list(range(6))
