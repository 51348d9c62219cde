"""Undoing a verify: the one place that knows how to take rejected tokens back out of
every kind of target cache.

After a rejected draft the target's state must be exactly what it would be had it
seen only the accepted tokens. Per cache kind:

- `KVCache` (and `QuantizedKVCache`): trim, as mlx-lm does.
- `RotatingKVCache` (sliding-window layers): a multi-token update (every verify has at
  least two tokens) leaves the cache in temporal order holding its last `max_size - 1`
  old tokens plus the new ones, so the rejected tokens are simply the last entries:
  slice them off. This stays exact after the window has wrapped, where mlx-lm's `trim`
  refuses, and costs nothing (no recompute, no copy).
- `ArraysCache` (gated-delta layers: a conv window and a recurrent state): restore the
  arrays held before the verify and feed the accepted tokens' inputs to that layer again,
  through the model's own module, which keeps mlx-lm's exact code path (its Metal kernel
  included) and needs no copy of its forward. Cost per cycle that rejects a draft (none
  when every draft is accepted): for each linear-attention layer, its input projections
  (`in_proj_qkv`, `in_proj_a`, `in_proj_b`), conv and recurrence over the accepted+1
  tokens (the layer's output is never read, so MLX's lazy graph skips the z / norm /
  out_proj half). On a Mac decoding is bound by weight reads: this re-reads `in_proj_qkv`
  of every linear layer once per rejecting cycle, roughly a fifth of such a layer's
  weights (estimated from Qwen3.5's shapes, not measured: on the order of 10-15% of a
  target step). With kernels on (`Target.use_kernels`) the verify records a tape of the
  recurrence inputs instead (kernels/tape.py, which owns a copy of the mixer's forward
  for that), and the rollback slides the conv window and replays the recurrence alone
  (`Tape.rewind`, the `gated_delta_replay` kernel): no weight is read again.

In a batch (`batch_spec.py`) every row verifies the same number of tokens and keeps its
own prefix: `Checkpoint.rollback_rows` takes each row's rejected tail out of the batch
caches (left as masked holes in a `holes.HoleKVCache`, or replayed per row for gated-delta
states).

A batch's plain step queued ahead (`batch.py`) feeds every row its last token before the
caller has seen the step: where the caller hands a row over (`extract`) or drafts instead,
that token is taken back out (`unstep_row`, `unstep_rows`).

After a draft tree's verify (`tree.py`) the KV caches hold root + every node in tree
order; `keep_rows` gathers the accepted path's rows into place and sets the offset, so
the cache is what it would be had it seen the committed tokens alone.

Saving the states costs nothing either: mlx-lm replaces these arrays on update (it
never writes into them), so a checkpoint holds references, not copies.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from .holes import HoleKVCache

#: replay(layer index, that layer's inputs (1, n, hidden), its cache): rebuild the cache.
Replay = Callable[[int, mx.array, Any], None]


class Checkpoint:
    """What undoing one verify forward needs: the recurrent layers' states before it,
    and (recorded by the forward) those layers' inputs during it."""

    def __init__(self, cache: Sequence[Any], replay: Replay):
        self.cache, self.replay = cache, replay
        self.states = recurrent_states(cache)
        self.inputs: dict[int, mx.array] = {}
        self.tapes: dict[int, Any] = {}  # kernels.tape.Tape of the layers whose forward recorded one

    def record(self, layer: int, inputs: mx.array) -> None:
        """Keep layer `layer`'s input (1, L, hidden) if the layer is recurrent."""
        if layer in self.states:
            self.inputs[layer] = inputs

    def rollback(self, drop: int) -> None:
        """Take the verify's last `drop` tokens back out of every layer's cache."""
        if drop <= 0:
            return
        for i, c in enumerate(self.cache):
            if isinstance(c, ArraysCache):
                c.cache = list(self.states[i])
                if i in self.tapes:
                    self.tapes[i].rewind(c, drop)
                else:
                    inputs = self.inputs[i]
                    self.replay(i, inputs[:, : inputs.shape[1] - drop], c)
            elif isinstance(c, RotatingKVCache):
                _drop_rotating(c, drop)
            elif c.is_trimmable():
                c.trim(drop)
            else:
                raise ValueError(f"a {type(c).__name__} target cache cannot be rolled back")

    def rollback_rows(self, drops: Sequence[int]) -> None:
        """Undo a batched verify (every row fed the same number of tokens, each keeping its
        own prefix): take row r's last `drops[r]` tokens back out of every layer's batch
        cache. A batch KV cache is trimmed by the fewest; each row's further rejected
        tokens become masked holes in a `HoleKVCache` (`punch`: no copy; mlx-lm's own
        `BatchKVCache` takes back only a tail every row rejected). A gated-delta `ArraysCache` is restored and fed
        each row's kept inputs again in one forward, the rows past their own length masked
        by mlx-lm's `lengths` (which holds their state and takes their conv window at their
        own end)."""
        least, most = min(drops), max(drops)
        if most <= 0:
            return
        for i, c in enumerate(self.cache):
            if isinstance(c, ArraysCache):
                c.cache = list(self.states[i])
                inputs = self.inputs[i]  # (B, L, hidden)
                kept = [inputs.shape[1] - d for d in drops]
                if least < most:
                    c.prepare(lengths=kept)
                self.replay(i, inputs[:, : max(kept)], c)
                c.finalize()  # lengths off (the batch's gated-delta rows carry no left padding)
            elif isinstance(c, HoleKVCache) or (isinstance(c, BatchKVCache) and least == most):
                c.trim(least)
                if least < most:
                    c.punch([d - least for d in drops])
            else:
                raise ValueError(f"a {type(c).__name__} batch cache cannot be rolled back per row")


def recurrent_states(cache: Sequence[Any]) -> dict[int, list[Any]]:
    """The arrays of each recurrent layer (`ArraysCache`) by layer index: references, which
    stay valid (mlx-lm replaces these arrays on update)."""
    return {i: list(c.cache) for i, c in enumerate(cache) if isinstance(c, ArraysCache)}


def unstep_row(layer: Any, row: int, before: Optional[list[Any]] = None) -> Any:
    """Row `row` of a batch cache layer as a single-sequence cache, without the last token a
    plain step queued ahead fed it: a KV cache drops its last entry; a rotating one whose
    window was full lost its oldest token to that one, and its freed slot goes first, where
    its next token is written (one token) or which it drops (several) before anything
    attends there; a recurrent layer is the row of `before`, its arrays before the step."""
    if isinstance(layer, ArraysCache):
        earlier = ArraysCache(len(before))
        earlier.cache = list(before)
        return earlier.extract(row)
    cache = layer.extract(row)  # keys (1, kv_heads, n, head_dim), in order
    if isinstance(cache, RotatingKVCache) and cache.offset > cache.keys.shape[2]:
        cache.keys, cache.values = (mx.roll(a, 1, axis=2) for a in (cache.keys, cache.values))
    else:
        cache.keys, cache.values = cache.keys[..., :-1, :], cache.values[..., :-1, :]
        if isinstance(cache, RotatingKVCache):
            cache._idx -= 1
    cache.offset -= 1
    return cache


def unstep_rows(cache: Sequence[Any], before: dict[int, list[Any]], ahead: int) -> None:
    """Take the last token back out of the first `ahead` rows of a speculating batch's
    caches, fed by a plain step queued ahead (the rows after them joined since): a
    `HoleKVCache` trims it where every row fed it, else leaves it a hole; a recurrent layer
    gets its arrays of those rows from before the step back (`before`, `recurrent_states`)."""
    for i, c in enumerate(cache):
        if isinstance(c, ArraysCache):
            c.cache = [
                was if now is None or ahead == now.shape[0] else mx.concatenate([was, now[ahead:]])
                for was, now in zip(before[i], c.cache)
            ]
        elif isinstance(c, HoleKVCache):
            rows = len(c.pads)
            if ahead == rows:
                c.trim(1)
            else:
                c.punch([1] * ahead + [0] * (rows - ahead))
        else:
            raise ValueError(f"a {type(c).__name__} batch cache cannot take back a queued step")


def _drop_rotating(c: RotatingKVCache, drop: int) -> None:
    """Remove the last `drop` entries of a rotating cache right after a multi-token update."""
    if c.keys is None or c._idx != c.keys.shape[2] or drop >= c.keys.shape[2]:
        raise ValueError("a RotatingKVCache can only be rolled back right after a multi-token update")
    end = c.keys.shape[2] - drop
    c.keys, c.values = c.keys[..., :end, :], c.values[..., :end, :]
    c.offset -= drop
    c._idx = end


def keep_rows(cache: Sequence[Any], start: int, rows: Sequence[int]) -> None:
    """After a tree verify wrote its rows at start, start + 1, ...: keep rows start + rows[j]
    at start + j (rows increasing, rows[j] >= j: a root-to-node path in tree order) and
    drop the rest. KVCache and QuantizedKVCache (each of its packed arrays) alike."""
    end = start + len(rows)
    if list(rows) != list(range(len(rows))):  # a prefix of the rows is already in place
        index = mx.array([start + r for r in rows])
        for c in cache:
            packed = (*c.keys, *c.values) if isinstance(c, QuantizedKVCache) else (c.keys, c.values)
            for a in packed:  # (1, kv_heads, capacity, dim)
                a[..., start:end, :] = a[..., index, :]
    for c in cache:
        c.offset = end


class Mark:
    """A hybrid cache as it was after its first `length` tokens (the end of a prompt), so
    that a later turn that keeps at least those can go back there instead of starting
    over: its KV layers are trimmed back, its recurrent layers' states kept by reference."""

    def __init__(self, cache: Sequence[Any], length: int):
        self.length = length
        self.states = {i: list(c.cache) for i, c in enumerate(cache) if isinstance(c, ArraysCache)}

    @staticmethod
    def take(cache: Sequence[Any], length: int) -> Optional["Mark"]:
        """A mark, where one is needed (recurrent layers) and possible (no rotating cache:
        mlx-lm writes into those in place, a reference would not hold still)."""
        recurrent = [isinstance(c, ArraysCache) for c in cache]
        kv = [not r and not isinstance(c, RotatingKVCache) and c.is_trimmable() for c, r in zip(cache, recurrent)]
        return Mark(cache, length) if any(recurrent) and all(r or k for r, k in zip(recurrent, kv)) else None


def rewind(cache: Sequence[Any], held: int, keep: int, mark: Optional[Mark] = None) -> Optional[int]:
    """Make a cache that holds `held` tokens hold its first `keep` only, between generations
    (multi-turn reuse). Returns how many it holds now: `keep`, or the `mark`'s length when
    only the mark can take it below `held`; None when it must start over (a recurrent
    state with no usable mark, a wrapped window)."""
    if keep >= held or can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, held - keep)
        return keep
    if mark is None or mark.length > keep:
        return None
    for i, c in enumerate(cache):
        if isinstance(c, ArraysCache):
            c.cache = list(mark.states[i])
        else:
            c.trim(held - mark.length)
    return mark.length
