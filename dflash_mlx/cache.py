"""The conversation state one generation hands to the next: `PromptCache`.

With `kv_bits` the target's KV cache is quantized by mlx-lm's own rule
(`maybe_quantize_kv_cache`: each layer's cache once it holds `quantized_kv_start`
tokens), applied after every forward, as mlx-lm applies it after every step. mlx-lm
decodes one token a step, so a token at position p attends to a quantized cache iff
p >= start; `Plan.kv_room` caps the cycle that would cross the start so that ours do too, and
greedy output stays mlx-lm's with the same quantized cache (rollback trims a
`QuantizedKVCache` as it does a `KVCache`). Quantization cannot be undone: a quantized
cache is reused only where a fresh run would hold the prefix quantized alike (the same
bits and group size, and the prefix reaching the start); else the prompt is prefilled
again, so that the cache a turn leaves never changes what the next one decodes.

A hybrid target's recurrent layers (gated delta, `ArraysCache`) cannot forget tokens, so
the cache keeps snapshots (`rollback.Mark`, a few, least recently used dropped first) at
prefix boundaries: the end of each prompt, and where a later prompt stopped sharing the
tokens held (the length of an agent's system prompt and tools, learned from its second
request). A prompt that shares a prefix goes back to the longest snapshot inside it and
prefills from there; one that finds none prefills from zero but snapshots the shared
prefix on the way, for the next.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import copy
import json
import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache, trim_prompt_cache
from mlx_lm.models.cache import make_prompt_cache as make_target_cache

from .atomic import atomic_file
from .drafter import Drafter
from .rollback import Mark, rewind


#: (bits, group size, start) of mlx-lm's KV cache quantization.
KV = tuple[int, int, int]

#: Hybrid snapshots a prompt cache keeps (each holds references to the recurrent
#: layers' states: a few conv windows and recurrent matrices, no KV).
MARKS = 4


class PromptCache:
    """The target's KV cache, the drafter's context cache, and the tokens they hold.

    Successive calls with the whole conversation as the prompt prefill only the part after
    the longest common prefix (`reuse`). What a sequence learned about the drafter is its
    `sequence.Sequence`'s, which holds this cache."""

    def __init__(self, model: nn.Module, draft_model: Optional[Drafter] = None):
        self.model = model
        self.target = make_target_cache(model)
        self.tokens: list[int] = []  # what the target cache holds
        self.drafter: Optional[Drafter] = None
        self.draft: Optional[list] = None
        self.pending: list[mx.array] = []  # features (1, n, k * hidden) not yet in the drafter's context
        self.marks: list[Mark] = []  # hybrid snapshots at prefix boundaries, least recently used first
        self.boundary: Optional[int] = None  # a prefix length the next prefill snapshots at
        self.use_drafter(draft_model)

    def quantize(self, kv: Optional[KV]) -> None:
        """After a forward: quantize every layer's cache that has reached the start, as `kv`
        = (bits, group size, start) says (None: not at all)."""
        if kv is not None:
            bits, group_size, start = kv
            maybe_quantize_kv_cache(self.target, start, group_size, bits)

    def use_drafter(self, draft_model: Optional[Drafter]) -> None:
        """Give `draft_model` a fresh context cache, unless it is the one this cache holds."""
        if draft_model is not None and draft_model is not self.drafter:
            self.drafter, self.draft, self.pending = draft_model, draft_model.make_cache(), []

    def bound_drafter(self, window: Optional[int], sink: int) -> None:
        """Bound the drafter's context cache to the last `window` tokens (None: all) and the first `sink`."""
        for c in self.draft or []:
            c.window, c.sink = window, sink

    def draft_memory(self) -> tuple[int, int]:
        """(tokens, bytes) the drafter's context cache keeps."""
        if not self.draft:
            return 0, 0
        return self.draft[0].stored, sum(c.nbytes for c in self.draft)

    @property
    def draft_length(self) -> int:
        """Tokens the drafter has as context (in its cache or pending)."""
        cached = self.draft[0].offset if self.draft else 0
        return cached + sum(f.shape[1] for f in self.pending)

    def remember(self) -> None:
        """Snapshot the target cache where it stands (a prefix boundary in a prefill), for
        a hybrid target; the least recently used snapshot goes past `MARKS`."""
        mark = Mark.take(self.target, len(self.tokens))
        if mark is not None:
            kept = [m for m in self.marks if m.length != mark.length]
            self.marks = kept[-(MARKS - 1) :] + [mark]

    def _rewind(self, keep: int, kv: Optional[KV]) -> int:
        """Make the target cache hold its first `keep` tokens, or as many as the longest
        snapshot inside them gives (0: a fresh cache, also where a fresh run quantizing as
        `kv` says would hold them otherwise); how many it holds."""
        self.marks = [m for m in self.marks if m.length <= keep]  # the others hold other tokens
        mark = max(self.marks, key=lambda m: m.length, default=None)
        held = rewind(self.target, len(self.tokens), keep, mark) if self._quantized_as(kv, keep) else None
        if held is None:
            self.target, self.marks, held = make_target_cache(self.model), [], 0
        elif mark is not None and held == mark.length:  # used: the most recently
            self.marks.remove(mark)
            self.marks.append(mark)
        self.boundary = keep if held < keep and Mark.take(self.target, held) is not None else None
        return held

    def _quantized_as(self, kv: Optional[KV], keep: int) -> bool:
        """Whether the target cache's first `keep` tokens are held as a fresh run quantizing
        as `kv` says would hold them: not quantized, or quantized alike and past the start
        (mlx-lm quantizes a layer once it holds `start` tokens)."""
        quantized = [c for c in self.target if isinstance(c, QuantizedKVCache)]
        if not quantized:
            return True
        return kv is not None and keep >= kv[2] and all((c.bits, c.group_size) == kv[:2] for c in quantized)

    def _context_whole(self, keep: int, length: int) -> int:
        """How many of the first `keep` tokens the drafter's context can go on from for a
        prompt of `length`: all, unless its window (this generation's) reaches back to
        tokens it dropped under a narrower one (kept: the sink before them; what followed
        is prefilled again, since its features are gone)."""
        c = self.draft[0]  # positions [head, tail) fell out of the window of an earlier generation
        reach = c.head if c.window is None else max(c.head, length - c.window)  # the first the next drafts read
        return c.head if min(c.tail, keep) > reach else keep

    def flush(self) -> None:
        """Move pending features into the drafter's context (lazily, one projection)."""
        if self.pending:
            self.drafter.append_context(mx.concatenate(self.pending, axis=1), self.draft)
            self.pending = []

    def context_copy(self) -> Optional[list]:
        """A copy of the drafter's context cache, pending features flushed in (None without a
        drafter): what a batch row takes over while this cache stays as it is. Shallow: a
        context cache replaces its arrays on update, never writes into them."""
        self.flush()
        return None if self.draft is None else [copy.copy(c) for c in self.draft]

    def take_over(self, target: list, draft: Optional[list], tokens: Sequence[int]) -> None:
        """Hold `target` and `draft` (a target cache and the drafter's context cache that
        decoded on elsewhere, e.g. a batch row's), which hold `tokens`. The snapshots stay:
        they are of a prefix of `tokens`."""
        self.target, self.draft, self.pending, self.tokens = target, draft, [], list(tokens)

    def reuse(self, prompt: Sequence[int], with_drafter: bool, kv: Optional[KV] = None) -> int:
        """Trim to the longest prefix shared with `prompt` (keeping at least one prompt
        token to prefill) and return its length. A target cache that cannot forget
        tokens goes back to its longest snapshot inside that prefix (a recurrent state,
        see the module docstring), else starts over (also a wrapped window, and a
        quantized cache that a fresh run quantizing as `kv` says would not hold so); the
        next prefill then snapshots the shared prefix (`boundary`)."""
        keep = 0
        for a, b in zip(self.tokens, prompt[:-1]):
            if a != b:
                break
            keep += 1
        if with_drafter:
            keep = min(keep, self.draft_length, self._context_whole(keep, len(prompt)))
        keep = self._rewind(keep, kv)
        self.tokens = self.tokens[:keep]
        if self.draft_length > keep:
            self.flush()
            trim_prompt_cache(self.draft, self.draft_length - keep)
        return keep


#: The version of prompt cache files (`save_file`): mlx-lm's safetensors layout, the
#: target's caches then the drafter's, with these metadata keys.
CACHE_FORMAT = "dflash-prompt-cache/1"


def _used_rows(layer: Any) -> Any:
    """What to save of one target cache layer: a copy cut to the rows it holds. mlx-lm's
    KV caches grow in steps of 256 rows and save the whole buffer (2 tokens of SmolLM2-135M
    were 11.8 MB); a cut cache loads as a working one, which grows again from its end. A
    rotating cache is cut only before it wraps (then its rows are in order); recurrent
    states have no spare rows."""
    if isinstance(layer, RotatingKVCache):
        used = layer._idx if layer.offset == layer._idx else None
    elif isinstance(layer, (KVCache, QuantizedKVCache)):
        used = layer.offset
    else:
        return layer
    if layer.keys is None or used is None:
        return layer
    cut = copy.copy(layer)  # the live cache keeps its buffer
    cut.keys, cut.values = tree_map(lambda x: x[..., :used, :], (layer.keys, layer.values))  # (1, heads, used, dim)
    return cut


def save_file(path: str, cache: PromptCache, model_id: str, draft_id: str) -> None:
    """Write `cache` (a prefilled prefix) to `path`, whole or not at all, in mlx-lm's prompt
    cache format, tagged with the format version and the ids of the target and drafter it
    belongs to: the rows the caches hold, not their spare capacity (`_used_rows`). The
    drafter's kept context goes as plain K/V; where it sits is in the metadata."""
    cache.flush()
    draft = []
    for c in cache.draft or []:
        kv = KVCache()
        kv.keys, kv.values, kv.offset = c.keys, c.values, c.stored
        draft.append(kv)
    first = (cache.draft or [None])[0]
    where = {} if first is None else dict(offset=first.offset, head=first.head, tail=first.tail)
    metadata = dict(
        format=CACHE_FORMAT,
        model=model_id,
        draft=draft_id,
        tokens=json.dumps(cache.tokens),
        target_layers=str(len(cache.target)),
        draft_where=json.dumps(where),
    )
    with atomic_file(path) as tmp:  # a failed write leaves the old file (or none), never half of one
        save_prompt_cache(str(tmp), [_used_rows(layer) for layer in cache.target] + draft, metadata)


def cache_ids(model: Optional[str], draft: Optional[str], no_draft: bool = False) -> tuple[str, str]:
    """The target and drafter ids a prompt cache file is tagged with: the names given on
    the command line ("default" for the defaults, "none" for no drafter)."""
    return model or "default", "none" if no_draft else draft or "default"


def read_file(path: str, model_id: str, draft_id: str, target_alone: bool = False) -> tuple[list, dict]:
    """The caches and metadata saved at `path`, after checking it is this format and
    belongs to this target and drafter (a ValueError of one line otherwise). With
    `target_alone`, a file saved without a drafter ("none") fits any drafter too: the
    drafter's context then starts empty, and its first prefill runs the prefix again."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such prompt cache file")
    try:
        caches, metadata = load_prompt_cache(path, return_metadata=True)
    except Exception as exc:  # mlx raises plain exceptions for a file that is not safetensors
        raise ValueError(f"{path} is not a prompt cache file ({type(exc).__name__})") from None
    if metadata.get("format") != CACHE_FORMAT:
        raise ValueError(f"{path} is not a {CACHE_FORMAT} file (format {metadata.get('format')!r})")
    if target_alone and metadata.get("draft") == "none":
        draft_id = "none"
    for kind, want in (("model", model_id), ("draft", draft_id)):
        if metadata.get(kind) != want:
            raise ValueError(f"{path} was saved for {kind} {metadata.get(kind)!r}, not {want!r}")
    return caches, metadata


def load_file(
    path: str,
    model: nn.Module,
    draft_model: Optional[Drafter],
    model_id: str,
    draft_id: str,
    target_alone: bool = False,
) -> PromptCache:
    """The `PromptCache` saved at `path` (checked as `read_file` does)."""
    caches, metadata = read_file(path, model_id, draft_id, target_alone)
    cache = PromptCache(model, draft_model)
    n = int(metadata["target_layers"])
    cache.target, cache.tokens = caches[:n], json.loads(metadata["tokens"])
    where = json.loads(metadata["draft_where"])
    for c, saved in zip(cache.draft or [], caches[n:]):
        c.keys, c.values = saved.keys, saved.values
        c.offset, c.head, c.tail = where["offset"], where["head"], where["tail"]
    cache.remember()
    return cache
