"""The drafter's context cache: `ContextCache`, and the masks of a block over what it keeps.

Only the context's K/V are cached (the block's are used once and thrown away), so this
cache never rolls back; it may forget old context beyond a window (`DecodeOptions.
draft_window`), keeping the first `sink` tokens, which changes drafts only: the target
verifies them, so output stays lossless.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class ContextCache(KVCache):
    """A drafter layer's context K/V, bounded: the first `sink` tokens and the last
    `window` (None: every token). `offset` stays the position of the next token (what
    the block's RoPE and the loop read); `stored` counts the tokens actually kept. The
    window only changes drafts, which the target verifies: output stays lossless."""

    def __init__(self, window: Optional[int] = None, sink: int = 0):
        super().__init__()
        self.window, self.sink = window, sink
        self.head = 0  # sink tokens kept (positions 0..head-1)
        self.tail = 0  # position of the first token after the sink part

    @property
    def stored(self) -> int:
        """Tokens whose K/V are kept."""
        return 0 if self.keys is None else self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append keys, values (1, kv_heads, n, head_dim) at positions offset..; drop what
        falls out of the window."""
        if self.keys is not None:
            keys, values = mx.concatenate([self.keys, keys], axis=2), mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2] - self.stored
        self.head = min(self.sink, self.offset) if self.tail == self.head else self.head
        if self.window is not None and keys.shape[2] - self.head > self.window:
            cut = keys.shape[2] - self.head - self.window
            keys = mx.concatenate([keys[..., : self.head, :], keys[..., self.head + cut :, :]], axis=2)
            values = mx.concatenate([values[..., : self.head, :], values[..., self.head + cut :, :]], axis=2)
        self.keys, self.values = keys, values
        self.tail = self.offset - (keys.shape[2] - self.head)
        return keys, values

    def positions(self) -> mx.array:
        """Positions (stored,) of the kept tokens."""
        return mx.concatenate([mx.arange(self.head), mx.arange(self.tail, self.offset)])

    def trim(self, n: int) -> int:
        """Forget the last n tokens (those still kept leave the cache)."""
        n = min(self.offset, n)
        self.offset -= n
        keep = self.head + max(0, self.offset - self.tail) if self.offset >= self.head else self.offset
        self.head = min(self.head, self.offset)
        self.tail = min(self.tail, self.offset)
        if self.keys is not None:
            self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the kept K/V."""
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def sliding_window_mask(
    start: int, length: int, window: int, causal: bool, keys: Optional[mx.array] = None
) -> mx.array:
    """Boolean mask of block queries (positions start..start+length-1) over the keys at
    positions `keys` (default: every position before the block) and the block's own."""
    q = mx.arange(start, start + length)[:, None]
    k = mx.arange(start + length) if keys is None else mx.concatenate([keys, mx.arange(start, start + length)])
    k = k[None]
    allowed = (q - k) < window
    if causal:
        allowed = allowed & (k <= q)
    else:
        allowed = allowed & ((k - q) < window)
    return allowed


def block_masks(config: Any, start: int, length: int, keys: Optional[mx.array]) -> dict[str, Optional[mx.array]]:
    """The attention mask of each layer kind of a drafter `config` (a `DrafterConfig`) for a
    block at positions start.. (length of them), over cached keys at positions `keys`
    (stored,) (None: 0..start - 1, nothing dropped)."""
    masks: dict[str, Optional[mx.array]] = {"full_attention": None}
    if config.is_causal:
        # As in z-lab's code (torch and MLX): a config's is_causal applies to every
        # layer, full-attention ones included (a window wider than all keys).
        masks["full_attention"] = sliding_window_mask(start, length, start + length, True, keys)
    if "sliding_attention" in config.layer_types:
        causal = True if config.is_causal is None else config.is_causal
        masks["sliding_attention"] = sliding_window_mask(start, length, config.sliding_window, causal, keys)
    return masks
