"""A request on its way through the server's worker, and what comes back from it.

`Job` carries a checked request to the worker thread and its events (`Delta`, `Done`,
`Failed`) back to the handler's event loop; `Metrics` keeps the running totals `/metrics`
reads. Both the one-at-a-time path (`worker`) and continuous batching (`scheduler`)
make their events here, so a request's answer does not depend on which ran it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, _byte_decoder

from dflash_mlx.topk import top_k_columns

from app.model_thread import Failed
from app.server.openai_api import TokenLogprob
from app.server.request import CompletionRequest

__all__ = ["Delta", "Done", "Failed", "Job", "Metrics", "QueueFull", "stop_hit", "token_logprob"]


@dataclass(frozen=True)
class Delta:
    """New text of a running request, and its tokens' log-probabilities if asked for."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Done:
    """A request finished: "stop" (EOS or a stop string), "length" or "cancelled";
    `stop_sequence`: the stop string that ended it, if one did."""

    finish_reason: str
    stop_sequence: Optional[str] = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stats: Any = None  # dflash_mlx.GenerationStats
    generation_tps: float = 0.0
    prompt_tps: float = 0.0
    queue_seconds: float = 0.0  # from its arrival to its start

    def summary(self) -> str:
        """The server log's line for this request: tokens, speed, tau (over its cycles; a
        batch cycle counts at its width), time in the queue."""
        tau = (
            f", tau {self.stats.mean_acceptance:.2f}" if self.stats is not None and self.stats.accepted_lengths else ""
        )
        return (
            f"request done ({self.finish_reason}): {self.completion_tokens} tokens, "
            f"{self.generation_tps:.1f} tok/s{tau}, queued {self.queue_seconds:.2f} s"
        )


@dataclass
class Metrics:
    """Running totals over the served requests, for `/metrics`. The worker thread writes
    all but `rejected` (the server's, for requests refused before the queue); readers on
    other threads may see one request's fields half-added, as scrapes tolerate."""

    finished: Counter = field(default_factory=Counter)  # requests by finish reason
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from a prompt cache
    cache_hits: int = 0  # requests that read some
    completion_tokens: int = 0
    generation_seconds: float = 0.0
    cycles: int = 0  # draft/verify cycles, and the tokens they committed
    committed: int = 0
    last_tokens_per_second: float = 0.0
    queue_seconds: float = 0.0  # requests' time in the queue, summed
    batch_steps: int = 0  # batched cycles (continuous batching): one target forward each, and their rows
    batch_rows: int = 0
    batch_drafted: int = 0  # those that verified a drafted block per row
    occupancy: int = 0  # rows in the last batch cycle
    prefilled: int = 0  # prompt tokens run through the target (not read from a cache)
    caught_up: int = 0  # tokens decoded in a batch, run through the target again for the drafter

    def record(self, done: Done) -> None:
        """Add a finished request."""
        self.finished[done.finish_reason] += 1
        self.queue_seconds += done.queue_seconds
        self.prompt_tokens += done.prompt_tokens
        self.cached_tokens += done.cached_tokens
        self.cache_hits += done.cached_tokens > 0
        self.completion_tokens += done.completion_tokens
        if done.generation_tps > 0:
            self.generation_seconds += done.completion_tokens / done.generation_tps
            self.last_tokens_per_second = done.generation_tps
        if done.stats is not None:
            self.cycles += len(done.stats.accepted_lengths)
            self.committed += done.stats.committed

    def stepped(self, rows: int, width: int) -> None:
        """Add a batched cycle of `rows` rows that verified `width` tokens per row (1: a
        plain step)."""
        self.batch_steps += 1
        self.batch_drafted += width > 1
        self.batch_rows += rows
        self.occupancy = rows

    def fed(self, tokens: int, again: bool) -> None:
        """Add a prefill of `tokens` tokens: a prompt's, or (`again`) a request's that goes
        back to decoding alone and gives the drafter the tokens it decoded in a batch."""
        if again:
            self.caught_up += tokens
        else:
            self.prefilled += tokens

    @property
    def tau(self) -> float:
        """Mean tokens committed per cycle over all requests (0 before the first cycle)."""
        return self.committed / self.cycles if self.cycles else 0.0


class QueueFull(Exception):
    """The worker's queue is at its bound."""


@dataclass
class Job:
    """A request on its way through the worker, and the channel back to its handler."""

    request: CompletionRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    generated: int = 0  # tokens so far (written by the worker)
    generated_at_cancel: Optional[int] = None
    queued_at: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Stop this request (its client went away); safe from any thread, idempotent."""
        if not self.cancelled.is_set():
            self.generated_at_cancel = self.generated
            self.cancelled.set()

    def emit(self, event: Delta | Done | Failed) -> None:
        """Hand an event to the handler's event loop (called on the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is gone: nobody is listening any more
            self.cancel()


#: SentencePiece's word boundary, a space in the text.
SPM_SPACE = "\u2581".encode()


def _token_bytes(tokenizer: Any, detokenizer: Any, token: int) -> bytes:
    """The bytes `token` adds to a reply, read from its piece as mlx-lm's streaming
    `detokenizer` reads it: a byte-fallback piece (SentencePiece's <0xNN>) is its byte, a
    byte-level BPE piece (GPT-2's alphabet) the bytes its characters stand for. Other
    tokenizers (and ids past the vocabulary) give their decoded text's."""
    pieces = detokenizer.tokenmap if isinstance(detokenizer, (SPMStreamingDetokenizer, BPEStreamingDetokenizer)) else ()
    if token >= len(pieces):
        return tokenizer.decode([token]).encode()
    piece = pieces[token]
    if isinstance(piece, bytes):  # SentencePiece's, with <0xNN> pieces already their byte
        return piece.replace(SPM_SPACE, b" ")
    alphabet = _byte_decoder()
    return b"".join(bytes([alphabet[c]]) if c in alphabet else c.encode() for c in piece)


def token_logprob(tokenizer: Any, token: int, logprobs: mx.array, top: int) -> TokenLogprob:
    """The target's log-probability of `token` (from `logprobs` (V,), the log-softmax of
    the target's logits there, as in mlx-lm) and its `top` alternatives."""
    detokenizer = tokenizer.detokenizer  # a fresh copy that shares mlx-lm's piece table

    def entry(i: int, value: float, alternatives: tuple = ()) -> TokenLogprob:
        return TokenLogprob(tokenizer.decode([i]), _token_bytes(tokenizer, detokenizer, i), value, alternatives)

    alternatives: tuple = ()
    if top:
        ids = top_k_columns(logprobs, top)
        ranked = sorted(zip(logprobs[ids].tolist(), ids.tolist()), reverse=True)
        alternatives = tuple(entry(i, value) for value, i in ranked)
    return entry(token, logprobs[token].item(), alternatives)


def stop_hit(whole: str, sent: str, stops: Sequence[str]) -> Optional[str]:
    """The stop string that ended a generation: the text sent stops where it begins."""
    return next((s for s in stops if whole.startswith(s, len(sent))), None)
