"""Token log-probabilities on `dflash serve`'s OpenAI routes (`logprobs`, `top_logprobs`),
through the official `openai` client against a real uvicorn server on loopback.

Each committed token's log-probability and its top alternatives must be the target's own,
as plain mlx-lm computes them (`response.logprobs`, float32) at T=0, within 1e-3 -- tokens
the drafter proposed and the target accepted included. Each token's `bytes` are its own,
so that a reply's tokens join to its UTF-8 (SmolLM2's byte-level BPE, and a tiny
SentencePiece-style tokenizer's byte-fallback pieces).
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import httpx
import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import SPMStreamingDetokenizer
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write a Python function that returns the factorial of n."
TOP = 5
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def worker(default_model_dir):
    """A worker that drafts every cycle (fixed blocks of 8): accepted drafts are certain to be checked."""
    from app.server.worker import Worker
    from dflash_mlx.options import DecodeOptions

    w = Worker(options=DecodeOptions(block_size=8), default_max_tokens=32)
    w.start(timeout=600)
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live}/v1", api_key="x", max_retries=0, timeout=120)


def mlx_lm_steps(default_model, prompt: list[int], max_tokens: int) -> list[tuple[int, np.ndarray]]:
    """(token, the target's log-probabilities there) of plain mlx-lm greedy decoding, EOS left out."""
    model, tokenizer = default_model
    out = mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
    return [(r.token, np.array(r.logprobs).reshape(-1)) for r in out if r.token not in tokenizer.eos_token_ids]


def check(entries: list[tuple[str, float, list[float]]], steps, tokenizer) -> None:
    """(token text, logprob, top logprobs) per token against mlx-lm's steps."""
    assert len(entries) == len(steps)
    for (text, logprob, top), (token, expected) in zip(entries, steps):
        assert text == tokenizer.decode([token])
        assert abs(logprob - expected[token]) < TOLERANCE
        assert np.allclose(top, np.sort(expected)[::-1][: len(top)], atol=TOLERANCE)


def test_chat_logprobs_equal_mlx_lm(client, default_model):
    _, tokenizer = default_model
    messages = [{"role": "user", "content": PROMPT}]
    steps = mlx_lm_steps(default_model, tokenizer.apply_chat_template(messages, add_generation_prompt=True), 48)
    args = dict(model=MODEL, messages=messages, max_tokens=48, temperature=0, logprobs=True, top_logprobs=TOP)
    whole = client.chat.completions.create(**args)
    assert whole.model_extra["dflash"]["accepted_drafted_tokens"] > 0  # drafts were accepted
    assert 0 <= whole.model_extra["dflash"]["lookup_chains"] <= whole.model_extra["dflash"]["cycles"]
    content = whole.choices[0].logprobs.content
    assert all(len(e.top_logprobs) == TOP and e.bytes == list(e.token.encode()) for e in content)
    check([(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in content], steps, tokenizer)
    streamed = [
        e
        for c in client.chat.completions.create(**args, stream=True)
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_completion_logprobs_equal_mlx_lm(client, default_model):
    _, tokenizer = default_model
    prompt = "def fibonacci(n):"
    steps = mlx_lm_steps(default_model, tokenizer.encode(prompt), 32)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=TOP)
    lp = whole.choices[0].logprobs
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert all(len(top) <= TOP for top in lp.top_logprobs)
    tops = [sorted(top.values(), reverse=True) for top in lp.top_logprobs]
    # a top dict keys by text: alternatives that decode alike collapse, so compare the best
    check([(t, v, top[:1]) for t, v, top in zip(lp.tokens, lp.token_logprobs, tops)], steps, tokenizer)
    chunks = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0, logprobs=TOP, stream=True
    )
    tokens, offsets = [], []
    for c in chunks:
        if c.choices and c.choices[0].logprobs:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("completions", {"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_logprobs_name_the_field(live, route, body, param):
    inputs = {"messages": [{"role": "user", "content": "hi"}]} if route.startswith("chat") else {"prompt": "hi"}
    r = httpx.post(f"{live}/v1/{route}", json={**inputs, **body, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_token_bytes_join_to_the_reply(client):
    """SmolLM2's byte-level BPE writes each character of 日本語 in two or three tokens: a
    token's `bytes` are its own (not U+FFFD's), so a reply's tokens join to its UTF-8."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Repeat after me: 日本語"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
    )
    text, content = reply.choices[0].message.content, reply.choices[0].logprobs.content
    assert "日本語" in text and any(e.token == "\ufffd" for e in content)  # characters split across tokens
    assert b"".join(bytes(e.bytes) for e in content) == text.encode()
    assert all(e.top_logprobs[0].bytes == e.bytes for e in content)  # greedy: each token is its top alternative


def test_byte_fallback_bytes_join_to_the_text(tmp_path):
    """A SentencePiece-style tokenizer without the pieces of 日 writes its bytes as <0xNN> pieces."""
    from app.server.jobs import token_logprob

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581": 257, "b": 258, "\u2581b": 259}
    spm = Tokenizer(models.BPE(vocab, [("\u2581", "b")], unk_token="<unk>", byte_fallback=True))
    spm.normalizer = normalizers.Replace(" ", "\u2581")
    spm.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    PreTrainedTokenizerFast(tokenizer_object=spm, unk_token="<unk>").save_pretrained(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer.detokenizer, SPMStreamingDetokenizer)  # mlx-lm reads it as SentencePiece
    ids = tokenizer.encode("日 b", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<0xE6>", "<0x97>", "<0xA5>", "\u2581b"]
    logprobs = mx.full((len(tokenizer),), -9.0)
    logprobs[ids[:2]] = mx.array([-0.1, -0.2])  # the top two: <0xE6>, <0x97>
    entries = [token_logprob(tokenizer, i, logprobs, 2) for i in ids]
    assert b"".join(e.raw for e in entries) == "日 b".encode()
    assert all([t.raw for t in e.top] == [b"\xe6", b"\x97"] for e in entries)
