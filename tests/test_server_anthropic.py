"""`dflash serve`'s Anthropic Messages API (`/v1/messages`) through the official `anthropic`
client against a real uvicorn server on loopback, the real default model and its drafter.

Greedy text must equal plain mlx-lm's greedy text for the same messages under the same
chat template; streamed text must equal the whole answer.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import httpx
import mlx_lm
import pytest

anthropic = pytest.importorskip("anthropic")
pytestmark = pytest.mark.slow

SYSTEM = "You are a concise assistant."
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
MODEL = "claude-any"  # clients send their own model names; the server answers with its own
#: Greedy decoding. The SDK (2.x) no longer types `temperature`, so it goes as an extra field.
GREEDY = {"extra_body": {"temperature": 0}}
#: tool_use blocks that are not: an `input` that is no object, a call with no `name`.
CALL = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": "x"}
NAMELESS = {"type": "tool_use", "id": "toolu_1", "input": {}}
#: A call, and a tool_result that does not say which call it answers (no `tool_use_id`).
CALLED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{**CALL, "input": {}}]}]
UNANSWERED = {"role": "user", "content": [{"type": "tool_result", "content": "42"}]}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def client(live):
    return anthropic.Anthropic(base_url=live, api_key="x", max_retries=0, timeout=120)


def mlx_lm_greedy(default_model, messages: list[dict], max_tokens: int) -> tuple[str, str, list[int]]:
    """(text, finish reason, prompt) of plain mlx-lm greedy decoding on the templated messages."""
    model, tokenizer = default_model
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    out = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens))
    return "".join(r.text for r in out), out[-1].finish_reason, prompt


def test_greedy_message_equals_mlx_lm(client, default_model):
    for text in PROMPTS:
        expected, finish, prompt = mlx_lm_greedy(
            default_model, [{"role": "system", "content": SYSTEM}] + user(text), 40
        )
        message = client.messages.create(
            model=MODEL, system=SYSTEM, messages=user(text), max_tokens=40, **GREEDY, metadata={"user_id": "u"}
        )
        assert message.content[0].type == "text" and message.content[0].text == expected
        assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
        assert message.model == "SmolLM2-135M-Instruct" and message.id.startswith("msg_")
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(prompt)
        assert message.model_extra["dflash"]["tau"] >= 1


def test_text_blocks_equal_strings(client):
    blocks = client.messages.create(
        model=MODEL,
        system=[{"type": "text", "text": "You are a concise "}, {"type": "text", "text": "assistant."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": PROMPTS[0]}]}],
        max_tokens=16,
        **GREEDY,
    )
    plain = client.messages.create(model=MODEL, system=SYSTEM, messages=user(PROMPTS[0]), max_tokens=16, **GREEDY)
    assert blocks.content[0].text == plain.content[0].text


def test_final_assistant_message_is_continued(client, default_model):
    """Anthropic's prefill: a last assistant turn is the start of the answer, which goes on from it."""
    model, tokenizer = default_model
    messages = user(PROMPTS[0]) + [{"role": "assistant", "content": "The capital of France is"}]
    prompt = tokenizer.apply_chat_template(messages, continue_final_message=True)
    expected = "".join(r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=4))
    message = client.messages.create(model=MODEL, messages=messages, max_tokens=4, **GREEDY)
    assert message.content[0].text == expected
    count = client.messages.count_tokens(model=MODEL, messages=messages)
    assert count.input_tokens == len(prompt)


def test_streamed_text_equals_whole(client):
    args = dict(model=MODEL, system=SYSTEM, messages=user(PROMPTS[1]), max_tokens=24, **GREEDY)
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stream_event_sequence(live):
    body = {"model": MODEL, "messages": user(PROMPTS[0]), "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live}/v1/messages", json=body, timeout=120) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        names = [line[len("event: ") :] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}


def test_stop_reasons(client, default_model):
    expected, _, _ = mlx_lm_greedy(default_model, user(PROMPTS[1]), 24)
    stop = expected.split()[2]  # a word the greedy answer reaches
    message = client.messages.create(
        model=MODEL, messages=user(PROMPTS[1]), max_tokens=24, **GREEDY, stop_sequences=["zzzq", stop]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == expected[: expected.index(stop)]
    short = client.messages.create(model=MODEL, messages=user(PROMPTS[1]), max_tokens=3, **GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_bad_requests_get_anthropic_errors(client, live):
    with pytest.raises(anthropic.BadRequestError):
        client.post("/v1/messages", body={"model": MODEL, "messages": user("hi")}, cast_to=object)
    bad = [
        ({"messages": user("hi")}, "max_tokens"),
        ({"messages": user("hi"), "max_tokens": 8, "temperature": -1}, "temperature"),
        ({"messages": user("hi"), "max_tokens": 8, "temperature": 1.5}, "temperature"),  # Anthropic's range: 0..1
        ({"messages": user("hi"), "max_tokens": 8, "tools": [{"name": "f"}]}, "tools"),
        ({"messages": [{"role": "system", "content": "hi"}], "max_tokens": 8}, "role"),
        ({"messages": user("hi"), "max_tokens": 8, "stop_sequences": [3]}, "stop_sequences"),
        ({"messages": user("hi"), "max_tokens": 8, "stop_sequences": "END"}, "stop_sequences"),  # a list only
        ({"messages": [*user("hi"), {"role": "assistant", "content": [CALL]}], "max_tokens": 8}, "content[0].input"),
        ({"messages": [*user("hi"), {"role": "assistant", "content": [NAMELESS]}], "max_tokens": 8}, "content[0].name"),
        ({"messages": [*CALLED, UNANSWERED], "max_tokens": 8}, "messages[2].content[0].tool_use_id"),
    ]
    for body, field in bad:
        r = httpx.post(f"{live}/v1/messages", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert field in error["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="cannot force a tool call"):
        client.messages.create(
            model=MODEL,
            messages=user("hi"),
            max_tokens=8,
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any"},
        )


def test_count_tokens_is_the_templated_prompt(client, default_model):
    _, tokenizer = default_model
    messages = [{"role": "system", "content": SYSTEM}] + user(PROMPTS[0])
    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=user(PROMPTS[0]))
    assert count.input_tokens == len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
