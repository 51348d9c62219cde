"""Lossless sampling: every committed token is a sample of the target's sampling
distribution, which is mlx-lm's (`make_sampler`: top-p, then top-k, on the
log-probabilities, then the temperature), and a seed gives the same text at any block size.

Statistics: Pearson's chi-square against the exact distribution (`chi_square.py`; all
seeds fixed). Outcomes that have probability zero (outside the top-p / top-k support) are
checked separately: never allowed. The filters and the keyed draws on synthetic
distributions are tested in `test_draws.py`.

End to end on the real default target (SmolLM2-135M-Instruct, float32): the first two
tokens of `stream_generate` at temperature 1 are distributed as plain sampling's exact
joint distribution p(t1) p(t2 | t1), with a random drafter (almost always rejected)
and with an "oracle" drafter whose proposals come from a sharpened copy of the target's
own distribution (mostly accepted, sometimes rejected), the latter with top-p and top-k,
and each generation equals the target alone (`draft_model=None`) with the same seed.
Plain sampling's distribution is computed with mlx-lm's own filters on the target's
logits, which is what `mlx_lm.stream_generate(..., sampler=make_sampler(...))` samples.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS preload before the first mlx import)


import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache as make_target_cache

from dflash_mlx import PromptCache, stream_generate
from dflash_mlx.policy import BlockSizePolicy
from dflash_mlx.drafter import Drafter
from dflash_mlx.drafter2 import Drafter2
from dflash_mlx.sampling import SamplingParams, accept
from dflash_mlx.targets import make_target

from chi_square import ALPHA, as_probs, assert_fits, chi_square_gof
from two_token_sampling import (
    ORACLE_SAMPLES,
    OracleDrafter,
    PlainDistribution,
    _drafter_config,
    _sample_pairs,
    _wrap_rest,
)


# ---------------------------------------------------------------------------
# End to end on the real default target
# ---------------------------------------------------------------------------

# Each sample costs two target forwards (the last prompt token again, then the verify of
# [t1, draft]): about 0.1-0.2 s on this CPU, hence this count (the oracle's: ORACLE_SAMPLES).
RANDOM_SAMPLES = 120


class CoinPolicy(BlockSizePolicy):
    """Adaptive block sizes, as the loop sees them, at random: a plain step or a block of
    2, on a coin toss of its own (independent of the tokens)."""

    def __init__(self, seed: int):
        super().__init__(2)
        self.rng = np.random.default_rng(seed)

    def choose(self, limit=None) -> int:
        return min(int(self.rng.integers(1, 3)), limit or 2)


def _assert_same_as_target_alone(setup, pairs, seed: int, count: int = 24, **sampling) -> None:
    """The first `count` generations equal the target decoding alone with the same seeds."""
    model, tokenizer, prompt, _, _ = setup
    cache = PromptCache(model)
    for i, pair in enumerate(pairs[:count]):
        r = stream_generate(
            model, tokenizer, prompt, None, max_tokens=2, prompt_cache=cache, seed=seed * 10_000 + i, **sampling
        )
        assert tuple(x.token for x in r) == pair, f"generation {i} differs from the target alone"


def test_first_two_tokens_random_drafter(sampling_setup):
    """A random drafter: its drafts are almost always rejected, so t2 is the target's own
    choice after a rejection, which must still give exactly p(t2 | t1); and each generation
    is the one the target alone makes with its seed (the chi-square on 120 samples alone
    would miss, about half the time, a t2 drawn at half the temperature)."""
    mx.random.seed(0)
    drafter = Drafter(_drafter_config(block_size=2))
    mx.eval(drafter.parameters())
    pairs, from_draft = _sample_pairs(sampling_setup, drafter, RANDOM_SAMPLES, seed=11, temp=1.0)
    plain = PlainDistribution(sampling_setup, temp=1.0)
    cells = plain.joint_cells(RANDOM_SAMPLES)
    assert_fits(_wrap_rest(pairs, cells), cells, "random drafter, T=1")
    assert sum(from_draft) <= 0.05 * RANDOM_SAMPLES
    _assert_same_as_target_alone(sampling_setup, pairs, seed=11, count=12, temp=1.0)


def test_first_two_tokens_oracle_drafter_with_filters(sampling_setup):
    """A good drafter (q = the target's distribution at half the temperature: confident,
    as trained drafters are), with top-p and top-k on both p and q: most drafts are
    accepted, some rejected.
    1. Lossless: the joint law of (t1, t2) is plain sampling's.
    2. Reproducible: each generation is the one the target alone makes with its seed."""
    sampling = dict(temp=1.0, top_p=0.95, top_k=20)
    alpha = 2.0  # draft logits = 2 x target logits (a power of two: exact in float32)
    n = ORACLE_SAMPLES
    model, _, prompt, _, _ = sampling_setup
    drafter = OracleDrafter(model, prompt, alpha, block_size=2)
    pairs, from_draft = _sample_pairs(sampling_setup, drafter, n, seed=12, **sampling)
    plain = PlainDistribution(sampling_setup, **sampling)
    bad = sorted({pair for pair in pairs if plain.impossible(pair)})
    assert not bad, f"pairs outside the top-p / top-k support were sampled: {bad[:5]}"
    cells = plain.joint_cells(n)
    assert_fits(_wrap_rest(pairs, cells), cells, "oracle drafter, T=1, top-p 0.95, top-k 20")
    assert 0.3 * n < sum(from_draft) < 0.97 * n  # both paths were exercised
    _assert_same_as_target_alone(sampling_setup, pairs, seed=12, **sampling)


def test_first_two_tokens_adaptive_block_sizes(sampling_setup):
    """With adaptive block sizes the first cycle is a plain step or a drafted block of 2
    (at random here): either way (t1, t2) follows plain sampling's joint law. The oracle
    drafter's blocks are accepted and rejected, so both outcomes of a drafted first cycle
    occur beside plain steps (a random drafter's block, always rejected, adds no path:
    `test_first_two_tokens_random_drafter` samples that one)."""
    model, _, prompt, _, _ = sampling_setup
    sampling, n = dict(temp=1.0, top_p=0.95, top_k=20), ORACLE_SAMPLES
    drafter = OracleDrafter(model, prompt, 2.0, block_size=2)
    policy = CoinPolicy(seed=5)
    pairs, from_draft = _sample_pairs(sampling_setup, drafter, n, seed=13, policy=policy, **sampling)
    plain = PlainDistribution(sampling_setup, **sampling)
    cells = plain.joint_cells(n)
    assert not [pair for pair in pairs if plain.impossible(pair)], "pairs outside the support were sampled"
    assert_fits(_wrap_rest(pairs, cells), cells, "oracle drafter, adaptive")
    assert 0.2 * n < sum(from_draft) < 0.6 * n  # both kinds of first cycle happened
    _assert_same_as_target_alone(sampling_setup, pairs, seed=13, count=12, **sampling)


# ---------------------------------------------------------------------------
# DFlash2: drafts along the selector's path
# ---------------------------------------------------------------------------

DFLASH2_SAMPLES = 80


class OracleDrafter2(OracleDrafter, Drafter2):
    """The oracle's hidden states (draft logits = the target's, alpha = 1) under a DFlash2
    selector whose interaction term is strong (about 4 nats): its law over the 8
    candidates is far from the target's distribution, so acceptance has real work to do."""

    def __init__(self, model, prompt: list[int]):
        super().__init__(model, prompt, 1.0, block_size=2)
        selector = self.candidate_selector
        k1, k2, k3 = mx.random.split(mx.random.key(17), 3)
        selector.predecessor_codebook = mx.random.normal(selector.predecessor_codebook.shape, key=k1)
        selector.successor_codebook = mx.random.normal(selector.successor_codebook.shape, key=k2)
        # the target's final hidden state has RMS ~2 here: queries of about 1 per rank
        weight = mx.random.normal(selector.hidden_projection.weight.shape, key=k3) * (1.0 / 2 / 576**0.5)
        selector.hidden_projection.weight = weight
        self.logits: dict[bytes, mx.array] = {}

    def head(self, h, target):
        """The target's head on the oracle's (memoised) hidden state, memoised too."""
        key = np.array(h).tobytes()
        if key not in self.logits:
            self.logits[key] = super().head(h, target)
        return self.logits[key]


def test_first_two_tokens_dflash2_drafter(sampling_setup):
    """A DFlash2 drafter at T=1 through stream_generate: (t1, t2) follows plain sampling's
    joint law, some drafts pass and some do not, and the text is the target's alone."""
    model, _, prompt, _, _ = sampling_setup
    drafter = OracleDrafter2(model, prompt)
    n = DFLASH2_SAMPLES
    pairs, from_draft = _sample_pairs(sampling_setup, drafter, n, seed=14, temp=1.0)
    plain = PlainDistribution(sampling_setup, temp=1.0)
    cells = plain.joint_cells(n)
    assert_fits(_wrap_rest(pairs, cells), cells, "DFlash2 drafter, T=1")
    assert 0.1 * n < sum(from_draft) < 0.9 * n  # both paths were exercised
    # every generation, not a few: the chi-square on 80 samples alone would miss a t2 drawn
    # at half the temperature about two times in three
    _assert_same_as_target_alone(sampling_setup, pairs, seed=14, count=n, temp=1.0)


@pytest.mark.parametrize("variant", ["candidates", "5-token draft vocabulary"])
def test_dflash2_cycle_commits_the_target_distribution(sampling_setup, variant):
    """One drafted cycle of 2 after [prompt, t1], many times (a seed each), through the
    loop's own steps (`Drafter2.draft`, `accept`) on the real target's logits: the committed
    t2 ~ p(t2 | t1) exactly, also with a draft vocabulary smaller than the selector's k
    (candidates at -inf are never drafted), and the selector, choosing with the target's
    noise, agrees with it more often than an independent draw from its own law would."""
    model, _, prompt, cache, first_logits = sampling_setup
    t1 = int(mx.argmax(first_logits))
    drafter = OracleDrafter2(model, prompt)
    p = np.array(PlainDistribution(sampling_setup, temp=1.0).second(t1))
    subset = np.union1d(np.argsort(-p)[:4], [2]).astype(np.int32)  # the 4 likeliest and EOS
    if variant == "5-token draft vocabulary":
        drafter.use_draft_vocab(mx.array(subset))
    target = make_target(model, drafter.config.target_layer_ids)
    draft_cache = drafter.make_cache()
    drafter.append_context(target.forward(mx.array(prompt)[None], make_target_cache(model))[1], draft_cache)
    block = mx.array([[t1, drafter.config.mask_token_id]])
    # Row 0 of the verify, p(t2 | t1), does not depend on the draft: compute it once.
    logits = mx.broadcast_to(PlainDistribution(sampling_setup, temp=1.0).logits_after(t1), (2, 49152))
    committed, drafted = [], []
    for seed in range(1000):
        draws = SamplingParams(temp=1.0, seed=seed).draws(len(prompt) + 1)
        drafts = drafter.draft(block, draft_cache, target, draws)
        a, bonus = accept(drafts, draws.choose(logits))
        committed.append(mx.where(a > 0, drafts[0], bonus))
        drafted.append(drafts[0])
    t2, d = np.array(mx.stack(committed)), np.array(mx.stack(drafted))
    stat, df, p_value = chi_square_gof(t2.tolist(), as_probs(p))
    assert p_value > ALPHA, f"DFlash2 cycle: chi-square {stat:.1f} on {df} dof, p-value {p_value:.2e}"
    if variant == "5-token draft vocabulary":
        assert set(d.tolist()) <= set(subset.tolist())
    law = np.bincount(d, minlength=p.shape[0]) / len(d)  # the selector's own law, estimated
    assert np.mean(d == t2) > float((law * p).sum()) + 0.1
