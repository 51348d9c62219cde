"""`dflash serve`'s reasoning: `<think>...</think>` apart from the answer, and
`chat_template_kwargs` (Anthropic: `thinking`) through to the chat template.

The default model does not think, so the template here is a small one that does, in
the way Qwen3's does (`enable_thinking` false: an empty think block in the prompt; true:
the prompt opens `<think>` and the reply starts inside it), over the default model's
vocabulary as mlx-lm loads it. Model outputs are scripted and go through the server's
own stream functions and body builders.
"""

from __future__ import annotations

import asyncio

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper, load as load_tokenizer
from server_helpers import events, scripted

from app.server import anthropic_api
from app.server.openai_api import completion_body, parse_request
from app.server.request import APIError, ModelInfo
from app.server.worker import Done
from app.server.routes import _anthropic_stream, _stream

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}"
)
ASK = [{"role": "user", "content": "Capital of France?"}]
#: A reply that started inside the reasoning the prompt opened.
REPLY = ["The user asks", " for a capital. </thi", "nk>\n\n", "Paris", "."]


@pytest.fixture(scope="module")
def info(default_model_dir) -> ModelInfo:
    hf = load_tokenizer(default_model_dir)._tokenizer
    hf.chat_template = THINKING_TEMPLATE
    return ModelInfo("m", TokenizerWrapper(hf), 2048, 32)


def chat(info: ModelInfo, **fields):
    return parse_request({"messages": ASK, **fields}, info, chat=True)


def test_chat_template_kwargs_reach_the_template(info):
    on = chat(info, chat_template_kwargs={"enable_thinking": True})
    off = chat(info, chat_template_kwargs={"enable_thinking": False})
    decode = info.tokenizer.decode
    assert decode(on.prompt).endswith("assistant\n<think>\n") and on.thinking
    assert decode(off.prompt).endswith("<think>\n\n</think>\n\n") and not off.thinking
    assert on.think == off.think == ("<think>", "</think>")
    for bad in ("yes", {"tools": []}, {"add_generation_prompt": False}):
        with pytest.raises(APIError, match="chat_template_kwargs"):
            chat(info, chat_template_kwargs=bad)
    thinking = {"messages": ASK, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert anthropic_api.parse_messages(thinking, info).prompt == on.prompt
    assert anthropic_api.parse_messages({**thinking, "thinking": {"type": "disabled"}}, info).prompt == off.prompt


def test_openai_reasoning_content(info):
    req = chat(info, chat_template_kwargs={"enable_thinking": True})
    message = completion_body(req, "".join(REPLY), "stop", {}, {})["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Paris.", "reasoning_content": "The user asks for a capital. "}
    chunks = [d for _, d in asyncio.run(_drain(_stream, req)) if d != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == "Paris."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    own = chat(info, chat_template_kwargs={"enable_thinking": False})  # a model may open its own think block
    message = completion_body(own, "<think>hmm</think>Paris.", "stop", {}, {})["choices"][0]["message"]
    assert message["reasoning_content"] == "hmm" and message["content"] == "Paris."


async def _drain(stream, req):
    return await events(stream(scripted(req, REPLY)))


def test_anthropic_thinking_block(info):
    body = {"messages": ASK, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    req = anthropic_api.parse_messages(body, info)
    whole = anthropic_api.message_body(req, "".join(REPLY), Done("stop"), {})
    assert whole["content"] == [
        {"type": "thinking", "thinking": "The user asks for a capital. ", "signature": ""},
        {"type": "text", "text": "Paris."},
    ]
    got = asyncio.run(_drain(_anthropic_stream, req))
    starts = [d["content_block"]["type"] for n, d in got if n == "content_block_start"]
    assert starts == ["thinking", "text"]
    thought = "".join(d["delta"].get("thinking", "") for n, d in got if n == "content_block_delta")
    assert thought == whole["content"][0]["thinking"]
