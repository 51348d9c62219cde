"""The OpenAI wire format of `dflash serve`: requests checked into one plain object, and
the response bodies built from what the worker reports.

Every request is checked here, before it is queued, so that a bad one costs the worker
nothing and gets a 4xx with OpenAI's error body (`{"error": {"message", "type", "param",
"code"}}`) naming the field at fault. Fields the server cannot honour (tools, echo,
n > 1, ...) are refused rather than silently ignored; unknown fields are ignored, as
OpenAI-compatible servers do, because clients send many optional ones. The field checks
are shared with Anthropic's Messages format (`anthropic_api`).
"""

from __future__ import annotations

import itertools
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from dflash_mlx.messages import apply_chat_template
from dflash_mlx.options import DecodeOptions, OptionError

__all__ = [
    "APIError",
    "CompletionRequest",
    "ModelInfo",
    "TokenLogprob",
    "chat_prompt",
    "check_body",
    "chunk",
    "completion_body",
    "decode_options",
    "dflash_stats",
    "flag",
    "logprobs_body",
    "parse_request",
    "stop_strings",
    "text_content",
    "token_budget",
    "usage",
]

#: Request fields by `DecodeOptions` field, where OpenAI names them differently.
API_NAMES = {"temp": "temperature"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP = 16
#: Fields refused when set to anything but their off value: we do not implement them.
UNSUPPORTED = ("tools", "functions", "tool_choice", "echo", "suffix", "logit_bias")
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, *, status: int = 400, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @property
    def kind(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ModelInfo:
    """What request checking needs to know about the served model."""

    id: str
    tokenizer: Any
    context_length: int
    default_max_tokens: int
    aliases: tuple[str, ...] = ()
    has_draft: bool = True
    options: DecodeOptions = DecodeOptions()  # the server's own (block size, kernels); requests add sampling


@dataclass
class CompletionRequest:
    """One checked request, ready for the worker."""

    chat: bool  # /v1/chat/completions, else /v1/completions
    prompt: list[int]
    max_tokens: int
    options: DecodeOptions = DecodeOptions()
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    logprobs: Optional[int] = None  # top alternatives per token (0: the chosen token's alone); None: off
    model: str = ""
    id: str = ""
    created: int = 0


# --------------------------------------------------------------------------- fields


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(f"'{name}' must be a number", param=name, code="invalid_type")
    return float(value)


def _integer(body: dict, name: str) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(f"'{name}' must be an integer", param=name, code="invalid_type")
    return value


def flag(body: dict, name: str) -> bool:
    """A true/false field (absent: false)."""
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(f"'{name}' must be true or false", param=name, code="invalid_type")
    return value


def stop_strings(body: dict, name: str = "stop") -> list[str]:
    """The stop strings in field `name` (a string or a list of them)."""
    value = body.get(name)
    stops = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(f"'{name}' must be a string or a list of strings", param=name, code="invalid_type")
    if len(stops) > MAX_STOP:
        raise APIError(f"'{name}' takes at most {MAX_STOP} strings", param=name)
    return [s for s in stops if s]


def _refuse_unsupported(body: dict) -> None:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}, "", "none", 0):
            raise APIError(f"'{name}' is not supported by this server", param=name, code="unsupported_parameter")
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise APIError(f"'{name}' must be 1: this server returns one choice", param=name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
        raise APIError("only response_format {'type': 'text'} is supported", param="response_format")


# --------------------------------------------------------------------------- prompts


def text_content(content: Any, where: str) -> str:
    """A content field: a string, or a list of text parts (OpenAI's and Anthropic's
    `{"type": "text", "text": ...}`), joined; other fields of a part are ignored."""
    text_parts = isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    )
    if text_parts:
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(f"'{where}' must be a string or a list of text parts", param=where, code="invalid_type")
    return content


def _content(message: Any, i: int, roles: dict) -> dict:
    """One chat message as `{"role", "content"}` with text content."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise APIError(f"'{where}' must be an object with 'role' and 'content'", param=where, code="invalid_type")
    role = message.get("role")
    if role not in roles:
        raise APIError(f"'{where}.role' must be one of {', '.join(roles)}; got {role!r}", param=f"{where}.role")
    return {"role": roles[role], "content": text_content(message.get("content"), f"{where}.content")}


def chat_prompt(body: dict, tokenizer: Any, system: Optional[str] = None, roles: dict = ROLES) -> list[int]:
    """The templated prompt of `body["messages"]` (after a `system` message, if given)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages", code="invalid_type")
    turns = [{"role": "system", "content": system}] if system else []
    turns += [_content(m, i, roles) for i, m in enumerate(messages)]
    return list(apply_chat_template(tokenizer, turns))


def _text_prompt(body: dict, tokenizer: Any) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        return list(tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos)))
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer.get_vocab()) if hasattr(tokenizer, "get_vocab") else None
        if vocab and any(not 0 <= t < vocab for t in prompt):
            raise APIError(f"'prompt' token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)
    raise APIError("'prompt' must be a string or a list of token ids", param="prompt", code="invalid_type")


# --------------------------------------------------------------------------- request


def token_budget(body: dict, info: ModelInfo, prompt_tokens: int, *, required: bool = False) -> int:
    """The request's `max_tokens` (or `max_completion_tokens`), within the context left
    after the prompt; the server's default when absent, unless `required`."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = _integer(body, name)
    if value is None and required:
        raise APIError(f"'{name}' is required", param=name, code="missing_field")
    if value is None:
        value = info.default_max_tokens
    elif not 1 <= value <= info.context_length:
        raise APIError(f"'{name}' must be between 1 and {info.context_length}; got {value}", param=name)
    if prompt_tokens >= info.context_length:
        raise APIError(
            f"the prompt is {prompt_tokens} tokens; this model's context is {info.context_length}",
            param="messages" if "messages" in body else "prompt",
            code="context_length_exceeded",
        )
    return min(value, info.context_length - prompt_tokens)


def decode_options(body: dict, server: DecodeOptions) -> DecodeOptions:
    """The server's options with the request's sampling fields (OpenAI's and Anthropic's
    defaults: temperature 1; top_k -1 means off; any seed is taken modulo 2**63)."""
    top_k, seed = _integer(body, "top_k"), _integer(body, "seed")
    sampling = dict(
        temp=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=0 if top_k in (None, -1) else top_k,
        seed=None if seed is None else seed % 2**63,
    )
    try:
        return replace(server, **sampling)
    except OptionError as e:  # checked where every front end's options are
        name = API_NAMES.get(e.field, e.field)
        raise APIError(e.named(f"'{name}'"), param=name) from None


def check_body(body: Any, info: ModelInfo, *, any_model: bool = False) -> dict:
    """`body` if it is a JSON object whose `model` is this server's (or, `any_model`, any string)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", code="invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError("'model' must be a string", param="model", code="invalid_type")
    if model and not any_model and model not in (info.id, *info.aliases):
        raise APIError(
            f"the model '{model}' does not exist; this server has '{info.id}'",
            status=404,
            param="model",
            code="model_not_found",
        )
    return body


def _logprobs(body: dict, chat: bool) -> Optional[int]:
    """How many top alternatives each token's log-probability comes with, or None: chat's
    `logprobs: true` with `top_logprobs`, the legacy completions' `logprobs: N`."""
    name = "top_logprobs" if chat else "logprobs"
    if chat:
        wanted = flag(body, "logprobs")
        if not wanted and body.get(name) is not None:
            raise APIError("'top_logprobs' needs 'logprobs': true", param=name)
    top = _integer(body, name)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(f"'{name}' must be between 0 and {MAX_TOP_LOGPROBS}; got {top}", param=name)
    if chat:
        return (top or 0) if wanted else None
    return top


def parse_request(body: Any, info: ModelInfo, *, chat: bool) -> CompletionRequest:
    """Check a decoded JSON body and tokenize its prompt. Raises `APIError`."""
    body = check_body(body, info)
    _refuse_unsupported(body)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError("'stream_options' must be an object", param="stream_options", code="invalid_type")
    prompt = chat_prompt(body, info.tokenizer) if chat else _text_prompt(body, info.tokenizer)
    if not prompt:
        raise APIError("the prompt is empty", param="messages" if chat else "prompt")
    return CompletionRequest(
        chat=chat,
        prompt=prompt,
        max_tokens=token_budget(body, info, len(prompt)),
        stop=stop_strings(body),
        stream=flag(body, "stream"),
        include_usage=flag(options or {}, "include_usage"),
        logprobs=_logprobs(body, chat),
        model=info.id,
        id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
        created=int(time.time()),
        options=decode_options(body, info.options),
    )


# --------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token (its text), its log-probability under the target, and the top
    alternatives there as (text, log-probability), most likely first."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


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


def completion_body(
    req: CompletionRequest, text: str, finish_reason: str, use: dict, dflash: dict, logprobs: Optional[dict] = None
) -> dict:
    """A whole (non-streamed) chat.completion or text_completion (`logprobs`: `logprobs_body`'s)."""
    if req.chat:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
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


def _token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def logprobs_body(req: CompletionRequest, entries: Sequence[TokenLogprob], offset: int = 0) -> Optional[dict]:
    """The `logprobs` of a choice or chunk: chat's `{"content": [...]}`, or the legacy
    completions' `{tokens, token_logprobs, top_logprobs, text_offset}` (offsets in the
    completion's text, from `offset`, the length of the tokens before these). None when
    the request did not ask for them."""
    if req.logprobs is None:
        return None
    if req.chat:
        content = [{**_token(e.token, e.logprob), "top_logprobs": [_token(t, v) for t, v in e.top]} for e in entries]
        return {"content": content}
    offsets = list(itertools.accumulate((len(e.token) for e in entries), initial=offset))[:-1]
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }
