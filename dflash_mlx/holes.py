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
row's holes exceed `COMPACT_SHARE` of the slots.

The host keeps its own exact copy of where the holes are (`runs`: each row's holes as runs
of slots) and of the left padding (`pads`), changed by the same calls that change the
arrays: on a GPU every read waits for the device, and `punch` runs on every layer after
every verify, so deciding to compact, compacting and extracting read nothing back. (This
covers the calls the batch makes: mlx-lm's `prepare` and `finalize`, which pad a prompt
batch, are not mirrored.) Only setting `state` reads the arrays, once.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from . import host

#: `punch` compacts the batch once some row's holes exceed this share of the slots.
COMPACT_SHARE = 0.5

Runs = list[tuple[int, int]]  # a row's holes: slots start .. end - 1 of each run, in order, apart


class HoleKVCache(BatchKVCache):
    """mlx-lm's `BatchKVCache` with per-row masked holes (see the module's docstring):
    built as that one is (`merge`, `extend`), the model calls it the same way."""

    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.holes: Optional[mx.array] = None  # (B, n) bool: a hole at row r, slot j < n
        self.pads = list(left_padding)  # the host's copy of `left_padding`
        self.runs: list[Runs] = [[] for _ in left_padding]  # the host's copy of `holes`

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "HoleKVCache":
        """mlx-lm's merge of single-sequence caches into one batch, a `HoleKVCache` also
        where every cache is empty (a one-token prompt: mlx-lm's own gives a plain
        `BatchKVCache` then, which cannot roll its rows back one by one)."""
        if max(c.size() for c in caches) == 0:
            return cls([0] * len(caches))
        return super().merge(caches)

    def hole_counts(self) -> list[int]:
        """How many holes each row holds (from the host's copy)."""
        return [sum(end - start for start, end in runs) for runs in self.runs]

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
        """Set every array; the host's copies are read from them (one read: a cache loaded
        from elsewhere, never a decoding cycle)."""
        self.keys, self.values, self.offset, self.left_padding, self._idx, self.holes = v
        pads, holes = host.read(self.left_padding, self._holes(self._idx))
        self.pads, self.runs = pads, [_runs(row) for row in holes]

    def punch(self, counts: Sequence[int]) -> None:
        """Row r's last `counts[r]` slots become holes and its offset goes back by the tokens
        among them; the slot index stays. Compacts the batch once some row's holes exceed
        `COMPACT_SHARE` of the slots."""
        if len(counts) != len(self.pads) or min(counts) < 0 or max(counts) > self._idx:
            raise ValueError(f"counts {list(counts)} must give 0..{self._idx} slots for each of the batch's rows")
        if max(counts) == 0:
            return
        fresh = [_punch(runs, self._idx, n) for runs, n in zip(self.runs, counts)]  # tokens that became holes
        tail = mx.arange(self._idx)[None] >= (self._idx - mx.array(counts))[:, None]  # (B, _idx)
        self.holes = self._holes(self._idx) | tail
        self.offset = self.offset - mx.array(fresh)
        if max(self.hole_counts()) > COMPACT_SHARE * self._idx:
            self.compact()

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> mx.array:
        """mlx-lm's mask (B, 1, N, _idx + N) for N new tokens, with the holes masked too."""
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if self.holes is None:
            return mask
        return mask & ~self._holes(self._idx + N)[:, None, None, :]

    def trim(self, n: int) -> int:
        """Drop the last `n` slots; each row's offset goes back by its tokens among them."""
        n = min(self._idx, n)
        if n == 0:
            return 0
        if self.holes is None:  # every slot holds a token: mlx-lm's trim
            return super().trim(n)
        gone = [_cut(runs, self._idx - n) for runs in self.runs]  # holes among them
        super().trim(n)
        self.offset = self.offset + mx.array(gone)
        self.holes = self.holes[:, : self._idx]
        return n

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep the given rows, shifted left past the padding they all share, holes too:
        mlx-lm's filter, which reads the left padding back from the device for that shift,
        where this one knows it."""
        keep = list(batch_indices)
        index = mx.array(keep)
        holes = None if self.holes is None else self._holes(self._idx)[index]
        if self.keys is not None:
            self.keys, self.values = self.keys[index], self.values[index]
        self.offset = self.offset[index]
        pads, runs = [self.pads[i] for i in keep], [self.runs[i] for i in keep]
        shift = min(pads)
        if shift:
            if self.keys is not None:
                self.keys, self.values = self.keys[..., shift:, :], self.values[..., shift:, :]
            self._idx -= shift
            holes = None if holes is None else holes[:, shift:]
        self.holes = holes
        self._set_pads([p - shift for p in pads], [_shifted(r, -shift) for r in runs])

    def extend(self, other: "HoleKVCache") -> None:
        """Append the rows of `other`, holes kept in place as mlx-lm right-justifies both
        to the longer slot index."""
        if not isinstance(other, HoleKVCache):
            raise TypeError(f"a HoleKVCache extends with another, not a {type(other).__name__}")
        width = max(self._idx, other._idx)
        mine, theirs = width - self._idx, width - other._idx

        def justified(c: HoleKVCache, left: int) -> mx.array:  # (rows of c, width)
            return mx.concatenate([mx.zeros((len(c.pads), left), dtype=mx.bool_), c._holes(c._idx)], axis=1)

        holes = None
        if self.holes is not None or other.holes is not None:
            holes = mx.concatenate([justified(self, mine), justified(other, theirs)])
        super().extend(other)
        self.holes = holes
        pads = [p + mine for p in self.pads] + [p + theirs for p in other.pads]
        self._set_pads(pads, [_shifted(r, mine) for r in self.runs] + [_shifted(r, theirs) for r in other.runs])

    def _set_pads(self, pads: list[int], runs: list[Runs]) -> None:
        """The rows' left padding and holes, on the host and (the padding) on the device."""
        self.pads, self.runs, self.left_padding = pads, runs, mx.array(pads)

    def _kept(self, row: int) -> list[int]:
        """Row `row`'s held slots (past its left padding, not holes), in order."""
        kept, at = [], self.pads[row]
        for start, end in self.runs[row]:
            kept += range(at, start)
            at = end
        return kept + list(range(at, self._idx))

    def extract(self, idx: int) -> KVCache:
        """Row `idx` as a single-sequence cache holding its tokens alone (holes dropped)."""
        cache = KVCache()
        if self.keys is None:
            return cache
        if self.runs[idx]:
            slots = mx.array(self._kept(idx))
            keys, values = self.keys[idx : idx + 1, :, slots], self.values[idx : idx + 1, :, slots]
        else:
            keys, values = (a[idx : idx + 1, :, self.pads[idx] : self._idx] for a in (self.keys, self.values))
        cache.keys, cache.values = mx.contiguous(keys), mx.contiguous(values)
        cache.offset = cache.keys.shape[2]
        return cache

    def compact(self) -> None:
        """Squeeze every row's holes out: its tokens right-justified at the slot index of the
        fullest row, the rest left padding (one gather of every layer's keys and values)."""
        if self.holes is None:
            return
        kept = [self._kept(r) for r in range(len(self.pads))]
        width = max(len(k) for k in kept)
        pads = [width - len(k) for k in kept]
        index = mx.array([[0] * p + k for p, k in zip(pads, kept)])[:, None, :, None]  # (B, 1, width, 1)
        self.keys = mx.take_along_axis(self.keys[..., : self._idx, :], index, axis=2)
        self.values = mx.take_along_axis(self.values[..., : self._idx, :], index, axis=2)
        self._idx = width
        self.holes = None
        self._set_pads(pads, [[] for _ in pads])


def _punch(runs: Runs, end: int, n: int) -> int:
    """Make slots end - n .. end - 1 holes in a row's `runs` (every run ends by `end`); how
    many of them were not holes already."""
    start, old = end - n, 0
    while runs and runs[-1][1] >= start:  # runs that overlap or touch the new one join it
        s, e = runs.pop()
        old += max(0, e - max(s, end - n))
        start = min(start, s)
    runs.append((start, end))
    return n - old


def _cut(runs: Runs, end: int) -> int:
    """Drop the holes at slot `end` and past from a row's `runs`; how many there were."""
    gone = 0
    while runs and runs[-1][1] > end:
        s, e = runs.pop()
        gone += e - max(s, end)
        if s < end:
            runs.append((s, end))
    return gone


def _shifted(runs: Runs, by: int) -> Runs:
    """A row's runs, `by` slots further right."""
    return [(s + by, e + by) for s, e in runs]


def _runs(row: list[bool]) -> Runs:
    """A row's holes (one bool per slot) as runs."""
    runs: Runs = []
    for j, hole in enumerate(row):
        if hole:
            _punch(runs, j + 1, 1)
    return runs
