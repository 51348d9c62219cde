"""The chat session as data: the messages the model sees, the transcript `/save` writes and
the running totals `/stats` reports. No widgets and no engine here, so the rules (what a
stopped reply leaves behind, how tau adds up over replies) read in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_mlx import tau
from dflash_mlx.train.transcripts import transcript_markdown

from .engine import Snapshot
from .widgets import summary_line


def shape(width: str, n: int) -> str:
    """`n` cycles of one `GenerationStats.widths` key: "52 chains of 8 tokens", "1 tree of 16 nodes"."""
    kind, _, size = width.partition(" ")
    plural = "" if n == 1 else "s"
    if not size:  # a plain step: the target alone, one token
        return f"{n} {kind} step{plural}"
    return f"{n} {kind}{plural} of {size} {'tokens' if kind == 'chain' else 'nodes'}"


@dataclass
class Totals:
    """Sums over every finished reply of the session."""

    replies: int = 0
    tokens: int = 0
    cycles: int = 0
    committed: int = 0  # tokens committed by draft/verify cycles
    drafted: int = 0
    accepted: int = 0

    def add(self, s: Snapshot) -> None:
        """Count one finished reply (its draft numbers only when it used the drafter)."""
        self.replies += 1
        self.tokens += s.generation_tokens
        if not s.baseline:
            self.cycles += s.cycles
            self.committed += s.committed
            self.drafted += s.drafted_tokens
            self.accepted += s.accepted_drafted_tokens

    def line(self) -> str:
        """The session line of `/stats`."""
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return (
            f"Session: {self.replies} replies, {self.tokens} tokens, τ {tau(self.committed, self.cycles):.2f} over "
            f"{self.cycles} blocks, drafted {self.drafted}, accepted {self.accepted} ({rate:.0%})"
        )


@dataclass
class Session:
    """One conversation: `messages` (without the system prompt) and the `log` of
    ``(kind, text)`` entries (you, assistant, summary) for the transcript: the conversation
    only, none of the app's notes or commands."""

    messages: list[dict] = field(default_factory=list)
    log: list[tuple[str, str]] = field(default_factory=list)
    totals: Totals = field(default_factory=Totals)

    def ask(self, text: str) -> None:
        """Add the user's message."""
        self.messages.append({"role": "user", "content": text})
        self.log.append(("you", text))

    def answer(self, text: str) -> None:
        """Add the assistant's reply."""
        self.messages.append({"role": "assistant", "content": text})
        self.log.append(("assistant", text))

    def drop_unanswered(self) -> None:
        """Forget a question that got no answer, so the history keeps alternating."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()

    def retract(self) -> bool:
        """Forget the last answer and its summary (`/regenerate`); False if the last message is no answer."""
        if not self.messages or self.messages[-1]["role"] != "assistant":
            return False
        self.messages.pop()
        while self.log and self.log.pop()[0] != "assistant":
            pass
        return True

    def clear(self) -> None:
        """Forget the conversation and its transcript (the totals stay)."""
        self.messages.clear()
        self.log.clear()

    def stats(self, last: Snapshot | None, header: list[str]) -> str:
        """The `/stats` text: `header` lines, the last reply, the session totals."""
        lines = list(header)
        if last is not None:
            lines.append("Last reply: " + summary_line(last, ""))
            if last.accepted_lengths and not last.baseline:
                tail = " ".join(map(str, last.accepted_lengths[-24:]))
                lines.append(f"Accepted per block (last {min(24, len(last.accepted_lengths))}): {tail}")
            if last.widths and not last.baseline:
                lines.append("Cycles verified: " + ", ".join(shape(width, n) for width, n in last.widths))
        lines.append(self.totals.line())
        return "\n".join(lines)

    def markdown(self, model: str | None, draft: str | None, system: str | None) -> str:
        """The transcript as Markdown (what `/save` writes; its format: `transcript_markdown`)."""
        return transcript_markdown(self.log, model, draft, system)
