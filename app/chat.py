"""dflash-chat: a terminal chat that shows DFlash speculative decoding at work.

    dflash-chat [--model PATH_OR_REPO] [--draft PATH_OR_REPO] [--temp T] [--top-p P]
                [--top-k K] [--block-size B] [--max-tokens N] [--system TEXT] [--no-draft]

All model work happens on the engine's worker thread (see `engine.py`); this module is
only the Textual UI: a transcript of Markdown messages, a live stats panel, an input.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Input, Markdown, ProgressBar, Static

from .engine import (
    Cleared,
    Engine,
    Event,
    Failed,
    Finished,
    Loaded,
    Prefill,
    Settings,
    Snapshot,
    Status,
    Token,
)

HELP = """\
**Commands**

- `/help` this help
- `/stats` numbers of the last reply and of the whole session
- `/clear` forget the conversation and its KV cache
- `/temp X` sampling temperature (0 = greedy)
- `/block N` drafter block size (`/block auto`: the drafter's own)
- `/baseline` toggle target-only decoding, to feel the difference
- `/save FILE` save the transcript as Markdown
- `/load [MODEL] [DRAFT]` load another model (none given: the built-in default)

**Keys**: `Enter` send · `Esc` stop the reply · `Ctrl+D` colour drafted tokens · `Ctrl+Q` or `Ctrl+C` quit
"""

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
    reused = f" (+{s.prompt_cached} reused)" if s.prompt_cached else ""
    return f"prompt {s.prefilled} tok{reused} @ {s.prompt_tps:.0f} tok/s"


def summary_line(s: Snapshot, reason: str) -> str:
    """The one line shown under each reply."""
    parts = [f"{s.generation_tokens} tokens", f"{s.generation_tps:.1f} tok/s"]
    if s.baseline:
        parts.append("baseline (target only)")
    else:
        parts.append(f"τ {s.mean_acceptance:.2f} over {s.cycles} blocks")
        parts.append(
            f"accepted {s.accepted_drafted_tokens}/{s.drafted_tokens} drafted"
            f" ({s.acceptance_rate:.0%})"
        )
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
    pass


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


# --------------------------------------------------------------------------- the app


class ChatApp(App):
    """Chat with a local model, decoded by DFlash speculative decoding."""

    TITLE = "dflash-chat"
    CSS = """
    #transcript { height: 1fr; padding: 0 1; }
    UserMessage {
        margin: 1 0 0 0; padding: 0 1; background: $boost;
        border-left: thick $accent;
    }
    Reply { height: auto; margin: 1 0 0 0; border-left: thick $success; }
    Reply Markdown { padding: 0 1; }
    UserMessage > *:last-child, Reply Markdown > *:last-child { margin-bottom: 0; }
    UserMessage > *:first-child, Reply Markdown > *:first-child { margin-top: 0; }
    Reply .tinted { display: none; padding: 0 1; }
    Reply.-tinted Markdown { display: none; }
    Reply.-tinted .tinted { display: block; }
    Note { color: $text-muted; padding: 0 1; margin: 1 0 0 0; }
    Note.summary { margin: 0; padding: 0 2; text-style: italic; }
    Note.error { color: $text-error; background: $error-muted; }
    StatsPanel {
        height: auto; border: round $primary; padding: 0 1;
        border-title-color: $text-primary; border-subtitle-color: $text-muted;
    }
    StatsPanel ProgressBar { display: none; }
    #prompt { border: tall $accent; }
    """
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+d", "toggle_tint", "Colour drafts", priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
    ]

    def __init__(
        self,
        model: str | None = None,
        draft: str | None = None,
        settings: Settings | None = None,
        system: str | None = None,
        engine_factory: Callable[[Callable[[Event], None]], Engine] | None = None,
    ) -> None:
        super().__init__()
        self.model_path = model
        self.draft_path = draft
        self.settings = settings or Settings()
        self.system = system
        self._engine_factory = engine_factory or (lambda on_event: Engine(on_event))
        self.engine: Engine | None = None
        self._transcript = VerticalScroll(id="transcript")
        self._panel = StatsPanel()
        self._follow_timer = None
        self.messages: list[dict] = []  # the conversation, without the system prompt
        self.log_entries: list[tuple[str, str]] = []  # (kind, text) for /save
        self.model_name: str | None = None
        self.draft_name: str | None = None
        self.state = "starting"  # starting | loading | ready | generating | stopping | no model
        self.tint = False
        self.reply: Reply | None = None
        self.last: Snapshot | None = None
        self.session = {"replies": 0, "tokens": 0, "cycles": 0, "committed": 0,
                        "drafted": 0, "accepted": 0}

    # ---- layout

    def compose(self) -> ComposeResult:
        yield Header()
        yield self._transcript
        yield self._panel
        yield Input(placeholder="Message  (/help for commands, Esc stops a reply)", id="prompt")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#prompt").focus()
        await self.note(
            "dflash-chat: DFlash speculative decoding on MLX. A small drafter proposes a "
            "block of tokens at once and the model verifies them in one pass. "
            "Type a message; /help lists commands."
        )
        self.engine = self._engine_factory(self._post_event)
        self.engine.start()
        self.engine.load(self.model_path, self.draft_path)
        self.refresh_stats()
        self._follow_timer = self.set_interval(0.1, self.follow)

    def on_unmount(self) -> None:
        if self._follow_timer is not None:
            self._follow_timer.stop()
        if self.engine is not None:
            self.engine.shutdown(timeout=10.0)

    def _post_event(self, event: Event) -> None:
        """Runs on the engine's thread: hand the event over to the UI thread."""
        try:
            self.post_message(EngineMessage(event))
        except RuntimeError:  # the event loop is gone: we are quitting
            pass

    # ---- helpers

    @property
    def transcript(self) -> VerticalScroll:
        return self._transcript

    @property
    def has_draft(self) -> bool:
        """A drafter is loaded (or, before loading ends, expected)."""
        return self.draft_name is not None or self.model_name is None

    @property
    def busy(self) -> bool:
        return self.state in ("generating", "stopping")

    def follow(self) -> None:
        """Keep to the bottom once the transcript overflows (Textual's anchor).

        Anchoring an unfilled container would bottom-align it, so it waits for overflow;
        once anchored, Textual keeps to the bottom unless the user scrolls up.
        """
        transcript = self._transcript
        if transcript.is_attached and not transcript.is_anchored and transcript.max_scroll_y > 0:
            transcript.anchor()

    async def note(self, text: str, kind: str = "info") -> Note:
        widget = Note(text, classes=kind, markup=False)
        await self.transcript.mount(widget)
        if kind != "summary":
            self.log_entries.append((kind, text))
        return widget

    def refresh_stats(self, detail: str = "") -> None:
        panel = self._panel
        labels = {
            "starting": "◌ starting",
            "loading": "◌ loading",
            "ready": "● ready",
            "generating": "▶ generating",
            "stopping": "■ stopping",
            "no model": "✖ no model",
        }
        panel.show(labels.get(self.state, self.state), self.last, detail)
        baseline = self.settings.baseline or not self.has_draft
        panel.border_title = "baseline" if baseline else "DFlash"
        if self.tint:
            colours = f"[{DRAFT_STYLE}]drafted[/] · [{TARGET_STYLE}]target[/]"
        else:
            colours = "ctrl+d: colour drafted tokens"
        block = self.last.block_size if self.last and not self.last.baseline else None
        describe = self.settings.describe(self.has_draft, block)
        panel.border_subtitle = f"{describe} · {colours}"

    # ---- input

    @on(Input.Submitted, "#prompt")
    async def submitted(self, event: Input.Submitted) -> None:
        line = event.value.strip()
        if not line:
            return
        event.input.clear()
        if line.startswith("/"):
            await self.command(line)
        else:
            await self.send(line)

    async def send(self, text: str) -> None:
        if self.busy:
            await self.note("Still answering: press Esc to stop the reply first.", "error")
            return
        if self.engine is None:
            return
        if self.transcript.is_anchored:
            self.transcript.anchor()  # back to the bottom, even if the user scrolled up
        await self.transcript.mount(UserMessage(text))
        self.messages.append({"role": "user", "content": text})
        self.log_entries.append(("you", text))
        self.reply = Reply()
        self.reply.set_class(self.tint, "-tinted")
        await self.transcript.mount(self.reply)
        self.state = "generating"
        self.refresh_stats("waiting for the model …" if self.model_name is None else "")
        system = [{"role": "system", "content": self.system}] if self.system else []
        self.engine.generate(system + self.messages, self.settings)

    # ---- engine events

    async def on_engine_message(self, message: EngineMessage) -> None:
        if not self._transcript.is_attached:
            return  # quitting: the widgets are gone
        event = message.event
        panel = self._panel
        if isinstance(event, Token):
            if self.reply is not None:
                await self.reply.add(event.text, event.from_draft)
            self.last = event.stats
            panel.hide_progress()
            if self.state != "stopping":
                self.refresh_stats()
        elif isinstance(event, Prefill):
            panel.progress(event.done, event.total)
            self.refresh_stats(f"prefill {event.done}/{event.total} tokens")
        elif isinstance(event, Finished):
            self.last = event.stats
            await self.end_reply(event.reason, summary_line(event.stats, event.reason))
            self._count(event.stats)
        elif isinstance(event, Status):
            if not self.busy:
                self.state = "loading"
            panel.progress(None, None)
            self.refresh_stats(event.text)
        elif isinstance(event, Loaded):
            self.model_name, self.draft_name = event.model, event.draft
            self.sub_title = event.model + (f" + {event.draft}" if event.draft else "")
            await self.note(
                f"Loaded {event.model}"
                + (f" with {event.draft}." if event.draft else " (no drafter: target-only).")
            )
            panel.hide_progress()
            if not self.busy:
                self.state = "ready"
            self.refresh_stats()
        elif isinstance(event, Failed):
            await self.note(event.message, "error")
            if event.stage == "load":
                self.model_name = self.draft_name = None
                if not self.busy:
                    self.state = "no model"
                self.sub_title = "no model loaded"
                panel.hide_progress()
                self.refresh_stats("/load [MODEL] [DRAFT] to try again")
            elif event.stage == "generate" and self.reply is not None:
                await self.end_reply("error", None)
        elif isinstance(event, Cleared):
            pass

    async def end_reply(self, reason: str, summary: str | None) -> None:
        reply, self.reply = self.reply, None
        self._panel.hide_progress()
        if reply is not None:
            await reply.finish()
            if reply.text:
                self.messages.append({"role": "assistant", "content": reply.text})
                self.log_entries.append(("assistant", reply.text))
            else:
                await reply.remove()
                if self.messages and self.messages[-1]["role"] == "user":
                    self.messages.pop()  # no answer: keep the history alternating
                if reason == "stopped":
                    await self.note("Stopped before the reply began; that message was dropped.")
        if summary is not None and reply is not None and reply.text:
            await self.note(summary, "summary")
            self.log_entries.append(("summary", summary))
        self.state = "ready" if self.model_name is not None else "no model"
        self.refresh_stats()

    def _count(self, s: Snapshot) -> None:
        self.session["replies"] += 1
        self.session["tokens"] += s.generation_tokens
        if not s.baseline:
            self.session["cycles"] += s.cycles
            self.session["committed"] += round(s.mean_acceptance * s.cycles)
            self.session["drafted"] += s.drafted_tokens
            self.session["accepted"] += s.accepted_drafted_tokens

    # ---- actions

    def action_stop(self) -> None:
        if self.state == "generating" and self.engine is not None:
            self.engine.stop()
            self.state = "stopping"
            self.refresh_stats()

    def action_toggle_tint(self) -> None:
        self.tint = not self.tint
        for reply in self.query(Reply):
            reply.set_class(self.tint, "-tinted")
        self.refresh_stats()

    async def action_quit(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.exit()

    # ---- slash commands

    async def command(self, line: str) -> None:
        name, _, arg = line[1:].partition(" ")
        handler = getattr(self, f"cmd_{name.lower()}", None)
        if handler is None:
            await self.note(f"Unknown command /{name}. /help lists the commands.", "error")
            return
        await handler(arg.strip())

    async def cmd_help(self, arg: str) -> None:
        widget = Markdown(HELP, classes="help")
        await self.transcript.mount(widget)

    async def cmd_clear(self, arg: str) -> None:
        if self.busy:
            await self.note("Press Esc to stop the reply before /clear.", "error")
            return
        self.messages.clear()
        self.log_entries.clear()
        self.last = None
        await self.transcript.remove_children()
        if self.engine is not None:
            self.engine.clear()
        await self.note("Conversation cleared (KV cache reset).")
        self.refresh_stats()

    async def cmd_temp(self, arg: str) -> None:
        try:
            value = float(arg)
            if value < 0:
                raise ValueError
        except ValueError:
            await self.note("Usage: /temp X  with X >= 0 (0 = greedy).", "error")
            return
        self.settings.temp = value
        await self.note(f"Temperature set to {value:g}.")
        self.refresh_stats()

    async def cmd_block(self, arg: str) -> None:
        if arg.lower() in ("auto", "default"):
            self.settings.block_size = None
        else:
            try:
                value = int(arg)
                if value < 2:
                    raise ValueError
            except ValueError:
                await self.note("Usage: /block N  with N >= 2, or /block auto.", "error")
                return
            self.settings.block_size = value
        await self.note(f"Block size set to {self.settings.block_size or 'auto'}.")
        self.refresh_stats()

    async def cmd_baseline(self, arg: str) -> None:
        if self.draft_name is None:
            await self.note("No drafter is loaded: decoding is target-only already.", "error")
            return
        self.settings.baseline = not self.settings.baseline
        if self.settings.baseline:
            await self.note("Baseline on: the target decodes alone, one token per step.")
        else:
            await self.note("Baseline off: DFlash speculative decoding again.")
        self.refresh_stats()

    async def cmd_stats(self, arg: str) -> None:
        s, t = self.last, self.session
        lines = [f"Model: {self.model_name or 'none'} · drafter: {self.draft_name or 'none'}",
                 f"Settings: {self.settings.describe(self.has_draft)}"]
        if s is not None:
            lines.append("Last reply: " + summary_line(s, ""))
            if s.accepted_lengths and not s.baseline:
                tail = " ".join(map(str, s.accepted_lengths[-24:]))
                lines.append(f"Accepted per block (last {min(24, len(s.accepted_lengths))}): {tail}")
        tau = t["committed"] / t["cycles"] if t["cycles"] else 0.0
        rate = t["accepted"] / t["drafted"] if t["drafted"] else 0.0
        lines.append(
            f"Session: {t['replies']} replies, {t['tokens']} tokens, τ {tau:.2f} over "
            f"{t['cycles']} blocks, drafted {t['drafted']}, accepted {t['accepted']} ({rate:.0%})"
        )
        await self.note("\n".join(lines))

    async def cmd_save(self, arg: str) -> None:
        path = Path(arg or "dflash-chat.md").expanduser()
        try:
            path.write_text(self.transcript_markdown(), encoding="utf-8")
        except OSError as exc:
            await self.note(f"Could not save the transcript: {exc}", "error")
            return
        await self.note(f"Transcript saved to {path}.")

    async def cmd_load(self, arg: str) -> None:
        if self.busy:
            await self.note("Press Esc to stop the reply before /load.", "error")
            return
        model, _, draft = arg.partition(" ")
        self.model_path, self.draft_path = model or None, draft.strip() or None
        self.model_name = self.draft_name = None
        self.messages.clear()
        self.last = None
        if self.engine is not None:
            self.engine.load(self.model_path, self.draft_path)

    async def cmd_quit(self, arg: str) -> None:
        await self.action_quit()

    def transcript_markdown(self) -> str:
        out = ["# dflash-chat transcript", ""]
        out.append(f"Model: {self.model_name or 'none'} · drafter: {self.draft_name or 'none'}")
        out.append("")
        if self.system:
            out += [f"**System:** {self.system}", ""]
        headings = {"you": "### You", "assistant": "### Assistant"}
        for kind, text in self.log_entries:
            if kind in headings:
                out += [headings[kind], "", text.strip(), ""]
            elif kind == "summary":
                out += [f"*{text}*", ""]
            else:
                out += [f"> {text}", ""]
        return "\n".join(out)


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflash-chat",
        description="Chat with a local model, several times faster with DFlash speculative decoding.",
    )
    p.add_argument("--model", default=None, help="target model path or HF repo (default: built-in)")
    p.add_argument("--draft", default=None, help="DFlash drafter path or HF repo (default: the target's)")
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    p.add_argument("--block-size", type=int, default=None, help="drafter block size (default: the drafter's)")
    p.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--no-draft", action="store_true", help="start in baseline mode (target only; /baseline toggles)")
    return p


def app_from_args(argv: list[str] | None = None) -> ChatApp:
    args = build_parser().parse_args(argv)
    settings = Settings(temp=args.temp, top_p=args.top_p, top_k=args.top_k,
                        block_size=args.block_size, max_tokens=args.max_tokens,
                        baseline=args.no_draft)
    return ChatApp(model=args.model, draft=args.draft, settings=settings, system=args.system)


def main(argv: list[str] | None = None) -> None:
    app_from_args(argv).run()


if __name__ == "__main__":
    main()
