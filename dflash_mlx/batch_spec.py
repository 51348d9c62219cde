"""Speculative cycles inside the batch: one target verify forward for every row, a drafted
block per row, each row keeping its own accepted prefix, rolled back per row exactly.

A `BatchSpeculator` is a `batch.BatchDecoder` whose rows also carry their drafter
context (each row's own context cache: the features of every token its target cache
holds) and their own acceptance record. A cycle is
* a plain batched step (`step`): one forward of every row's last token, as the decoder
  takes it, through the target adapter so that the feature layers' outputs are kept for
  each row's drafter context (`target.Target.forward` runs mlx-lm's batch caches and their
  left-padding masks as it runs a single sequence's);
* or a block of `width` (`speculate`): every row drafts `width - 1` tokens after its last
  (one drafter forward for all rows, their context caches side by side, left-padded and
  masked: `propose_rows`; one forward per row where the drafter's forward is another's,
  such as DFlash2's, or a context window dropped tokens), the target verifies the
  (B, width) tokens in one forward, and each row accepts by the one-sequence loop's rule
  (`sampling.accept` on its own position-keyed draws), so each row's text is its solo
  text whatever it shares the batch with and whatever was drafted. Every row's rejected
  tail leaves the target caches at once (`rollback.Checkpoint.rollback_rows`: the KV
  layers are `holes.HoleKVCache`s, where a row's rejected slots stay as masked holes and
  its RoPE offset goes back, no copy; gated-delta states are replayed).
`cycle` picks the width for the batch as it is (`batch_width.BatchWidth`) and teaches it
the cycle's measured time.

A drafted cycle reads the device once (`host.read`): every row's drafts and its accepted
count and next token, in one array; the caches' state after the rollback and the
log-probabilities are queued (`host.queue`), not waited for, so the device computes them
(and any replay) during the host's bookkeeping, and the lazy graph never outgrows a cycle.
A plain cycle is pipelined as `BatchDecoder.step` is, where it can be: while the device
computes it, `cycle` chooses the next cycle's width, and queues that cycle ahead when it
is a plain step too. A `speculate` called while a step is queued ahead takes that step
back first (`rollback.unstep_rows`: its forward is wasted; `cycle` never does this).

Prompt lookup (`lookup.py`) works inside the batch as in a chain cycle alone: a row whose
own recent tokens promise more from lookup's guess than from the drafter's drafts
(`acceptance.Records.chain_guess`, on the row's own records) verifies the guess in their
place, the rest of its block filled with the drafter's drafts (any fill is lossless:
acceptance stops at the first token the target would not choose). A batch whose rows all
guess a full block runs no drafter forward. The chooser weighs each row by what it
expects of its guess or its drafts (`Outlook`), so repetitive rows can make a drafted
cycle pay where the drafter alone would not.

Sliding-window layers (a `BatchRotatingKVCache` cannot give back a row's last tokens) and
rows that joined without drafter context take plain steps only: `speculation_refusal`
says why, and `cycle` then steps plainly; never a wrong token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from . import host
from .acceptance import Acceptance, Records
from .batch import BatchDecoder, Drawn, Queued, cache_length
from .batch_width import BatchWidth
from .context_cache import ContextCache
from .drafter import Drafter
from .holes import HoleKVCache
from .lookup import WINDOW, lookup
from .pair import Pair
from .rollback import Checkpoint, unstep_rows
from .sampling import Draws, SamplingParams, accept, log_softmax
from .targets import model_type
from .targets.hybrid import HybridTarget
from .target import Target

#: Target adapters whose forward runs every layer through mlx-lm's batch caches as their
#: own `__call__` does (the families with extra inputs or shared K/V keep plain steps).
_ADAPTERS = (Target, HybridTarget)


def speculation_refusal(model: nn.Module, drafter: Optional[Drafter]) -> Optional[str]:
    """Why rows of `model` with `drafter` cannot take speculative cycles in a batch, in one
    line (they take plain batched steps); None when they can."""
    if drafter is None:
        return "no drafter: the batch takes plain steps"
    for layer in make_prompt_cache(model):
        if type(layer) not in (KVCache, ArraysCache):
            kind = type(layer).__name__
            return f"a {kind} cannot give back one row's rejected tokens in a batch: the batch takes plain steps"
    if type(Pair.of(model, drafter).target) not in _ADAPTERS:
        return f"model type {model_type(model)!r} is verified one sequence at a time: the batch takes plain steps"
    return None


class Committed(NamedTuple):
    """One row's outcome of a cycle: its id, the committed tokens (its accepted drafts,
    then the target's own token), how many of them are accepted drafts, and the target's
    log-probabilities (V,) for each (None unless the row asked for them)."""

    uid: int
    tokens: list[int]
    accepted: int
    logprobs: Optional[list[mx.array]]
    guessed: bool = False  # the row verified prompt lookup's guess, not the drafter's drafts


@dataclass
class _Context:
    draft: Optional[list[Any]]  # the row's drafter context cache (None: joined without one)
    records: Records  # what the row learned of the drafter and of its lookup guesses
    lookup: int  # prompt lookup's longest suffix for this row (0: off)
    history: list[int]  # the row's latest tokens before its last (lookup's context)
    pending: list[mx.array] = field(default_factory=list)  # features (1, n, k * hidden) not yet in `draft`

    def outlook(self, last: int, width: int) -> Outlook:
        """The row's records, and lookup's guess of up to `width - 1` tokens after `last`."""
        found = lookup(self.history[-WINDOW:] + [last], width - 1, self.lookup) if self.lookup else []
        return Outlook(self.records, found)

    def fed(self, tokens: list[int]) -> None:
        """`tokens` went in before the row's new last token: lookup's context grows."""
        self.history += tokens
        if len(self.history) > 2 * WINDOW:
            del self.history[:-WINDOW]


class Outlook(NamedTuple):
    """A row's prospects before a cycle: its records and lookup's guess at the widest width."""

    records: Records
    found: list[int]

    def guess(self, width: int) -> list[int]:
        """The guess a cycle of `width` verifies in place of the drafts ([]: the drafts)."""
        return self.records.chain_guess(self.found, width - 1)

    def expected(self, width: int) -> float:
        """Tokens a cycle of `width` is expected to commit for the row."""
        guess = self.guess(width)
        return 1 + self.records.guesses.expected(len(guess)) if guess else self.records.drafts.expected(width)


class BatchSpeculator(BatchDecoder):
    """A batch of sequences that decode with speculative cycles: `speculate(width)` (a
    drafted block per row, one verify forward), `step()` (a plain batched step), or
    `cycle()` (whichever `chooser` expects to commit the most tokens per second).

    `add` a row with its drafter context cache (what the loop's prefill leaves in it);
    `remove` and `extract` as in `BatchDecoder`, and `context` for the row's drafter
    context cache. The models are never changed."""

    def __init__(self, model: nn.Module, drafter: Optional[Drafter], chooser: Optional[BatchWidth] = None):
        super().__init__(model)
        self.pair = Pair.of(model, drafter)
        self.family_refusal = speculation_refusal(model, drafter)
        block = drafter.config.block_size if drafter is not None else 1
        self.chooser = chooser if chooser is not None else BatchWidth(sorted({1, min(4, block), block}))
        self.contexts: dict[int, _Context] = {}
        self.width = 1  # of the last cycle
        self._next: Optional[int] = None  # the width the last (plain) cycle chose for the next

    def add(
        self,
        cache: list[Any],
        last: int,
        sampling: SamplingParams,
        logprobs: bool = False,
        draft: Optional[list[Any]] = None,
        records: Optional[Records] = None,
        history: Sequence[int] = (),
        lookup: int = 0,
    ) -> int:
        """A sequence joins (see `BatchDecoder.add`) with `draft`, its drafter context cache
        holding the features of every token before `last` (taken over, not copied; None:
        the batch takes plain steps while the row is in), `records`, what it learned of the
        drafter and of lookup's guesses so far (shared, not copied; default: fresh ones),
        and for prompt lookup (`lookup`: its longest suffix, 0: off) `history`, the tokens
        before `last` (the latest `lookup.WINDOW` are kept). Returns the row's id."""
        if draft is not None and draft[0].offset != cache_length(cache):
            raise ValueError(f"draft holds {draft[0].offset} tokens, cache {cache_length(cache)}: they must agree")
        if records is not None and records.drafts.size != self.pair.block:
            raise ValueError(f"records cover a block of {records.drafts.size}, the drafter's is {self.pair.block}")
        if lookup < 0:
            raise ValueError(f"lookup must be an integer >= 0, got {lookup!r}")
        uid = super().add(cache, last, sampling, logprobs)
        records = records if records is not None else Records(Acceptance(self.pair.block))
        self.contexts[uid] = _Context(draft, records, lookup, list(history[-WINDOW:]))
        return uid

    def _batch_form(self, layer: Any) -> Any:
        """A KV layer joins as a `HoleKVCache` (a row's rejected slots stay as masked
        holes), any other as its own `merge` makes it."""
        return HoleKVCache.merge([layer]) if type(layer) is KVCache else super()._batch_form(layer)

    def speculation_refusal(self) -> Optional[str]:
        """Why the batch as it is now cannot take a speculative cycle (None: it can)."""
        if self.family_refusal is not None:
            return self.family_refusal
        missing = [row.uid for row in self.rows if self.contexts[row.uid].draft is None]
        if missing:
            return f"rows {missing} joined without drafter context: the batch takes plain steps"
        empty = [uid for uid, ctx in self.contexts.items() if not ctx.pending and not ctx.draft[0].offset]
        if empty:
            return f"rows {empty} have no context yet (a one-token prompt): the batch takes a plain step"
        return None

    def remove(self, uid: int) -> None:
        """Row `uid` leaves (its drafter context with it)."""
        super().remove(uid)
        del self.contexts[uid]

    def context(self, uid: int) -> Optional[list[Any]]:
        """Row `uid`'s drafter context cache (None: it joined without one): with `extract`,
        what `add` takes to continue the row. It holds every token the row has fed where the
        batch's family speculates; where it does not (`family_refusal`), plain steps capture
        no features and it holds what the row joined with."""
        self._index(uid)
        ctx = self.contexts[uid]
        self._flush(ctx)
        return ctx.draft

    def outlooks(self, width: int) -> list[Outlook]:
        """Each row's records and lookup's guess for a cycle of up to `width`, in row order."""
        return [self.contexts[row.uid].outlook(row.last, width) for row in self.rows]

    def _flush(self, ctx: _Context) -> None:
        """Move a row's pending features into its drafter context (one projection)."""
        if ctx.pending and ctx.draft is not None:
            self.pair.drafter.append_context(mx.concatenate(ctx.pending, axis=1), ctx.draft)
        ctx.pending = []

    def _forward(self, inputs: mx.array) -> tuple[mx.array, Optional[mx.array]]:
        """A plain step through the target adapter: logits (B, 1, V) of inputs (B, 1), the
        rows' next tokens, and their features (B, 1, k * hidden) for the rows' drafter
        contexts (None where the family does not speculate)."""
        if self.family_refusal is not None:
            return super()._forward(inputs)
        hidden, features = self.pair.target.forward(inputs, self.cache)  # (B, 1, hidden), (B, 1, k * hidden)
        return self.pair.target.lm_head(hidden), features

    def _take(self, queued: Queued, behind: bool) -> list[Drawn]:
        """A plain step's tokens handed to their rows (`BatchDecoder._take`); the tokens it
        fed join each row's lookup context, and their features wait in its pending list for
        its next draft."""
        for i, row in enumerate(self.rows[: len(queued)]):
            ctx = self.contexts[row.uid]
            ctx.fed([row.last])
            if queued.features is not None and ctx.draft is not None:  # a row without a context takes plain steps only
                ctx.pending.append(queued.features[i : i + 1])
        return super()._take(queued, behind)

    def _choose(self) -> tuple[int, Optional[list[Outlook]]]:
        """The width of a cycle of the batch as it is (1 where it cannot speculate), and the
        rows' outlooks it was chosen from."""
        if self.speculation_refusal() is not None:
            return 1, None
        outlooks = self.outlooks(self.chooser.widths[-1])
        return self.chooser.choose(outlooks), outlooks

    def _plain_next(self) -> bool:
        """Whether the next cycle is a plain step (chosen now: the current one is)."""
        self._next = self._choose()[0]
        return self._next == 1

    def cycle(self) -> list[Committed]:
        """One cycle of the width `chooser` picks for the batch as it is (a plain step when
        the batch cannot speculate, or a plain step queued ahead is on the way; `width` says
        which it was); the chooser learns its measured seconds. Returns one `Committed` per
        row that had tokens, in row order (see `step`)."""
        if not self.rows:
            raise ValueError("the batch is empty: add a sequence first")
        rows, width, outlooks = len(self.rows), self._next, None
        self._next = None
        if self._queued is not None:
            width = 1
        elif width is None:  # the last cycle did not choose this one's width
            width, outlooks = self._choose()
        if width > 1 and self.speculation_refusal() is not None:  # rows joined since it was chosen
            width = 1
        tic = time.perf_counter()
        if width == 1:
            drawn = self._plain(self._plain_next)
            out = [Committed(d.uid, [d.token], 0, None if d.logprobs is None else [d.logprobs]) for d in drawn]
        else:
            out = self.speculate(width, outlooks)
        self.chooser.update(rows, width, time.perf_counter() - tic)
        self.width = width
        return out

    def speculate(self, width: int, outlooks: Optional[Sequence[Outlook]] = None) -> list[Committed]:
        """A block of `width` tokens per row ([last, width - 1 drafts]: lookup's guess where
        the row's `outlooks` say it promises more, else the drafter's), verified in one
        target forward; each row keeps its accepted drafts and the target's next token.
        Returns one `Committed` per row, in row order."""
        reason = self.speculation_refusal()
        if reason is not None:
            raise ValueError(reason)
        if not self.rows:
            raise ValueError("the batch is empty: add a sequence first")
        if width < 2:
            raise ValueError(f"width must be an integer >= 2, got {width!r}")
        if self._queued is not None:  # each block starts at its row's last token
            unstep_rows(self.cache, self._queued.before, len(self._queued))
            self._queued = None
        self._next = None
        outlooks = outlooks if outlooks is not None else self.outlooks(width)
        target = self.pair.target
        draws = [row.sampling.draws(row.position) for row in self.rows]  # block positions 1.. choose there
        guesses = [o.guess(width) for o in outlooks]
        drafts = self._blocks(draws, width, guesses)  # (B, w - 1)
        inputs = mx.concatenate([mx.array([[row.last] for row in self.rows]), drafts], axis=1)  # (B, w)
        checkpoint = Checkpoint(self.cache, target.replay)
        hidden, features = target.forward(inputs, self.cache, checkpoint=checkpoint)  # (B, w, ...)
        logits = target.lm_head(hidden)  # (B, w, V)
        outcome = mx.stack([mx.stack(accept(drafts[i], d.choose(logits[i]))) for i, d in enumerate(draws)])  # (B, 2)
        read = host.read(mx.concatenate([drafts, outcome], axis=1))  # (B, w + 1): drafts, accepted, next token
        checkpoint.rollback_rows([width - 1 - r[-2] for r in read])
        out = []
        for i, (row, r) in enumerate(zip(self.rows, read)):
            ctx, drafted, (a, bonus) = self.contexts[row.uid], r[:-2], r[-2:]
            committed = drafted[:a] + [bonus]
            ctx.pending.append(features[i : i + 1, : a + 1])  # [last, accepted drafts] join the context
            ctx.records.guesses.observe(outlooks[i].found[: width - 1], committed)
            if not guesses[i]:
                ctx.records.drafts.learn(width, a)
            ctx.fed([row.last] + drafted[:a])
            row.last, row.position = bonus, row.position + a + 1
            lps = list(log_softmax(logits[i, : a + 1])) if row.logprobs else None
            out.append(Committed(row.uid, committed, a, lps, bool(guesses[i])))
        host.queue([c.state for c in self.cache], [lp for c in out for lp in c.logprobs or []])
        return out

    def _blocks(self, draws: list[Draws], width: int, guesses: list[list[int]]) -> mx.array:
        """Every row's `width - 1` drafts (B, width - 1): its guess, then the drafter's drafts
        past it (no drafter forward where every row guesses them all)."""
        if all(len(g) == width - 1 for g in guesses):
            return mx.array(guesses)
        drafts = self._drafts(draws, width)
        if not any(guesses):
            return drafts
        fill = [g + [0] * (width - 1 - len(g)) for g in guesses]
        taken = mx.arange(width - 1)[None] < mx.array([len(g) for g in guesses])[:, None]  # (B, w - 1)
        return mx.where(taken, mx.array(fill, dtype=drafts.dtype), drafts)

    def _drafts(self, draws: list[Draws], width: int) -> mx.array:
        """Every row's first `width - 1` drafts (B, width - 1) after its last token, from the
        drafter's whole block (as the one-sequence loop's adaptive chains draft): in one
        drafter forward where `rows_draft_together`, else one forward per row."""
        drafter, target = self.pair.drafter, self.pair.target
        contexts = []
        for row in self.rows:
            ctx = self.contexts[row.uid]
            self._flush(ctx)
            contexts.append(ctx.draft)
        size = max(width, drafter.config.block_size)
        blocks = mx.array([[row.last] + [drafter.config.mask_token_id] * (size - 1) for row in self.rows])  # (B, L)
        if rows_draft_together(drafter, contexts):
            logits = propose_rows(drafter, target, blocks, contexts)  # (B, L - 1, V)
            return mx.stack([d.choose(logits[i, : width - 1]) for i, d in enumerate(draws)])
        rows = [drafter.draft(blocks[i : i + 1], c, target, d) for i, (c, d) in enumerate(zip(contexts, draws))]
        return mx.stack(rows)[:, : width - 1]


def rows_draft_together(drafter: Drafter, contexts: Sequence[Sequence[ContextCache]]) -> bool:
    """Whether `propose_rows` drafts for these rows' context caches: a DFlash v1 drafter
    (its own class: subclasses may change the forward) of full-attention layers without a
    causal mask, whose caches keep every context token."""
    config = drafter.config
    plain = type(drafter) is Drafter and not config.is_causal and set(config.layer_types) == {"full_attention"}
    return plain and all(c[0].stored == c[0].offset > 0 for c in contexts)


def propose_rows(
    drafter: Drafter, target: Target, blocks: mx.array, contexts: Sequence[Sequence[ContextCache]]
) -> mx.array:
    """Draft logits (B, L - 1, V) for positions 1..L-1 of each row's block, blocks (B, L),
    each over its own context cache, in one drafter forward: the rows' context K/V side by
    side, left-padded to the longest and masked, each block at its row's own position.
    Row i's logits are `Drafter.propose` of its block alone (up to float rounding)."""
    rows, size = blocks.shape
    lengths = [c[0].offset for c in contexts]
    longest = max(lengths)
    pads = mx.array([longest - n for n in lengths])
    context_valid = mx.arange(longest)[None] >= pads[:, None]  # (B, longest)
    mask = mx.concatenate([context_valid, mx.ones((rows, size), dtype=mx.bool_)], axis=1)[:, None, None]  # (B, 1, 1, S)
    h = drafter.embed_blocks(blocks, target)  # (B, L, hidden)
    offsets = mx.array(lengths)  # (B,): each block's first position
    for j, layer in enumerate(drafter.layers):
        keys, values = (
            mx.concatenate(
                [
                    mx.pad(getattr(c[j], name), [(0, 0), (0, 0), (longest - n, 0), (0, 0)])
                    for c, n in zip(contexts, lengths)
                ]
            )
            for name in ("keys", "values")
        )  # (B, kv_heads, longest, head_dim)
        h = layer(h, (keys, values), offsets, mask)
    h = drafter.norm(h)[:, 1:]  # (B, L - 1, hidden)
    return drafter.head(h.reshape(rows * (size - 1), -1), target).reshape(rows, size - 1, -1)
