"""The chat's slash commands (`/help`, `/stats`, `/temp`, ...), one method each.

They are a mixin of the app (`ChatApp` in `app.py`) because each one drives its state,
widgets and engine; `command` dispatches ``/name arg`` to ``cmd_name(arg)``, and the
commands that set a decoding option (`OPTIONS`) to `set_option`, whose parsing, usage and
help lines `app.flags` makes from the `DecodeOptions` field.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from textual.widgets import Markdown

from app.flags import describe, parse_value, slash_help, usage
from dflash_mlx import OptionError, cache_dir

from .widgets import Reply, Summary

#: The largest file `/file` pastes (a long prompt, not a data set).
MAX_FILE_BYTES = 1_000_000


def transcripts_dir() -> Path:
    """Where `/save` with no file name writes: transcripts/ in the app's cache directory
    (`$DFLASH_HOME`, else `$XDG_CACHE_HOME/mlx-dflash`, else ~/.cache/mlx-dflash)."""
    return cache_dir() / "transcripts"


#: The slash commands that set a decoding option: `/temp 0.7`, `/block 4`, `/tree auto`.
OPTIONS = {"temp": "temp", "top-p": "top_p", "block": "block_size", "tree": "tree_budget"}

HELP = f"""\
**Commands**

- `/help` this help
- `/stats` numbers of the last reply and of the whole session
- `/clear` forget the conversation and its KV cache
- `/regenerate` drop the last reply and answer the last message again
- `/system TEXT` the system prompt of the next turns (`/system` shows it, `/system off` drops it)
{chr(10).join(slash_help(command, name) for command, name in OPTIONS.items())}
- `/max N` most tokens per reply
- `/baseline` toggle target-only decoding, to feel the difference
- `/save [FILE]` save the conversation as Markdown (no FILE: a new file in {transcripts_dir()})
- `/file PATH [TEXT]` send TEXT with the file's contents pasted below it (a document, code)
- `/load [MODEL] [DRAFT]` load another model (none given: the built-in default)

**Keys**: `Enter` send (during a reply: queued) · `Shift+Enter` or `Ctrl+J` new line · `Up`/`Down` on the first/last
line: earlier messages · `Esc` stop the reply · `Ctrl+D` colour drafted tokens · `Ctrl+Q` or `Ctrl+C` quit
"""


class SlashCommands:
    """`/name arg` -> ``cmd_name(arg)``; mixed into the app, whose attributes they use."""

    async def command(self, line: str) -> None:
        name, _, arg = line[1:].partition(" ")
        if name.lower() in OPTIONS:
            await self.set_option(name.lower(), arg.strip())
            return
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
        self.session.clear()
        self.last = None
        await self.transcript.remove_children()
        if self.engine is not None:
            self.engine.clear()
        await self.note("Conversation cleared (KV cache reset).")
        self.refresh_stats()

    async def set_option(self, command: str, arg: str) -> None:
        """`/command VALUE`: set the decoding option `OPTIONS[command]` (checked by `DecodeOptions`)."""
        name = OPTIONS[command]
        try:
            options = replace(self.settings.options, **{name: parse_value(name, arg)})
            if self.drafter is not None:
                options.block_limit(self.drafter)  # a block size above the drafter's B
            self.settings.options = options
            # A block size typed here is the user's: the loaded drafter's check names /block, not --block-size.
            self.from_flags = self.from_flags and name != "block_size"
        except ValueError as e:  # not a number, or an `OptionError` naming the rule
            rule = f": {e.named(f'/{command}')}" if isinstance(e, OptionError) else ""
            await self.note(f"Usage: /{command} {usage(name)}{rule}.", "error")
            return
        await self.note(f"{describe(name, getattr(self.settings.options, name)).capitalize()}.")
        self.refresh_stats()

    async def cmd_max(self, arg: str) -> None:
        """`/max N`: the most tokens a reply may have."""
        try:
            self.settings = replace(self.settings, max_tokens=int(arg))
        except ValueError as e:  # not a number, or the `OptionError` of `Settings`
            rule = f": {e.named('/max')}" if isinstance(e, OptionError) else ""
            await self.note(f"Usage: /max N (most tokens per reply){rule}.", "error")
            return
        await self.note(f"Max tokens per reply: {self.settings.max_tokens}.")
        self.refresh_stats()

    async def cmd_system(self, arg: str) -> None:
        """`/system TEXT` sets the system prompt of the next turns (the KV cache keeps what comes
        before the change, nothing here); `/system` shows it, `/system off` drops it."""
        if not arg:
            shown = f"System prompt: {self.system}" if self.system else "No system prompt (/system TEXT sets one)."
            await self.note(shown)
            return
        self.system = None if arg.lower() == "off" else arg
        await self.note(f"System prompt set: {self.system}" if self.system else "System prompt dropped.")

    async def cmd_regenerate(self, arg: str) -> None:
        """Drop the last reply (and its summary) and answer the last message again."""
        if self.busy:
            await self.note("Press Esc to stop the reply before /regenerate.", "error")
            return
        if self.engine is None or not self.session.retract():
            await self.note("No reply to regenerate yet.", "error")
            return
        reply = self.query(Reply).last()
        after = self.transcript.children[self.transcript.children.index(reply) + 1 :]
        await reply.remove()
        # Its summary: the first below it, not always the next widget (a note typed during the reply comes between).
        summary = next((w for w in after if isinstance(w, Summary)), None)
        if summary is not None:
            await summary.remove()
        await self.answer()

    async def cmd_baseline(self, arg: str) -> None:
        if self.draft_name is None:
            await self.note("No drafter is loaded: decoding is target-only already.", "error")
            return
        self.settings.baseline = not self.settings.baseline
        self.last = None  # the panel's numbers were the other mode's
        if self.settings.baseline:
            await self.note("Baseline on: the target decodes alone, one token per step.")
        else:
            await self.note("Baseline off: DFlash speculative decoding again.")
        self.refresh_stats()

    async def cmd_stats(self, arg: str) -> None:
        header = [
            f"Model: {self.model_name or 'none'} · drafter: {self.draft_name or 'none'}",
            f"Settings: {self.settings.describe(self.has_draft)}",
        ]
        await self.note(self.session.stats(self.last, header))

    async def cmd_save(self, arg: str) -> None:
        """`/save [FILE]`: the conversation as Markdown, by default in a new file of `transcripts_dir()`."""
        path = Path(arg).expanduser() if arg else transcripts_dir() / time.strftime("chat-%Y%m%d-%H%M%S.md")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(self.transcript_markdown(), encoding="utf-8")
        except OSError as exc:
            await self.note(f"Could not save the transcript: {exc}", "error")
            return
        await self.note(f"Transcript saved to {path}.")

    async def cmd_file(self, arg: str) -> None:
        path, _, text = arg.partition(" ")
        if not path:
            await self.note("Usage: /file PATH [TEXT]", "error")
            return
        path = Path(path).expanduser()
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                raise OSError(f"larger than {MAX_FILE_BYTES // 1000} KB")
            contents = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            await self.note(f"Could not read {path}: {exc}", "error")
            return
        fence = "````" if "```" in contents else "```"
        pasted = f"{path.name}:\n{fence}\n{contents.rstrip()}\n{fence}"
        await self.send(f"{text.strip()}\n\n{pasted}" if text.strip() else pasted)

    async def cmd_load(self, arg: str) -> None:
        if self.busy:
            await self.note("Press Esc to stop the reply before /load.", "error")
            return
        model, _, draft = arg.partition(" ")
        # The conversation and the model there is stay until the new one has loaded (`Loaded`).
        self.model_path, self.draft_path = model or None, draft.strip() or None
        if self.engine is not None:
            self.state = "loading"  # a message sent from now on waits for the new conversation
            self.refresh_stats()
            pair = (self.model_path, self.draft_path)
            self.engine.load(*pair, self.draft_vocab if pair == self.vocab_pair else None)  # another's: its own

    async def cmd_quit(self, arg: str) -> None:
        await self.action_quit()
