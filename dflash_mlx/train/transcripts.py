"""The user's own conversations on disk, in the formats that write them, read back as prompts.

Two formats are written here and read here, so that each has one home:

- **chat transcripts**: what the chat's `/save` writes (`transcript_markdown`), Markdown::

      # dflash-chat transcript

      Model: M · drafter: D

      **System:** S            (only with a system prompt)

      ### You

      the user's message

      ### Assistant

      the reply

      *12 tokens · 30.1 tok/s · ...*   (the reply's summary line)

- **conversation logs**: what a server keeping its conversations appends to
  ``conversations-YYYYMMDD.jsonl`` files, one JSON record a line (`conversation_log_record`,
  `append_conversation_log`; read by `read_conversation_log`)::

      {"time": "2025-06-01T12:00:00Z", "model": "M", "messages": [{"role": "user", "content": "..."}], "reply": "..."}

  `messages` is the request's conversation as the chat template receives it (contents are
  strings), `reply` the answer sent back. A client sends the whole conversation with every
  request, so one conversation is several records, each extending the one before.

`read_conversations` reads either (directories of them, or files; any other file is a
prompt file, `messages.read_prompt_file`) as `Conversation`s: every user turn, with all
that came before it, is a prompt the target answers (`dflash adapt`).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..messages import read_prompt_file

TITLE = "# dflash-chat transcript"
HEADINGS = {"you": "### You", "assistant": "### Assistant"}
_ROLES = {"### You": "user", "### Assistant": "assistant"}
_SYSTEM = "**System:** "
_SUMMARY = re.compile(r"^\*\d+ tokens · .*\*$")  # `summary_line` in the chat's widgets, in italics
LOG_PREFIX = "conversations-"  # log files: conversations-YYYYMMDD.jsonl
_TEXT_ROLES = ("system", "user", "assistant")


def transcript_markdown(
    entries: Sequence[tuple[str, str]], model: Optional[str], draft: Optional[str], system: Optional[str]
) -> str:
    """A chat transcript as Markdown (see the module docstring) from ``(kind, text)``
    entries: "you", "assistant", or "summary" (a reply's summary line)."""
    out = [TITLE, "", f"Model: {model or 'none'} · drafter: {draft or 'none'}", ""]
    if system:
        out += [f"{_SYSTEM}{system}", ""]
    for kind, text in entries:
        if kind in HEADINGS:
            out += [HEADINGS[kind], "", text.strip(), ""]
        else:  # a reply's summary line
            out += [f"*{text}*", ""]
    return "\n".join(out)


def read_transcript(path: str | Path) -> list[dict]:
    """The messages of a chat transcript (`transcript_markdown`): the system prompt if any,
    then the user's and the assistant's turns, summary lines left out. Raises a one-line
    ValueError when the file is no transcript."""
    path = Path(path)
    lines = _text(path).splitlines()
    if not lines or lines[0].strip() != TITLE:
        raise ValueError(f"{path}: not a dflash-chat transcript (its first line is not {TITLE!r})")
    messages: list[dict] = []
    system: list[str] = []
    body: Optional[list[str]] = None
    for line in lines[1:]:
        if line.strip() in _ROLES:
            body = []
            messages.append({"role": _ROLES[line.strip()], "content": body})
        elif body is not None:
            body.append(line)
        elif line.startswith(_SYSTEM) or system:
            system.append(line.removeprefix(_SYSTEM))
    for m in messages:
        paragraphs = "\n".join(m["content"]).strip().split("\n\n")
        if m["role"] == "assistant" and _SUMMARY.match(paragraphs[-1].strip()):
            paragraphs.pop()
        m["content"] = "\n\n".join(paragraphs).strip()
    head = [{"role": "system", "content": "\n".join(system).strip()}] if "".join(system).strip() else []
    return head + [m for m in messages if m["content"]]


def read_conversation_log(path: str | Path) -> list[list[dict]]:
    """The requests' message lists of a conversation log, in order. A last line that does
    not end in a newline (still being written, or torn by a crash) is left out; any other
    bad line is refused in one line naming it."""
    path = Path(path)
    text = _text(path)
    out = []
    for i, line in enumerate(text[: text.rfind("\n") + 1].splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i + 1}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
            raise ValueError(f"{path}:{i + 1}: a conversation log record needs a 'messages' list")
        out.append(record["messages"])
    return out


def conversation_log_record(messages: Sequence[dict], reply: str, model: Optional[str]) -> dict:
    """One conversation log record (see the module docstring): a request's messages and the reply."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {"time": stamp, "model": model or "default", "messages": list(messages), "reply": reply}


def append_conversation_log(directory: str | Path, record: dict) -> Path:
    """Append `record` to today's log file in `directory` (created if missing), one line,
    one write: a reader skips a line torn by a crash. Returns the file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{LOG_PREFIX}{time.strftime('%Y%m%d', time.gmtime())}.jsonl"
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


@dataclass(frozen=True)
class Conversation:
    """One conversation: `key` (a digest of its first prompt), `kind` ("transcript", "log" or
    "prompts") and its `prompts`, message lists that each end at a user turn, every earlier
    turn before it."""

    key: str
    kind: str
    prompts: tuple[tuple[dict, ...], ...]


def prompt_id(messages: Sequence[dict]) -> str:
    """A prompt's id: a digest of its messages (the same text keeps its id wherever it is read)."""
    return hashlib.sha256(json.dumps(list(messages), sort_keys=True).encode()).hexdigest()[:16]


def user_turn_prompts(messages: Sequence[dict]) -> list[tuple[dict, ...]]:
    """Every prefix of `messages` that ends at a user turn; none past a message that is not
    plain text (a tool call, a list of content parts), which the chat template may not take."""
    out: list[tuple[dict, ...]] = []
    for i, m in enumerate(messages):
        if m.get("role") not in _TEXT_ROLES or not isinstance(m.get("content"), str):
            break
        if m["role"] == "user" and m["content"].strip():
            out.append(tuple({"role": x["role"], "content": x["content"]} for x in messages[: i + 1]))
    return out


def read_conversations(sources: Sequence[str | Path]) -> list[Conversation]:
    """The conversations of `sources`, each a directory of chat transcripts (``*.md``),
    conversation logs (``conversations-*.jsonl``) and prompt files (other ``*.jsonl``), or
    one such file (any other file is a prompt file too: `read_prompt_file`). A log's or a
    prompt file's record that extends an earlier one (a conversation's later request) joins
    its conversation. A prompt seen before, in any source, is left out. Raises a one-line
    error naming SOURCE when one is missing or holds no conversation."""
    groups: list[list[tuple[dict, ...]]] = []
    kinds: list[str] = []
    for source in sources:
        path = Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"SOURCE {source}: no such file or directory")
        files = sorted(p for p in path.iterdir() if p.suffix in (".md", ".jsonl")) if path.is_dir() else [path]
        before = len(groups)
        for file in files:
            if file.suffix == ".md":
                groups.append(user_turn_prompts(read_transcript(file)))
                kinds.append("transcript")
            elif file.name.startswith(LOG_PREFIX) and file.suffix == ".jsonl":
                _join_records(groups, kinds, read_conversation_log(file), "log")
            else:
                _join_records(groups, kinds, [r["messages"] for r in read_prompt_file(file)], "prompts")
        if not any(groups[before:]):
            what = "chat transcripts (*.md) or conversation logs (*.jsonl)" if path.is_dir() else "prompts"
            raise ValueError(f"SOURCE {source}: no conversations in it (expected {what})")
    seen: set[str] = set()
    out = []
    for prompts, kind in zip(groups, kinds):
        fresh = []
        for p in prompts:
            if prompt_id(p) not in seen:
                seen.add(prompt_id(p))
                fresh.append(p)
        if fresh:
            out.append(Conversation(prompt_id(fresh[0]), kind, tuple(fresh)))
    return out


def _join_records(groups: list[list[tuple[dict, ...]]], kinds: list[str], records: list[list[dict]], kind: str) -> None:
    """Add a file's records (message lists) to `groups`: a record whose messages extend an
    earlier record's joins that record's group; any other starts a group of `kind`."""
    ends: dict[str, int] = {}  # prompt id -> its group
    for messages in records:
        prompts = user_turn_prompts(messages)
        home = next((ends[prompt_id(p)] for p in prompts[:-1] if prompt_id(p) in ends), None)
        if home is None:
            groups.append([])
            kinds.append(kind)
            home = len(groups) - 1
        for p in prompts:
            ends.setdefault(prompt_id(p), home)
            groups[home].append(p)


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file") from None
