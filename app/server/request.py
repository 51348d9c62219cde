"""A checked request, whatever its wire format: `CompletionRequest`, what the worker decodes,
and the checks of the fields OpenAI's and Anthropic's formats share.

Every request is checked before it is queued, so that a bad one costs the worker nothing
and gets a 4xx (`APIError`) naming the field at fault. The wire formats (`openai_api`,
`anthropic_api`) parse their bodies with these checks and `prompts`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from app.server.output import OutputSplitter, Piece, ToolFormat
from dflash_mlx import DecodeOptions, OptionError

__all__ = [
    "APIError",
    "CompletionRequest",
    "ModelInfo",
    "check_body",
    "decode_options",
    "flag",
    "integer",
    "split_reply",
    "stop_strings",
    "token_budget",
]

#: Request fields by `DecodeOptions` field, where OpenAI names them differently.
API_NAMES = {"temp": "temperature"}
#: OpenAI's upper bound on `temperature` (Anthropic's is 1, `anthropic_api`): above it the text is noise.
MAX_TEMPERATURE = 2.0
MAX_STOP = 16


class APIError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, *, status: int = 400, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @property
    def kind(self) -> str:
        """OpenAI's error `type`: the client's fault (4xx) or the server's."""
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
    options: DecodeOptions = DecodeOptions()  # the server's own (its decoding flags); requests add sampling


@dataclass
class CompletionRequest:
    """One checked request, ready for the worker."""

    chat: bool  # a chat (/v1/chat/completions, /v1/messages), else a text completion (/v1/completions)
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
    messages: tuple = ()  # a chat's text turns (`prompts.conversation`), for --keep-conversations

    def splitter(self) -> Optional[OutputSplitter]:
        """A fresh splitter of this reply into text, reasoning and tool calls; None where
        the reply is all text (no tools offered, a template that does not think)."""
        if not self.tools and not self.think:
            return None
        return OutputSplitter(self.tools, self.tool_format, self.think, self.thinking)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(f"'{name}' must be a number", param=name, code="invalid_type")
    return float(value)


def integer(body: dict, name: str) -> Optional[int]:
    """An integer field (absent: None; a whole float such as 5.0 is taken)."""
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


def stop_strings(body: dict, name: str = "stop", *, lone: bool = True) -> list[str]:
    """The stop strings in field `name`: a list of strings or, where `lone` (OpenAI's
    `stop`; Anthropic's `stop_sequences` is a list only), one string."""
    value = body.get(name)
    stops = [] if value is None else [value] if lone and isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        kind = "a string or a list of strings" if lone else "a list of strings"
        raise APIError(f"'{name}' must be {kind}", param=name, code="invalid_type")
    if len(stops) > MAX_STOP:
        raise APIError(f"'{name}' takes at most {MAX_STOP} strings", param=name)
    return [s for s in stops if s]


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


def token_budget(body: dict, info: ModelInfo, prompt_tokens: int, *, required: bool = False) -> int:
    """The request's `max_tokens` (or `max_completion_tokens`); the prompt and it must fit
    the context (a 400 otherwise). Absent (unless `required`): the server's default,
    cut to the context left after the prompt."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = integer(body, name)
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


def decode_options(body: dict, server: DecodeOptions, max_temperature: float = MAX_TEMPERATURE) -> DecodeOptions:
    """The server's options with the request's sampling fields (OpenAI's and Anthropic's
    defaults: temperature 1, at most `max_temperature`, the API's own bound; top_k -1
    means off; any seed is taken modulo 2**63)."""
    top_k, seed, temp = integer(body, "top_k"), integer(body, "seed"), _number(body, "temperature", 1.0)
    if temp > max_temperature:
        raise APIError(f"'temperature' must be at most {max_temperature:g}, got {temp:g}", param="temperature")
    sampling = dict(
        temp=temp,
        top_p=_number(body, "top_p", 1.0),
        top_k=0 if top_k in (None, -1) else top_k,
        seed=None if seed is None else seed % 2**63,
    )
    try:
        return replace(server, **sampling)
    except OptionError as e:  # checked where every front end's options are
        name = API_NAMES.get(e.field, e.field)
        raise APIError(e.named(f"'{name}'"), param=name) from None


def split_reply(req: CompletionRequest, text: str) -> tuple[list[Piece], bool]:
    """The pieces of a whole reply (all text where `req` does not split), and whether it called a tool."""
    splitter = req.splitter()
    if splitter is None:
        return [Piece("text", text)], False
    return splitter.feed(text) + splitter.close(), splitter.calls > 0
