"""A sequence made ready to join a batch in tests: its prompt (all but the last token) fed
into a single-sequence cache in chunks, and with a drafter into its context cache too (the
server builds its rows through the decoding loop instead); and the batch tests' prompts
and sampled rows' settings (`SAMPLED`)."""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from dflash_mlx.drafter import Drafter
from dflash_mlx.pair import Pair
from dflash_mlx.sampling import SamplingParams
from tiny_targets import VOCAB

#: Seeded sampled settings (temperature, top-p, top-k, seed) that batch rows decode with.
SAMPLED = [SamplingParams(0.9, 0.9, 0, 11), SamplingParams(1.0, 1.0, 20, 12), SamplingParams(0.7, 0.8, 30, 13)]


def row_prompt(length: int, salt: int, vocab: int = VOCAB) -> list[int]:
    """A `length`-token prompt of a batch row, different for each `salt`: a regular pattern
    (tokens below `vocab`)."""
    return [(7 * i + 31 * salt + 3) % vocab for i in range(length)]


def prefill(
    model: nn.Module,
    tokens: Sequence[int],
    cache: list[Any],
    chunk: int = 256,
    draft: Optional[tuple[Drafter, list[Any]]] = None,
) -> Iterator[int]:
    """Feed `tokens` into `cache`, `chunk` tokens per forward, yielding how many are in
    after each (a test runs batch steps between chunks). With `draft` (a drafter and the
    sequence's context cache, `Drafter.make_cache`) the tokens' features go into that
    cache too: what a speculating row joins with (`BatchSpeculator.add`)."""
    pair = Pair.of(model, draft[0]) if draft is not None else None
    for start in range(0, len(tokens), chunk):
        inputs = mx.array(tokens[start : start + chunk])[None]  # (1, n)
        if pair is None:
            model(inputs, cache=cache)  # logits unused
        else:
            _, features = pair.target.forward(inputs, cache)  # features (1, n, k * hidden)
            pair.drafter.append_context(features, draft[1])
        mx.eval([layer.state for layer in cache] + ([c.keys for c in draft[1]] if draft else []))
        yield min(start + chunk, len(tokens))
