"""Drafters and prompts for the tiny targets (`tiny_targets.py`): the block size and mask
token the tiny-target tests decode with, a random drafter, a scripted adversary that
proposes the true continuation corrupted where told (and the error patterns it is
given), random prompts, random per-depth candidates for draft trees, and how the
prompt-cache tests decode a cached prefix and a fresh prefill alike (`N`, `DECODE`)."""

from __future__ import annotations

from dataclasses import replace

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from dflash_mlx.drafter import Drafter, DrafterConfig
from dflash_mlx.target import Target
from scripted_drafts import scripted_logits
from tiny_targets import VOCAB, tiny_drafter_config

BLOCK = 6
MASK = VOCAB - 1
#: Tokens the prompt-cache tests decode, and how `dflash_tokens` decodes them (from a
#: loaded or reused prefix, and from a fresh prefill of the same prompt).
N = 20
DECODE = dict(block_size=4, draft_window=6)


def drafter_config(target: Target, block_size: int = BLOCK) -> DrafterConfig:
    """A one-layer drafter config for `target` (`tiny_drafter_config`, mask token `MASK`)."""
    return tiny_drafter_config(target.num_layers, block_size, mask_token_id=MASK)


def random_drafter(target: Target, seed: int = 0, **fields) -> Drafter:
    """A random drafter for `target` (`drafter_config`, `fields` replaced), drawn from `seed`."""
    mx.random.seed(seed)
    drafter = Drafter(replace(drafter_config(target), **fields))
    mx.eval(drafter.parameters())
    return drafter


class ScriptedDrafter(Drafter):
    """Proposes the true continuation, corrupted where `corrupt(cycle, k)` says (one-hot logits)."""

    def __init__(self, target: Target, truth: list[int], corrupt):
        super().__init__(drafter_config(target))
        self.truth, self.corrupt, self.cycle = truth, corrupt, 0

    def propose(self, block, cache, target):
        logits = scripted_logits(self.truth, self.corrupt, self.cycle, cache[0].offset, block.shape[1] - 1, VOCAB)
        self.cycle += 1
        return logits


# all wrong, first wrong, last wrong, middle wrong, all right
PATTERNS = [lambda k: True, lambda k: k == 1, lambda k: k == BLOCK - 1, lambda k: k == BLOCK // 2, lambda k: False]


def prompt_of(length: int, seed: int) -> list[int]:
    """`length` random tokens drawn from `seed` (neither 0 nor `MASK`)."""
    return np.random.default_rng(seed).integers(1, MASK, size=length).tolist()


def random_candidates(depth: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each depth's k candidates (log-probabilities most likely first, distinct ids)."""
    rng = np.random.default_rng(seed)
    lp = np.sort(np.log(rng.dirichlet(np.ones(k + 2), size=depth))[:, :k], axis=1)[:, ::-1]
    ids = np.stack([rng.permutation(VOCAB)[:k] for _ in range(depth)])
    return np.ascontiguousarray(lp), ids
