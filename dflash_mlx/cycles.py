"""The two kinds of decoding cycle (a plain target step, a drafted block) and the prefill.

A plain step's token is returned lazy, already queued with `mx.async_eval`: the block
size policy does not look at token values, so the loop can queue the next plain step
on the lazy token before it reads this one on the host, as mlx-lm does. A run of plain
steps then costs what plain mlx-lm decoding does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import mlx.core as mx

from .cache import PromptCache
from .drafter import Drafter
from .rollback import Checkpoint
from .sampling import SamplingParams, log_softmax
from .target import Target

PREFILL_STEP = 2048


@dataclass
class Cycle:
    """One cycle's outcome. `tokens` is a lazy scalar until `read()` for the prefill and
    plain steps."""

    size: int  # tokens verified (1: a plain step; 0: the prefill)
    tokens: Union[mx.array, list[int]]
    accepted: int
    logprobs: list[mx.array]
    drafting: float = 0.0  # seconds of it spent drafting (profiling only)

    @property
    def ready(self) -> bool:
        return isinstance(self.tokens, list)

    def read(self) -> list[int]:
        """The committed tokens on the host (waits for a queued step)."""
        if not self.ready:
            self.tokens = [self.tokens.item()]
        return self.tokens


class Cycles:
    """Prefill, plain steps and drafted blocks, on the state one generation shares."""

    def __init__(
        self,
        target: Target,
        draft_model: Optional[Drafter],
        cache: PromptCache,
        sampling: SamplingParams,
        profile: bool,
        full_blocks: bool = False,
    ):
        self.target, self.drafter, self.cache = target, draft_model, cache
        self.sampling, self.profile, self.full_blocks = sampling, profile, full_blocks

    def prefill(self, tokens: Sequence[int], start: int, progress: Optional[Callable[[int, int], None]]) -> Cycle:
        """Prefill the target from `start`, feeding the captured features straight into
        the drafter's context. The first token is queued, not read."""
        cache, drafter = self.cache, self.drafter
        todo = list(tokens[start:])
        for i in range(0, len(todo), PREFILL_STEP):
            chunk = todo[i : i + PREFILL_STEP]
            hidden, features = self.target.forward(mx.array(chunk)[None], cache.target, capture=drafter is not None)
            if drafter is not None:
                cache.flush()
                drafter.append_context(features, cache.draft)
            cache.tokens += chunk
            mx.eval([c.state for c in cache.target] + ([c.keys for c in cache.draft] if cache.draft else []))
            if progress:
                progress(start + i + len(chunk), len(tokens))
        cache.remember()
        return self._queue(0, self.target.lm_head(hidden[:, -1])[0])

    def plain(self, token: Union[int, mx.array]) -> Cycle:
        """Queue one target step on `token` (an int, or the lazy output of the step before).
        With a drafter, its features wait in the cache's `pending` list: the next draft
        needs them, a run of plain steps does not. The caller appends `token` to
        `cache.tokens` once it knows its value."""
        capture = self.drafter is not None
        token = token if isinstance(token, mx.array) else mx.array(token)
        hidden, features = self.target.forward(token.reshape(1, 1), self.cache.target, capture=capture)
        if capture:
            self.cache.pending.append(features)
        return self._queue(1, self.target.lm_head(hidden)[0, -1])

    def _queue(self, size: int, logits: mx.array) -> Cycle:
        token, logprobs = self.sampling.choose(logits), log_softmax(logits)
        mx.async_eval(token, logprobs)
        return Cycle(size, token, 0, [logprobs])

    def speculate(self, token: int, size: int) -> Cycle:
        """Draft `size - 1` tokens after `token` (with `full_blocks`: the first ones of the
        drafter's whole block), verify them, keep the accepted prefix."""
        cache, drafter, target, tic = self.cache, self.drafter, self.target, time.perf_counter()
        cache.flush()
        # Adaptive cycles draft the full block and verify its first drafts: the drafter
        # was trained on full blocks, and drafts from one are more often accepted (on a
        # CPU, the head over a few more rows costs little beside the verify).
        width = max(size, drafter.config.block_size) if self.full_blocks else size
        block = mx.array([[token] + [drafter.config.mask_token_id] * (width - 1)])
        draft = drafter.draft(block, cache.draft, target, self.sampling).first(size - 1)
        drafts = draft.tokens
        drafting = 0.0
        if self.profile:
            mx.eval(drafts)
            drafting = time.perf_counter() - tic
        else:
            mx.async_eval(drafts)  # drafting runs while the verify graph is built
        checkpoint = Checkpoint(cache.target, target.replay)
        hidden, features = target.forward(
            mx.concatenate([block[0, :1], drafts])[None], cache.target, checkpoint=checkpoint
        )
        logits = target.lm_head(hidden)[0]
        accepted, bonus = self.sampling.accept(draft, logits)
        *drafted, accepted, bonus = mx.concatenate([drafts, accepted[None], bonus[None]]).tolist()
        # Keep [token, accepted drafts] in the target cache; their features become context.
        checkpoint.rollback(size - accepted - 1)
        cache.tokens += [token] + drafted[:accepted]
        drafter.append_context(features[:, : accepted + 1], cache.draft)
        logprobs = list(log_softmax(logits[: accepted + 1]))
        return Cycle(size, drafted[:accepted] + [bonus], accepted, logprobs, drafting)
