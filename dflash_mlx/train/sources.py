"""The prompt sources `dflash data --source` names, and reading them.

The first sources (`prompts`: ``chat``, ``math``, ``stdlib``, ``humaneval``) wrote the
data the shipped drafter trained on; round 6's (``round6-chat``, ``round6-math``,
``round6-stdlib``, ``round6-code``, or all four as ``round6``) write more of the same
kinds, passed through `fresh_prompts.fresh` against the shipped held-out prompts and the
first sources' prompts at seed 0 (those the committed answers answered, whatever seed
round 6 runs at). Anything else is a prompt file (`read_prompt_file`: JSONL prompts or
chat transcripts, or plain text, one prompt a line).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from ..messages import read_prompt_file, read_prompt_sources
from .code_prompts import round6_code
from .fresh_prompts import fresh, round6_chat, round6_math, round6_stdlib
from .prompts import chat_prompts, humaneval_prompts, math_prompts, stdlib_prompts

__all__ = ["BUILTIN_SOURCES", "ROUND6_SOURCES", "collect_prompts"]

#: The first sources, by name: a function of the seed each.
BUILTIN_SOURCES: dict[str, Callable[[int], list[dict]]] = {
    "humaneval": lambda seed: humaneval_prompts(),
    "stdlib": lambda seed: stdlib_prompts(seed),
    "math": lambda seed: math_prompts(1500, seed),
    "chat": lambda seed: chat_prompts(800, seed),
}
#: Round 6's sources, by name, before `fresh` filters them.
ROUND6_SOURCES: dict[str, Callable[[int], list[dict]]] = {
    "round6-chat": lambda seed: round6_chat(1800, seed),
    "round6-math": lambda seed: round6_math(1100, seed),
    "round6-stdlib": lambda seed: round6_stdlib(1100, seed),
    "round6-code": round6_code,
}


def collect_prompts(sources: Sequence[str], seed: int = 0) -> list[dict]:
    """Prompts from source names (`BUILTIN_SOURCES`, `ROUND6_SOURCES`, ``round6`` for all
    of those) and/or prompt files, in the order named."""
    out: list[dict] = []
    for s in sources:
        if s in BUILTIN_SOURCES:
            out.extend(BUILTIN_SOURCES[s](seed))
        elif s in ROUND6_SOURCES or s == "round6":
            out.extend(round6_prompts(list(ROUND6_SOURCES) if s == "round6" else [s], seed))
        elif Path(s).is_file():
            out.extend(read_prompt_file(s))
        else:
            known = ", ".join([*BUILTIN_SOURCES, *ROUND6_SOURCES, "round6"])
            raise ValueError(f"--source: unknown prompt source {s!r} (built-in: {known}; or a JSONL file)")
    return out


def round6_prompts(names: Sequence[str], seed: int = 0) -> list[dict]:
    """Round 6's sources `names`, less any prompt `fresh` keeps out: near a shipped
    held-out prompt or about its subject, or written by a first source at seed 0."""
    earlier = [p for f in BUILTIN_SOURCES.values() for p in _available(f)]
    return fresh((p for name in names for p in ROUND6_SOURCES[name](seed)), read_prompt_sources(["heldout"]), earlier)


def _available(source: Callable[[int], list[dict]]) -> list[dict]:
    """A first source's prompts at seed 0; none where its package is missing (humaneval)."""
    try:
        return source(0)
    except RuntimeError:
        return []
