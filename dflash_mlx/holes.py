"""A batch KV cache whose rows' rejected slots stay in place as masked holes.

After a batched verify (`batch_spec.py`) each row keeps its own accepted prefix; mlx-lm's
`BatchKVCache` holds one slot index `_idx` for every row, so a row that rejected more
than the others has dead slots at its end. `HoleKVCache` leaves them where they are and
masks them for every later query (`punch`), instead of rolling each row's keys and values
into its left padding (a copy of every layer per cycle: `benchmarks/concurrency/
rollback_cost.py` times both). A row's
RoPE offset (`offset`, the number of tokens it holds) is kept apart from the slot index:
it goes back by the row's rejected count while `_idx` stays, so the next token of that row
sits at its own position, after a few masked slots.

`holes` (B, n) marks row r's slot j a hole (slots at or past n are not); the mask
(`make_mask`, which the models call through `create_attention_mask`) hides them on top of
the left padding and causality. `filter`, `extend` and `trim` carry the holes along;
`extract` gives a compact single-sequence cache (holes dropped); `compact` squeezes every
row's holes out of the batch (one gather of every slot), which `punch` does itself once a
row's holes exceed `COMPACT_SHARE` of the slots. That check reads the holes back to the host
only once a host-side bound on them (`hole_bound`) passes the share: on a GPU each read
waits for the device, and `punch` runs on every layer after every verify.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

#: `punch` compacts the batch once some row's holes exceed this share of the slots.
COMPACT_SHARE = 0.5


class HoleKVCache(BatchKVCache):
    """mlx-lm's `BatchKVCache` with per-row masked holes (see the module's docstring):
    built as that one is (`merge`, `extend`), the model calls it the same way."""

    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.holes: Optional[mx.array] = None  # (B, n) bool: a hole at row r, slot j < n
        self.hole_bound = 0  # no row holds more holes than this (a host integer: see `punch`)

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "HoleKVCache":
        """mlx-lm's merge of single-sequence caches into one batch, a `HoleKVCache` also
        where every cache is empty (a one-token prompt: mlx-lm's own gives a plain
        `BatchKVCache` then, which cannot roll its rows back one by one)."""
        if max(c.size() for c in caches) == 0:
            return cls([0] * len(caches))
        return super().merge(caches)

    def _holes(self, width: int) -> mx.array:
        """The holes (B, width): cut or padded on the right with no holes."""
        rows = self.offset.shape[0]
        if self.holes is None:
            return mx.zeros((rows, width), dtype=mx.bool_)
        n = self.holes.shape[1]
        if n >= width:
            return self.holes[:, :width]
        return mx.concatenate([self.holes, mx.zeros((rows, width - n), dtype=mx.bool_)], axis=1)

    @property
    def state(self) -> tuple:
        """keys, values, offset, left_padding, `_idx` (as mlx-lm's) and the holes."""
        return (*super().state, self.holes)

    @state.setter
    def state(self, v: tuple) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx, self.holes = v
        self.hole_bound = 0 if self.holes is None else self._idx

    def punch(self, counts: Sequence[int]) -> None:
        """Row r's last `counts[r]` slots become holes and its offset goes back by the tokens
        among them; the slot index stays. Compacts the batch once some row's holes exceed
        `COMPACT_SHARE` of the slots."""
        if len(counts) != self.offset.shape[0] or min(counts) < 0 or max(counts) > self._idx:
            raise ValueError(f"counts {list(counts)} must give 0..{self._idx} slots for each of the batch's rows")
        if max(counts) == 0:
            return
        self.hole_bound += max(counts)
        counts = mx.array(counts)
        fresh = mx.arange(self._idx)[None] >= (self._idx - counts)[:, None]  # (B, _idx)
        before = self._holes(self._idx)
        self.holes = before | fresh
        self.offset = self.offset - mx.sum(fresh & ~before, axis=1)
        if self.hole_bound > COMPACT_SHARE * self._idx:  # perhaps: count them (one read)
            self.hole_bound = mx.max(mx.sum(self.holes, axis=1)).item()
            if self.hole_bound > COMPACT_SHARE * self._idx:
                self.compact()

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        """mlx-lm's mask (B, 1, N, _idx + N) for N new tokens, with the holes masked too."""
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if self.holes is None:
            return mask
        return mask & ~self._holes(self._idx + N)[:, None, None, :]

    def trim(self, n: int) -> int:
        """Drop the last `n` slots; each row's offset goes back by its tokens among them."""
        if self.holes is None:  # every slot holds a token: mlx-lm's trim
            return super().trim(n)
        n = min(self._idx, n)
        gone = mx.sum(self._holes(self._idx)[:, self._idx - n :], axis=1)  # (B,) holes among them
        super().trim(n)
        self.offset = self.offset + gone
        self.holes = self.holes[:, : self._idx]
        return n

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep the given rows (mlx-lm's filter, which may shift every row left), holes too."""
        before = self._idx
        holes = None if self.holes is None else self._holes(before)[mx.array(batch_indices)]
        super().filter(batch_indices)
        self.holes = None if holes is None else holes[:, before - self._idx :]

    def extend(self, other: BatchKVCache) -> None:
        """Append the rows of `other` (a `HoleKVCache` or mlx-lm's `BatchKVCache`), holes
        kept in place as mlx-lm right-justifies both to the longer slot index."""
        width = max(self._idx, other._idx)
        mine = self.holes is not None
        theirs = getattr(other, "holes", None) is not None

        def justified(c: BatchKVCache) -> mx.array:  # (rows of c, width)
            rows = c.offset.shape[0]
            h = c._holes(c._idx) if isinstance(c, HoleKVCache) else mx.zeros((rows, c._idx), dtype=mx.bool_)
            return mx.concatenate([mx.zeros((rows, width - c._idx), dtype=mx.bool_), h], axis=1)

        holes = mx.concatenate([justified(self), justified(other)]) if mine or theirs else None
        super().extend(other)
        self.holes = holes
        self.hole_bound = max(self.hole_bound, getattr(other, "hole_bound", 0))

    def _kept(self) -> list[list[int]]:
        """Each row's held slots (past its left padding, not holes), in order."""
        holes = self._holes(self._idx).tolist()
        return [[j for j in range(pad, self._idx) if not row[j]] for pad, row in zip(self.left_padding.tolist(), holes)]

    def extract(self, idx: int) -> KVCache:
        """Row `idx` as a single-sequence cache holding its tokens alone (holes dropped)."""
        if self.holes is None:
            return super().extract(idx)
        slots = mx.array(self._kept()[idx])
        cache = KVCache()
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, slots])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, slots])
        cache.offset = cache.keys.shape[2]
        return cache

    def compact(self) -> None:
        """Squeeze every row's holes out: its tokens right-justified at the slot index of the
        fullest row, the rest left padding (one gather of every layer's keys and values)."""
        if self.holes is None:
            return
        kept = self._kept()
        width = max(len(k) for k in kept)
        pads = [width - len(k) for k in kept]
        index = mx.array([[0] * p + k for p, k in zip(pads, kept)])[:, None, :, None]  # (B, 1, width, 1)
        self.keys = mx.take_along_axis(self.keys[..., : self._idx, :], index, axis=2)
        self.values = mx.take_along_axis(self.values[..., : self._idx, :], index, axis=2)
        self.left_padding = mx.array(pads)
        self._idx = width
        self.holes = None
        self.hole_bound = 0
