"""Anthropic's Messages wire format of `dflash serve` (`/v1/messages`, `/v1/messages/count_tokens`).

A Messages request is checked into the same `CompletionRequest` as an OpenAI chat
request, with the same field checks (`api`: sampling through `DecodeOptions`, stop
strings, the token budget, the chat template), so it runs on the same worker with DFlash
under it; only the names differ (`stop_sequences`, `system`, a required `max_tokens`) and
the answer's shape. Any `model` name is accepted (clients such as Claude Code send their
own) and the answer names the served model. Errors have Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from app.api import (
    APIError,
    CompletionRequest,
    ModelInfo,
    chat_prompt,
    check_body,
    decode_options,
    flag,
    stop_strings,
    text_content,
    token_budget,
)

__all__ = [
    "count_tokens",
    "error_body",
    "message_body",
    "parse_messages",
    "stop_reason",
    "stream_delta",
    "stream_start",
    "stream_stop",
]

#: Anthropic's roles (a system prompt is the `system` field, not a message).
ROLES = {"user": "user", "assistant": "assistant"}
#: The worker's finish reasons as Anthropic's stop reasons.
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}
#: Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


def error_body(exc: APIError) -> dict:
    """Anthropic's error body."""
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": str(exc)}}


def _prompt(body: Any, info: ModelInfo) -> list[int]:
    """The templated prompt of a Messages (or count_tokens) body: `system`, then `messages`."""
    body = check_body(body, info, any_model=True)
    if body.get("tools"):
        raise APIError("tools are not supported yet", param="tools", code="unsupported_parameter")
    system = body.get("system")
    system = None if system is None else text_content(system, "system")
    prompt = chat_prompt(body, info.tokenizer, system, ROLES)
    if not prompt:
        raise APIError("the prompt is empty", param="messages")
    return prompt


def parse_messages(body: Any, info: ModelInfo) -> CompletionRequest:
    """Check a Messages request body and tokenize its prompt. Raises `APIError`."""
    prompt = _prompt(body, info)
    return CompletionRequest(
        chat=True,
        prompt=prompt,
        max_tokens=token_budget(body, info, len(prompt), required=True),
        stop=stop_strings(body, "stop_sequences"),
        stream=flag(body, "stream"),
        model=info.id,
        id="msg_" + uuid.uuid4().hex[:24],
        created=int(time.time()),
        options=decode_options(body, info.options),
    )


def count_tokens(body: Any, info: ModelInfo) -> dict:
    """The answer of `/v1/messages/count_tokens`: the templated prompt's length."""
    return {"input_tokens": len(_prompt(body, info))}


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


def stop_reason(finish_reason: str, stop_sequence: Optional[str]) -> str:
    """Anthropic's stop reason of a finished request."""
    return "stop_sequence" if stop_sequence is not None else STOP_REASONS[finish_reason]


def message_body(req: CompletionRequest, text: str, done: Any, dflash: dict) -> dict:
    """A whole (non-streamed) message, from the worker's `Done`."""
    use = _usage(done.prompt_tokens or len(req.prompt), done.completion_tokens, done.cached_tokens)
    reason = stop_reason(done.finish_reason, done.stop_sequence)
    content = [{"type": "text", "text": text}]
    return {**_message(req, content, reason, done.stop_sequence, use), "dflash": dflash}


def stream_start(req: CompletionRequest) -> list[tuple[str, dict]]:
    """The (event, data) pairs that open a streamed message: message_start, content_block_start."""
    head = _message(req, [], None, None, _usage(len(req.prompt), 0, 0))
    block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    return [("message_start", {"type": "message_start", "message": head}), ("content_block_start", block)]


def stream_delta(text: str) -> list[tuple[str, dict]]:
    """New text of a streamed message: a content_block_delta with a text_delta."""
    return [
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        )
    ]


def stream_stop(req: CompletionRequest, done: Any, dflash: dict) -> list[tuple[str, dict]]:
    """The events that close a streamed message: content_block_stop, message_delta (the
    stop reason and usage of the worker's `Done`), message_stop."""
    use = _usage(done.prompt_tokens or len(req.prompt), done.completion_tokens, done.cached_tokens)
    delta = {"stop_reason": stop_reason(done.finish_reason, done.stop_sequence), "stop_sequence": done.stop_sequence}
    return [
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta", "delta": delta, "usage": use, "dflash": dflash}),
        ("message_stop", {"type": "message_stop"}),
    ]
