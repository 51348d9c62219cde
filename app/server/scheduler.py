"""Continuous batching on the server's worker thread: concurrent requests share target forwards.

Everything runs on the worker's one thread (`worker.Worker`, which owns the model, the
drafter, the prompt-cache pool and the inbox); the scheduler decides what that thread
does next. A request alone decodes speculatively with the drafter (the one-sequence
loop). When another arrives, the running one stops at the end of its cycle and both go on
as rows of one `dflash_mlx.batch_spec.BatchSpeculator`, every row with its own sampling;
newcomers join while there is room (`max_batch` rows, the rest wait in order), their
prompts prefilled one chunk between two batch cycles so that a long prompt does not stall
the others. The rows speculate: each cycle is a plain batched step or a drafted block per
row (or prompt lookup's guess from the row's own tokens, where its record says that
promises more: `--lookup`) verified in one target forward, its width (`widths_up_to`: 1,
4 or the block size) chosen from the rows' acceptance and the (rows, width) cost table,
then the costs measured, which the scheduler keeps from one batch to the next. Sliding-window families and a
server without a drafter take plain batched steps (`batch_spec.speculation_refusal`).
A cycle commits 1 .. width tokens per row (none to a row that joined during a pipelined
plain step: its first comes with the step after), taken one by one as alone: a row leaves at
its end (EOS, a stop string, `max_tokens`, even inside a block: the block's later
tokens are dropped) or when its client goes away. A row left alone with `RESUME` tokens
or more to go returns to decoding alone.

Each request has its own prompt cache (`Running.cache`, a sequence from the worker's
pool, so that hot prefixes and the next turn of a conversation are reused whether it
decodes alone or batched). It joins the batch from that cache, which then holds every
token of its prompt and of its answer so far but the last (fed by its first step), in
the target and in the drafter's context: a request that was decoding alone stops at the
end of a cycle and joins with what its cache holds, nothing prefilled again (but on a
hybrid target after a plain step, which fed the last token already: a recurrent state
cannot drop it, so the cache goes back to its snapshot at the end of its last prefill
and prefills the tokens since); a newcomer's prompt is prefilled into its cache through
the loop, the drafter's context with it. The batch copies the target cache and takes a
copy of the drafter's context (`PromptCache.context_copy`), so the pooled cache stays as
the request joined. A row that goes back to decoding alone continues from the row's own
caches (`extract`, `context`, `PromptCache.take_over`): nothing runs again. Where the
batch kept no features for the row (plain steps of a sliding-window family) it
continues its pooled cache instead, the target running again over the tokens the row
decoded in the batch, for the drafter's context.

Hand-overs are exact: a row's token at position t is drawn from the key (seed, t) alone,
in the batch as in the speculative loop, so a request that moves continues with the
very tokens it would have drawn alone. Each request keeps its own `TokenText` (its
detokenizer and stop strings), fed its tokens whichever decoding drew them, so its text,
stop and finish reason never depend on who shared the batch. Its `stats` count every
cycle: its speculative ones alone, and each batch cycle at its width with the drafts
the row accepted and took.

`policy` says when requests are served one at a time instead (each decodes alone to its
end, through the same `Running`: one path emits every request's tokens, with one stop
check): `--max-batch 1`, under `mlx.launch` (every rank decodes each request, stopping
together: `ranks.Ranks.run`), a quantized KV cache, a target family with no tested batch
form (`dflash_mlx.batch.refusal`).
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Optional

import mlx.core as mx

from app.model_thread import describe_error
from app.server import MAX_BATCH
from app.server.jobs import Delta, Done, Job, stop_hit, token_logprob
from dflash_mlx import DecodeOptions, GenerationStats
from dflash_mlx.acceptance import Acceptance, Records
from dflash_mlx.batch import cache_length, refusal
from dflash_mlx.batch_spec import BatchSpeculator
from dflash_mlx.batch_width import BatchWidth
from dflash_mlx.text import TokenText

__all__ = ["MAX_BATCH", "RESUME", "SOLO", "Running", "Scheduler", "policy", "widths_up_to"]

SOLO = "first come, first served: one request runs at a time on one worker thread, the rest wait in order"
#: Tokens a lone row must still have to go back to speculative decoding (fewer: not worth a prefill).
RESUME = 32
#: Prompt tokens a joining request prefills per forward: a batch step waits for at most one chunk.
PREFILL_CHUNK = 256


def policy(max_batch: int, model: Any, options: DecodeOptions, ranks: Any = None) -> tuple[bool, str]:
    """Whether requests decode together, and the queue's policy in words (`/health`, the
    start-up log)."""
    if max_batch == 1:
        reason: Optional[str] = "--max-batch 1"
    elif ranks is not None:
        reason = "under mlx.launch every rank decodes each request"
    elif options.kv_bits is not None:
        reason = "--kv-bits: a quantized KV cache has no batch form"
    else:
        reason = refusal(model)
    if reason is not None:
        return False, f"{SOLO} ({reason})"
    return True, (
        f"continuous batching: up to {max_batch} requests decode together on one worker thread "
        "(a request alone decodes speculatively), the rest wait in order"
    )


@dataclass(eq=False)
class Running:
    """A started request: its tokens so far, its text stream, its end once it came."""

    job: Job
    options: DecodeOptions  # sampled requests carry their seed
    stream: TokenText
    queue_seconds: float
    tokens: list[int] = field(default_factory=list)
    sent: list[str] = field(default_factory=list)
    reason: Optional[str] = None  # its finish reason, once it ended
    cache: Any = None  # its sequence (`dflash_mlx.make_prompt_cache`) from the worker's pool
    # every cycle it ran: speculative ones alone, and each batch cycle at its width
    stats: GenerationStats = field(default_factory=GenerationStats)
    cached: int = 0  # prompt tokens read from a pooled cache
    prompt_seconds: float = 0.0
    first: float = 0.0  # when its first token came

    @property
    def left(self) -> int:
        """Tokens it may still generate."""
        return self.job.request.max_tokens - len(self.tokens)

    def accept(self, tokenizer: Any, token: int, logprobs: Optional[mx.array]) -> bool:
        """Take the request's next token and its log-probabilities (V,) (whichever
        decoding drew it), emit its text; True when the request ends with it."""
        req, n = self.job.request, len(self.tokens) + 1
        self.tokens.append(token)
        self.job.generated = n
        self.first = self.first or time.perf_counter()
        text, self.reason = self.stream.push(token, n)
        # as OpenAI does, an EOS token has no log-probability entry (it has no text)
        wanted = req.logprobs is not None and token not in tokenizer.eos_token_ids
        entry = (token_logprob(tokenizer, token, logprobs, req.logprobs),) if wanted else ()
        if text:
            self.sent.append(text)
        if text or entry:
            self.job.emit(Delta(text, entry))
        return self.reason is not None

    def done(self, tokenizer: Any) -> Done:
        """Its `Done` (the stop string that ended it, speed, its stats)."""
        req, stop, reason = self.job.request, None, self.reason or "cancelled"
        if reason == "stop" and req.stop and self.tokens[-1] not in tokenizer.eos_token_ids:
            stop = stop_hit(tokenizer.decode(self.tokens), "".join(self.sent), req.stop)
        seconds = time.perf_counter() - self.first if self.first else 0.0
        tps = len(self.tokens) / seconds if seconds > 0 else 0.0
        prompt_tps = (len(req.prompt) - self.cached) / self.prompt_seconds if self.prompt_seconds else 0.0
        n, cached = len(self.tokens), self.cached
        return Done(reason, stop, n, len(req.prompt), cached, self.stats, tps, prompt_tps, self.queue_seconds)


def widths_up_to(limit: int) -> BatchWidth:
    """The batch's width chooser: plain steps, and drafted blocks of 4 and of `limit`
    tokens (at most `limit`: the server's block size, or its drafter's). The scheduler keeps
    one, so that the (rows, width) costs it measured carry from one batch to the next."""
    return BatchWidth(sorted({1, min(4, limit), limit}))


class _Joining(NamedTuple):
    """A request on its way into the batch: its prefill's chunks, and how many tokens its
    cache holds once they are in."""

    run: Running
    chunks: Iterator[int]
    total: int


class Scheduler:
    """Runs requests on `worker`'s thread, batched while several are there (see the module
    docstring). `worker` is the `worker.Worker` whose thread calls `serve`."""

    def __init__(self, worker: Any, max_batch: int):
        self.worker, self.max_batch = worker, max_batch
        self.batched, self.policy = policy(max_batch, worker.model, worker.options, worker.ranks)
        self.jobs: list[Job] = []  # requests started and not ended (any thread may read it)
        self.stopping = False  # the inbox said stop while a batch ran
        self.resumed = 0  # rows that went back to speculative decoding
        self.widths = widths_up_to(worker.options.block_limit(worker.draft))

    def serve(self, job: Job) -> None:
        """Run `job`, and every request that joins it, to their ends."""
        run: Optional[Running] = self._start(job)
        try:
            while run is not None:
                self._alone(run)
                if run.reason is not None or run.job.cancelled.is_set() or not self.batched:
                    self._finish(run)
                    return
                run = self._batch(run)
        except Exception as exc:  # every request that was running hears of it
            message = describe_error(exc)
            for failed in self.jobs:
                self.worker.failed(failed, message)
            self.jobs.clear()

    def _start(self, job: Job) -> Running:
        req, queued = job.request, time.perf_counter() - job.queued_at
        self.jobs.append(job)
        stream = TokenText(self.worker.tokenizer, req.stop, req.max_tokens)
        stats = GenerationStats(block_size=self.widths.widths[-1])
        return Running(job, self.worker.request_options(req), stream, queued, stats=stats)

    def _finish(self, run: Running) -> None:
        done = run.done(self.worker.tokenizer)
        if done.finish_reason in ("stop", "length"):  # a whole reply: kept where the server keeps them
            self.worker.keep(run.job.request, "".join(run.sent))
        run.job.emit(done)
        self.jobs.remove(run.job)
        self.worker.finished(done)

    def _waiting(self) -> bool:
        return not self.worker.inbox.empty()

    def _alone(self, run: Running) -> None:
        """Decode `run` speculatively until it ends, is cancelled, or (at the end of a cycle
        that gave it a token more) another request waits."""
        if run.job.cancelled.is_set():  # before it started (its client left while it waited)
            return
        w, fresh = self.worker, not run.tokens
        fed = run.job.request.prompt + run.tokens
        run.cache = w.pool.take(fed)  # its own, unless another request took it over meanwhile
        tic, had, closed = time.perf_counter(), len(run.tokens), [False]

        def stops() -> bool:
            waited = self.batched and len(run.tokens) > had and closed[0] and self._waiting()
            return run.job.cancelled.is_set() or run.reason is not None or waited

        def response(r: Any) -> None:
            if run.reason is None:
                if fresh and not run.tokens:
                    run.cached, run.prompt_seconds = r.stats.prompt_cached, time.perf_counter() - tic
                closed[0] = not r.from_draft  # a cycle's last token is the target's own
                run.accept(w.tokenizer, r.token, r.logprobs)

        last = self._decode(run, fed, run.left, response, stops, w.prefill_progress(), drawn=not fresh)
        if last is not None:
            run.stats.absorb(last.stats)

    def _decode(
        self,
        run: Running,
        fed: list[int],
        max_tokens: int,
        on_response: Any,
        stops: Any,
        progress: Any = None,
        drawn: bool = False,
    ) -> Any:
        """The speculative loop on `run`'s cache over `fed` (its prompt and answer so far);
        the prefill it starts with is counted in the metrics (`drawn`: `fed` ends with a
        token drawn and never fed yet, which is not run again). Its last response, if any."""
        w, first = self.worker, [True]

        def response(r: Any) -> None:
            if first[0]:
                w.metrics.fed(len(fed) - r.stats.prompt_cached - drawn, again=bool(run.tokens))
                first[0] = False
            on_response(r)

        if w.ranks is not None:  # every rank decodes it (never batched); they stop together
            stops, response = w.ranks.run(run.job.request, run.options, stops, response)
        last, _ = w.decode(
            fed,
            w.draft,
            run.options,
            run.cache,
            max_tokens=max_tokens,
            cancelled=stops,
            on_response=response,
            drop_cache=lambda: w.pool.drop(run.cache),
            on_prefill=progress,
        )
        return last

    def _batch(self, first: Running) -> Optional[Running]:
        """Decode `first` and whoever comes as rows of one batch, until none is left (None)
        or one is left alone with `RESUME` tokens to go (that one, to decode alone)."""
        decoder, rows = BatchSpeculator(self.worker.model, self.worker.draft, self.widths), {}
        joining = [self._joining(first)]
        while True:
            self._admit(joining, len(rows))
            if joining:
                self._prefill_chunk(decoder, rows, joining)
            self._drop_cancelled(decoder, rows, joining)
            if rows:
                self._cycle(decoder, rows)
            if not rows and not joining:
                return None
            if len(rows) == 1 and not joining and not self._waiting():
                ((uid, run),) = rows.items()
                if run.left >= RESUME:
                    self._leave(decoder, uid, run)
                    decoder.remove(uid)
                    self.resumed += 1
                    return run

    def _joining(self, run: Running) -> _Joining:
        """`run` on its way into the batch, from its own cache (a newcomer: one from the pool)."""
        fed = run.job.request.prompt + run.tokens
        if run.cache is None:
            run.cache = self.worker.pool.take(fed)
        return _Joining(run, self._fill(run, fed), len(fed) - 1)

    def _fill(self, run: Running, fed: list[int]) -> Iterator[int]:
        """Make `run`'s cache hold every token of `fed` (its prompt and answer so far) but
        the last: what it holds of them stays (all, for a request that was decoding alone;
        a newcomer's pooled prefix), the rest is prefilled `PREFILL_CHUNK` tokens at a time
        with the drafter's context. Yields how many it holds after each chunk. Runs when
        the request's turn to join comes, so that requests sharing a pooled cache fill it
        one after another (the batch copies it)."""
        held = run.cache.cache.reuse(fed, with_drafter=self.worker.draft is not None)
        if not run.tokens:
            run.cached = held
        while held < len(fed) - 1:
            held = min(held + PREFILL_CHUNK, len(fed) - 1)
            # a prefill through the loop (its one token is not used): the drafter's context too
            self._decode(run, fed[:held], 1, lambda r: None, lambda: False)
            yield held

    def _admit(self, joining: list, rows: int) -> None:
        """Start waiting requests while the batch has room."""
        while not self.stopping and rows + len(joining) < self.max_batch:
            try:
                job = self.worker.inbox.get_nowait()
            except queue.Empty:
                return
            if job is None:  # the worker is stopping: finish what runs, start nothing more
                self.stopping = True
                return
            joining.append(self._joining(self._start(job)))

    def _prefill_chunk(self, decoder: BatchSpeculator, rows: dict, joining: list) -> None:
        """One prefill chunk of the first joining request; it joins the batch after its last."""
        entry, tic = joining[0], time.perf_counter()
        held = next(entry.chunks, entry.total)
        run = entry.run
        run.prompt_seconds += time.perf_counter() - tic
        if held < entry.total:
            return
        joining.pop(0)
        req = run.job.request
        fed = req.prompt + run.tokens
        last, sampling = fed[-1], run.options.sampling()
        cache = run.cache.cache  # holds every token before `last`, in the target and the drafter's context
        draft = cache.context_copy()
        learned = decoder.pair.policy  # what the pair learned of the drafter (None: no drafter)
        records = Records(learned.drafts if learned is not None else Acceptance(1), run.cache.guesses)
        logprobs, lookup = req.logprobs is not None, run.options.lookup
        rows[decoder.add(cache.target, last, sampling, logprobs, draft, records, fed[:-1], lookup)] = run

    def _drop_cancelled(self, decoder: BatchSpeculator, rows: dict, joining: list) -> None:
        for uid, run in list(rows.items()):
            if run.job.cancelled.is_set():
                decoder.remove(uid)
                del rows[uid]
                self._finish(run)
        for entry in [e for e in joining if e.run.job.cancelled.is_set()]:
            joining.remove(entry)
            self._finish(entry.run)

    def _leave(self, decoder: BatchSpeculator, uid: int, run: Running) -> None:
        """Before row `uid` leaves to decode alone: its pooled cache takes over the row's
        caches where its drafter context holds every token the row fed (the batch
        speculated, or there is no drafter), so that nothing runs again; else (sliding
        windows: plain steps capture no features) it stays as it joined, and the loop runs
        the target again over the tokens the row decoded in the batch."""
        target, _ = decoder.extract(uid)
        draft = decoder.context(uid)
        if draft is None or draft[0].offset == cache_length(target):
            run.cache.cache.take_over(target, draft, (run.job.request.prompt + run.tokens)[:-1])

    def _cycle(self, decoder: BatchSpeculator, rows: dict) -> None:
        """One batch cycle: every row's next tokens (1 .. the cycle's width), each taken as
        it would be alone, the row ending at its stop or its `max_tokens` (its later tokens
        are dropped); rows that end leave."""
        committed = decoder.cycle()
        width = decoder.width
        self.worker.metrics.stepped(len(committed), width)
        for row in committed:
            run, taken = rows[row.uid], 0
            for token, lps in zip(row.tokens, row.logprobs or [None] * len(row.tokens)):
                taken += 1
                if run.accept(self.worker.tokenizer, token, lps):
                    break
            run.stats.record(width, min(row.accepted, taken - 1), guessed=row.guessed)  # the accepted drafts it took
            if run.reason is not None:
                decoder.remove(row.uid)
                del rows[row.uid]
                self._finish(run)
