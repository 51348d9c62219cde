"""Chat messages: built from a prompt, read from prompt files, turned into model input.

The CLI, the chat, the benchmark, data generation and evaluation all start from a list
of ``{"role", "content"}`` messages. This module is the one place that reads them from a
file and the one place that applies the tokenizer's chat template (opening the
assistant's turn), with the same fallback for tokenizers that have no template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = [
    "HELDOUT_SETS",
    "apply_chat_template",
    "prompt_kind",
    "read_prompt_file",
    "read_prompt_sources",
    "user_messages",
]

#: Names of the shipped held-out prompt sets (``assets/prompts/heldout_<name>.jsonl``;
#: "heldout": all of them, 10 of each kind).
HELDOUT_SETS = ("heldout", "chat", "code", "math", "stdlib")

_TEXT_FIELDS = ("prompt", "text", "question")


def user_messages(prompt: str, system: Optional[str] = None) -> list[dict]:
    """``[system?, user]`` messages for a single prompt."""
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": prompt}]


def apply_chat_template(
    tokenizer: Any,
    messages: Sequence[dict],
    *,
    tokenize: bool = True,
    continue_final: bool = False,
    **template_kwargs: Any,
) -> list[int] | str:
    """The generation prompt for `messages`: the tokenizer's chat template with the
    assistant's turn opened (``continue_final``: the last message, an assistant's, left
    open to go on from), as token ids (or text with ``tokenize=False``);
    `template_kwargs` (``tools``, ``enable_thinking``, ...) go to the template. A tokenizer
    without a template gets the messages' contents joined by newlines."""
    if getattr(tokenizer, "chat_template", None):
        turn = {"continue_final_message": True} if continue_final else {"add_generation_prompt": True}
        out = tokenizer.apply_chat_template(list(messages), tokenize=tokenize, **turn, **template_kwargs)
        if isinstance(out, dict):  # some tokenizers return a BatchEncoding
            out = out["input_ids"]
        return out if isinstance(out, str) else list(out)
    text = "\n".join(m["content"] for m in messages)
    return list(tokenizer.encode(text)) if tokenize else text


def _record_messages(rec: dict, where: str) -> list[dict]:
    if "messages" in rec:
        msgs = list(rec["messages"])
        last_user = max((j for j, m in enumerate(msgs) if m.get("role") == "user"), default=None)
        if last_user is None:
            raise ValueError(f"{where}: transcript has no user turn")
        return msgs[: last_user + 1]
    text = next((rec[k] for k in _TEXT_FIELDS if k in rec), None)
    if text is None:
        raise ValueError(f"{where}: need 'prompt', 'text', 'question' or 'messages'")
    return user_messages(str(text))


def prompt_kind(record: dict) -> str:
    """The kind a prompt record is reported under: its `set`, else its `source`."""
    return str(record.get("set", record.get("source", "prompts")))


def read_prompt_file(path: str | Path) -> list[dict]:
    """Prompts from a file, as ``{"id", "source", "set", "messages"}`` records.

    A JSONL file holds one record a line: ``{"prompt" | "text" | "question": ...}``, a
    JSON string, or ``{"messages": [...]}`` (a chat transcript: the prompt is everything
    up to and including its last user turn); `id`, `source` (where the prompt came from)
    and `set` (its kind, which bench and eval report by) are kept when present, else they
    default to ``<file stem>/<line>``, the file stem and the source. Any other file holds
    one plain-text prompt a line. Raises a one-line ValueError naming the file (and the
    line) when it is not UTF-8 text or a line is bad.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file") from None
    lines = [(i, line) for i, line in enumerate(text.splitlines()) if line.strip()]
    jsonl = bool(lines) and lines[0][1].lstrip().startswith(("{", '"'))
    if path.suffix == ".jsonl" and lines and not jsonl:
        raise ValueError(f"{path}:{lines[0][0] + 1}: not valid JSON (a .jsonl file holds one JSON record a line)")
    out = []
    for i, line in lines:
        where = f"{path}:{i + 1}"
        if jsonl:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        else:
            rec = line
        if isinstance(rec, str):
            rec = {"prompt": rec}
        source = str(rec.get("source", rec.get("set", path.stem)))
        out.append(
            {
                "id": str(rec.get("id", f"{path.stem}/{i}")),
                "source": source,
                "set": str(rec.get("set", source)),
                "messages": _record_messages(rec, where),
            }
        )
    return out


def read_prompt_sources(sources: Sequence[str]) -> list[dict]:
    """Prompt records (`read_prompt_file`) from files and/or names of the shipped held-out
    sets (`HELDOUT_SETS`: the prompts `dflash bench` and `dflash eval` measure on, never
    trained on). Raises a one-line ValueError for a source that is neither, or no prompts."""
    from .defaults import shipped_asset

    out = []
    for source in sources:
        if source in HELDOUT_SETS and not Path(source).exists():
            name = "heldout" if source == "heldout" else f"heldout_{source}"
            source = shipped_asset("prompts") / f"{name}.jsonl"
        elif not Path(source).is_file():
            raise ValueError(f"prompts: {source!r} is neither a file nor a held-out set ({', '.join(HELDOUT_SETS)})")
        out.extend(read_prompt_file(source))
    if not out:
        raise ValueError(f"prompts: no prompts in {', '.join(map(str, sources))}")
    return out
