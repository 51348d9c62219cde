"""`dflash serve`: the OpenAI-compatible server, end to end with the real default model.

In-process tests go through Starlette's TestClient; the disconnect, burst and `openai`
client tests talk to a real uvicorn server on 127.0.0.1 at a free port (a thread of this
process, sharing the one worker, so the model loads once). Loopback traffic only.
Greedy output must equal plain mlx-lm greedy output (float32) token for token; a seeded
sampled request must be reproducible. Tests that decode are marked `slow`.
"""

from __future__ import annotations

import asyncio
import socket
import time

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import httpx
import pytest

from references import mlx_lm_greedy
from server_helpers import CHAT, PROMPTS, sse, user, wait_idle

slow = pytest.mark.slow
# `worker`, `live` (a real uvicorn server) and `client` (an in-process one) are in conftest.py.


# --------------------------------------------------------------------------- the real model

BAD = [
    ({"messages": user("hi"), "model": "gpt-4"}, 404, "model"),
    ({"messages": user("hi"), "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": user("hi"), "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": user("hi"), "max_tokens": 10**12}, 400, "max_tokens"),
    ({"messages": user("hi"), "max_completion_tokens": -5}, 400, "max_completion_tokens"),
    ({"messages": user("hi"), "max_tokens": "ten"}, 400, "max_tokens"),
    ({"messages": user("hi"), "temperature": -0.5}, 400, "temperature"),
    ({"messages": user("hi"), "temperature": "hot"}, 400, "temperature"),
    ({"messages": user("hi"), "temperature": 1e308}, 400, "temperature"),  # OpenAI caps it at 2
    ({"messages": user("hi"), "temperature": 2.5}, 400, "temperature"),
    ({"messages": user("hi"), "top_p": 0}, 400, "top_p"),
    ({"messages": user("hi"), "top_p": 1.5}, 400, "top_p"),
    ({"messages": user("hi"), "top_k": -3}, 400, "top_k"),
    ({"messages": [{"role": "user", "content": 42}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": user("hi"), "stream": "yes"}, 400, "stream"),
    ({"messages": user("hi"), "stream_options": {"include_usage": True}}, 400, "stream_options"),  # no stream
    ({"messages": user("hi"), "stop": 3}, 400, "stop"),
    ({"messages": user("hi"), "n": 2}, 400, "n"),
    ({"messages": user("hi"), "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": user("hi"), "seed": 1.5}, 400, "seed"),
    ({"messages": user("hi"), "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"messages": user("hi"), "presence_penalty": -1}, 400, "presence_penalty"),
    ({"messages": user("hi"), "logit_bias": {"42": 5}}, 400, "logit_bias"),
    ({"messages": user("word " * 9000)}, 400, "messages"),  # longer than the 8192-token context
]


@slow
@pytest.mark.parametrize("body,status,param", BAD, ids=[b[2] + f"-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_errors(client, body, status, param):
    r = client.post(CHAT, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


@slow
def test_malformed_requests_and_routes_then_still_serving(client):
    r = client.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post(CHAT, json=["not", "an", "object"])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/completions", json={"prompt": [1] * 9000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert client.get("/v1/nothing").status_code == 404 and "error" in client.get("/v1/nothing").json()
    assert client.get(CHAT).status_code == 405
    r = client.post(CHAT, json={"messages": user("Name a colour."), "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


@slow
def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    # the openai client's `models.retrieve(id)`: the model by its name or an alias, else a 404 naming it
    assert client.get("/v1/models/SmolLM2-135M-Instruct").json() == models["data"][0]
    assert client.get("/v1/models/default").json()["id"] == "SmolLM2-135M-Instruct"
    missing = client.get("/v1/models/gpt-4")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["draft"] is True
    assert "continuous batching" in health["queue"]["policy"] and health["queue"]["waiting"] == 0


@slow
def test_greedy_chat_equals_mlx_lm_token_for_token(client, default_model):
    _, tokenizer = default_model
    for text in PROMPTS[:3]:
        prompt = tokenizer.apply_chat_template(user(text), add_generation_prompt=True)
        expected, count = mlx_lm_greedy(default_model, prompt, 40)
        body = client.post(CHAT, json={"messages": user(text), "max_tokens": 40, "temperature": 0}).json()
        assert body["choices"][0]["message"]["content"] == expected
        assert body["usage"]["completion_tokens"] == count and body["usage"]["prompt_tokens"] == len(prompt)
        dflash = body["dflash"]
        assert dflash["tau"] >= 1 and sum(dflash["accepted_length_histogram"]) == dflash["cycles"]
        assert dflash["tokens_per_second"] > 0


@slow
def test_greedy_completion_equals_dflash_generate(client, default_model):
    model, tokenizer = default_model
    draft = dflash_mlx.load_draft(model=model)
    expected = dflash_mlx.generate(model, tokenizer, "The ocean is", draft, max_tokens=24)
    body = client.post("/v1/completions", json={"prompt": "The ocean is", "max_tokens": 24, "temperature": 0}).json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == expected
    assert expected == mlx_lm_greedy(default_model, tokenizer.encode("The ocean is"), 24)[0]


@slow
def test_seeded_sampling_is_reproducible(client, default_model):
    """The same seed gives the same text, and it is the target's own sample for that seed
    and those settings (`draft_model=None`): the server samples as asked, not greedily."""
    body = {"messages": user("Tell me a fact about cats."), "max_tokens": 24, "temperature": 0.9, "top_p": 0.95}
    first = client.post(CHAT, json={**body, "seed": 7}).json()
    again = client.post(CHAT, json={**body, "seed": 7}).json()
    text = first["choices"][0]["message"]["content"]
    assert text == again["choices"][0]["message"]["content"]
    assert first["dflash"]["cycles"] > 0  # drafted and verified: the lossless rejection sampler ran
    model, tokenizer = default_model
    prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
    alone = dflash_mlx.stream_generate(model, tokenizer, prompt, None, temp=0.9, top_p=0.95, seed=7, max_tokens=24)
    assert text == "".join(r.text for r in alone)


@slow
def test_streaming_chunks_usage_and_done(client):
    body = {"messages": user(PROMPTS[0]), "max_tokens": 16, "temperature": 0}
    whole = client.post(CHAT, json=body).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", CHAT, json=stream) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events, done = sse(r.iter_lines())
    assert done and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert "tau" in events[-1]["dflash"]


@slow
def test_stop_strings(client):
    r = client.post(CHAT, json={"messages": user(PROMPTS[0]), "max_tokens": 32, "temperature": 0, "stop": ["Paris"]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "Paris" not in choice["message"]["content"]


@slow
def test_next_turn_reuses_the_prompt_cache(client):
    turn = user("Name a fruit.")
    first = client.post(CHAT, json={"messages": turn, "max_tokens": 16, "temperature": 0}).json()
    reply = first["choices"][0]["message"]["content"]
    turn2 = turn + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And a vegetable?"}]
    second = client.post(CHAT, json={"messages": turn2, "max_tokens": 8, "temperature": 0}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]


@slow
def test_openai_client_streaming_and_not(live):
    import openai

    client = openai.OpenAI(base_url=f"{live}/v1", api_key="unused", max_retries=0, timeout=120)
    whole = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=user(PROMPTS[1]), max_tokens=16, temperature=0
    )
    assert whole.choices[0].message.content and whole.usage.completion_tokens > 0
    assert whole.model_extra["dflash"]["tau"] >= 1
    chunks = list(
        client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=user(PROMPTS[1]),
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=user("hi"), temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")


@slow
def test_client_disconnect_stops_generation_and_frees_the_worker(live, worker):
    wait_idle(worker)
    body = {"messages": user("Write a long story about a dragon and a knight."), "max_tokens": 400}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{live}{CHAT}", json={**body, "temperature": 0, "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 4:
                    break
            job = worker.running
            assert job is not None and job.generated < 400
        # the response is closed: the client is gone
        wait_idle(worker, timeout=30)
        assert job.cancelled.is_set() and job.generated_at_cancel is not None
        assert job.generated - job.generated_at_cancel <= 16  # at most one cycle (the drafter's B) more
        assert job.generated < 400
        after = http.post(f"{live}{CHAT}", json={"messages": user("Hi"), "max_tokens": 4, "temperature": 0})
        assert after.status_code == 200


@slow
def test_non_streamed_request_is_cancelled_when_its_client_leaves(live, worker):
    wait_idle(worker)
    body = {"messages": user("Write a long story about a dragon and a knight."), "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{live}{CHAT}", json=body, timeout=httpx.Timeout(60, read=1.5))  # gives up, closes
    job = worker.running
    wait_idle(worker, timeout=30)
    assert job is not None and job.cancelled.is_set() and job.generated < 400


async def _burst(live: str, prompts: list[str], max_tokens: int) -> tuple[list[str], list[float]]:
    """Stream all prompts at once while polling /health; returns the texts and health latencies."""
    latencies: list[float] = []
    async with httpx.AsyncClient(base_url=live, timeout=300) as http:

        async def one(text: str) -> str:
            body = {"messages": user(text), "max_tokens": max_tokens, "temperature": 0, "stream": True}
            async with http.stream("POST", CHAT, json=body) as r:
                assert r.status_code == 200
                events, done = sse([line async for line in r.aiter_lines()])
            assert done
            return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])

        async def health(stop: asyncio.Event) -> None:
            while not stop.is_set():
                tic = time.perf_counter()
                assert (await http.get("/health")).status_code == 200
                latencies.append(time.perf_counter() - tic)
                await asyncio.sleep(0.1)

        stop = asyncio.Event()
        poller = asyncio.create_task(health(stop))
        texts = await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), 600)
        stop.set()
        await poller
    return texts, latencies


@slow
def test_burst_of_streams_all_complete_unmixed(live, worker):
    wait_idle(worker)
    prompts, n = PROMPTS, 16
    alone = []
    with httpx.Client(base_url=live, timeout=120) as http:
        for text in prompts:
            body = {"messages": user(text), "max_tokens": n, "temperature": 0}
            alone.append(http.post(CHAT, json=body).json()["choices"][0]["message"]["content"])
    texts, latencies = asyncio.run(_burst(live, prompts, n))
    assert texts == alone
    assert latencies and max(latencies) < 2.0


@slow
def test_dflash_serve_process_end_to_end(default_model_dir):
    """The real command in its own process: starts, answers the openai client, stops on Ctrl+C."""
    import os
    import signal
    import subprocess
    import sys

    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--max-tokens", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", temperature=0)
        assert reply.usage.completion_tokens <= 8 and reply.choices[0].text
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    assert "serving SmolLM2-135M-Instruct on http://127.0.0.1" in err and "Traceback" not in err


def test_penalties_off_are_accepted(default_model):
    from app.server.openai_api import parse_request
    from app.server.request import ModelInfo

    info = ModelInfo("m", default_model[1], 2048, 8)
    off = {"frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "repetition_penalty": 1}
    assert parse_request({"messages": user("hi"), **off}, info, chat=True).prompt
