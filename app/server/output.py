"""What a reply is made of: its text, its reasoning (`<think>...</think>`) and its tool calls.

The model writes one stream of text; clients want it apart. `OutputSplitter` reads that
text as it arrives (in pieces of any size) and hands back `Piece`s of three kinds:
plain text, reasoning (between the template's think markers), and tool calls (between
the tool parser's markers, parsed by mlx-lm's own parser from `mlx_lm.tool_parsers`).
Text that could still be the start of a marker is held back until the next piece
decides it, so a stream splits exactly as the whole text does. A tool call that does
not parse, or names a function the request did not offer, stays text: text that only
looks like a call is text. Whitespace between a structure and the next one (the
newline after `</tool_call>`, the blank line after `</think>`) is dropped.

`ToolFormat` is how a model writes its calls: the tokenizer's own parser where mlx-lm
found one for it (`tokenizer_utils.load` reads `tool_parser_type` from the tokenizer's
config, else infers it from the chat template), else mlx-lm's `json_tools`
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), the format `tool_prompt`
teaches a model whose template has no tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from mlx_lm.tool_parsers import json_tools

__all__ = ["Piece", "OutputSplitter", "ToolFormat", "think_markers", "tool_format", "tool_prompt"]

#: The think markers of templates that think, when the tokenizer does not name its own.
THINK = ("<think>", "</think>")
#: What a parser raises on text it cannot read (mlx-lm's server catches the first two).
PARSE_ERRORS = (ValueError, json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError)


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls: between `start` and `end` (`end` empty: to the end
    of the reply), read by `parse(text, tools)` into `{"name", "arguments"}` (or a list)."""

    start: str
    end: str
    parse: Callable[[str, Any], Any]


def tool_format(tokenizer: Any) -> ToolFormat:
    """The tokenizer's own tool format (mlx-lm's `TokenizerWrapper.tool_parser`), else `json_tools`'."""
    parser = getattr(tokenizer, "tool_parser", None)
    if parser is not None:
        return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end or "", parser)
    return ToolFormat(json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call)


def think_markers(tokenizer: Any) -> Optional[tuple[str, str]]:
    """(start, end) of the reasoning of a model that thinks, or None: mlx-lm's markers for
    the tokenizer's vocabulary, else `<think>` / `</think>` if the chat template writes them."""
    if getattr(tokenizer, "has_thinking", False):
        return tokenizer.think_start, tokenizer.think_end
    template = getattr(tokenizer, "chat_template", None)
    return THINK if isinstance(template, str) and THINK[1] in template else None


def tool_prompt(tools: Sequence[dict], fmt: ToolFormat) -> str:
    """The system message that offers `tools` (OpenAI's function shape) to a model whose
    template takes none, and shows it how to call them."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    example = json.dumps({"name": "<function name>", "arguments": {"<parameter>": "<value>"}})
    return (
        "You may call one or more functions to help with the user's request. "
        f"The functions, as JSON schemas:\n{listed}\n"
        f"To call a function, reply with {fmt.start}{example}{fmt.end} (one per call) and nothing else; "
        "the result comes back in a tool message."
    )


@dataclass(frozen=True)
class Piece:
    """A part of the reply: kind "text" or "reasoning" with its `text`, or kind "tool"
    with a parsed `call` (`{"index", "id", "name", "arguments"}`, arguments as a JSON string)."""

    kind: str
    text: str = ""
    call: Optional[dict] = None


def _held(buf: str, markers: Sequence[str]) -> int:
    """How many characters at the end of `buf` could begin one of `markers`."""
    lengths = (n for m in markers for n in range(min(len(m) - 1, len(buf)), 0, -1) if m.startswith(buf[-n:]))
    return max(lengths, default=0)


@dataclass
class OutputSplitter:
    """Splits a reply's text into `Piece`s as it arrives; see the module docstring.

    Args:
        tools: the tools offered (OpenAI's shape); empty: tool calls are not looked for.
        fmt: how the model writes tool calls.
        think: the think markers, or None.
        thinking: whether the reply starts inside the reasoning (the prompt opened it).
    """

    tools: Sequence[dict] = ()
    fmt: Optional[ToolFormat] = None
    think: Optional[tuple[str, str]] = None
    thinking: bool = False
    buf: str = ""
    mode: str = "text"
    structured: bool = False  # a structure (reasoning or a call) came before the text in `buf`
    calls: int = 0
    names: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.mode = "reasoning" if self.think and self.thinking else "text"
        self.names = {t["function"]["name"] for t in self.tools}

    def _openers(self) -> list[tuple[str, str]]:
        pairs = [(self.think[0], "reasoning")] if self.think else []
        return pairs + ([(self.fmt.start, "tool")] if self.tools and self.fmt else [])

    def feed(self, text: str) -> list[Piece]:
        """The pieces `text` completes (text that could begin a marker waits)."""
        self.buf += text
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def close(self) -> list[Piece]:
        """The pieces left at the end of the reply (an unclosed call is parsed as it stands)."""
        out: list[Piece] = []
        buf, self.buf = self.buf, ""
        if self.mode == "tool":
            out += self._call(buf, closed=False)
        elif self.mode == "reasoning":
            out += [Piece("reasoning", buf)] if buf else []
        else:
            self._text(buf, out, final=True)
        return out

    def _text(self, text: str, out: list[Piece], final: bool) -> None:
        """Emit plain text (not whitespace alone but at the end, where none came after a structure)."""
        if self.structured:
            text = text.lstrip()
        if text and (text.strip() or (final and not self.structured)):
            out.append(Piece("text", text))
            self.structured = False

    def _step(self, out: list[Piece]) -> bool:
        """Move one marker forward in `buf`; False when `buf` needs more text."""
        if self.mode == "text":
            found = [(self.buf.find(m), m, mode) for m, mode in self._openers() if m in self.buf]
            if not found:
                keep = _held(self.buf, [m for m, _ in self._openers()])
                head = self.buf[: len(self.buf) - keep].rstrip()  # trailing whitespace waits too
                if head:
                    self._text(head, out, final=False)
                    self.buf = self.buf[len(head) :]
                return False
            at, marker, mode = min(found)
            self._text(self.buf[:at].rstrip(), out, final=False)
            self.buf, self.mode = self.buf[at + len(marker) :], mode
            return True
        end = self.think[1] if self.mode == "reasoning" else self.fmt.end
        if not end or end not in self.buf:
            if self.mode == "reasoning":
                keep = _held(self.buf, [end])
                if len(self.buf) > keep:
                    out.append(Piece("reasoning", self.buf[: len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep :]
            return False
        at = self.buf.index(end)
        body, self.buf = self.buf[:at], self.buf[at + len(end) :]
        if self.mode == "reasoning":
            out += [Piece("reasoning", body)] if body else []
            self.structured = True
        else:
            out += self._call(body, closed=True)
        self.mode = "text"
        return True

    def _call(self, body: str, closed: bool) -> list[Piece]:
        """The tool calls in `body`, or `body` (with its markers) as text if it is none."""
        parsed = _parse(self.fmt, body, self.tools)
        if parsed is None or any(c["name"] not in self.names for c in parsed):
            raw = self.fmt.start + body + (self.fmt.end if closed else "")
            self.structured = False
            return [Piece("text", raw)]
        self.structured = True
        pieces = [Piece("tool", call=_call_dict(c, self.calls + k)) for k, c in enumerate(parsed)]
        self.calls += len(parsed)
        return pieces


def _parse(fmt: ToolFormat, body: str, tools: Sequence[dict]) -> Optional[list[dict]]:
    """`fmt.parse`'s calls in `body` as a list, or None where it reads none."""
    try:
        parsed = fmt.parse(body, list(tools))
    except PARSE_ERRORS:
        return None
    parsed = parsed if isinstance(parsed, list) else [parsed]
    ok = all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in parsed)
    return parsed if parsed and ok else None


def _call_dict(call: dict, index: int) -> dict:
    """A parsed call with its place among the reply's calls, an id, and its arguments
    as a JSON string (OpenAI's shape)."""
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    call_id = call.get("id") or "call_" + uuid.uuid4().hex[:24]
    return {"index": index, "id": call_id, "name": call["name"], "arguments": arguments}
