"""dflash-chat: a terminal chat that shows DFlash speculative decoding at work.

Its command line is `main.py`. All model work happens on the engine's worker thread
(`engine.py`); the widgets are in `widgets.py`, the conversation's data in `session.py`
and the look in `chat.tcss`. This module is the app itself: it routes input, slash
commands and engine events.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Header

from app.flags import flag_name
from app.model_thread import Failed
from dflash_mlx import OptionError

from .commands import SlashCommands
from .engine import Cleared, Engine, Event, Finished, Loaded, Prefill, Settings, Snapshot, Status, Token
from .session import Session
from .widgets import (
    DRAFT_STYLE,
    TARGET_STYLE,
    EngineMessage,
    Note,
    Prompt,
    Reply,
    StatsPanel,
    Summary,
    UserMessage,
    summary_line,
)


# --------------------------------------------------------------------------- the app


class ChatApp(SlashCommands, App):
    """Chat with a local model, decoded by DFlash speculative decoding."""

    TITLE = "dflash-chat"
    CSS_PATH = "chat.tcss"
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
        draft_vocab: str | None = None,
        engine_factory: Callable[[Callable[[Event], None]], Engine] | None = None,
        prompt_cache_file: str | None = None,
    ) -> None:
        super().__init__()
        self.model_path = model
        self.draft_path = draft
        self.draft_vocab = draft_vocab
        self.vocab_pair = (model, draft)  # the pair --draft-vocab was given for: /load of another drops it
        self.settings = settings or Settings()
        self.system = system
        self.prompt_cache_file = prompt_cache_file
        self._engine_factory = engine_factory or (
            lambda on_event: Engine(on_event, prompt_cache_file=prompt_cache_file)
        )
        self.engine: Engine | None = None
        self._transcript = VerticalScroll(id="transcript")
        self._panel = StatsPanel()
        self._follow_timer = None
        self.session = Session()
        self.model_name: str | None = None
        self.draft_name: str | None = None
        self.drafter = None  # the loaded drafter (`Loaded.drafter`), whose B limits /block
        self.from_flags = True  # the options are the command line's, not yet checked against a drafter
        self.state = "starting"  # starting | loading | ready | generating | stopping | no model
        self.tint = False
        self.reply: Reply | None = None
        self.pending: list[str] = []  # messages sent during a reply or a load, in order
        self._footer_baseline = False  # the mode the footer's keys were last shown for
        self.last: Snapshot | None = None

    # ---- layout

    def compose(self) -> ComposeResult:
        yield Header()
        yield self._transcript
        yield self._panel
        yield Prompt("Message  (Enter sends, Shift+Enter or Ctrl+J: new line, /help: commands)", id="prompt")
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
        self.engine.load(self.model_path, self.draft_path, self.draft_vocab)
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
    def messages(self) -> list[dict]:
        """The conversation the model sees, without the system prompt."""
        return self.session.messages

    @property
    def transcript(self) -> VerticalScroll:
        return self._transcript

    @property
    def has_draft(self) -> bool:
        """A drafter is loaded (or, before loading ends, expected)."""
        return self.draft_name is not None or self.model_name is None

    @property
    def baseline(self) -> bool:
        """Target-only decoding: asked for (`/baseline`), or no drafter is loaded."""
        return self.settings.baseline or not self.has_draft

    @property
    def busy(self) -> bool:
        return self.state in ("generating", "stopping")

    @property
    def loading(self) -> bool:
        """A load is under way: its `Loaded` starts a new conversation."""
        return self.state in ("starting", "loading")

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
        panel.border_title = "baseline" if self.baseline else "DFlash"
        block = self.last.block_in_use if self.last and not self.last.baseline else None
        subtitle = self.settings.describe(self.has_draft, block)
        if self.tint and not self.baseline:
            subtitle += f" · [{DRAFT_STYLE}]drafted[/] · [{TARGET_STYLE}]target[/]"
        elif not self.baseline:  # nothing is drafted in baseline mode: nothing to colour
            subtitle += " · ctrl+d: colour drafted tokens"
        panel.border_subtitle = subtitle
        if self.baseline != self._footer_baseline:  # Ctrl+D comes and goes with the drafts (`check_action`)
            self._footer_baseline = self.baseline
            self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Ctrl+D (colour drafted tokens) is offered only where tokens are drafted."""
        return not (action == "toggle_tint" and self.baseline)

    # ---- input

    @on(Prompt.Submitted)
    async def submitted(self, event: Prompt.Submitted) -> None:
        if event.text.startswith("/"):
            await self.command(event.text)
        else:
            await self.send(event.text)

    async def send(self, text: str) -> None:
        if self.busy or self.loading:  # sent when the reply ends or the load does (`send_pending`)
            self.pending.append(text)
            when = "the model has loaded" if self.loading else "this reply ends"
            await self.note(f"Queued: sent when {when} ({len(self.pending)} waiting).")
            return
        if self.engine is None:
            return
        if self.transcript.is_anchored:
            self.transcript.anchor()  # back to the bottom, even if the user scrolled up
        await self.transcript.mount(UserMessage(text))
        self.session.ask(text)
        await self.answer()

    async def answer(self) -> None:
        """Start the reply to the conversation as it stands (its last message is the user's)."""
        self.reply = Reply(tinted=self.tint)
        await self.transcript.mount(self.reply)
        self.state = "generating"
        self.refresh_stats()
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
            if self.reply is not None and self.reply.text:  # one stopped before it began is dropped (`end_reply`)
                self.session.totals.add(event.stats)  # before any await: a /stats typed meanwhile sees it
            await self.end_reply(event.reason, event.stats)
        elif isinstance(event, Status):
            if not self.busy:
                self.state = "loading"
            panel.progress(None, None)
            self.refresh_stats(event.text)
        elif isinstance(event, Loaded):  # a new model: a new conversation
            self.model_name, self.draft_name, self.drafter = event.model, event.draft, event.drafter
            if not await self.check_block_size():
                return  # ending: the command line's --block-size is above the drafter's
            self.session.messages.clear()
            self.last = None
            self.sub_title = event.model + (f" + {event.draft}" if event.draft else "")
            await self.note(
                f"Loaded {event.model}" + (f" with {event.draft}." if event.draft else " (no drafter: target-only).")
            )
            if event.prefix:
                await self.note(f"The conversation starts after the prompt cache's {event.prefix} tokens.")
            panel.hide_progress()
            if not self.busy:
                self.state = "ready"
            self.refresh_stats()
            await self.send_pending()
        elif isinstance(event, Failed):
            await self.note(event.message, "error")
            if event.stage == "load":
                self.model_name = self.draft_name = self.drafter = None
                if not self.busy:
                    self.state = "no model"
                self.sub_title = "no model loaded"
                panel.hide_progress()
                self.refresh_stats("/load [MODEL] [DRAFT] to try again")
                await self.send_pending()
            elif event.stage == "reload":  # the models there were are still loaded
                panel.hide_progress()
                if not self.busy:
                    self.state = "ready"
                self.refresh_stats()
                await self.send_pending()
            elif event.stage == "generate" and self.reply is not None:
                await self.end_reply("error", None)
        elif isinstance(event, Cleared):
            pass

    async def check_block_size(self) -> bool:
        """A fixed block size above the new drafter's B: refused (`DecodeOptions.block_limit`).
        From the command line the app ends with one line naming --block-size and exit code 1;
        after a `/load`, the block size goes back to adaptive, with a note. False: ending."""
        try:
            self.settings.options.block_limit(self.drafter)
        except OptionError as e:
            if self.from_flags:
                line = f"dflash-chat: error: {e.named(flag_name(e.field))}"
                self.exit(return_code=1, message=Text(line, no_wrap=True, overflow="ignore"))
                return False
            self.settings.options = replace(self.settings.options, block_size=None)
            await self.note(f"{e.named('/block')}: back to auto (adaptive).", "error")
        self.from_flags = False
        return True

    async def end_reply(self, reason: str, stats: Snapshot | None) -> None:
        """Close the reply in progress; with `stats`, put its summary line under it."""
        reply, self.reply = self.reply, None
        self._panel.hide_progress()
        if reply is not None:
            await reply.finish()
            if reply.text:
                self.session.answer(reply.text)
            else:
                await reply.remove()
                self.session.drop_unanswered()
                if reason == "stopped":
                    await self.note("Stopped before the reply began; that message was dropped.")
        if stats is not None and reply is not None and reply.text:
            await self.transcript.mount(Summary(stats, reason))
            self.session.log.append(("summary", summary_line(stats, reason)))
        self.state = "ready" if self.model_name is not None else "no model"
        self.refresh_stats()
        await self.send_pending()

    async def send_pending(self) -> None:
        """Send the first message queued during a reply or a load (the next waits for its reply)."""
        if self.pending and not self.busy:
            await self.send(self.pending.pop(0))

    # ---- actions

    def action_stop(self) -> None:
        if self.state == "generating" and self.engine is not None:
            self.engine.stop()
            self.state = "stopping"
            self.refresh_stats()

    def action_toggle_tint(self) -> None:
        self.tint = not self.tint
        for reply in self.query(Reply):
            reply.set_tint(self.tint)
        self.refresh_stats()

    async def action_quit(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        self.exit()

    def transcript_markdown(self) -> str:
        """The conversation as Markdown (what /save writes)."""
        return self.session.markdown(self.model_name, self.draft_name, self.system)
