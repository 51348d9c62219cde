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
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import count
from typing import Any, NamedTuple, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

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
        """One forward over every row's last token; each row's next token drawn with its
        own sampling at its own position. Returns one `Drawn` per row, in row order."""
        if not self.rows:
            raise ValueError("the batch is empty: add a sequence first")
        inputs = mx.array([[row.last] for row in self.rows])  # (B, 1)
        logits = self._forward(inputs)[:, -1]  # (B, V)
        tokens = mx.concatenate(
            [row.sampling.choose(logits[i : i + 1], row.position) for i, row in enumerate(self.rows)]
        )  # (B,)
        lps = [log_softmax(logits[i]) if row.logprobs else None for i, row in enumerate(self.rows)]
        mx.eval(tokens, [lp for lp in lps if lp is not None])
        drawn = []
        for row, token, lp in zip(self.rows, tokens.tolist(), lps):
            row.last, row.position = token, row.position + 1
            drawn.append(Drawn(row.uid, token, lp))
        return drawn

    def _forward(self, inputs: mx.array) -> mx.array:
        """Logits (B, L, V) of inputs (B, L) through the batch cache: the model's own call."""
        return self.model(inputs, cache=self.cache)

    def _index(self, uid: int) -> int:
        for i, row in enumerate(self.rows):
            if row.uid == uid:
                return i
        raise KeyError(f"no row {uid} in the batch")

    def remove(self, uid: int) -> None:
        """Row `uid` leaves (a stop, max tokens, a cancel); the others go on untouched."""
        i = self._index(uid)
        del self.rows[i]
        if not self.rows:
            self.cache = []
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
        if self.rows[i].position == 1:  # nothing fed yet (a one-token prompt): a batch cache may hold no state to cut
            return make_prompt_cache(self.model), self.rows[i].last
        return [layer.extract(i) for layer in self.cache], self.rows[i].last
