"""The OpenAI wire format of `dflash serve`: requests checked into one `CompletionRequest`,
and the response bodies built from what the worker reports.

A bad request gets a 4xx with OpenAI's error body (`{"error": {"message", "type", "param",
"code"}}`) naming the field at fault. Fields the server cannot honour (echo, n > 1, ...)
are refused rather than silently ignored; unknown fields are ignored, as OpenAI-compatible
servers do, because clients send many optional ones. The field checks are `request.py`'s,
shared with Anthropic's Messages format (`anthropic_api`); the prompts are `prompts.py`'s.
"""

from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from app.server.output import Piece
from app.server.prompts import chat_prompt, check_tools, conversation, reply_format, text_prompt
from app.server.request import (
    APIError,
    CompletionRequest,
    ModelInfo,
    check_body,
    decode_options,
    flag,
    integer,
    split_reply,
    stop_strings,
    token_budget,
)

__all__ = [
    "TokenLogprob",
    "chunk",
    "completion_body",
    "dflash_stats",
    "finish",
    "logprobs_body",
    "parse_request",
    "piece_chunks",
    "usage",
]

#: Fields refused when set to anything but their off value: we do not implement them.
UNSUPPORTED = ("functions", "echo", "suffix")
#: Fields that reshape the target's distribution: refused, not ignored (the loop samples
#: and accepts by the target's own distribution; see docs/server.md on sampling).
PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")
MAX_TOP_LOGPROBS = 20


def _refuse_unsupported(body: dict) -> None:
    for name in PENALTIES:
        if body.get(name) not in (None, 0, {}) and not (name == "repetition_penalty" and body[name] == 1):
            raise APIError(
                f"'{name}' is not supported: DFlash samples and accepts by the target's own distribution",
                param=name,
                code="unsupported_parameter",
            )
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}, "", "none", 0):
            raise APIError(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise APIError(f"'{name}' must be 1: this server returns one choice", param=name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
        raise APIError("only response_format {'type': 'text'} is supported", param="response_format")


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """How many top alternatives each token's log-probability comes with, or None: chat's
    `logprobs: true` with `top_logprobs`, the legacy completions' `logprobs: N`."""
    name = "top_logprobs" if chat else "logprobs"
    if chat:
        wanted = flag(body, "logprobs")
        if not wanted and body.get(name) is not None:
            raise APIError("'top_logprobs' needs 'logprobs': true", param=name)
    top = integer(body, name)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(f"'{name}' must be between 0 and {MAX_TOP_LOGPROBS}; got {top}", param=name)
    if chat:
        return (top or 0) if wanted else None
    return top


def _offered_tools(body: dict, chat: bool) -> list[dict]:
    """The tools a chat request offers: its `tools`, unless `tool_choice` is "none"
    ("auto" and absent offer them; forcing a call is not supported)."""
    tools, choice = check_tools(body.get("tools")), body.get("tool_choice")
    if tools and not chat:
        raise APIError("'tools' needs /v1/chat/completions", param="tools", code="unsupported_parameter")
    if choice not in (None, "auto", "none"):
        raise APIError(
            "'tool_choice' must be 'auto' or 'none': this server cannot force a tool call",
            param="tool_choice",
            code="unsupported_parameter",
        )
    return [] if choice == "none" else tools


def parse_request(body: Any, info: ModelInfo, *, chat: bool) -> CompletionRequest:
    """Check a decoded JSON body and tokenize its prompt. Raises `APIError`."""
    body = check_body(body, info)
    _refuse_unsupported(body)
    stream, options = flag(body, "stream"), body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError("'stream_options' must be an object", param="stream_options", code="invalid_type")
    if options is not None and not stream:  # as OpenAI: options of a stream that is not there
        raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    tools = _offered_tools(body, chat)
    prompt = chat_prompt(body, info.tokenizer, tools=tools) if chat else text_prompt(body, info.tokenizer)
    if not prompt:
        raise APIError("the prompt is empty", param="messages" if chat else "prompt")
    return CompletionRequest(
        chat=chat,
        prompt=prompt,
        max_tokens=token_budget(body, info, len(prompt)),
        stop=stop_strings(body),
        stream=stream,
        include_usage=flag(options or {}, "include_usage"),
        logprobs=_logprobs(body, chat),
        **(reply_format(info.tokenizer, prompt, tools) if chat else {}),
        model=info.id,
        id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        created=int(time.time()),
        options=decode_options(body, info.options),
        messages=conversation(body.get("messages")) if chat else (),
    )


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token (its text and its own bytes: a token that holds part of a UTF-8
    character decodes to U+FFFD), its log-probability under the target, and the top
    alternatives there, most likely first."""

    token: str
    raw: bytes
    logprob: float
    top: tuple[TokenLogprob, ...] = ()


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


#: The `dflash` object's fields taken as they are from the stats' view (`GenerationStats.to_dict`).
DFLASH_FIELDS = (
    "accepted_length_histogram",
    "block_size",
    "adaptive",
    "block_size_histogram",
    "cycles",
    "drafted_tokens",
    "accepted_drafted_tokens",
    "tree_budget",
    "widths",
    "lookup_chains",
)


def dflash_stats(stats: Any, generation_tps: float, prompt_tps: float) -> dict:
    """The `dflash` object: how speculative decoding went for this request."""
    if stats is None:
        return {}
    view = stats.to_dict()
    return {
        "tau": round(view["tau"], 4),
        **{name: view[name] for name in DFLASH_FIELDS},
        "tokens_per_second": round(generation_tps, 2),
        "prompt_tokens_per_second": round(prompt_tps, 2),
    }


def _head(req: CompletionRequest, obj: str) -> dict:
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model}


def _openai_call(call: dict, streamed: bool) -> dict:
    head = {"index": call["index"]} if streamed else {}
    function = {"name": call["name"], "arguments": call["arguments"]}
    return {**head, "id": call["id"], "type": "function", "function": function}


def _piece_delta(piece: Piece) -> dict:
    """A piece of a reply as a streamed chat delta."""
    if piece.kind == "tool":
        return {"tool_calls": [_openai_call(piece.call, True)]}
    return {"reasoning_content" if piece.kind == "reasoning" else "content": piece.text}


def finish(reason: str, called: bool) -> str:
    """OpenAI's finish reason: "tool_calls" where a reply that stopped by itself called a tool."""
    return "tool_calls" if called and reason == "stop" else reason


def completion_body(
    req: CompletionRequest, text: str, finish_reason: str, use: dict, dflash: dict, logprobs: Optional[dict] = None
) -> dict:
    """A whole (non-streamed) chat.completion or text_completion (`logprobs`: `logprobs_body`'s).
    A chat reply's reasoning is its message's `reasoning_content`, its calls `tool_calls`."""
    if req.chat:
        pieces, called = split_reply(req, text)
        message = {"role": "assistant", "content": "".join(p.text for p in pieces if p.kind == "text") or None}
        if not called and message["content"] is None:
            message["content"] = ""
        reasoning = "".join(p.text for p in pieces if p.kind == "reasoning")
        if reasoning:
            message["reasoning_content"] = reasoning
        if called:
            message["tool_calls"] = [_openai_call(p.call, False) for p in pieces if p.kind == "tool"]
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish(finish_reason, called)}
        return {**_head(req, "chat.completion"), "choices": [choice], "usage": use, "dflash": dflash}
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_head(req, "text_completion"), "choices": [choice], "usage": use, "dflash": dflash}


def chunk(
    req: CompletionRequest,
    text: Optional[str],
    finish_reason: Optional[str] = None,
    logprobs: Optional[dict] = None,
    **extra: Any,
) -> dict:
    """One streamed chunk; `text=None` with no finish reason opens a chat reply (the role)."""
    if req.chat:
        delta = {"role": "assistant", "content": ""} if text is None and finish_reason is None else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**_head(req, "chat.completion.chunk"), "choices": [choice], **extra}
    choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_head(req, "text_completion"), "choices": [choice], **extra}


def piece_chunks(req: CompletionRequest, pieces: Sequence[Piece], logprobs: Optional[dict]) -> list[dict]:
    """The chat chunks of a split reply's new pieces (`logprobs` ride on the first; with
    no pieces, on a chunk of their own)."""
    chunks = []
    for piece in pieces:
        out = chunk(req, "", logprobs=logprobs)
        out["choices"][0]["delta"] = _piece_delta(piece)
        chunks.append(out)
        logprobs = None
    return chunks or ([chunk(req, "", logprobs=logprobs)] if logprobs else [])


def _token(entry: TokenLogprob) -> dict:
    return {"token": entry.token, "logprob": entry.logprob, "bytes": list(entry.raw)}


def logprobs_body(req: CompletionRequest, entries: Sequence[TokenLogprob], offset: int = 0) -> Optional[dict]:
    """The `logprobs` of a choice or chunk: chat's `{"content": [...]}`, or the legacy
    completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets in the
    completion's text, from `offset`, the length of the tokens before these). None when
    the request did not ask for them."""
    if req.logprobs is None:
        return None
    if req.chat:
        content = [{**_token(e), "top_logprobs": [_token(t) for t in e.top]} for e in entries]
        return {"content": content}
    offsets = list(itertools.accumulate((len(e.token) for e in entries), initial=offset))[:-1]
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }
