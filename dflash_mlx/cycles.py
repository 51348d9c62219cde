"""The kinds of decoding cycle (a plain target step, a drafted block, a draft tree) and the prefill.

A plain step's token is returned lazy, already queued with `mx.async_eval`: the block
size policy does not look at token values, so the loop can queue the next plain step
on the lazy token before it reads this one on the host, as mlx-lm does. A run of plain
steps then costs what plain mlx-lm decoding does.

During a generation `Cycles` appends to `PromptCache.tokens` (what the target cache
holds): a token joins it when it enters the target, or, fed lazily, once `read` knows its
value. The models are the `Pair`'s (shared); the caches and records are one sequence's.

A drafted cycle is queued in two parts. `draft` queues the drafter's forward (or takes
prompt lookup's guess) as soon as the last cycle's tokens are on the host, before the loop's
bookkeeping and the caller's work on them, so the device drafts meanwhile; `run` then
verifies. The drafter always fills its whole block when the width is adaptive, so one
forward serves a chain or a tree. Every drafted cycle reads the host once: a chain its
accepted drafts and the target's next token, in one array; a tree, grown on the device
from the drafter's candidates (`tree.grow_tree`) and walked there, its walk. Every read goes
through `host.py`.

A tree's candidates are the top tokens of the drafter's logits at each block position (for
DFlash2, the selector's candidates: the same top-k set the selector ranks), and the chain
it shows the policy is the drafter's own chain draft (`Drafter.candidates`: DFlash2's
selector path). A chain cycle may verify prompt lookup's guess instead of drafting
(`acceptance.Records.chain_guess`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import mlx.core as mx

from . import host
from .acceptance import Records
from .cache import PromptCache
from .lookup import WINDOW, lookup
from .pair import Pair
from .plan import Plan
from .policy import Width
from .rollback import Checkpoint, keep_rows
from .sampling import Draws, accept, log_softmax
from .tree import grow_tree, top_candidates

PREFILL_STEP = 2048


@dataclass
class Cycle:
    """One cycle's outcome. A queued one (the prefill, a plain step) holds its token lazy
    in `queued` until `Cycles.read` brings it to the host."""

    size: int  # tokens verified (1: a plain step; 0: the prefill)
    accepted: int
    logprobs: list[mx.array]  # the target's log-probabilities (V,) of each committed token
    drafting: float = 0.0  # seconds of it spent drafting (profiling only)
    tokens: list[int] = field(default_factory=list)  # the committed tokens, once on the host
    queued: Optional[mx.array] = None  # a queued step's token (a lazy scalar), until read
    tree: bool = False  # a draft tree: `size` - 1 nodes verified below the root
    # A tree cycle: the (size, accepted) of the chain its tokens show, what `speculate`'s
    # drafts on the same draws would have had accepted (up to the first miss, if one is seen)
    chain: Optional[tuple[int, int]] = None
    guessed: bool = False  # a chain of prompt lookup's guess, not the drafter's drafts

    @property
    def width(self) -> Width:
        """What the cycle verified."""
        return Width(self.size, self.tree)

    @property
    def shown(self) -> tuple[int, int]:
        """(size, accepted) of the drafter's chain this cycle judged (a tree: the chain its
        tokens show; a plain step: (1, 0), nothing drafted)."""
        return self.chain if self.chain is not None else (self.size, self.accepted)

    @property
    def ready(self) -> bool:
        """Whether the committed tokens are on the host."""
        return self.queued is None

    @property
    def last(self) -> Union[int, mx.array]:
        """The last committed token: an int, or the lazy scalar of a queued step."""
        return self.tokens[-1] if self.ready else self.queued


@dataclass
class Drafted:
    """A drafted cycle's first part, queued before the host's bookkeeping (`Cycles.draft`):
    its root token and width, the draws the drafter and the verify share, and the drafts: a
    chain's (the drafter's first `size - 1`, or prompt lookup's guess in their place), or a
    tree's candidates (`top_candidates`, (rows, k) each) and the drafter's own chain (rows,)."""

    token: int
    width: Width
    draws: Draws
    drafts: mx.array  # a chain: its drafts (size - 1,); a tree: the drafter's chain (rows,)
    found: list[int]  # prompt lookup's guess (a chain: as far as the chain goes; a tree: its depth)
    guessed: bool = False  # a chain of lookup's guess
    candidates: Optional[tuple[mx.array, mx.array]] = None  # a tree's (log-probabilities, ids)
    depth: int = 0  # a tree's depth
    drafting: float = 0.0  # seconds spent drafting (profiling only)


def _chunks(todo: list[int], last_apart: bool) -> list[list[int]]:
    """The prefill's forwards: PREFILL_STEP tokens each; with `last_apart` (a quantized KV
    cache) the last token in one of its own, as mlx-lm's prefill does, so the same tokens
    see a quantized cache."""
    body, tail = (todo[:-1], todo[-1:]) if last_apart else (todo, [])
    return [body[i : i + PREFILL_STEP] for i in range(0, len(body), PREFILL_STEP)] + ([tail] if tail else [])


class Cycles:
    """Prefill, plain steps, chains and trees of one generation: the pair's models (shared)
    on one sequence's cache and records (its own), as the plan says."""

    def __init__(self, pair: Pair, cache: PromptCache, records: Records, plan: Plan):
        self.target, self.drafter, self.cache = pair.target, pair.drafter, cache
        self.records, self.plan = records, plan
        self._fed: Optional[Cycle] = None  # a queued cycle whose lazy token a plain step was queued on

    def read(self, cycle: Cycle) -> list[int]:
        """The committed tokens of `cycle` on the host (waits for a queued step). A token
        already fed to the next plain step joins `cache.tokens` now that its value is known."""
        if not cycle.ready:  # a plain step queued on it keeps the device busy meanwhile
            cycle.tokens, cycle.queued = [host.read(cycle.queued, behind=cycle is self._fed)], None
            if cycle is self._fed:
                self.cache.tokens.append(cycle.tokens[-1])
                self._fed = None
        return cycle.tokens

    def prefill(self, tokens: Sequence[int], start: int, progress: Optional[Callable[[int, int], None]]) -> Cycle:
        """Prefill the target from `start`, feeding the captured features straight into
        the drafter's context. The first token is queued, not read. `progress` is told the
        prompt tokens held of all (reused ones count), as mlx-lm tells it: before the first
        forward (0 of all for a fresh cache), then after each, ending at all of them."""
        cache, hidden = self.cache, None
        if progress:
            progress(start, len(tokens))
        stops = [b for b in (cache.boundary,) if b is not None and start < b < len(tokens)] + [len(tokens)]
        cache.boundary = None
        for begin, end in zip([start] + stops, stops):  # a snapshot at each stop
            for chunk in _chunks(list(tokens[begin:end]), self.plan.kv is not None and end == len(tokens)):
                hidden = self._prefill_chunk(chunk)
                if progress:
                    progress(len(cache.tokens), len(tokens))
            cache.remember()
        return self._queue(0, self.target.lm_head(hidden[:, -1]), len(tokens))

    def _prefill_chunk(self, chunk: list[int]) -> mx.array:
        """Feed `chunk` to the target (and its features to the drafter); its hidden states."""
        cache, drafter = self.cache, self.drafter
        hidden, features = self.target.forward(mx.array(chunk)[None], cache.target, capture=drafter is not None)
        cache.quantize(self.plan.kv)
        if drafter is not None:
            cache.flush()
            drafter.append_context(features, cache.draft)
        cache.tokens += chunk
        host.wait([c.state for c in cache.target] + ([c.keys for c in cache.draft] if cache.draft else []))
        return hidden

    def plain(self, after: Cycle) -> Cycle:
        """Queue one target step on the last token of `after`, which may itself still be
        queued: the host sync then overlaps this step's compute, as in mlx-lm. With a
        drafter, its features wait in the cache's `pending` list: the next draft needs
        them, a run of plain steps does not."""
        capture = self.drafter is not None
        if after.ready:
            self.cache.tokens.append(after.last)
            token = mx.array(after.last)
        else:
            self._fed, token = after, after.queued
        position = len(self.cache.tokens) + (self._fed is not None)  # of the token this step chooses
        hidden, features = self.target.forward(token.reshape(1, 1), self.cache.target, capture=capture)
        self.cache.quantize(self.plan.kv)
        if capture:
            self.cache.pending.append(features)
        return self._queue(1, self.target.lm_head(hidden)[0], position)

    def run(self, after: Cycle, drafted: Optional[Drafted]) -> Cycle:
        """The cycle after `after`: the verify of `drafted` (a chain or a tree, queued by
        `draft`), or, with no drafts, a plain step."""
        if drafted is None:
            return self.plain(after)
        return self.tree(drafted) if drafted.width.tree else self.speculate(drafted)

    def _queue(self, size: int, logits: mx.array, position: int) -> Cycle:
        """logits (1, V) choose the token at `position`."""
        token, logprobs = self.plan.sampling.choose(logits, position)[0], log_softmax(logits[0])
        host.queue(token, logprobs)
        return Cycle(size, 0, [logprobs], queued=token)

    def _lookup(self, token: int, k: int) -> list[int]:
        """Prompt lookup's guess of up to `k` tokens after `token`, from the recent context ([] when off)."""
        n = self.plan.lookup
        return lookup(self.cache.tokens[-WINDOW:] + [token], k, n) if n else []

    def draft(self, after: Cycle, width: Width, depth: int, rows: int) -> Optional[Drafted]:
        """Queue the drafts of a cycle of `width` after `after` (its tokens on the host): a
        chain's `size - 1` drafts (the first ones of the block `Plan.draft_block` says), or
        prompt lookup's guess where it promises more (never in a probe); a tree's candidates
        for `rows` depths and lookup's guess `depth` deep (`Plan.depths`). None for a plain step."""
        if width.size == 1:
            return None
        cache, drafter, tic = self.cache, self.drafter, time.perf_counter()
        cache.flush()
        token = after.last
        # The drafter and the verify choose block positions 1.. with the same draws.
        draws = self.plan.sampling.draws(len(cache.tokens) + 1)
        found = self._lookup(token, depth if width.tree else width.nodes)
        guess = [] if width.tree or self.plan.probing else self.records.chain_guess(found, width.nodes)
        if guess:
            return Drafted(token, Width(len(guess) + 1), draws, mx.array(guess), found, guessed=True)
        block = mx.array([[token] + [drafter.config.mask_token_id] * (self.plan.draft_block(width) - 1)])
        if not width.tree:
            drafts = drafter.draft(block, cache.draft, self.target, draws)[: width.nodes]
            return self._queued(Drafted(token, width, draws, drafts, found), tic)
        proposals, chain = drafter.candidates(block, cache.draft, self.target, draws)  # (B - 1, V), (B - 1,)
        candidates = top_candidates(proposals[:rows], width.nodes)
        drafted = Drafted(token, width, draws, chain[:rows], found, candidates=candidates, depth=depth)
        return self._queued(drafted, tic, *candidates)

    def _queued(self, drafted: Drafted, tic: float, *more: mx.array) -> Drafted:
        """`drafted` with its drafts (and `more`) queued; waited for and timed when profiling."""
        if not self.plan.profile:
            host.queue(drafted.drafts, *more)  # the device drafts while the host does its bookkeeping
            return drafted
        host.wait(drafted.drafts, *more)
        drafted.drafting = time.perf_counter() - tic
        return drafted

    def speculate(self, drafted: Drafted) -> Cycle:
        """Verify a chain's drafts (`draft`), keep the accepted prefix."""
        cache, target, token, drafts = self.cache, self.target, drafted.token, drafted.drafts
        size = drafted.width.size
        checkpoint = Checkpoint(cache.target, target.replay)
        hidden, features = target.forward(
            mx.concatenate([mx.array([token]), drafts])[None], cache.target, checkpoint=checkpoint
        )
        logits = target.lm_head(hidden)[0]
        accepted, bonus = accept(drafts, drafted.draws.choose(logits))
        *drafts_read, accepted, bonus = host.read(mx.concatenate([drafts, accepted[None], bonus[None]]))
        # Keep [token, accepted drafts] in the target cache; their features become context.
        checkpoint.rollback(size - accepted - 1)
        cache.quantize(self.plan.kv)
        cache.tokens += [token] + drafts_read[:accepted]
        self.drafter.append_context(features[:, : accepted + 1], cache.draft)
        logprobs = list(log_softmax(logits[: accepted + 1]))
        committed = drafts_read[:accepted] + [bonus]
        self.records.guesses.observe(drafted.found, committed)
        return Cycle(size, accepted, logprobs, drafted.drafting, committed, guessed=drafted.guessed)

    def tree(self, drafted: Drafted) -> Cycle:
        """Grow the tree of `drafted`'s candidates on the device (up to its width's nodes, at
        most its depth deep, prompt lookup's guess one more path that may go deeper:
        `lookup.py`), verify root + nodes in one target forward, walk it with the target's
        rule and keep the accepted path: one read, of the walk."""
        cache, target, records, token = self.cache, self.target, self.records, drafted.token
        logprobs, ids = drafted.candidates
        tree = grow_tree(
            token, logprobs, ids, drafted.width.nodes, drafted.depth, drafted.found, records.guesses.logprob
        )
        start = cache.target[0].offset
        hidden, features = target.tree_forward(
            tree.tokens[None], cache.target, tree.positions(start), tree.ancestor_mask(start)
        )
        logits = target.lm_head(hidden)[0]  # (n + 1, V)
        # node i chooses the token after it, at position root + depth + 1, with the keyed draws
        path, accepted, bonus = tree.walk(drafted.draws.choose(logits, tree.depths, tree.depth))
        # the chain's drafts (what `speculate` would verify) tell the policy how a chain would
        # have fared on this cycle's tokens, so its estimates stay fresh while trees run
        walked = [accepted[None], bonus[None], path, drafted.drafts, tree.tokens]
        values = host.read(mx.concatenate([a.astype(mx.int32) for a in walked]))
        accepted, bonus, rows = values[0], values[1], drafted.drafts.shape[0]
        path, chain, tokens = (
            values[2 : 2 + accepted],
            values[2 + tree.depth : 2 + tree.depth + rows],
            values[-tree.size - 1 :],
        )
        kept = [0] + path
        keep_rows(cache.target, start, kept)
        cache.quantize(self.plan.kv)
        cache.tokens += [tokens[i] for i in kept]
        rows_kept = mx.array(kept)
        self.drafter.append_context(features[:, rows_kept], cache.draft)
        committed = [tokens[i] for i in path] + [bonus]
        records.guesses.observe(drafted.found, committed)
        logprobs = list(log_softmax(logits[rows_kept]))
        shown = chain_shown(chain, committed)
        return Cycle(tree.size + 1, accepted, logprobs, drafted.drafting, committed, tree=True, chain=shown)


def chain_shown(drafts: Sequence[int], committed: Sequence[int]) -> tuple[int, int]:
    """(size, accepted) of the chain whose `drafts` a tree cycle's `committed` tokens (the
    target's own choices) judge: up to the first miss, or, where every draft seen agrees,
    as far as the tokens go (what lies beyond is not seen)."""
    seen = min(len(drafts), len(committed))
    hits = next((k for k in range(seen) if drafts[k] != committed[k]), seen)
    return (hits + 2, hits) if hits < seen else (hits + 1, hits)
