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
import json
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

from jinja2 import TemplateError

from app.server.output import OutputSplitter, Piece, ToolFormat, think_markers, tool_format, tool_prompt
from dflash_mlx import DecodeOptions, OptionError, apply_chat_template

__all__ = [
    "APIError",
    "CompletionRequest",
    "ModelInfo",
    "TokenLogprob",
    "chat_prompt",
    "check_body",
    "check_tools",
    "chunk",
    "completion_body",
    "finish",
    "piece_chunks",
    "split_reply",
    "decode_options",
    "dflash_stats",
    "flag",
    "logprobs_body",
    "parse_request",
    "reply_format",
    "stop_strings",
    "template_kwargs",
    "text_content",
    "token_budget",
    "usage",
]

#: Request fields by `DecodeOptions` field, where OpenAI names them differently.
API_NAMES = {"temp": "temperature"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_STOP = 16
#: Fields refused when set to anything but their off value: we do not implement them.
UNSUPPORTED = ("functions", "echo", "suffix")
#: Fields that reshape the target's distribution: refused, not ignored (the loop samples
#: and accepts by the target's own distribution; see README, "Sampling fields").
PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")
#: `chat_template_kwargs` the server sets itself.
RESERVED_TEMPLATE_KWARGS = {"messages", "conversation", "tools", "add_generation_prompt", "tokenize", "return_dict"}
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
    tools: tuple = ()  # offered (OpenAI's function shape); their calls are parsed out of the reply
    tool_format: Optional[ToolFormat] = None
    think: Optional[tuple[str, str]] = None  # the template's think markers, if it thinks
    thinking: bool = False  # the prompt opened the reasoning
    model: str = ""
    id: str = ""
    created: int = 0

    def splitter(self) -> Optional[OutputSplitter]:
        """A fresh splitter of this reply into text, reasoning and tool calls; None where
        the reply is all text (no tools offered, a template that does not think)."""
        if not self.tools and not self.think:
            return None
        return OutputSplitter(self.tools, self.tool_format, self.think, self.thinking)


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


def _tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as templates take them (arguments as objects)."""
    if not isinstance(value, list):
        raise APIError(f"'{where}' must be a list", param=where, code="invalid_type")
    calls = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise APIError(f"'{where}[{i}].function.name' must be a string", param=f"{where}[{i}]")
        arguments = function.get("arguments") or {}
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise APIError(f"'{where}[{i}].function.arguments' is not JSON", param=f"{where}[{i}]") from None
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def _content(message: Any, i: int, roles: dict) -> dict:
    """One chat message as `{"role", "content"}` with text content (and an assistant's
    `tool_calls`, a tool message's `tool_call_id`)."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise APIError(f"'{where}' must be an object with 'role' and 'content'", param=where, code="invalid_type")
    role = message.get("role")
    if role not in roles:
        raise APIError(f"'{where}.role' must be one of {', '.join(roles)}; got {role!r}", param=f"{where}.role")
    calls = message.get("tool_calls") if role == "assistant" else None
    content = message.get("content")
    text = "" if content is None and calls else text_content(content, f"{where}.content")
    turn = {"role": roles[role], "content": text}
    if calls:
        turn["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if role == "tool":
        turn["tool_call_id"] = message.get("tool_call_id")
    return turn


def check_tools(value: Any) -> list[dict]:
    """OpenAI's `tools` (functions with a name and JSON-schema parameters), checked."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise APIError("'tools' must be a list", param="tools", code="invalid_type")
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise APIError(f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name', ...}}}}", param="tools")
        if not isinstance(function.get("parameters", {}), dict):
            raise APIError(f"'tools[{i}].function.parameters' must be an object", param="tools")
    return value


def _plain_turns(turns: list[dict], fmt: ToolFormat) -> list[dict]:
    """`turns` for a template that knows no tools: an assistant's calls written in `fmt`
    after its text, a tool's result as a user turn in `<tool_response>` tags."""
    out = []
    for turn in turns:
        calls = [
            fmt.start + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}) + fmt.end
            for c in turn.get("tool_calls", ())
        ]
        if turn["role"] == "tool":
            turn = {"role": "user", "content": f"<tool_response>\n{turn['content']}\n</tool_response>"}
        elif calls:
            turn = {"role": "assistant", "content": "\n".join(([turn["content"]] if turn["content"] else []) + calls)}
        out.append(turn)
    return out


def template_kwargs(body: dict) -> dict:
    """`chat_template_kwargs` (e.g. `enable_thinking`), passed to the chat template."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise APIError("'chat_template_kwargs' must be an object", param="chat_template_kwargs", code="invalid_type")
    taken = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if taken:
        raise APIError(f"'chat_template_kwargs' cannot set {', '.join(taken)}", param="chat_template_kwargs")
    return kwargs


def chat_prompt(
    body: dict,
    tokenizer: Any,
    system: Optional[str] = None,
    roles: dict = ROLES,
    tools: Sequence[dict] = (),
    messages: Optional[list] = None,
    kwargs: Optional[dict] = None,
) -> list[int]:
    """The templated prompt of `messages` (default `body["messages"]`), after a `system`
    message if given, offering `tools`: to the template where it takes tools (it names
    `tools`), else as a system message (`tool_prompt`) with the tool turns in plain text.
    `kwargs` (default `template_kwargs(body)`) go to the template."""
    messages = body.get("messages") if messages is None else messages
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list", param="messages", code="invalid_type")
    turns = [{"role": "system", "content": system}] if system else []
    turns += [_content(m, i, roles) for i, m in enumerate(messages)]
    kwargs = dict(template_kwargs(body) if kwargs is None else kwargs)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and "tools" in template:
        kwargs["tools"] = list(tools) or None
    else:
        turns = _plain_turns(turns, tool_format(tokenizer))
        if tools:
            offer = tool_prompt(tools, tool_format(tokenizer))
            head = turns[0]["content"] + "\n\n" if turns[0]["role"] == "system" else ""
            turns = [{"role": "system", "content": head + offer}] + turns[bool(head) :]
    try:
        return list(apply_chat_template(tokenizer, turns, **kwargs))
    except (TemplateError, TypeError, KeyError) as exc:
        raise APIError(f"the chat template refused these messages: {exc}", param="messages") from None


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
    """The request's `max_tokens` (or `max_completion_tokens`); the prompt and it must fit
    the context (a 400 otherwise). Absent (unless `required`): the server's default,
    cut to the context left after the prompt."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = _integer(body, name)
    if value is None and required:
        raise APIError(f"'{name}' is required", param=name, code="missing_field")
    asked = value is not None
    if not asked:
        value = info.default_max_tokens
    elif not 1 <= value <= info.context_length:
        raise APIError(f"'{name}' must be between 1 and {info.context_length}; got {value}", param=name)
    if prompt_tokens >= info.context_length or (asked and prompt_tokens + value > info.context_length):
        tail = f" and '{name}' {value}" if asked else ""
        raise APIError(
            f"the prompt is {prompt_tokens} tokens{tail}; this model's context is {info.context_length}",
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


def reply_format(tokenizer: Any, prompt: Sequence[int], tools: Sequence[dict]) -> dict:
    """The `CompletionRequest` fields that say how to split a chat reply: the tools
    offered and how the model calls them, the think markers, and whether the prompt
    ends inside an opened reasoning (templates that start the thinking themselves)."""
    think = think_markers(tokenizer)
    thinking = False
    if think:
        tail = tokenizer.decode(list(prompt[-64:]))
        thinking = tail.rfind(think[0]) > tail.rfind(think[1])
    return {"tools": tuple(tools), "tool_format": tool_format(tokenizer), "think": think, "thinking": thinking}


def parse_request(body: Any, info: ModelInfo, *, chat: bool) -> CompletionRequest:
    """Check a decoded JSON body and tokenize its prompt. Raises `APIError`."""
    body = check_body(body, info)
    _refuse_unsupported(body)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise APIError("'stream_options' must be an object", param="stream_options", code="invalid_type")
    tools = _offered_tools(body, chat)
    prompt = chat_prompt(body, info.tokenizer, tools=tools) if chat else _text_prompt(body, info.tokenizer)
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
        **(reply_format(info.tokenizer, prompt, tools) if chat else {}),
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


def split_reply(req: CompletionRequest, text: str) -> tuple[list[Piece], bool]:
    """The pieces of a whole reply (all text where `req` does not split), and whether it called a tool."""
    splitter = req.splitter()
    if splitter is None:
        return [Piece("text", text)], False
    return splitter.feed(text) + splitter.close(), splitter.calls > 0


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
