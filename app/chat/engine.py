"""The chat's engine: one long-lived thread that owns the model and does all MLX work.

The thread itself (queue, cancellation, cache drop on failure, one-line errors) is
`app.model_thread.ModelThread`, which the server's worker shares. The UI talks to the engine
through commands (`load`, `generate`, `clear`, `stop`) and hears back through a callback
that receives the event objects defined below. The callback runs on the worker thread:
it must hand the event over to the UI thread (Textual's `post_message` does that).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any, Callable

from dflash_mlx import DecodeOptions, OptionError, apply_chat_template

from app.model_thread import Failed, ModelThread, describe_error

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
BAR_HISTORY = 64  # how many of the last blocks' accepted lengths the events carry


# --------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """What every `generate` command carries: how to decode, how long, with the drafter or not.
    A bad `max_tokens` is an `OptionError`."""

    options: DecodeOptions = DecodeOptions()
    max_tokens: int = 512
    baseline: bool = False  # target-only decoding through the same loop

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise OptionError("max_tokens", "must be an integer >= 1", self.max_tokens)

    def describe(self, has_draft: bool = True, block_in_use: int | None = None) -> str:
        """The footer line; `block_in_use`: the block size of the last cycle, if any."""
        o = self.options
        mode = "baseline (target only)" if self.baseline or not has_draft else "DFlash"
        size = o.block_size or ("auto" + (f" ({block_in_use})" if block_in_use else ""))
        block = "" if self.baseline or not has_draft else f" B={size}"
        if block and o.tree_budget is not None:
            block += f" tree {o.tree_budget}" if o.tree_budget else " chains"
        return f"{mode}{block} · T={o.temp:g} · top-p {o.top_p:g} · max {self.max_tokens}"


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Snapshot:
    """The numbers of one generation at one moment (copied off the live stats)."""

    generation_tokens: int = 0
    generation_tps: float = 0.0
    prompt_tokens: int = 0  # the whole conversation so far
    prompt_cached: int = 0  # of which reused from the KV cache (not prefilled)
    prompt_tps: float = 0.0  # prefill speed over the tokens actually prefilled
    peak_memory: float = 0.0
    baseline: bool = False
    block_size: int | None = None
    block_in_use: int | None = None  # the last cycle's block size (adaptive: what it chose)
    widths: tuple[tuple[str, int], ...] = ()  # cycles by what they verified: ("chain 8", 52), ("tree 16", 1)
    cycles: int = 0
    committed: int = 0  # tokens committed by the cycles
    mean_acceptance: float = 0.0
    accepted_lengths: tuple[int, ...] = ()  # the last BAR_HISTORY blocks
    drafted_tokens: int = 0
    accepted_drafted_tokens: int = 0
    draft_tokens_out: int = 0  # tokens of the reply that came from accepted drafts

    @classmethod
    def of(cls, response: Any, baseline: bool, draft_tokens_out: int) -> "Snapshot":
        """A response's numbers and its stats' view (`GenerationStats.to_dict`)."""
        stats = response.stats.to_dict()
        return cls(
            generation_tokens=response.generation_tokens,
            generation_tps=response.generation_tps,
            prompt_tokens=response.prompt_tokens,
            prompt_cached=stats["prompt_cached"],
            prompt_tps=response.prompt_tps,
            peak_memory=response.peak_memory,
            baseline=baseline,
            block_size=stats["block_size"],
            block_in_use=(stats["block_sizes"] or [None])[-1],
            widths=tuple(stats["widths"].items()),
            cycles=stats["cycles"],
            committed=stats["committed_tokens"],
            mean_acceptance=stats["tau"],
            accepted_lengths=tuple(stats["accepted_lengths"][-BAR_HISTORY:]),
            drafted_tokens=stats["drafted_tokens"],
            accepted_drafted_tokens=stats["accepted_drafted_tokens"],
            draft_tokens_out=draft_tokens_out,
        )

    @property
    def acceptance_rate(self) -> float:
        """Share of the drafted tokens that were accepted."""
        return self.accepted_drafted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def prefilled(self) -> int:
        """Prompt tokens run through the target (not reused from the cache)."""
        return self.prompt_tokens - self.prompt_cached

    @property
    def target_tokens(self) -> int:
        """Reply tokens the target produced itself (not from accepted drafts)."""
        return self.generation_tokens - self.draft_tokens_out


@dataclass(frozen=True)
class Status:
    """Something slow is under way (loading); `text` says what."""

    text: str


@dataclass(frozen=True)
class Loaded:
    """A target (and its drafter, if one loaded) is ready: a new conversation starts."""

    model: str
    draft: str | None  # None: no drafter, target-only decoding
    prefix: int = 0  # tokens of the saved prompt cache the conversation starts after
    drafter: Any = None  # the drafter itself, for `DecodeOptions.block_limit`'s check (read, never run)


@dataclass(frozen=True)
class Prefill:
    """Prefill progress: `done` of `total` prompt tokens."""

    done: int
    total: int


@dataclass(frozen=True)
class Token:
    """New text of the reply, whether an accepted draft wrote it, and the numbers so far."""

    text: str
    from_draft: bool
    stats: Snapshot


@dataclass(frozen=True)
class Finished:
    """The reply ended: its final numbers and why."""

    stats: Snapshot
    reason: str  # "stop" | "length" | "stopped" (by the user)


@dataclass(frozen=True)
class Cleared:
    """The conversation's KV state is forgotten (`clear`)."""


Event = Status | Loaded | Prefill | Token | Finished | Failed | Cleared


# --------------------------------------------------------------------------- engine


class Engine(ModelThread):
    """Owns the model on one worker thread; every public method is safe to call from the UI.

    Args:
        on_event: called on the worker thread with each event.
        backend: the engine module (default: `dflash_mlx`; tests pass a scripted one).
        prompt_cache_file: a prefix saved by `dflash cache-prompt`: every conversation
            starts after its tokens (its caches are loaded, never prefilled).
    """

    def __init__(
        self, on_event: Callable[[Event], None], backend: Any = None, prompt_cache_file: str | None = None
    ) -> None:
        super().__init__("dflash-engine", backend)
        self.prefix_file, self.prefix = prompt_cache_file, []  # the file's tokens, while the loaded pair uses it
        self.refs: tuple = (None, None)  # the target and drafter as named to `load`
        self._emit = on_event
        self._seq_lock = threading.Lock()
        self._submitted = 0  # generate commands handed in so far
        self._stop_upto = 0  # every generate command numbered <= this is cancelled
        self.cache = None  # the conversation's KV state, shared by DFlash and baseline (worker thread)

    # ---- UI side

    def start(self) -> None:
        """Start the worker thread."""
        self.start_thread()

    def load(self, model: str | None = None, draft: str | None = None, draft_vocab: str | None = None) -> None:
        """Queue loading a target and its drafter (None: the defaults); `Loaded` or `Failed` follows."""
        self.inbox.put(("load", model, draft, draft_vocab))

    def generate(self, messages: list[dict], settings: Settings) -> int:
        """Queue a reply to `messages`; returns the generation's number."""
        with self._seq_lock:
            self._submitted += 1
            seq = self._submitted
        self.inbox.put(("generate", seq, [dict(m) for m in messages], replace(settings)))
        return seq

    def stop(self) -> None:
        """Stop the running generation (and any queued one) as soon as possible."""
        with self._seq_lock:
            self._stop_upto = self._submitted

    def clear(self) -> None:
        """Forget the conversation's KV state."""
        self.inbox.put(("clear",))

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop any generation and end the thread, waiting up to `timeout` seconds."""
        self.stop()
        self.stop_thread(timeout)

    # ---- worker side

    def handle(self, command: tuple) -> None:
        name, *args = command
        getattr(self, f"_do_{name}")(*args)

    def failed(self, command: tuple, message: str) -> None:
        self._emit(Failed(message, command[0]))

    def forget(self) -> None:
        super().forget()
        self.cache = None

    def _cancelled(self, seq: int) -> bool:
        return seq <= self._stop_upto

    def _drop_cache(self) -> None:
        self.cache = None

    def _do_load(self, model_path: str | None, draft_path: str | None, draft_vocab: str | None = None) -> None:
        """Load a target and its drafter. The models there were stay until both are loaded:
        a failed load keeps them (stage "reload"), or reports "load" when there were none."""
        model_name = model_path or DEFAULT_MODEL_NAME
        kept = self.model is not None
        self._emit(Status(f"target {model_name} …"))
        try:
            model, tokenizer = self.load_target(model_path)
        except Exception as exc:
            message = f"Could not load model {model_name}: {describe_error(exc)}"
            self._emit(Failed(message + ("; keeping the current model." if kept else ""), "reload" if kept else "load"))
            return
        self._emit(Status(f"drafter: {draft_path or f'default drafter for {model_name}'} …"))
        draft, note = None, None
        try:
            draft = self.load_drafter(draft_path, draft_vocab, model)  # draft_vocab: "none", a file, or None
        except Exception as exc:
            note = f"Drafter unavailable ({describe_error(exc)}); continuing with target-only decoding."
        self.forget()
        self.model, self.tokenizer, self.draft, self.refs = model, tokenizer, draft, (model_path, draft_path)
        if note:
            self._emit(Failed(note, "draft"))
        if self.prefix_file is not None:
            self._load_prefix()
        drafter = (draft_path or "default drafter") if draft is not None else None
        self._emit(Loaded(model_name, drafter, len(self.prefix), draft))

    def _load_prefix(self) -> None:
        """Load the prompt cache file as the conversation's cache (a file for another
        target or drafter: a note, and this pair's conversations start from nothing; the
        next load tries the file again). A file saved for the target alone (`cache-prompt
        --no-draft`) fits: baseline turns reuse it, the first DFlash turn prefills it again."""
        from dflash_mlx.cache import cache_ids, load_file

        try:
            self.cache = load_file(self.prefix_file, self.model, self.draft, *cache_ids(*self.refs), target_alone=True)
        except Exception as exc:
            self.prefix = []
            self._emit(Failed(f"Prompt cache not used: {describe_error(exc)}", "draft"))
            return
        self.prefix = list(self.cache.tokens)

    def _do_clear(self) -> None:
        self.cache = None  # with a prompt cache file, the next reply loads it again
        self._emit(Cleared())

    def _do_generate(self, seq: int, messages: list[dict], settings: Settings) -> None:
        baseline = settings.baseline or self.draft is None
        if self._cancelled(seq):
            self._emit(Finished(Snapshot(baseline=baseline), "stopped"))
            return
        if self.model is None:
            self._emit(Failed("No model is loaded (see the message above).", "generate"))
            return
        if self.cache is None and self.prefix:  # the file fits this pair: its cache again
            self._load_prefix()
        if self.cache is None:
            self.cache = self.backend.make_prompt_cache(self.model, self.draft)
        from_draft = 0

        def token(response: Any) -> None:
            nonlocal from_draft
            from_draft += bool(response.from_draft)
            if response.text:
                self._emit(Token(response.text, bool(response.from_draft), Snapshot.of(response, baseline, from_draft)))

        last, reason = self.decode(
            self.prefix + apply_chat_template(self.tokenizer, messages),
            None if baseline else self.draft,
            settings.options,
            self.cache,
            max_tokens=settings.max_tokens,
            cancelled=lambda: self._cancelled(seq),
            on_response=token,
            drop_cache=self._drop_cache,
            on_prefill=lambda done, total: self._emit(Prefill(done, total)),
        )
        stats = Snapshot.of(last, baseline, from_draft) if last else Snapshot(baseline=baseline)
        self._emit(Finished(stats, "stopped" if reason == "cancelled" else reason))
