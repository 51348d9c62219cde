"""The chat's widgets and the text they show: a reply that streams Markdown (tinted, its
text coloured by where each token came from), the live stats panel and the one-line summaries.

Nothing here talks to the engine; `app.py` feeds these widgets the engine's snapshots.
"""

from __future__ import annotations

import itertools
import re
import sys

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import Markdown, ProgressBar, Static, TextArea
from textual.widgets.markdown import MarkdownFence

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


def summary_parts(s: Snapshot, reason: str) -> list[str]:
    """The figures of the line shown under each reply."""
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
    return parts


def summary_line(s: Snapshot, reason: str) -> str:
    """The one line shown under each reply (and in `/stats`, `/save`)."""
    return " · ".join(summary_parts(s, reason))


def pack(units: list[Text], width: int, gap: str) -> Text:
    """`units` joined by `gap` on lines of `width` cells, broken between units only: a
    figure such as "peak 0.61 GB" never wraps inside (one wider than a line gets its own)."""
    out, used = Text(), 0
    for unit in units:
        if used and used + len(gap) + unit.cell_len > width:
            out.append("\n")
            used = 0
        elif used:
            out.append(gap)
            used += len(gap)
        out.append_text(unit)
        used += unit.cell_len
    return out


_SPACE = re.compile(r"\s")


def align(text: str, source: str, start: int = 0) -> tuple[list[int | None], int]:
    """The index in `source` (Markdown) of each character of `text` (one rendered block of
    it), and where the next block's search begins.

    Rendering keeps the text in order and drops syntax (`**`, `#`, a fence, a link's target),
    so each character is the next equal one from `start` on (a space: the next whitespace, as
    soft breaks render as spaces); None where rendering added one (a bullet, a smart quote).
    Approximate only where dropped syntax holds the character that follows (a link's URL)."""
    where: list[int | None] = []
    for ch in text:
        if ch.isspace():
            found = _SPACE.search(source, start)
            j = found.start() if found else -1
        else:
            j = source.find(ch, start)
        if j < 0:
            where.append(None)
        else:
            where.append(j)
            start = j + 1
    return where, start


def tint(content: Content, where: list[int | None], drafted: bytes) -> Content:
    """`content` with each character coloured by who wrote its source character `where[i]`."""
    runs = itertools.groupby(range(len(where)), key=lambda i: None if where[i] is None else drafted[where[i]])
    for from_draft, run in runs:
        run = list(run)
        if from_draft is not None:
            content = content.stylize(DRAFT_STYLE if from_draft else TARGET_STYLE, run[0], run[-1] + 1)
    return content


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
    """An assistant reply, streamed as Markdown. Tinted, the rendered Markdown stays and its
    text takes the colour of the tokens it came from (accepted drafts or the target)."""

    def __init__(self, tinted: bool = False) -> None:
        super().__init__()
        self.text = ""
        self.tinted = tinted
        self._drafted = bytearray()  # per character of `text`: 1 where an accepted draft wrote it
        self._stream = None
        self._painted: dict[Static, tuple[Content, Content, int]] = {}  # (as rendered, tinted, search end)

    def compose(self) -> ComposeResult:
        yield Markdown()

    async def add(self, text: str, from_draft: bool) -> None:
        self.text += text
        self._drafted += bytes([from_draft]) * len(text)
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        await self._stream.write(text)
        if self.tinted:
            self.paint()  # what the stream has rendered so far; the rest on the next token

    async def finish(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
            async with self.query_one(Markdown).lock:  # the stream's last append may still be running
                pass
        if self.tinted:
            self.paint()

    def set_tint(self, tinted: bool) -> None:
        """Colour the text by where it came from, or show the Markdown as rendered."""
        self.tinted = tinted
        if tinted:
            self.paint()
            return
        for widget, (rendered, painted, _) in self._painted.items():
            if widget.content is painted:
                widget.update(rendered)
        self._painted.clear()

    def paint(self) -> None:
        """Tint every text widget of the rendered Markdown, in document order; a widget
        already tinted and not re-rendered since is kept as it is."""
        painted, start = {}, 0
        for widget in self.query_one(Markdown).query(Static):
            content = widget.content
            if not isinstance(content, Content) or not content.plain:
                continue  # a container block, a rule
            known = self._painted.get(widget)
            if known is not None and known[1] is content:
                painted[widget], start = known, known[2]
                continue
            code = widget.parent.code if isinstance(widget.parent, MarkdownFence) else None
            found = self.text.find(code, start) if code else -1
            if found >= 0:  # code is verbatim: past its fence line, which may hold its first letter
                where, start = list(range(found, found + len(code))), found + len(code)
            else:
                where, start = align(content.plain, self.text, start)
            painted[widget] = (content, tint(content, where, self._drafted), start)
            widget.update(painted[widget][1])
        self._painted = painted


class Figures(Static):
    """A line of figures that wraps between figures, never inside one (see `pack`)."""

    def __init__(self, units: list[Text] | None = None, gap: str = "   ", **kwargs) -> None:
        self.gap = gap
        self.units = units or []
        super().__init__(pack(self.units, sys.maxsize, gap), **kwargs)

    def show(self, units: list[Text]) -> None:
        """Show these figures, packed to the widget's width."""
        self.units = units
        self.on_resize()

    def on_resize(self) -> None:
        self.update(pack(self.units, self.content_size.width or sys.maxsize, self.gap))


class Summary(Note, Figures):
    """The line under a reply, its figures (`summary_parts`) kept whole."""

    def __init__(self, s: Snapshot, reason: str) -> None:
        super().__init__([Text(part) for part in summary_parts(s, reason)], " · ", classes="summary")


class StatsPanel(Vertical):
    """Live numbers: speed, acceptance, the last blocks' accepted lengths, memory."""

    def compose(self) -> ComposeResult:
        yield Figures(id="stats-speed")
        yield Figures(gap=" · ", id="stats-blocks")
        yield ProgressBar(id="progress", show_eta=False)

    def show(self, state: str, snap: Snapshot | None, detail: str = "") -> None:
        speed = [Text(state, style="bold")]
        blocks = []
        if snap is not None:
            speed.append(Text(f"{snap.generation_tps:6.1f} tok/s", style="bold #5fd7af"))
            speed.append(Text("τ –") if snap.baseline else Text(f"τ {snap.mean_acceptance:5.2f}", style="bold"))
            speed += [Text(prompt_text(snap)), Text(f"peak {snap.peak_memory:.2f} GB")]
            if snap.baseline:
                blocks.append(Text("baseline: every token comes from the target", style="dim"))
            else:
                bar = Text("accepted/block ", style="dim")
                bar.append_text(acceptance_bar(snap.accepted_lengths, snap.block_size))
                accepted = f"accepted {snap.accepted_drafted_tokens} ({snap.acceptance_rate:.0%})"
                blocks += [bar, Text(f"drafted {snap.drafted_tokens}"), Text(accepted)]
            blocks.append(Text(f"{snap.generation_tokens} tokens, {snap.target_tokens} from target", style="dim"))
        if detail:
            speed.append(Text(detail, style="dim"))
        self.query_one("#stats-speed", Figures).show(speed)
        self.query_one("#stats-blocks", Figures).show(blocks)

    def progress(self, done: int | None = None, total: int | None = None) -> None:
        """Show a progress bar (indeterminate when total is None)."""
        bar = self.query_one(ProgressBar)
        bar.display = True
        bar.update(total=total, progress=done or 0)

    def hide_progress(self) -> None:
        self.query_one(ProgressBar).display = False


class Prompt(TextArea):
    """The message box. Enter sends (`Prompt.Submitted`); Shift+Enter or Ctrl+J starts a new
    line (terminals often send Shift+Enter as a plain Enter); a paste keeps every line. Up on
    the first line and Down on the last walk through what was sent before (`sent`)."""

    class Submitted(Message):
        """The text the user sent (Enter)."""

        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, placeholder: str = "", **kwargs) -> None:
        super().__init__(
            soft_wrap=True, tab_behavior="focus", highlight_cursor_line=False, placeholder=placeholder, **kwargs
        )
        self.sent: list[str] = []  # what was sent, oldest first
        self._back = 0  # how many entries back the box shows (0: the text being written)
        self._draft = ""  # the text being written, kept while the history is shown

    async def _on_key(self, event: events.Key) -> None:
        if event.key in ("enter", "shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            if event.key == "enter":
                self.submit()
            else:
                self.insert("\n")
            return
        await super()._on_key(event)

    def submit(self) -> None:
        """Send the text (unless blank), remember it, and empty the box."""
        text = self.text.strip()
        if not text:
            return
        if not self.sent or self.sent[-1] != text:
            self.sent.append(text)
        self._back, self._draft = 0, ""
        self.clear()
        self.post_message(self.Submitted(text))

    def action_cursor_up(self, select: bool = False) -> None:
        if not select and self.get_cursor_up_location() == (0, 0) and self._back < len(self.sent):
            self.recall(self._back + 1)
        else:
            super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        if not select and self.get_cursor_down_location() == self.document.end and self._back > 0:
            self.recall(self._back - 1)
        else:
            super().action_cursor_down(select)

    def recall(self, back: int) -> None:
        """Show what was sent `back` messages ago (0: the text being written)."""
        if self._back == 0:
            self._draft = self.text
        self._back = back
        self.load_text(self.sent[-back] if back else self._draft)
        self.move_cursor(self.document.end)
