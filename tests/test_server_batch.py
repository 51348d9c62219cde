"""`dflash serve` under continuous batching (`app/server/scheduler.py`): concurrent requests
decode as rows of one batch, and each gets exactly its solo answer.

A real uvicorn server on loopback over the default model and drafter (float32), through
the official `openai` client. Each request is first sent alone (the speculative loop from
start to end), then all at once: a long greedy request starts alone and is handed over
to the batch when the others arrive, and goes back to decoding alone once they are done;
a seeded sampled one, one with log-probabilities, one with a stop string, one with few
tokens and one whose client leaves mid-way join it. Text, finish reason, token count and
log-probabilities must equal the solo ones (the cancelled one: a prefix of its solo text),
and `/metrics` must show steps of more than one row, some of them drafted blocks.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import httpx
import pytest
from server_helpers import PROMPTS, metric, user, wait_idle

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
LONG = 96  # the first request's tokens: it is alone again with more than RESUME to go


def requests(stop: str) -> list[dict]:
    """The concurrent requests (the first one starts alone); `stop` ends the fourth."""
    return [
        {"messages": user("Write a long story about a dragon and a knight."), "max_tokens": LONG, "temperature": 0},
        {"messages": user(PROMPTS[1]), "max_tokens": 12, "temperature": 0.8, "seed": 7},
        {"messages": user(PROMPTS[2]), "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3},
        {"messages": user(PROMPTS[3]), "max_tokens": 24, "temperature": 0, "stop": [stop]},
        {"messages": user(PROMPTS[4]), "max_tokens": 3, "temperature": 0},
    ]


def answer(client, body: dict) -> tuple:
    """(text, finish reason, completion tokens, [(token, logprob, top logprobs)])."""
    r = client.chat.completions.create(model=MODEL, **body)
    choice = r.choices[0]
    lps = (
        [(t.token, t.logprob, [a.logprob for a in t.top_logprobs]) for t in (choice.logprobs.content or [])]
        if choice.logprobs
        else []
    )
    return choice.message.content, choice.finish_reason, r.usage.completion_tokens, lps


def same(got: tuple, solo: tuple) -> bool:
    """Equal text, finish reason and token count; log-probabilities within 1e-4."""
    if got[:3] != solo[:3] or len(got[3]) != len(solo[3]):
        return False
    for (tok, lp, top), (tok2, lp2, top2) in zip(got[3], solo[3]):
        if tok != tok2 or abs(lp - lp2) > 1e-4 or any(abs(a - b) > 1e-4 for a, b in zip(top, top2)):
            return False
    return True


def cancelled_midway(live: str, started: threading.Event) -> str:
    """A streamed greedy request whose client leaves after a few chunks; the text it got."""
    body = {"messages": user(PROMPTS[5]), "max_tokens": 200, "temperature": 0, "stream": True, "model": MODEL}
    started.wait(30)
    text, seen = "", 0
    with httpx.Client(base_url=live, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    text += event["choices"][0]["delta"].get("content") or "" if event["choices"] else ""
                    seen += 1
                    if seen >= 4:
                        break
    return text


def cancelled(metrics: str) -> float:
    """Requests finished as cancelled, in a /metrics page."""
    found = re.search(r'^dflash_requests_total\{finish_reason="cancelled"\} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


def test_concurrent_requests_each_equal_their_solo_answer(live, worker):
    wait_idle(worker)
    client = openai.OpenAI(base_url=f"{live}/v1", api_key="x", max_retries=0, timeout=120)
    free = answer(client, requests("")[3] | {"stop": None})[0]
    stop = free.split()[len(free.split()) // 2]  # a word from the middle of its solo text
    bodies = requests(stop)
    solo = [answer(client, b) for b in bodies]
    cancel_solo = answer(client, {"messages": user(PROMPTS[5]), "max_tokens": 40, "temperature": 0})[0]
    assert solo[3][1] == "stop" and stop not in solo[3][0] and solo[2][3]

    before, resumed = httpx.get(f"{live}/metrics").text, worker.scheduler.resumed
    started = threading.Event()
    with ThreadPoolExecutor(len(bodies) + 1) as pool:
        first = pool.submit(answer, client, bodies[0])
        while worker.running is None or worker.running.generated < 2:  # the first one decodes alone
            time.sleep(0.01)
        started.set()
        rest = [pool.submit(answer, client, b) for b in bodies[1:]]
        leaver = pool.submit(cancelled_midway, live, started)
        got = [first.result()] + [f.result() for f in rest]
        partial = leaver.result()
    wait_idle(worker)
    after = httpx.get(f"{live}/metrics").text

    for i, (g, s) in enumerate(zip(got, solo)):
        assert same(g, s), f"request {i}: {g[:3]} != solo {s[:3]}"
    assert partial and cancel_solo.startswith(partial)
    steps = metric(after, "batch_steps_total") - metric(before, "batch_steps_total")
    rows = metric(after, "batch_rows_total") - metric(before, "batch_rows_total")
    assert steps > 0 and rows > steps  # steps of several rows ran
    assert metric(after, "batch_drafted_cycles_total") > metric(before, "batch_drafted_cycles_total")  # rows speculated
    assert cancelled(after) > cancelled(before)
    assert worker.scheduler.resumed > resumed  # the long one went back to decoding alone
    assert metric(after, "queue_seconds_total") >= metric(before, "queue_seconds_total")


def post(live: str, body: dict) -> dict:
    """A chat completion's JSON reply, over plain HTTP (the `dflash` object included)."""
    return httpx.post(f"{live}/v1/chat/completions", json=body | {"model": MODEL}, timeout=120).json()


def test_hand_over_prefills_no_prompt_again_and_batched_requests_get_stats(live, worker):
    """A request decoding alone joins the batch with its own cache, and goes back to
    decoding alone from the batch's caches (its row's target cache and drafter context):
    no prompt is prefilled twice, no token runs again. Both replies carry `dflash` stats
    in which each batch cycle counts at its width, drafted ones included."""
    wait_idle(worker)
    long = {"messages": user("Tell me about the history of bridges, in detail."), "max_tokens": LONG, "temperature": 0}
    short = {"messages": user("Name three rivers of Europe."), "max_tokens": 8, "temperature": 0}
    before, resumed = httpx.get(f"{live}/metrics").text, worker.scheduler.resumed
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, live, long)
        while worker.running is None or worker.running.generated < 2:  # the first one decodes alone
            time.sleep(0.01)
        replies = [first, pool.submit(post, live, short)]
        a, b = [r.result() for r in replies]
    wait_idle(worker)
    after = httpx.get(f"{live}/metrics").text

    def grew(name: str) -> float:
        return metric(after, name) - metric(before, name)

    def committed(reply: dict) -> int:
        return sum(n * (k + 1) for k, n in enumerate(reply["dflash"]["accepted_length_histogram"]))

    fresh = sum(r["usage"]["prompt_tokens"] - r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (a, b))
    assert grew("batch_steps_total") > 0 and worker.scheduler.resumed > resumed
    assert 0 < grew("prompt_prefilled_tokens_total") <= fresh  # each prompt once, at most
    assert grew("caught_up_tokens_total") == 0  # it went on from the batch's caches: nothing ran again
    # the newcomer decoded in the batch only: every token from a batch cycle, some drafted
    assert committed(b) == b["usage"]["completion_tokens"]
    assert grew("batch_drafted_cycles_total") > 0 and any(w.startswith("chain") for w in b["dflash"]["widths"])
    assert b["dflash"]["drafted_tokens"] > 0 and b["dflash"]["tau"] >= 1.0
    # the first one: its speculative cycles alone and in the batch (its first token is the prefill's)
    assert a["dflash"]["cycles"] > 0 and a["dflash"]["tau"] >= 1.0
    assert committed(a) < a["usage"]["completion_tokens"]


def test_health_names_the_policy(live, worker):
    health = httpx.get(f"{live}/health").json()
    assert "continuous batching: up to 8 requests" in health["queue"]["policy"]


def test_policy_names_why_requests_run_one_at_a_time():
    from tiny_targets import tiny_target

    from app.server.scheduler import SOLO, policy
    from dflash_mlx import DecodeOptions

    model = tiny_target("qwen3")
    assert policy(8, model, DecodeOptions())[0]
    for args, why in [
        ((1, model, DecodeOptions()), "--max-batch 1"),
        ((8, model, DecodeOptions(kv_bits=8)), "--kv-bits"),
        ((8, model, DecodeOptions(), object()), "mlx.launch"),
    ]:
        batched, words = policy(*args)
        assert not batched and words.startswith(SOLO) and why in words
