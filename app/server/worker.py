"""The server's worker: one long-lived thread that owns the model and runs every request.

The thread (an `app.model_thread.ModelThread`, as the chat's engine is) owns the target, the
drafter and the prompt caches. Requests queue in arrival order; `scheduler.Scheduler`
decodes up to `max_batch` of them together (continuous batching), or, where its `policy`
says so, each alone to its end; either way one path emits a request's tokens
(`scheduler.Running.accept`, with its stop check). A request runs until its
end or until its client goes away (checked after every token, so a cancelled request
stops within the cycle it is in). The asyncio side hears back through the job's own
queue, fed thread-safely.

Prompt caches: a few are kept (`CachePool`). A request that extends a conversation whose
tokens a cache holds (the next turn of a chat) continues that cache and prefills only
the new messages. One that shares at least `HOT_PREFIX` tokens with a cache (an agent's
system prompt and tools, sent again with other messages after them) takes that cache (of
several such, the least recently used: the latest conversations keep theirs): it is
trimmed back to the shared prefix and only the rest is prefilled (a hybrid target goes
back to a snapshot there, `dflash_mlx.cache`); the conversation it held then keeps that
prefix only. Any other request takes a fresh cache while there is room, else the one
that shares the longest prefix with it. `usage.prompt_tokens_details.cached_tokens`
says how many prompt tokens were not prefilled.

A prompt is prefilled in chunks (`dflash_mlx.PREFILL_STEP` tokens); one longer than a chunk
logs its progress, and a streamed chat answer's first event (the role) goes out before
the prefill.

The worker's lines (the queue's policy at the start, prefill progress, one line per
finished request) go to the `dflash.server` logger (`LOG`), which `dflash serve` prints
to stderr as bare lines (`print_log`); elsewhere (tests, an embedding program) they are
logging records like any other.
"""

from __future__ import annotations

import logging
import queue
import secrets
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional, Sequence

from app.model_thread import Failed, ModelThread, describe_error
from app.server.jobs import Delta, Done, Job, Metrics, QueueFull
from app.server.request import CompletionRequest, ModelInfo
from app.server.scheduler import MAX_BATCH, Scheduler
from dflash_mlx import PREFILL_STEP, DecodeOptions, context_length

__all__ = ["LOG", "CachePool", "Delta", "Done", "Failed", "Job", "Metrics", "QueueFull", "Worker", "print_log"]

#: Where the worker's lines go (see the module docstring).
LOG = logging.getLogger("dflash.server")


@contextmanager
def print_log() -> Iterator[None]:
    """While it lasts, print the worker's lines (`LOG`, INFO and up) to stderr, each as it
    is: `dflash serve`'s console. `LOG` is as it was afterwards."""
    handler, level = logging.StreamHandler(sys.stderr), LOG.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    LOG.addHandler(handler)
    LOG.setLevel(logging.INFO)
    try:
        yield
    finally:
        LOG.removeHandler(handler)
        LOG.setLevel(level)


#: Prompt tokens shared with a pooled cache that make a request take that cache (fewer:
#: a chat template's opening and a default system prompt, not worth another conversation).
HOT_PREFIX = 128


class CachePool:
    """Up to `size` prompt caches; see the module docstring for which one a prompt gets."""

    def __init__(self, make: Any, size: int = 4, hot: int = HOT_PREFIX):
        self.make, self.size, self.hot = make, size, hot
        self.caches: list = []  # most recently used last

    @staticmethod
    def _shared(tokens: Sequence[int], prompt: Sequence[int]) -> int:
        n = 0
        for a, b in zip(tokens, prompt):
            if a != b:
                break
            n += 1
        return n

    def take(self, prompt: Sequence[int]) -> Any:
        """The cache to decode `prompt` with (marked most recently used)."""
        scored = [(self._shared(c.tokens, prompt), i) for i, c in enumerate(self.caches)]
        # Ties go to the least recently used cache: the latest conversations keep theirs.
        best = max(scored, key=lambda s: (s[0], -s[1]), default=None)
        extends = best is not None and best[0] == len(self.caches[best[1]].tokens) and best[0] > 0
        if extends or (best is not None and (best[0] >= self.hot or len(self.caches) >= self.size)):
            cache = self.caches.pop(best[1])
        else:
            cache = self.make()
        self.caches.append(cache)
        return cache

    def drop(self, cache: Any) -> None:
        """Forget a cache whose state is unknown (a failed or abandoned prefill)."""
        if cache in self.caches:
            self.caches.remove(cache)


class Worker(ModelThread):
    """Loads the model and runs queued requests on its own thread.

    Args:
        model, draft: references for `load` / `load_draft` (None: the defaults).
        options: the server's decoding options (block size, kernels); each request sets
            the sampling ones.
        default_max_tokens: for requests that do not set one.
        max_queue: requests waiting at most (beyond that `submit` raises `QueueFull`).
        cache_slots: prompt caches kept (`CachePool`'s size).
        no_draft: decode with the target alone.
        draft_vocab: the drafter's draft vocabulary file, "none", or None for its own.
        max_batch: requests decoded together at most (1: one at a time).
        log: where prefill progress and finished requests' lines go (default: `LOG.info`).
        sharding: load the target sharded over the ranks of `mlx.launch` (`dflash_mlx.load`).
        ranks: under `mlx.launch`, the other ranks (a `ranks.Ranks`, which imports this
            module, hence `Any` here): rank 0's worker sends them each request; a
            follower's runs what they receive.
        keep_conversations: a directory where each finished chat request's text turns and
            reply are appended (`dflash_mlx.train.transcripts`' conversation log, what
            `dflash adapt` reads); None (the default): nothing is kept.
    """

    def __init__(
        self,
        model: Optional[str] = None,
        draft: Optional[str] = None,
        *,
        options: DecodeOptions = DecodeOptions(),
        default_max_tokens: int = 512,
        max_queue: int = 64,
        cache_slots: int = 4,
        max_batch: int = MAX_BATCH,
        no_draft: bool = False,
        draft_vocab: Optional[str] = None,
        log: Optional[Callable[[str], None]] = None,
        sharding: Optional[str] = None,
        ranks: Any = None,
        keep_conversations: Optional[str] = None,
    ):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"--max-batch must be an integer >= 1, got {max_batch!r}")
        super().__init__("dflash-serve", max_queue=max_queue)
        self.log = log or LOG.info
        self.sharding, self.ranks = sharding, ranks
        self.model_ref, self.draft_ref, self.no_draft, self.draft_vocab = model, draft, no_draft, draft_vocab
        self.options, self.default_max_tokens, self.cache_slots = options, default_max_tokens, cache_slots
        self.info: Optional[ModelInfo] = None
        self.load_error: Optional[str] = None
        self.ready = threading.Event()  # set once loading ended, well or not
        self.running: Optional[Job] = None
        self.served = 0
        self.metrics = Metrics()
        self.pool: Optional[CachePool] = None  # owned by the worker thread
        self.max_batch, self.scheduler = max_batch, None  # the scheduler is made once the model is in
        self.keep_conversations = keep_conversations

    # ---- any thread

    def start(self, timeout: Optional[float] = None) -> ModelInfo:
        """Start the thread and wait for the model; raises RuntimeError if it did not load."""
        self.start_thread()
        self.ready.wait(timeout)
        if self.info is None:
            raise RuntimeError(self.load_error or "the model did not load in time")
        return self.info

    @property
    def waiting(self) -> int:
        """Requests queued and not started."""
        return self.inbox.qsize()

    @property
    def active(self) -> int:
        """Requests decoding now."""
        batched = self.scheduler.jobs if self.scheduler is not None else []
        return len(batched) or int(self.running is not None)

    @property
    def policy(self) -> str:
        """The queue's policy in words (`scheduler.policy`); empty until the model is in."""
        return self.scheduler.policy if self.scheduler is not None else ""

    def submit(self, job: Job) -> None:
        """Queue a job behind those already waiting."""
        try:
            self.inbox.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self.inbox.maxsize} requests are already waiting") from None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Cancel the running requests and stop the thread (queued ones are cancelled)."""
        for job in [self.running, *(self.scheduler.jobs if self.scheduler is not None else [])]:
            if job is not None:
                job.cancel()
        while True:
            try:
                self.inbox.get_nowait().cancel()
            except queue.Empty:
                break
        self.stop_thread(timeout)

    # ---- the worker thread

    def setup(self) -> None:
        """Load the models (a failure is kept in `load_error`; `ready` is set either way)."""
        try:
            self._load()
        except Exception as exc:
            self.load_error = describe_error(exc)
        finally:
            self.ready.set()

    def load_target(self, ref: Optional[str]) -> tuple[Any, Any]:
        if self.sharding is None:
            return super().load_target(ref)
        return self.backend.load(ref, sharding=self.sharding)

    def _load(self) -> None:
        self.model, self.tokenizer = self.load_target(self.model_ref)
        if not self.no_draft:
            self.draft = self.load_drafter(self.draft_ref, self.draft_vocab, self.model)
        self.options.block_limit(self.draft)  # a --block-size the drafter cannot verify fails the start
        self.pool = CachePool(lambda: self.backend.make_prompt_cache(self.model, self.draft), self.cache_slots)
        name = self.model_ref.rstrip("/").rsplit("/", 1)[-1] if self.model_ref else "SmolLM2-135M-Instruct"
        aliases = tuple({self.model_ref, "default"} - {None, name})
        context = context_length(self.model, self.tokenizer)
        has_draft = self.draft is not None
        self.info = ModelInfo(name, self.tokenizer, context, self.default_max_tokens, aliases, has_draft, self.options)
        self.scheduler = Scheduler(self, self.max_batch)
        self.log(f"queue: {self.policy}")

    def handle(self, job: Job) -> None:
        self.running = job
        try:
            self.scheduler.serve(job)  # alone, or batched where the queue's policy allows
        finally:
            self.running = None

    def keep(self, req: CompletionRequest, reply: str) -> None:
        """Append a finished chat request's turns and reply to the conversation log
        (`--keep-conversations`; rank 0 alone under `mlx.launch`)."""
        if self.keep_conversations is None or not req.messages or (self.ranks is not None and not self.ranks.leader):
            return
        from dflash_mlx.train.transcripts import append_conversation_log, conversation_log_record

        append_conversation_log(self.keep_conversations, conversation_log_record(req.messages, reply, req.model))

    def finished(self, done: Done) -> None:
        """Count a finished request, and log its line."""
        self.served += 1
        self.metrics.record(done)
        self.log(done.summary())

    def next_item(self) -> Optional[Job]:
        if self.scheduler is not None and self.scheduler.stopping:
            return None
        if self.ranks is None or self.ranks.leader:
            return super().next_item()
        return self.ranks.next_job(self)  # a follower runs rank 0's requests

    def failed(self, job: Job, message: str) -> None:
        self.metrics.finished["failed"] += 1
        job.emit(Failed(message))

    def forget(self) -> None:
        if self.ranks is not None and self.ranks.leader and self.info is not None:
            self.ranks.send(None)  # the thread is ending: so do the followers
        super().forget()
        self.pool = None

    def request_options(self, req: CompletionRequest) -> DecodeOptions:
        """The request's options as decoded. Unseeded sampled requests get a fresh random
        seed (the text of a seed does not depend on the block sizes the loop picks)."""
        options = req.options
        if options.temp > 0 and options.seed is None:
            return replace(options, seed=secrets.randbits(63))
        return options

    def prefill_progress(self) -> Callable[[int, int], None]:
        """A prefill callback that logs each chunk of a prompt longer than one."""
        tic = time.perf_counter()

        def progress(done: int, total: int) -> None:
            if total > PREFILL_STEP:
                seconds = time.perf_counter() - tic
                self.log(f"prefill {done}/{total} prompt tokens ({seconds:.1f} s)")

        return progress
