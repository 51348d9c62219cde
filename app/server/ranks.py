"""`dflash serve` under `mlx.launch`: rank 0 serves, every other rank follows.

Every rank holds a shard of the target, so every rank must run each request's
generation, in lockstep. Rank 0 alone listens for HTTP; its worker thread, before it
decodes a request, sends the other ranks what they need to run the identical loop: the
prompt's token ids, max_tokens, the stop strings and the decoding options, seed included
(an unseeded sampled request gets its seed drawn on rank 0 first). The followers run that
request through the same `Worker` code, with output going nowhere, and their prompt-cache
pool (`CachePool`) then makes the same choices as rank 0's: it sees the same prompts in
the same order and the same generated tokens. A message is a length then the bytes of a
small JSON, each one all-sum to which rank 0 alone contributes; a length of zero is
"shut down", which rank 0's worker sends as its thread ends (Ctrl-C, SIGTERM).

EOS, max_tokens and stop strings end a generation at the same token on every rank by
themselves (same tokens, same tokenizer). A cancellation (the client went away, the
server stopping) is rank 0's alone: every check of it becomes one scalar all-sum of rank
0's flag, made once per cycle (after the cycle's last token, the one not from the draft)
and at every prefill chunk, where every rank checks, so all ranks stop at the same token.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import asdict
from typing import Any, Callable, Optional

from app.server.request import CompletionRequest
from app.server.worker import Failed, Job, Worker
from dflash_mlx.distributed import here, is_leader
from dflash_mlx import DecodeOptions

import mlx.core as mx  # after dflash_mlx (its import preloads OpenBLAS)
import numpy as np

__all__ = ["Ranks", "follow"]


def _leaders(values: Any, dtype: mx.Dtype) -> mx.array:
    """Rank 0's `values` on every rank: an all-sum to which the others add zeros."""
    array = mx.array(values, dtype=dtype)
    return mx.distributed.all_sum(array if is_leader() else mx.zeros_like(array), stream=mx.cpu)


class Ranks:
    """The server's side of the ranks: sending requests (rank 0), receiving them (the
    others), and agreeing on when a generation is cancelled (all)."""

    def __init__(self) -> None:
        self.leader = is_leader()

    def send(self, req: Optional[CompletionRequest], options: Optional[DecodeOptions] = None) -> None:
        """On rank 0: make the followers run `req` decoded with `options`, or stop (None)."""
        body = b""
        if req is not None:
            message = {"prompt": req.prompt, "max_tokens": req.max_tokens, "stop": req.stop, "options": asdict(options)}
            body = json.dumps(message).encode()
        _leaders(len(body), mx.int32).item()
        if body:
            mx.eval(_leaders(np.frombuffer(body, dtype=np.uint8), mx.uint8))

    def receive(self) -> Optional[CompletionRequest]:
        """On a follower: wait for rank 0's next request (None: shut down)."""
        size = _leaders(0, mx.int32).item()
        if not size:
            return None
        body = bytes(np.array(_leaders(np.zeros(size, dtype=np.uint8), mx.uint8)))
        message = json.loads(body)
        options = DecodeOptions(**message.pop("options"))
        return CompletionRequest(chat=False, options=options, **message)

    def next_job(self, worker: Worker) -> Optional[Job]:
        """On a follower's worker thread: rank 0's next request as a job (None: stop, or the
        model did not load here)."""
        req = self.receive() if worker.info is not None else None
        return None if req is None else _Silent(req, None)

    def run(
        self,
        req: CompletionRequest,
        options: DecodeOptions,
        cancelled: Callable[[], bool],
        on_response: Callable[[Any], None],
    ) -> tuple[Callable[[], bool], Callable[[Any], None]]:
        """Start decoding `req` with `options` on every rank (rank 0 sends it; the others
        have received it) and return its `cancelled` and `on_response`, made collective:
        the check is rank 0's `cancelled()` on every rank, asked at the prefill's chunks
        and after each cycle's last token (it is False in between)."""
        if self.leader:
            self.send(req, options)
        cycle_ended = True  # no token yet: the prefill checks at every chunk

        def seen(response: Any) -> None:
            nonlocal cycle_ended
            cycle_ended = not response.from_draft
            on_response(response)

        def check() -> bool:
            if not cycle_ended:
                return False
            return bool(_leaders(int(self.leader and cancelled()), mx.int32).item())

        return check, seen


class _Silent(Job):
    """A follower's job: its output goes nowhere but a failure, printed as rank 0's is sent."""

    def emit(self, event: Any) -> None:
        if isinstance(event, Failed):
            print(f"error: {here()}: {event.message}", file=sys.stderr)


def follow(worker: Worker) -> None:
    """A follower's life: on the worker's thread, as rank 0's, load the model (sharded) and
    run every request rank 0 sends until rank 0 says stop (`Ranks.next_job`). Ctrl-C and
    SIGTERM are rank 0's to act on (a terminal sends them to every process of the launch);
    rank 0 then stops us."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    worker.start_thread()
    worker.join_thread()
    if worker.info is None:
        raise RuntimeError(worker.load_error)
