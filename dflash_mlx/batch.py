"""Continuous batching of plain target steps: B sequences of different lengths share one
target forward per step, and join and leave between steps.

Each sequence joins with its own single-sequence prompt cache (mlx-lm's per-layer caches,
as `make_prompt_cache` makes them and a prefill fills them) and the token it will feed
next; mlx-lm's batch caches hold the rows side by side (`BatchKVCache` and
`BatchRotatingKVCache` left-pad the shorter rows and give each its own RoPE offset,
`ArraysCache` stacks gated-delta states), built with their `merge` class methods, joined
with `extend`, left with `filter`, given back with `extract`. The model is only called,
never changed.

Each row's token at position t is drawn with its own `SamplingParams` from the key (seed,
t) alone (`sampling.py`), exactly as the one-sequence loop draws it: a request's text is
its solo text whoever shares the batch, greedy or seeded. A family is batched only where
that was tested (`tests/test_batch.py`); `refusal` says why another, or a quantized KV
cache, is served one request at a time.

Steps are pipelined as mlx-lm's `BatchGenerator` pipelines them: `step` queues the next
step's forward on this step's tokens, still lazy, and only then reads them (its one
blocking read, `host.read`, made while the device computes the next step), so the device
does not wait for the host's bookkeeping between steps. The step queued ahead (`Queued`)
has fed each row its last token, which the caller has seen, and drawn the next on the
device, which it has not. Rows still join and leave between steps: a leaving row leaves
the queued step too; a joining row is fed by the next step's forward and its first token
comes with the step after (in a new batch, with the first step); a row handed over
(`extract`) gives its cache without that last token (`rollback.unstep_row`), as its
caller knows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from typing import Any, Callable, NamedTuple, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from . import host
from .rollback import recurrent_states, unstep_row
from .sampling import SamplingParams, log_softmax
from .targets import model_type

#: Model types whose rows batch exactly (each tested against its solo decoding).
BATCHED_FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "gpt_oss",
    "gemma4_text",
    "gemma4",
)
#: Single-sequence caches whose `merge` builds a batch cache that decodes each row exactly.
#: A `QuantizedKVCache` has no batch form (and a `RotatingKVCache` that keeps its first
#: tokens has none either): such a request decodes alone.
_MERGEABLE = (KVCache, RotatingKVCache, ArraysCache)


def refusal(model: nn.Module, cache: Optional[Sequence[Any]] = None) -> Optional[str]:
    """Why `model` (with `cache`, a single-sequence prompt cache; default: a fresh one)
    cannot decode in a batch, in one line; None when it can. A request with a quantized
    KV cache (`DecodeOptions.kv_bits`) decodes alone even before its cache is quantized:
    the batch never quantizes."""
    kind = model_type(model)
    if kind not in BATCHED_FAMILIES:
        return f"model type {kind!r} is not batched (batched: {', '.join(BATCHED_FAMILIES)})"
    for layer in cache if cache is not None else make_prompt_cache(model):
        if type(layer) not in _MERGEABLE or getattr(layer, "keep", 0):
            return f"a {type(layer).__name__} has no batch form in mlx-lm: its request decodes alone"
    return None


def batchable(model: nn.Module) -> bool:
    """Whether `model`'s requests can share a `BatchDecoder` (see `refusal`)."""
    return refusal(model) is None


def cache_length(cache: Sequence[Any]) -> int:
    """How many tokens a single-sequence cache has seen (its attention layers' offset)."""
    return max(layer.offset for layer in cache if isinstance(layer, (KVCache, RotatingKVCache)))


class Drawn(NamedTuple):
    """One row's outcome of a step: its id, its new token, and the target's
    log-probabilities (V,) at that position, as the one-sequence loop gives them (None
    unless the row asked for them)."""

    uid: int
    token: int
    logprobs: Optional[mx.array]


@dataclass
class _Row:
    uid: int
    sampling: SamplingParams
    last: int  # the token the next step feeds
    position: int  # of the token the next step chooses (= tokens fed once `last` is in)
    logprobs: bool


@dataclass
class Queued:
    """A plain step queued ahead and not read yet: the first `len(self)` rows fed their
    last token and drew the next one on the device."""

    tokens: mx.array  # (n,) each row's next token
    logprobs: list[Optional[mx.array]]  # (V,) each, for the rows that asked for them
    before: dict[int, list[Any]]  # the recurrent layers' arrays before the step (n rows): `rollback.unstep_row`
    features: Optional[mx.array]  # (n, 1, k * hidden): the fed tokens' drafter features (a speculating batch)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def filter(self, keep: list[int]) -> None:
        """Keep the given rows (of its first `len(self)`)."""
        index = mx.array(keep)
        self.tokens = self.tokens[index]
        self.logprobs = [self.logprobs[i] for i in keep]
        self.before = {j: [None if a is None else a[index] for a in arrays] for j, arrays in self.before.items()}
        if self.features is not None:
            self.features = self.features[index]


class BatchDecoder:
    """Plain one-token steps for every sequence of a batch, in one forward of one target.

    `add` a sequence (its prompt cache and its next token), `step` all rows, `remove` or
    `extract` a row; rows are named by the id `add` returns. The model is never changed."""

    def __init__(self, model: nn.Module):
        reason = refusal(model)
        if reason is not None:
            raise ValueError(reason)
        self.model, self.layers = model, len(make_prompt_cache(model))
        self.cache: list[Any] = []  # one batch cache per layer; empty while no row is in
        self.rows: list[_Row] = []
        self._uids = count()
        self._queued: Optional[Queued] = None  # the step queued ahead (see the module docstring)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def uids(self) -> list[int]:
        """The rows' ids, in row order."""
        return [row.uid for row in self.rows]

    def add(self, cache: list[Any], last: int, sampling: SamplingParams, logprobs: bool = False) -> int:
        """A sequence joins: `cache` (a single-sequence prompt cache that holds every token
        before `last`; copied, not changed), `last` (its next token, not yet fed), its own
        `sampling` (parameters and seed) and whether its steps return log-probabilities.
        Returns the row's id."""
        reason = refusal(self.model, cache)
        if reason is not None:
            raise ValueError(reason)
        if len(cache) != self.layers:
            raise ValueError(f"cache has {len(cache)} layers, the model {self.layers}")
        joined = [self._batch_form(layer) for layer in cache]  # one-row batch caches (copies)
        if self.cache:
            for batch, row in zip(self.cache, joined):
                batch.extend(row)
        else:
            self.cache = joined
        row = _Row(next(self._uids), sampling, int(last), cache_length(cache) + 1, logprobs)
        self.rows.append(row)
        return row.uid

    def _batch_form(self, layer: Any) -> Any:
        """The one-row batch cache of a single-sequence cache layer: its `merge`."""
        return layer.merge([layer])

    def step(self) -> list[Drawn]:
        """One plain step, the next queued before it is read: each row's next token drawn
        with its own sampling at its own position. Returns one `Drawn` per row whose token
        was on the way, in row order: every row but those that joined while steps were
        under way (theirs comes with the next step)."""
        return self._plain(lambda: True)

    def _plain(self, ahead: Callable[[], bool]) -> list[Drawn]:
        """A plain step; the next is queued before this one is read where `ahead()` (asked
        while the device computes this one) says so, else every row's last token is on the
        host and not fed when it returns."""
        if not self.rows:
            raise ValueError("the batch is empty: add a sequence first")
        queued = self._queued if self._queued is not None else self._draw(None)
        self._queued = self._draw(queued) if ahead() else None
        return self._take(queued, behind=self._queued is not None)

    def _draw(self, after: Optional[Queued]) -> Queued:
        """Queue one forward of every row's next token (the one `after` drew for its rows,
        still lazy; the last token for the rest), each row's next token drawn at its own
        position."""
        n = 0 if after is None else len(after)
        rest = [row.last for row in self.rows[n:]]
        if after is None:
            inputs = mx.array(rest)  # (B,)
        else:
            inputs = mx.concatenate([after.tokens, mx.array(rest, dtype=after.tokens.dtype)]) if rest else after.tokens
        before = recurrent_states(self.cache)
        logits, features = self._forward(inputs[:, None])  # (B, 1, V), (B, 1, k * hidden) or None
        logits = logits[:, -1]
        tokens = mx.concatenate(
            [row.sampling.choose(logits[i : i + 1], row.position + (i < n)) for i, row in enumerate(self.rows)]
        )  # (B,)
        lps = [log_softmax(logits[i]) if row.logprobs else None for i, row in enumerate(self.rows)]
        host.queue(tokens, lps)
        return Queued(tokens, lps, before, features)

    def _take(self, queued: Queued, behind: bool) -> list[Drawn]:
        """The tokens `queued` drew, read (a step's one blocking read; `behind`: the next
        step is queued behind it) and handed to their rows."""
        drawn = []
        for row, token, lp in zip(self.rows, host.read(queued.tokens, behind=behind), queued.logprobs):
            row.last, row.position = token, row.position + 1
            drawn.append(Drawn(row.uid, token, lp))
        return drawn

    def _forward(self, inputs: mx.array) -> tuple[mx.array, Optional[mx.array]]:
        """Logits (B, L, V) of inputs (B, L) through the batch cache: the model's own call
        (and no drafter features)."""
        return self.model(inputs, cache=self.cache), None

    def _index(self, uid: int) -> int:
        for i, row in enumerate(self.rows):
            if row.uid == uid:
                return i
        raise KeyError(f"no row {uid} in the batch")

    def remove(self, uid: int) -> None:
        """Row `uid` leaves (a stop, max tokens, a cancel); the others go on untouched."""
        i = self._index(uid)
        del self.rows[i]
        queued = self._queued
        if queued is not None and i < len(queued):
            keep = [k for k in range(len(queued)) if k != i]
            if keep:
                queued.filter(keep)
            else:
                self._queued = None
        if not self.rows:
            self.cache, self._queued = [], None
            return
        keep = list(range(len(self.rows) + 1))
        del keep[i]
        for layer in self.cache:
            layer.filter(keep)

    def extract(self, uid: int) -> tuple[list[Any], int]:
        """Row `uid`'s single-sequence prompt cache (every token it has fed) and the token
        it feeds next: what `add` takes, and what the one-sequence loop continues from
        (its prompt [token] on this cache). The row stays in the batch."""
        i = self._index(uid)
        row = self.rows[i]
        if row.position == 1:  # nothing fed before `last` (a one-token prompt): a batch cache may hold no state to cut
            return make_prompt_cache(self.model), row.last
        if self._queued is None or i >= len(self._queued):
            return [layer.extract(i) for layer in self.cache], row.last
        before = self._queued.before  # the step queued ahead fed `last`: the row's cache is without it
        return [unstep_row(layer, i, before.get(j)) for j, layer in enumerate(self.cache)], row.last
