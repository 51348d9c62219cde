"""A sequence made ready to join a batch in tests: its prompt (all but the last token) fed
into a single-sequence cache in chunks, and with a drafter into its context cache too (the
server builds its rows through the decoding loop instead), and joined to a speculating
batch (`join_row`); the batch tests' prompts and sampled rows' settings (`SAMPLED`); and a
scripted drafter for a speculating batch that proposes each row's true continuation,
corrupted where the row's pattern says (`PATTERNS`)."""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from conftest import smollm2_drafter_config
from dflash_mlx.batch_spec import BatchSpeculator
from dflash_mlx.drafter import Drafter
from dflash_mlx.pair import Pair
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.targets import make_target
from scripted_drafts import scripted_logits
from tiny_targets import VOCAB, tiny_drafter_config

#: Seeded sampled settings (temperature, top-p, top-k, seed) that batch rows decode with.
SAMPLED = [SamplingParams(0.9, 0.9, 0, 11), SamplingParams(1.0, 1.0, 20, 12), SamplingParams(0.7, 0.8, 30, 13)]
#: The block size of the speculating batch tests' drafters
BLOCK = 6
#: where each request's drafts are wrong: corrupt(cycle, k) for draft k of the block
PATTERNS = [
    lambda cycle, k: False,  # every draft right
    lambda cycle, k: k == 2,  # one accepted
    lambda cycle, k: (cycle + k) % 3 == 0,  # 0, 1 or 2 accepted, by cycle
    lambda cycle, k: k == 1 + cycle % 4,  # 0 to 3 accepted
]


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


class RowScripted(Drafter):
    """A real drafter forward whose logits (one-hot, through its head) propose each row's
    true continuation, corrupted as the row's pattern says; the row is told by its context
    cache (`watch`), the block's position by that cache's length, like a real drafter."""

    def __init__(self, config, vocab: int):
        super().__init__(config)
        self.vocab, self.rows = vocab, {}

    def watch(self, draft: list, truth: list[int], corrupt) -> None:
        """Script the row whose context cache is `draft`."""
        self.rows[id(draft[0])] = [truth, corrupt, 0]

    def __call__(self, block_embeddings, cache):
        self.row, self.position = self.rows[id(cache[0])], cache[0].offset
        return super().__call__(block_embeddings, cache)

    def head(self, h, target):
        truth, corrupt, cycle = self.row
        logits = scripted_logits(truth, corrupt, cycle, self.position, h.shape[0], self.vocab)
        self.row[2] += 1
        return logits


def scripted_drafter(model, vocab: int = VOCAB) -> RowScripted:
    """A `RowScripted` drafter for `model`: the tiny one at the tiny vocabulary, else one
    that fits the default target (random weights from seed 3 under the script)."""
    mx.random.seed(3)
    if vocab == VOCAB:
        config = tiny_drafter_config(make_target(model).num_layers, BLOCK, mask_token_id=VOCAB - 1)
    else:
        config = smollm2_drafter_config(block_size=BLOCK)
    drafter = RowScripted(config, vocab)
    mx.eval(drafter.parameters())
    return drafter


def join_row(spec: BatchSpeculator, model, drafter, prompt: list[int], sampling: SamplingParams) -> tuple[int, list]:
    """Prefill `prompt` but its last token (chunks of 4, into `drafter`'s context cache too)
    and add it to `spec` with `sampling`: the row's uid and its context cache."""
    cache, draft = make_prompt_cache(model), drafter.make_cache()
    list(prefill(model, prompt[:-1], cache, chunk=4, draft=(drafter, draft)))
    return spec.add(cache, prompt[-1], sampling, draft=draft), draft
