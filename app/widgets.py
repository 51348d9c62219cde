"""The chat's widgets and the text they show: a reply that streams Markdown (or colours
each token by where it came from), the live stats panel and the one-line summaries.

Nothing here talks to the engine; `chat.py` feeds these widgets the engine's snapshots.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Markdown, ProgressBar, Static

from .engine import Event, Snapshot

DRAFT_STYLE = "bold #5fd7af"  # tokens that came from accepted drafts
TARGET_STYLE = "#ffaf5f"  # tokens the target produced itself
BAR_CHARS = "▁▂▃▄▅▆▇█"


# --------------------------------------------------------------------------- formatting


def acceptance_bar(lengths: tuple[int, ...], block_size: int | None, width: int = 40) -> Text:
    """One character per block, as tall as the number of tokens that block committed."""
    top = max(block_size or 0, max(lengths, default=1), 1)
    bar = Text()
    for n in lengths[-width:]:
        frac = n / top
        level = min(len(BAR_CHARS) - 1, max(0, round(frac * (len(BAR_CHARS) - 1))))
        colour = "#5fd7af" if frac >= 0.5 else "#d7d75f" if frac >= 0.25 else "#ff875f"
        bar.append(BAR_CHARS[level], style=colour)
    return bar


def prompt_text(s: Snapshot) -> str:
    """Prompt tokens prefilled (and reused from the cache) and the prefill speed."""
    reused = f" (+{s.prompt_cached} reused)" if s.prompt_cached else ""
    return f"prompt {s.prefilled} tok{reused} @ {s.prompt_tps:.0f} tok/s"


def summary_line(s: Snapshot, reason: str) -> str:
    """The one line shown under each reply."""
    parts = [f"{s.generation_tokens} tokens", f"{s.generation_tps:.1f} tok/s"]
    if s.baseline:
        parts.append("baseline (target only)")
    else:
        parts.append(f"τ {s.mean_acceptance:.2f} over {s.cycles} blocks")
        parts.append(f"accepted {s.accepted_drafted_tokens}/{s.drafted_tokens} drafted ({s.acceptance_rate:.0%})")
    parts.append(prompt_text(s))
    parts.append(f"peak {s.peak_memory:.2f} GB")
    if reason == "stopped":
        parts.append("stopped")
    elif reason == "length":
        parts.append("hit max tokens")
    return " · ".join(parts)


# --------------------------------------------------------------------------- widgets


class EngineMessage(Message):
    """An engine event, carried from the worker thread to the UI thread."""

    def __init__(self, event: Event) -> None:
        super().__init__()
        self.event = event


class Note(Static):
    """A line from the app itself: info, error or a reply's summary."""


class UserMessage(Markdown):
    """A message the user sent."""


class Reply(Vertical):
    """An assistant reply: Markdown, or the raw text coloured by where tokens came from."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self._tinted = Text()
        self._stream = None

    def compose(self) -> ComposeResult:
        yield Markdown()
        yield Static(classes="tinted")

    async def add(self, text: str, from_draft: bool) -> None:
        self.text += text
        self._tinted.append(text, style=DRAFT_STYLE if from_draft else TARGET_STYLE)
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(text)
        self.query_one(".tinted", Static).update(self._tinted)

    async def finish(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None


class StatsPanel(Vertical):
    """Live numbers: speed, acceptance, the last blocks' accepted lengths, memory."""

    def compose(self) -> ComposeResult:
        yield Static(id="stats-speed")
        yield Static(id="stats-blocks")
        yield ProgressBar(id="progress", show_eta=False)

    def show(self, state: str, snap: Snapshot | None, detail: str = "") -> None:
        speed = Text(state, style="bold")
        blocks = Text()
        if snap is not None:
            speed.append(f"   {snap.generation_tps:6.1f} tok/s", style="bold #5fd7af")
            if snap.baseline:
                speed.append("   τ –")
            else:
                speed.append(f"   τ {snap.mean_acceptance:5.2f}", style="bold")
            speed.append(f"   {prompt_text(snap)}")
            speed.append(f"   peak {snap.peak_memory:.2f} GB")
            if snap.baseline:
                blocks.append("baseline: every token comes from the target", style="dim")
            else:
                blocks.append("accepted/block ", style="dim")
                blocks.append_text(acceptance_bar(snap.accepted_lengths, snap.block_size))
                blocks.append(
                    f"  drafted {snap.drafted_tokens} · accepted "
                    f"{snap.accepted_drafted_tokens} ({snap.acceptance_rate:.0%})"
                )
            blocks.append(
                f" · {snap.generation_tokens} tokens, {snap.target_tokens} from target",
                style="dim",
            )
        if detail:
            speed.append(f"   {detail}", style="dim")
        self.query_one("#stats-speed", Static).update(speed)
        self.query_one("#stats-blocks", Static).update(blocks)

    def progress(self, done: int | None = None, total: int | None = None) -> None:
        """Show a progress bar (indeterminate when total is None)."""
        bar = self.query_one(ProgressBar)
        bar.display = True
        bar.update(total=total, progress=done or 0)

    def hide_progress(self) -> None:
        self.query_one(ProgressBar).display = False
