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

__all__ = ["apply_chat_template", "read_prompt_file", "user_messages"]

_TEXT_FIELDS = ("prompt", "text", "question")


def user_messages(prompt: str, system: Optional[str] = None) -> list[dict]:
    """``[system?, user]`` messages for a single prompt."""
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": prompt}]


def apply_chat_template(tokenizer: Any, messages: Sequence[dict], *, tokenize: bool = True) -> list[int] | str:
    """The generation prompt for `messages`: the tokenizer's chat template with the
    assistant's turn opened, as token ids (or text with ``tokenize=False``). A tokenizer
    without a template gets the messages' contents joined by newlines."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=tokenize)
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


def read_prompt_file(path: str | Path) -> list[dict]:
    """Prompts from a file, as ``{"id", "source", "messages"}`` records.

    A JSONL file holds one record a line: ``{"prompt" | "text" | "question": ...}``, a
    JSON string, or ``{"messages": [...]}`` (a chat transcript: the prompt is everything
    up to and including its last user turn); `id` and `source` (or `set`: the prompt's
    kind) are kept when present, else they default to ``<file stem>/<line>`` and the
    file stem. Any other file holds
    one plain-text prompt a line. Raises a one-line ValueError naming a bad line.
    """
    path = Path(path)
    lines = [(i, line) for i, line in enumerate(path.read_text().splitlines()) if line.strip()]
    jsonl = bool(lines) and lines[0][1].lstrip().startswith(("{", '"'))
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
        out.append(
            {
                "id": str(rec.get("id", f"{path.stem}/{i}")),
                "source": str(rec.get("source", rec.get("set", path.stem))),
                "messages": _record_messages(rec, where),
            }
        )
    return out
