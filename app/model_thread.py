"""The model's own thread: what the chat's `Engine` and the server's `Worker` share.

MLX streams are thread-local, so the target, the drafter and the prompt caches are
created, used and dropped on one long-lived thread, and the front ends talk to it
through its inbox. `ModelThread` is that thread: it takes items from the inbox one at
a time (the subclass says what an item is), never dies of a failure (every one becomes
one line, `describe_error`, sent back as `Failed`), loads the models, and runs one
generation at a time (`decode`): cancelled between tokens, or inside a prefill by an
exception raised from the prefill callback, and a cache whose state is unknown after
either (part of a prompt, a failure) is dropped.
"""

from __future__ import annotations

import gc
import queue
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import dflash_mlx
import mlx.core as mx
from dflash_mlx import DecodeOptions, OptionError, one_line

from app.flags import flag_error

__all__ = ["Cancelled", "Failed", "ModelThread", "describe_error"]


@dataclass(frozen=True)
class Failed:
    """Something failed on the model's thread; `message` is one line."""

    message: str
    stage: str = "generate"  # "load" | "reload" (the models there were are kept) | "draft" | "generate"


class Cancelled(Exception):
    """Raised in the prefill callback to abandon a cancelled generation's prefill."""


def describe_error(exc: BaseException) -> str:
    """A one-line message a person can act on; a bad option named by its flag (`--block-size`),
    which is where the chat's and the server's options come from."""
    if isinstance(exc, OptionError):
        return flag_error(exc)
    text = one_line(exc)
    lowered = text.lower()
    if isinstance(exc, MemoryError) or "out of memory" in lowered or "malloc" in lowered:
        return f"Out of memory: {text}. Try /clear, a smaller --max-tokens or a smaller model."
    if isinstance(exc, FileNotFoundError):
        return f"Not found: {text}"
    if isinstance(exc, ValueError):
        return text
    return f"{type(exc).__name__}: {text}"


class ModelThread:
    """One thread that owns the model and does every MLX evaluation.

    Subclasses say what an inbox item is (`handle`) and how a failure is reported
    (`failed`); `setup` runs first on the thread. `backend` is the engine module
    (`dflash_mlx`: `load`, `load_draft`, `make_prompt_cache`, `stream_generate`); the
    chat's tests pass a scripted stand-in with the same four functions.
    """

    def __init__(self, name: str, backend: Any = None, max_queue: int = 0):
        self.backend = backend or dflash_mlx
        self.inbox: queue.Queue = queue.Queue(max_queue)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.model = self.tokenizer = self.draft = None  # owned by the thread

    # ---- any thread

    def start_thread(self) -> None:
        """Start the thread (`setup`, then the inbox's items)."""
        self._thread.start()

    def join_thread(self) -> None:
        """Wait for the thread to end by itself (`next_item` returned None)."""
        self._thread.join()

    def stop_thread(self, timeout: float) -> None:
        """Let the thread finish its item, end it, and wait up to `timeout` seconds."""
        self.inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.ident is not None and not self._thread.is_alive():
            # MLX may abort at process exit ("terminate called without an active exception")
            # while arrays made on a thread that has ended are still alive: free the
            # thread's (some sit in reference cycles) and replace the global random key.
            gc.collect()
            mx.random.seed(secrets.randbits(63))

    # ---- the thread

    def setup(self) -> None:
        """Runs on the thread before the first item."""

    def handle(self, item: Any) -> None:
        """Run one inbox item (the subclass's); an exception becomes `failed`."""
        raise NotImplementedError

    def failed(self, item: Any, message: str) -> None:
        """Report that `item` failed (`message`: one line)."""
        raise NotImplementedError

    def next_item(self) -> Any:
        """The next item to handle, None to end the thread (by default: from the inbox)."""
        return self.inbox.get()

    def forget(self) -> None:
        """Drop every MLX object the thread holds (it is ending)."""
        self.model = self.tokenizer = self.draft = None

    def _run(self) -> None:
        self.setup()
        while (item := self.next_item()) is not None:
            try:
                self.handle(item)
            except Exception as exc:  # never let the thread die
                self.failed(item, describe_error(exc))
        self.forget()

    def load_target(self, ref: Optional[str]) -> tuple[Any, Any]:
        """(model, tokenizer) of `ref` (None: the default model); the thread's are untouched."""
        return self.backend.load(ref)

    def load_drafter(self, ref: Optional[str], draft_vocab: Optional[str], model: Any) -> Any:
        """The drafter `ref` (None: the default for `model`), checked against `model`."""
        return self.backend.load_draft(ref, model=model, draft_vocab=draft_vocab)

    def decode(
        self,
        prompt: Sequence[int],
        draft: Any,
        options: DecodeOptions,
        cache: Any,
        *,
        max_tokens: int,
        cancelled: Callable[[], bool],
        on_response: Callable[[Any], None],
        drop_cache: Callable[[], None],
        on_prefill: Optional[Callable[[int, int], None]] = None,
        stop: Sequence[str] = (),
    ) -> tuple[Any, str]:
        """One generation with `cache`: `on_response` sees every response. Returns the
        last response (None if there was none) and its finish reason, or "cancelled"
        when `cancelled()` turned true first. After a cancelled prefill or any failure
        `drop_cache()` is called (a failure is then raised again)."""

        def progress(done: int, total: int) -> None:
            if cancelled():
                raise Cancelled
            if on_prefill is not None:
                on_prefill(done, total)

        responses = self.backend.stream_generate(
            self.model,
            self.tokenizer,
            prompt,
            draft,
            options,
            max_tokens=max_tokens,
            stop=stop,
            prompt_cache=cache,
            prompt_progress_callback=progress,
        )
        last = None
        try:
            for last in responses:
                on_response(last)
                if last.finish_reason is not None:
                    return last, last.finish_reason
                if cancelled():
                    break
        except Cancelled:
            drop_cache()  # part of the prompt may be in it
        except Exception:
            drop_cache()  # its state is unknown after a failure
            raise
        finally:
            responses.close()
        return last, "cancelled"
