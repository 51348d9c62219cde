"""The chat's engine: one long-lived thread that owns the model and does all MLX work.

MLX streams are thread-local, so the model, the drafter and the prompt caches are
created, used and dropped on a single worker thread. The UI talks to it through a
command queue (`load`, `generate`, `clear`, `stop`) and hears back through a callback
that receives the event objects defined below. The callback runs on the worker thread:
it must hand the event over to the UI thread (Textual's `post_message` does that).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable

from dflash_mlx.errors import one_line
from dflash_mlx.messages import apply_chat_template
from dflash_mlx.options import DecodeOptions

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
BAR_HISTORY = 64  # how many of the last blocks' accepted lengths the events carry


# --------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """What every `generate` command carries: how to decode, how long, with the drafter or not."""

    options: DecodeOptions = DecodeOptions()
    max_tokens: int = 512
    baseline: bool = False  # target-only decoding through the same loop

    def describe(self, has_draft: bool = True, block_in_use: int | None = None) -> str:
        """The footer line; `block_in_use`: the block size of the last cycle, if any."""
        o = self.options
        mode = "baseline (target only)" if self.baseline or not has_draft else "DFlash"
        size = o.block_size or ("auto" + (f" ({block_in_use})" if block_in_use else ""))
        block = "" if self.baseline or not has_draft else f" B={size}"
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
    size_histogram: tuple[int, ...] = ()  # [b - 1]: cycles that verified b tokens
    cycles: int = 0
    mean_acceptance: float = 0.0
    accepted_lengths: tuple[int, ...] = ()  # the last BAR_HISTORY blocks
    drafted_tokens: int = 0
    accepted_drafted_tokens: int = 0
    draft_tokens_out: int = 0  # tokens of the reply that came from accepted drafts

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def prefilled(self) -> int:
        return self.prompt_tokens - self.prompt_cached

    @property
    def target_tokens(self) -> int:
        return self.generation_tokens - self.draft_tokens_out


@dataclass(frozen=True)
class Status:
    """Something slow is under way (loading); `text` says what."""

    text: str


@dataclass(frozen=True)
class Loaded:
    model: str
    draft: str | None  # None: no drafter, target-only decoding


@dataclass(frozen=True)
class Prefill:
    done: int
    total: int


@dataclass(frozen=True)
class Token:
    text: str
    from_draft: bool
    stats: Snapshot


@dataclass(frozen=True)
class Finished:
    stats: Snapshot
    reason: str  # "stop" | "length" | "stopped" (by the user)


@dataclass(frozen=True)
class Failed:
    message: str
    stage: str  # "load" | "draft" | "generate"


@dataclass(frozen=True)
class Cleared:
    pass


Event = Status | Loaded | Prefill | Token | Finished | Failed | Cleared


# --------------------------------------------------------------------------- helpers


class _Stopped(Exception):
    """Raised inside the prefill progress callback to abandon a prefill."""


def describe_error(exc: BaseException) -> str:
    """A one-line message a person can act on."""
    text = one_line(exc)
    lowered = text.lower()
    if isinstance(exc, MemoryError) or "out of memory" in lowered or "malloc" in lowered:
        return f"Out of memory: {text}. Try /clear, a smaller --max-tokens or a smaller model."
    if isinstance(exc, FileNotFoundError):
        return f"Not found: {text}"
    if isinstance(exc, ValueError):
        return text
    return f"{type(exc).__name__}: {text}"


def _snapshot(response: Any, baseline: bool, draft_tokens_out: int) -> Snapshot:
    stats = getattr(response, "stats", None)
    lengths = list(getattr(stats, "accepted_lengths", None) or ())
    prompt_tokens = getattr(response, "prompt_tokens", 0) or 0
    cached = getattr(stats, "prompt_cached", 0) or 0
    return Snapshot(
        generation_tokens=getattr(response, "generation_tokens", 0) or 0,
        generation_tps=getattr(response, "generation_tps", 0.0) or 0.0,
        prompt_tokens=prompt_tokens,
        prompt_cached=cached,
        prompt_tps=getattr(response, "prompt_tps", 0.0) or 0.0,
        peak_memory=getattr(response, "peak_memory", 0.0) or 0.0,
        baseline=baseline,
        block_size=getattr(stats, "block_size", None),
        block_in_use=(getattr(stats, "block_sizes", None) or [None])[-1],
        size_histogram=tuple(getattr(stats, "size_histogram", None) or ()),
        cycles=getattr(stats, "cycles", 0) or 0,
        mean_acceptance=getattr(stats, "mean_acceptance", 0.0) or 0.0,
        accepted_lengths=tuple(lengths[-BAR_HISTORY:]),
        drafted_tokens=getattr(stats, "drafted_tokens", 0) or 0,
        accepted_drafted_tokens=getattr(stats, "accepted_drafted_tokens", 0) or 0,
        draft_tokens_out=draft_tokens_out,
    )


# --------------------------------------------------------------------------- engine


class Engine:
    """Owns the model on one worker thread; every method here is safe to call from the UI.

    Args:
        on_event: called on the worker thread with each event.
        backend: the module providing `load`, `load_draft`, `make_prompt_cache` and
            `stream_generate` (default: `dflash_mlx`; tests pass a fake).
    """

    def __init__(self, on_event: Callable[[Event], None], backend: Any = None) -> None:
        self._emit = on_event
        self._backend = backend
        self._commands: queue.Queue = queue.Queue()
        self._seq_lock = threading.Lock()
        self._submitted = 0  # generate commands handed in so far
        self._stop_upto = 0  # every generate command numbered <= this is cancelled
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        # Owned by the worker thread only:
        self.model = None
        self.tokenizer = None
        self.draft = None
        self.cache = None  # the conversation's KV state, shared by DFlash and baseline

    # ---- UI side

    def start(self) -> None:
        self._thread.start()

    def load(self, model: str | None = None, draft: str | None = None, draft_vocab: str | None = None) -> None:
        self._commands.put(("load", model, draft, draft_vocab))

    def generate(self, messages: list[dict], settings: Settings) -> int:
        """Queue a reply to `messages`; returns the generation's number."""
        with self._seq_lock:
            self._submitted += 1
            seq = self._submitted
        self._commands.put(("generate", seq, [dict(m) for m in messages], replace(settings)))
        return seq

    def stop(self) -> None:
        """Stop the running generation (and any queued one) as soon as possible."""
        with self._seq_lock:
            self._stop_upto = self._submitted

    def clear(self) -> None:
        """Forget the conversation's KV state."""
        self._commands.put(("clear",))

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stop()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- worker side

    def _cancelled(self, seq: int) -> bool:
        return seq <= self._stop_upto

    def _run(self) -> None:
        if self._backend is None:
            import dflash_mlx  # the real engine (tests pass a fake backend)

            self._backend = dflash_mlx
        while (command := self._commands.get()) is not None:
            name, *args = command
            try:
                getattr(self, f"_do_{name}")(*args)
            except Exception as exc:  # never let the worker die
                self._emit(Failed(describe_error(exc), name))
        self.model = self.tokenizer = self.draft = self.cache = None

    def _do_load(self, model_path: str | None, draft_path: str | None, draft_vocab: str | None = None) -> None:
        self.model = self.tokenizer = self.draft = self.cache = None
        model_name = model_path or DEFAULT_MODEL_NAME
        self._emit(Status(f"target {model_name} …"))
        try:
            self.model, self.tokenizer = self._backend.load(model_path)
        except Exception as exc:
            self._emit(Failed(f"Could not load model {model_name}: {describe_error(exc)}", "load"))
            return
        draft_name = draft_path or f"default drafter for {model_name}"
        self._emit(Status(f"drafter: {draft_name} …"))
        try:
            extra = {"draft_vocab": draft_vocab} if draft_vocab else {}  # "none", or a draft_vocab.json
            self.draft = self._backend.load_draft(draft_path, model=self.model, **extra)
        except Exception as exc:
            self._emit(
                Failed(
                    f"Drafter unavailable ({describe_error(exc)}); continuing with target-only decoding.",
                    "draft",
                )
            )
            self._emit(Loaded(model_name, None))
            return
        self._emit(Loaded(model_name, draft_path or "default drafter"))

    def _do_clear(self) -> None:
        self.cache = None
        self._emit(Cleared())

    def _do_generate(self, seq: int, messages: list[dict], settings: Settings) -> None:
        baseline = settings.baseline or self.draft is None
        if self._cancelled(seq):
            self._emit(Finished(Snapshot(baseline=baseline), "stopped"))
            return
        if self.model is None:
            self._emit(Failed("No model is loaded (see the message above).", "generate"))
            return
        draft = None if baseline else self.draft
        prompt = apply_chat_template(self.tokenizer, messages)
        if self.cache is None:
            self.cache = self._backend.make_prompt_cache(self.model, self.draft)

        def progress(done: int, total: int) -> None:
            if self._cancelled(seq):
                raise _Stopped
            self._emit(Prefill(done, total))

        responses = self._backend.stream_generate(
            self.model,
            self.tokenizer,
            prompt,
            draft,
            settings.options,
            max_tokens=settings.max_tokens,
            prompt_cache=self.cache,
            prompt_progress_callback=progress,
        )
        last = None
        from_draft = 0
        reason = "stop"
        try:
            for response in responses:
                last = response
                from_draft += bool(getattr(response, "from_draft", False))
                snap = _snapshot(response, baseline, from_draft)
                if response.text:
                    self._emit(Token(response.text, bool(response.from_draft), snap))
                if response.finish_reason is not None:
                    reason = response.finish_reason
                if self._cancelled(seq):
                    reason = "stopped"
                    break
        except _Stopped:
            # Abandoned mid-prefill: the cache may hold part of the prompt, drop it.
            self.cache = None
            reason = "stopped"
        except Exception as exc:
            self.cache = None  # its state is unknown after a failure
            self._emit(Failed(describe_error(exc), "generate"))
            return
        finally:
            responses.close()
        stats = _snapshot(last, baseline, from_draft) if last else Snapshot(baseline=baseline)
        self._emit(Finished(stats, reason))
