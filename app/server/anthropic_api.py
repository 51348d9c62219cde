"""Anthropic's Messages wire format of `dflash serve` (`/v1/messages`, `/v1/messages/count_tokens`).

A Messages request is checked into the same `CompletionRequest` as an OpenAI chat
request, with the same field checks (`request` and `prompts`: sampling through `DecodeOptions`, stop
strings, the token budget, the chat template), so it runs on the same worker with DFlash
under it; only the names differ (`stop_sequences`, `system`, a required `max_tokens`) and
the answer's shape. Any `model` name is accepted (clients such as Claude Code send their
own) and the answer names the served model. `tools` and `tool_use` / `tool_result`
blocks become OpenAI's function tools, `tool_calls` and tool messages, so both APIs
share one path into the chat template; the reply's calls come back as `tool_use`
blocks (stop reason "tool_use") and its reasoning as `thinking` blocks. Errors have Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional

from app.server.output import Piece
from app.server.prompts import chat_prompt, check_tools, conversation, reply_format, template_kwargs, text_content
from app.server.request import (
    APIError,
    CompletionRequest,
    ModelInfo,
    check_body,
    decode_options,
    flag,
    split_reply,
    stop_strings,
    token_budget,
)

__all__ = [
    "MessageStream",
    "count_tokens",
    "error_body",
    "message_body",
    "parse_messages",
    "stop_reason",
]

#: Anthropic's roles (a system prompt is the `system` field, not a message).
ROLES = {"user": "user", "assistant": "assistant"}
#: The roles of the OpenAI-shaped turns a Messages body becomes (`_openai_turns`).
TURN_ROLES = {**ROLES, "tool": "tool"}
#: The worker's finish reasons as Anthropic's stop reasons.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}
#: Anthropic's upper bound on `temperature` (its range is 0..1; OpenAI's goes to 2).
MAX_TEMPERATURE = 1.0
#: Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def error_body(exc: APIError) -> dict:
    """Anthropic's error body."""
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(exc)}}


def _tools(body: dict) -> list[dict]:
    """Anthropic's `tools` (`name`, `description`, `input_schema`) in OpenAI's function
    shape, unless `tool_choice` is `{"type": "none"}`; forcing a call is not supported."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    if kind not in (None, "auto", "none"):
        raise APIError("'tool_choice' must be auto or none: this server cannot force a tool call", param="tool_choice")
    if not isinstance(tools, list):
        raise APIError("'tools' must be a list", param="tools", code="invalid_type")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or "input_schema" not in tool:
            raise APIError(f"'tools[{i}]' must be a client tool with 'name' and 'input_schema'", param="tools")
        function = {
            "name": tool["name"],
            "description": tool.get("description", ""),
            "parameters": tool["input_schema"],
        }
        out.append({"type": "function", "function": function})
    return [] if kind == "none" else check_tools(out)


def _blocks(content: Any, where: str) -> list:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise APIError(f"'{where}' must be a string or a list of content blocks", param=where, code="invalid_type")
    return content


def _tool_call(block: dict, where: str) -> dict:
    """A `tool_use` block (at `where`) as an OpenAI tool call, checked here so that an
    error names the block's own fields."""
    if not isinstance(block.get("name"), str):
        raise APIError(f"'{where}.name' must be a string", param=f"{where}.name", code="invalid_type")
    if not isinstance(block.get("input", {}), dict):
        raise APIError(f"'{where}.input' must be an object", param=f"{where}.input", code="invalid_type")
    function = {"name": block["name"], "arguments": block.get("input", {})}
    return {"id": block.get("id"), "type": "function", "function": function}


def _tool_message(block: dict, where: str) -> dict:
    """A `tool_result` block (at `where`) as an OpenAI tool message, answering the call
    its `tool_use_id` names (required, as Anthropic's)."""
    if not isinstance(block.get("tool_use_id"), str):
        raise APIError(
            f"'{where}.tool_use_id' must be a string: the id of the tool_use it answers",
            param=f"{where}.tool_use_id",
            code="invalid_type",
        )
    content = text_content(block.get("content", ""), f"{where}.content")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _openai_turns(message: Any, i: int) -> list[dict]:
    """One Messages turn as OpenAI-shaped chat messages: a user's `tool_result` blocks
    become tool messages, an assistant's `tool_use` blocks its `tool_calls`; earlier
    `thinking` blocks are left out, as chat templates leave out earlier reasoning."""
    where = f"messages[{i}]"
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ROLES:
        raise APIError(f"'{where}.role' must be one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role")
    content = _blocks(message.get("content"), f"{where}.content")
    blocks = [b for b in content if b.get("type") != "thinking"]
    turns = [_tool_message(b, f"{where}.content[{j}]") for j, b in enumerate(content) if b.get("type") == "tool_result"]
    calls = [_tool_call(b, f"{where}.content[{j}]") for j, b in enumerate(content) if b.get("type") == "tool_use"]
    text = [b for b in blocks if b.get("type") not in ("tool_result", "tool_use")]
    if text or calls or not turns:
        turns.append(
            {
                "role": role,
                "content": text_content(text, f"{where}.content"),
                **({"tool_calls": calls} if calls else {}),
            }
        )
    return turns


def _thinking(body: dict) -> dict:
    """Anthropic's `thinking` (`{"type": "enabled" | "disabled", ...}`) as the template's
    `enable_thinking`; absent: the template's own default."""
    thinking = body.get("thinking")
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled"):
        raise APIError("'thinking.type' must be 'enabled' or 'disabled'", param="thinking")
    return {"enable_thinking": kind == "enabled"}


def _prompt(body: Any, info: ModelInfo) -> tuple[list[int], list[dict], tuple[dict, ...]]:
    """The templated prompt of a Messages (or count_tokens) body (`system`, `messages`,
    `tools`), the tools it offers (OpenAI's shape) and its text turns (`conversation`)."""
    body = check_body(body, info, any_model=True)
    system = body.get("system")
    system = None if system is None else text_content(system, "system")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages", code="invalid_type")
    turns = [t for i, m in enumerate(messages) for t in _openai_turns(m, i)]
    tools = _tools(body)
    kwargs = {**template_kwargs(body), **_thinking(body)}
    prompt = chat_prompt(body, info.tokenizer, system, TURN_ROLES, tools, turns, kwargs, continue_final=True)
    if not prompt:
        raise APIError("the prompt is empty", param="messages")
    return prompt, tools, conversation(turns, system)


def parse_messages(body: Any, info: ModelInfo) -> CompletionRequest:
    """Check a Messages request body and tokenize its prompt. Raises `APIError`."""
    prompt, tools, turns = _prompt(body, info)
    return CompletionRequest(
        chat=True,
        prompt=prompt,
        max_tokens=token_budget(body, info, len(prompt), required=True),
        stop=stop_strings(body, "stop_sequences", lone=False),
        stream=flag(body, "stream"),
        **reply_format(info.tokenizer, prompt, tools),
        model=info.id,
        id="msg_" + uuid.uuid4().hex[:24],
        created=int(time.time()),
        options=decode_options(body, info.options, MAX_TEMPERATURE),
        messages=turns,
    )


def count_tokens(body: Any, info: ModelInfo) -> dict:
    """The answer of `/v1/messages/count_tokens`: the templated prompt's length."""
    return {"input_tokens": len(_prompt(body, info)[0])}


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """Anthropic's usage: `input_tokens` are those prefilled, the rest were read from a cache."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": completion_tokens,
        "cache_read_input_tokens": cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _message(req: CompletionRequest, content: list, stop_reason: Optional[str], stop: Optional[str], use: dict) -> dict:
    return {
        "id": req.id,
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop,
        "usage": use,
    }


def stop_reason(finish_reason: str, stop_sequence: Optional[str], called: bool = False) -> str:
    """Anthropic's stop reason of a finished request ("tool_use": it stopped after calling a tool)."""
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called and finish_reason == "stop" else STOP_REASONS[finish_reason]


def _arguments(call: dict) -> dict:
    """A parsed call's arguments as the `input` object of a tool_use block."""
    try:
        value = json.loads(call["arguments"])
    except json.JSONDecodeError:
        value = call["arguments"]
    return value if isinstance(value, dict) else {"arguments": value}


def _block(piece: Piece) -> dict:
    """The (empty, for text and thinking) content block a piece of the reply opens."""
    if piece.kind == "tool":
        return {"type": "tool_use", "id": piece.call["id"], "name": piece.call["name"], "input": {}}
    return (
        {"type": "thinking", "thinking": "", "signature": ""}
        if piece.kind == "reasoning"
        else {"type": "text", "text": ""}
    )


def message_body(req: CompletionRequest, text: str, done: Any, dflash: dict) -> dict:
    """A whole (non-streamed) message, from the worker's `Done`: text, `thinking` and
    `tool_use` blocks in the order the reply wrote them."""
    use = _usage(done.prompt_tokens or len(req.prompt), done.completion_tokens, done.cached_tokens)
    pieces, called = split_reply(req, text)
    content: list[dict] = []
    for piece in pieces:
        if piece.kind == "tool":
            content.append({**_block(piece), "input": _arguments(piece.call)})
        elif content and content[-1]["type"] == _block(piece)["type"]:
            content[-1][piece.kind.replace("reasoning", "thinking")] += piece.text
        else:
            content.append({**_block(piece), piece.kind.replace("reasoning", "thinking"): piece.text})
    reason = stop_reason(done.finish_reason, done.stop_sequence, called)
    return {**_message(req, content, reason, done.stop_sequence, use), "dflash": dflash}


class MessageStream:
    """The events of a streamed message: content blocks opened and closed as the reply's
    pieces come (message_start, then per block content_block_start / _delta / _stop,
    then message_delta with the stop reason and usage, and message_stop)."""

    def __init__(self, req: CompletionRequest):
        self.req, self.index, self.open, self.called = req, -1, None, False

    def start(self) -> list[tuple[str, dict]]:
        """message_start."""
        head = _message(self.req, [], None, None, _usage(len(self.req.prompt), 0, 0))
        return [("message_start", {"type": "message_start", "message": head})]

    def _close(self) -> list[tuple[str, dict]]:
        was, self.open = self.open, None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})] if was else []

    def _open(self, piece: Piece) -> list[tuple[str, dict]]:
        events = self._close()
        self.index, self.open = self.index + 1, piece.kind
        return events + [
            (
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": _block(piece)},
            )
        ]

    def pieces(self, pieces: list[Piece]) -> list[tuple[str, dict]]:
        """The events of the reply's next pieces."""
        events = []
        for piece in pieces:
            if piece.kind != self.open or piece.kind == "tool":
                events += self._open(piece)
            if piece.kind == "tool":
                delta = {"type": "input_json_delta", "partial_json": json.dumps(_arguments(piece.call))}
                self.called = True
            elif piece.kind == "reasoning":
                delta = {"type": "thinking_delta", "thinking": piece.text}
            else:
                delta = {"type": "text_delta", "text": piece.text}
            events.append(("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        return events

    def stop(self, done: Any, dflash: dict) -> list[tuple[str, dict]]:
        """The events that close the message (an empty text block if it had none)."""
        events = self._open(Piece("text")) if self.index < 0 else []
        use = _usage(done.prompt_tokens or len(self.req.prompt), done.completion_tokens, done.cached_tokens)
        reason = stop_reason(done.finish_reason, done.stop_sequence, self.called)
        delta = {"stop_reason": reason, "stop_sequence": done.stop_sequence}
        return (
            events
            + self._close()
            + [
                ("message_delta", {"type": "message_delta", "delta": delta, "usage": use, "dflash": dflash}),
                ("message_stop", {"type": "message_stop"}),
            ]
        )
