"""`dflash serve`'s tools: prompts that offer them, replies whose calls are parsed out.

Scripted model outputs go through `OutputSplitter` with each mlx-lm parser the server
uses (`json_tools`, the default model's format, taught by `tool_prompt`; `qwen3_coder`,
a tokenizer's own parser as mlx-lm's `TokenizerWrapper` carries it), fed whole and in
pieces of every size; then through the server's own stream functions (OpenAI's
`tool_calls` deltas, Anthropic's `tool_use` blocks). The real server, with the openai
and anthropic clients, shows the tools reach the default model's prompt.
"""

from __future__ import annotations

import asyncio
import re
import json

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper, load as load_tokenizer
from mlx_lm.tool_parsers import qwen3_coder

from app.server import anthropic_api
from app.server.openai_api import completion_body, parse_request
from app.server.prompts import chat_prompt
from app.server.request import APIError, ModelInfo
from app.server.output import OutputSplitter, tool_format, tool_prompt
from app.server.worker import Done
from app.server.routes import _anthropic_stream, _stream
from server_helpers import events, scripted

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
JSON_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
QWEN_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
#: A chat template that takes tools (it names them), as tool-calling models' templates do.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    """The default model's tokenizer as mlx-lm loads it (no tool parser: its template has no tools)."""
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def qwen_tokenizer(default_model_dir):
    """The same vocabulary with a template that takes tools and mlx-lm's qwen3_coder parser."""
    hf = load_tokenizer(default_model_dir)._tokenizer
    hf.chat_template = TOOL_TEMPLATE
    return TokenizerWrapper(
        hf,
        chat_template=None,
        tool_parser=qwen3_coder.parse_tool_call,
        tool_call_start=qwen3_coder.tool_call_start,
        tool_call_end=qwen3_coder.tool_call_end,
    )


def info(tok) -> ModelInfo:
    return ModelInfo("m", tok, 2048, 32)


def split(splitter: OutputSplitter, text: str, step: int) -> list[tuple]:
    """The pieces of `text` fed `step` characters at a time, without the calls' random ids."""
    pieces = [p for i in range(0, len(text), step) for p in splitter.feed(text[i : i + step])] + splitter.close()
    merged: list[tuple] = []
    for p in pieces:
        call = p.call and {k: v for k, v in p.call.items() if k != "id"}
        if merged and p.kind != "tool" and merged[-1][0] == p.kind:
            merged[-1] = (p.kind, merged[-1][1] + p.text, None)
        else:
            merged.append((p.kind, p.text, call))
    return merged


def every_step(make, text: str) -> list[tuple]:
    """`split` at every piece size agrees; that split."""
    results = [split(make(), text, step) for step in (1, 2, 3, 7, len(text))]
    assert all(r == results[0] for r in results), results
    return results[0]


@pytest.mark.parametrize("parser", ["json_tools", "qwen3_coder"])
def test_calls_split_out_in_any_pieces(parser, tokenizer, qwen_tokenizer):
    tok, call = (tokenizer, JSON_CALL) if parser == "json_tools" else (qwen_tokenizer, QWEN_CALL)
    fmt = tool_format(tok)
    assert fmt.parse.__module__ == f"mlx_lm.tool_parsers.{parser}"
    text = "Let me look.\n" + call + "\n" + call.replace("Paris", "Rome") + "\n"
    pieces = every_step(lambda: OutputSplitter([WEATHER], fmt), text)
    assert pieces == [
        ("text", "Let me look.", None),
        ("tool", "", {"index": 0, "name": "get_weather", "arguments": '{"city": "Paris"}'}),
        ("tool", "", {"index": 1, "name": "get_weather", "arguments": '{"city": "Rome"}'}),
    ]


def test_what_only_looks_like_a_call_stays_text(tokenizer):
    fmt = tool_format(tokenizer)
    unknown = JSON_CALL.replace("get_weather", "launch")
    broken = '<tool_call>{"name": "get_weather", "arguments": </tool_call> then more'
    for text in (unknown, broken, "a < b and <tool_ and <tool_call"):
        assert every_step(lambda: OutputSplitter([WEATHER], fmt), text) == [("text", text, None)]
    assert every_step(lambda: OutputSplitter([], fmt), JSON_CALL) == [("text", JSON_CALL, None)]  # no tools offered
    unclosed = JSON_CALL[: -len("</tool_call>")]
    assert every_step(lambda: OutputSplitter([WEATHER], fmt), unclosed)[0][0] == "tool"  # cut off: parsed as it stands


def test_plain_text_passes_unchanged(tokenizer):
    text = "  Two spaces, a tab\t and a newline at the end.\n"
    assert every_step(lambda: OutputSplitter([WEATHER], tool_format(tokenizer)), text) == [("text", text, None)]


def test_tools_reach_a_template_without_them_as_a_system_message(tokenizer):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]}
    text = tokenizer.decode(chat_prompt(body, tokenizer, tools=[WEATHER]))
    assert text.count("<|im_start|>system") == 1
    assert "Be brief.\n\n" + tool_prompt([WEATHER], tool_format(tokenizer)) in text
    assert '"name": "get_weather"' in text and '"required": ["city"]' in text
    turns = body["messages"] + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": json.loads(JSON_CALL[11:-12])}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tokenizer.decode(chat_prompt({"messages": turns}, tokenizer))
    assert JSON_CALL in text and "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text


def test_tools_reach_a_template_that_takes_them(qwen_tokenizer):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    turns = [{"role": "user", "content": "Rome?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    text = qwen_tokenizer.decode(chat_prompt({"messages": turns}, qwen_tokenizer, tools=[WEATHER]))
    assert text.startswith("<|im_start|>system\nTOOLS: get_weather") and 'CALL get_weather {"city": "Rome"}' in text


def test_tool_fields_are_checked(tokenizer):
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    bad = [
        ({**chat, "tool_choice": "required"}, True, "tool_choice"),
        ({**chat, "tools": [{"type": "function"}]}, True, "tools[0]"),
        ({"prompt": "hi", "tools": [WEATHER]}, False, "tools"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
            True,
            "arguments",
        ),
    ]
    for body, is_chat, field in bad:
        with pytest.raises(APIError, match=re.escape(field)):
            parse_request(body, info(tokenizer), chat=is_chat)
    assert parse_request({**chat, "tool_choice": "none"}, info(tokenizer), chat=True).splitter() is None


def test_openai_stream_and_body_of_a_call(tokenizer):
    req = parse_request(
        {"messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER]}, info(tokenizer), chat=True
    )
    texts = ["Sure.", "\n<tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}</tool_call>']
    chunks = [d for _, d in asyncio.run(_drain(_stream, req, texts)) if d != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[1] == {"content": "Sure."}
    call = deltas[2]["tool_calls"][0]
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    body = completion_body(req, "".join(texts), "stop", {}, {})
    message = body["choices"][0]["message"]
    assert message["content"] == "Sure." and message["tool_calls"][0]["function"] == call["function"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"


async def _drain(stream, req, texts):
    return await events(stream(scripted(req, texts)))


def test_anthropic_stream_and_body_of_a_call(tokenizer):
    tool = {"name": "get_weather", "description": "d", "input_schema": WEATHER["function"]["parameters"]}
    body = {"messages": [{"role": "user", "content": "Paris?"}], "tools": [tool], "max_tokens": 8}
    req = anthropic_api.parse_messages(body, info(tokenizer))
    texts = ["Sure.\n", JSON_CALL[:20], JSON_CALL[20:]]
    got = asyncio.run(_drain(_anthropic_stream, req, texts))
    names = [n for n, _ in got]
    assert names == ["message_start"] + ["content_block_start", "content_block_delta", "content_block_stop"] * 2 + [
        "message_delta",
        "message_stop",
    ]
    assert got[4][1]["content_block"]["type"] == "tool_use" and got[4][1]["content_block"]["name"] == "get_weather"
    assert json.loads(got[5][1]["delta"]["partial_json"]) == {"city": "Paris"}
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use"
    whole = anthropic_api.message_body(req, "".join(texts), Done("stop"), {})
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"] and whole["stop_reason"] == "tool_use"
    assert whole["content"][1]["input"] == {"city": "Paris"}


def test_anthropic_tool_turns_reach_the_prompt(tokenizer):
    messages = [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
    ]
    req = anthropic_api.parse_messages({"messages": messages, "max_tokens": 8}, info(tokenizer))
    text = tokenizer.decode(req.prompt)
    assert JSON_CALL in text and "<tool_response>\nsunny\n</tool_response>" in text
    with pytest.raises(APIError, match="tool_choice"):
        anthropic_api.parse_messages(
            {"messages": messages, "max_tokens": 8, "tool_choice": {"type": "any"}}, info(tokenizer)
        )


@pytest.mark.slow
def test_real_server_puts_the_tools_in_the_prompt(live, tokenizer):
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    expected = len(chat_prompt({"messages": messages}, tokenizer, tools=[WEATHER]))
    assert expected > len(chat_prompt({"messages": messages}, tokenizer)) + 30
    client = openai.OpenAI(base_url=f"{live}/v1", api_key="x", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="default", messages=messages, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert reply.usage.prompt_tokens == expected and reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    claude = anthropic.Anthropic(base_url=live, api_key="x", max_retries=0, timeout=120)
    tool = {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": WEATHER["function"]["parameters"],
    }
    message = claude.messages.create(model="claude-any", messages=messages, tools=[tool], max_tokens=8)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected
    assert claude.messages.count_tokens(model="claude-any", messages=messages, tools=[tool]).input_tokens == expected
