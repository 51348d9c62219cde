"""The first two tokens sampled on the default target (SmolLM2-135M-Instruct, float32), for
the chi-square tests against plain sampling's exact joint law p(t1) p(t2 | t1): the
oracle drafter's sample count and the test drafters' config, an "oracle" drafter that
proposes from a sharpened copy of the target's own distribution (`OracleDrafter`), that
exact law (`PlainDistribution`), n seeded generations' first two tokens through
`stream_generate` (`_sample_pairs`), and a sample's chi-square cell (`_wrap_rest`).
Each test takes the prompt, prefilled, from conftest's `sampling_setup` fixture."""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS preload before the first mlx import)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache as make_target_cache
from mlx_lm.models.cache import trim_prompt_cache

from chi_square import MIN_EXPECTED
from conftest import smollm2_drafter_config
from dflash_mlx import PromptCache, stream_generate
from dflash_mlx.drafter import Drafter, DrafterConfig
from dflash_mlx.drafter2 import Drafter2
from dflash_mlx.sampling import log_softmax
from references import mlx_lm_logprobs

# Each sample costs two target forwards (the last prompt token again, then the verify of
# [t1, draft]): about 0.1-0.2 s on this CPU, hence this count.
ORACLE_SAMPLES = 160


def _drafter_config(block_size: int, dflash2: bool = False) -> DrafterConfig:
    """The sampling tests' drafter for the default target (MLP 256, feature layer 29)."""
    return smollm2_drafter_config(dflash2, intermediate_size=256, target_layer_ids=[29], block_size=block_size)


class OracleDrafter(Drafter):
    """Proposes from the target's own next-token distribution, scaled by `alpha`: for
    block position 1 it returns alpha * the target's final hidden state after
    [prompt, block token 0], so draft logits are alpha * the target's logits. Valid for the
    first cycle after the prompt, which is all a two-token generation verifies (the loop
    queues the next cycle's drafts before it yields the second token: those are zeros, never
    verified, since the caller stops there)."""

    def __init__(self, model, prompt: list[int], alpha: float, block_size: int):
        super().__init__(_drafter_config(block_size, dflash2=isinstance(self, Drafter2)))
        self.model, self.prompt, self.alpha = model, prompt, alpha
        self.target_cache = make_target_cache(model)
        model.model(mx.array(prompt)[None], self.target_cache)
        self.memo: dict[bytes, mx.array] = {}

    def __call__(self, block_embeddings: mx.array, cache) -> mx.array:
        if cache[0].offset != len(self.prompt):  # queued ahead, past the two tokens
            return mx.zeros(block_embeddings.shape, dtype=block_embeddings.dtype)
        first = block_embeddings[:, :1]
        key = np.array(first).tobytes()
        if key not in self.memo:
            hidden = self.model.model(None, self.target_cache, input_embeddings=first)
            trim_prompt_cache(self.target_cache, 1)
            mx.eval(hidden)
            self.memo[key] = hidden
        return mx.broadcast_to(self.alpha * self.memo[key], block_embeddings.shape)


class PlainDistribution:
    """Exact probabilities of plain sampling (mlx-lm's filters, then the temperature) of
    the first two tokens: p(t1) from the prompt, p(t2 | t1) by one forward per t1."""

    def __init__(self, setup, temp: float, top_p: float = 1.0, top_k: int = 0):
        self.model, _, self.prompt, self.cache, first_logits = setup
        self.temp, self.top_p, self.top_k = temp, top_p, top_k
        self.first = self.probs(first_logits)
        self._second: dict[int, np.ndarray] = {}
        self._logits: dict[int, mx.array] = {}

    def probs(self, logits: mx.array, scale: float = 1.0) -> np.ndarray:
        logprobs = mlx_lm_logprobs(log_softmax(scale * logits), self.top_p, self.top_k)
        return np.array(mx.softmax(logprobs * (1.0 / self.temp), axis=-1))

    def logits_after(self, t1: int) -> mx.array:
        if t1 not in self._logits:
            logits = self.model(mx.array([[t1]]), self.cache)[0, -1]
            trim_prompt_cache(self.cache, 1)
            mx.eval(logits)
            self._logits[t1] = logits
        return self._logits[t1]

    def second(self, t1: int) -> np.ndarray:
        if t1 not in self._second:
            self._second[t1] = self.probs(self.logits_after(t1))
        return self._second[t1]

    def joint_cells(self, n: int) -> dict:
        """(t1, t2) and (t1, None = any other t2) cells, for every t1 likely enough."""
        cells = {}
        for t1 in np.flatnonzero(self.first * n >= MIN_EXPECTED):
            p1 = float(self.first[t1])
            second = self.second(int(t1))
            named = 0.0
            for t2 in np.flatnonzero(p1 * second * n >= MIN_EXPECTED):
                cells[(int(t1), int(t2))] = p1 * float(second[t2])
                named += float(second[t2])
            cells[(int(t1), None)] = p1 * max(0.0, 1.0 - named)
        return cells

    def impossible(self, pair) -> bool:
        t1, t2 = pair
        return self.first[t1] == 0 or self.second(t1)[t2] == 0


def _sample_pairs(setup, drafter, n: int, seed: int, policy=None, **sampling) -> tuple[list, list]:
    """n generations through our stream_generate, seeded seed * 10_000 + i; returns the
    first two tokens (t1, t2) and whether t2 was an accepted draft. A PromptCache keeps
    the prompt prefilled. Fixed blocks of 2 (a one-cycle, two-token generation), or with
    `policy` adaptive (three tokens, so that the first cycle may be a block of 2)."""
    model, tokenizer, prompt, _, _ = setup
    cache = PromptCache(model, drafter)
    pairs, from_draft = [], []
    for i in range(n):
        r = list(
            stream_generate(
                model,
                tokenizer,
                prompt,
                drafter,
                max_tokens=3 if policy else 2,
                prompt_cache=cache,
                block_size=None if policy else 2,
                policy=policy,
                seed=seed * 10_000 + i,
                **sampling,
            )
        )
        assert len(r) >= 2 or r[0].token in tokenizer.eos_token_ids
        pairs.append((r[0].token, r[1].token if len(r) >= 2 else None))
        from_draft.append(len(r) >= 2 and r[1].from_draft)
    assert all(t2 is not None for _, t2 in pairs)
    return pairs, from_draft


def _wrap_rest(pairs, cells):
    """Map a sample to its cell key: (t1, t2) if named, else (t1, None) if that row has a
    cell, else itself (the pooled rest)."""
    return [p if p in cells else ((p[0], None) if (p[0], None) in cells else p) for p in pairs]
