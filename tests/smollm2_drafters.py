"""Drafters and prompts for the default target (SmolLM2-135M-Instruct) in the lossless
tests: the block size and drafter config they decode with, a scripted adversary of
either family (v1 `ScriptedDrafter`, DFlash2 `ScriptedDrafter2`) that proposes the
true continuation corrupted where told, the prompts, and a user message chat-templated."""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

from conftest import smollm2_drafter_config
from dflash_mlx.drafter import Drafter, DrafterConfig
from dflash_mlx.drafter2 import Drafter2
from scripted_drafts import scripted_logits

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 10.",
]
BLOCK = 8


def drafter_config(**kw) -> DrafterConfig:
    """The lossless tests' drafter for the default target (MLP 1536, feature layers 2, 15
    and 28, block `BLOCK`); `kw`: `smollm2_drafter_config`'s overrides."""
    return smollm2_drafter_config(
        **{"intermediate_size": 1536, "target_layer_ids": [2, 15, 28], "block_size": BLOCK, **kw}
    )


class Scripted:
    """A drafter (mixed into either family) that proposes the target's true continuation,
    corrupted by `corrupt(cycle, k)`.

    It reads the block's position from its context cache, like a real drafter, runs its
    real forward, and gives one-hot logits through its head, so it exercises every
    acceptance length (a DFlash2 drafter's selector then picks among those logits)."""

    def __init__(self, truth: list[int], corrupt, block_size: int = BLOCK):
        super().__init__(drafter_config(block_size=block_size, dflash2=isinstance(self, Drafter2)))
        self.truth, self.corrupt, self.cycle = truth, corrupt, 0

    def __call__(self, block_embeddings, cache):
        self.position = cache[0].offset  # position of block[0]
        return super().__call__(block_embeddings, cache)

    def head(self, h, target):
        logits = scripted_logits(self.truth, self.corrupt, self.cycle, self.position, h.shape[0], 49152)
        self.cycle += 1
        return logits


class ScriptedDrafter(Scripted, Drafter):
    """`Scripted` on a v1 (DFlash) drafter."""


class ScriptedDrafter2(Scripted, Drafter2):
    """`Scripted` on a DFlash2 drafter (its selector picks among the scripted logits)."""


def chat(tokenizer, text: str) -> list[int]:
    """The token ids of one user message `text`, chat-templated for the answer."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
