"""Lossless sampling: every committed token is a sample of the target's sampling
distribution, which is mlx-lm's (`make_sampler`: top-p, then top-k, on the
log-probabilities, then the temperature), and a seed gives the same text at any block size.

Statistics: every distribution check is Pearson's chi-square goodness-of-fit test
against the EXACT distribution (computed, not sampled), cells with an expected count
below 5 pooled, at a false-alarm rate ALPHA = 1e-3 per test; all seeds are fixed, so a
run is reproducible and a pass is not luck of the day. Outcomes that have probability
zero (outside the top-p / top-k support) are checked separately: never allowed.

* `filter_logprobs` / `probabilities` agree with mlx-lm's `apply_top_p` / `apply_top_k`.
* Keyed draws on synthetic distributions: each position's choice follows the filtered
  distribution and positions are independent (a broken variant sharing one key is
  caught); the noise is a function of (seed, position) alone; draft and target choosing
  with the same noise agree with probability 1 - TV(p, q) over two tokens.
* End to end on the real default target (SmolLM2-135M-Instruct, float32): the first two
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

import math
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache as make_target_cache
from mlx_lm.models.cache import trim_prompt_cache
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.adaptive import BlockSizePolicy
from conftest import smollm2_drafter_config
from dflash_mlx.drafter import Drafter, DrafterConfig
from dflash_mlx.drafter2 import Drafter2
from dflash_mlx.sampling import SamplingParams, accept, filter_logprobs, log_softmax, probabilities
from dflash_mlx.targets import make_target

ALPHA = 1e-3  # false-alarm rate of each statistical test
MIN_EXPECTED = 5.0  # cells expected to hold fewer samples are pooled


# ---------------------------------------------------------------------------
# Statistics helpers
# ---------------------------------------------------------------------------

def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_prefactor = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1:  # series for the lower function P, then Q = 1 - P
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefactor))
    # continued fraction for Q (modified Lentz)
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return math.exp(log_prefactor) * h


def chi_square_gof(samples, probs: dict, impossible=lambda outcome: False) -> tuple[float, int, float]:
    """Goodness of fit of `samples` (hashable outcomes) to a distribution given by `probs`:
    outcome -> exact probability for the outcomes that get a cell of their own; every other
    outcome falls into one pooled cell holding the remaining probability. Outcomes whose
    expected count is below MIN_EXPECTED are pooled too. Returns (statistic, dof, p-value).
    Fails at once if a sample is an outcome of probability zero (`impossible`)."""
    n = len(samples)
    bad = [s for s in set(samples) if impossible(s)]
    assert not bad, f"outcomes of probability zero were sampled: {bad[:5]}"
    counts = Counter(samples)
    cells = [(counts.get(k, 0), n * p) for k, p in probs.items() if n * p >= MIN_EXPECTED]
    kept = {k for k, p in probs.items() if n * p >= MIN_EXPECTED}
    rest = (sum(c for k, c in counts.items() if k not in kept),
            n * max(0.0, 1.0 - sum(probs[k] for k in kept)))
    if rest[1] >= MIN_EXPECTED:
        cells.append(rest)
    elif cells:  # too small for a cell of its own: pool it with the smallest one
        i = min(range(len(cells)), key=lambda j: cells[j][1])
        cells[i] = (cells[i][0] + rest[0], cells[i][1] + rest[1])
    assert len(cells) >= 2, "not enough probability mass spread to test"
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return stat, df, chi2_sf(stat, df)


def assert_fits(samples, probs: dict, what: str, impossible=lambda outcome: False) -> None:
    stat, df, p = chi_square_gof(samples, probs, impossible)
    assert p > ALPHA, f"{what}: chi-square {stat:.1f} on {df} dof, p-value {p:.2e} < {ALPHA}"


def test_chi2_sf_known_values():
    # textbook 95% / 99.9% quantiles
    for x, df, sf in [(3.841458820694124, 1, 0.05), (18.307038053275146, 10, 0.05),
                      (10.827566170662733, 1, 1e-3), (59.70306137973097, 30, 1e-3),
                      (2.0, 2, math.exp(-1.0)), (0.5, 3, 0.918891411654)]:
        assert chi2_sf(x, df) == pytest.approx(sf, rel=1e-5)


# ---------------------------------------------------------------------------
# Filters agree with mlx-lm
# ---------------------------------------------------------------------------

def _mlx_lm_logprobs(logprobs: mx.array, top_p: float, top_k: int) -> mx.array:
    """mlx-lm's `make_sampler` chain: top-p, then top-k."""
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    return logprobs


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.05, 0), (0.5, 0), (0.9, 0), (0.999, 0),
                                         (1.0, 1), (1.0, 7), (1.0, 300), (1.0, 999),
                                         (0.9, 20), (0.3, 200), (0.95, 1)])
def test_filters_agree_with_mlx_lm(top_p, top_k):
    rng = np.random.default_rng(7)
    # rows of very different shapes: flat, peaked, heavy-tailed
    scale = np.array([0.3, 1.0, 3.0, 8.0])[:, None]
    logits = mx.array((scale * rng.standard_normal((4, 1000))).astype(np.float32))
    logprobs = log_softmax(logits)
    ours = np.array(filter_logprobs(logprobs, top_p, top_k))
    ref = np.array(_mlx_lm_logprobs(logprobs, top_p, top_k))
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    np.testing.assert_array_equal(ours[np.isfinite(ours)], ref[np.isfinite(ref)])
    for temp in (0.5, 1.0, 1.7):
        want = mx.softmax(_mlx_lm_logprobs(logprobs, top_p, top_k) * (1.0 / temp), axis=-1)
        np.testing.assert_allclose(np.array(probabilities(logits, temp, top_p, top_k)),
                                   np.array(want), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------
# Keyed draws on synthetic distributions
# ---------------------------------------------------------------------------

def _dist(p_row: np.ndarray) -> dict:
    return {int(i): float(v) for i, v in enumerate(p_row) if v > 0}


def _random_rows(rng, rows: int, vocab: int, concentration: float = 1.0) -> np.ndarray:
    return rng.dirichlet(np.full(vocab, concentration), size=rows).astype(np.float32)


def _choices(logits: np.ndarray, trials: int, start: int = 0, **sampling) -> np.ndarray:
    """(trials, rows): each trial's choices for the rows of `logits` (positions start..),
    one seed per trial."""
    x = mx.array(logits)
    return np.array(mx.stack([SamplingParams(seed=seed, **sampling).choose(x, start) for seed in range(trials)]))


@pytest.mark.parametrize("temp,top_p,top_k", [(1.0, 1.0, 0), (1.0, 0.8, 0), (0.7, 1.0, 4), (1.3, 0.9, 5)])
def test_choices_sample_the_filtered_distribution(temp, top_p, top_k):
    """Each position's choice ~ mlx-lm's filtered, tempered distribution, and positions are
    independent: the pair (position 0, position 1) follows the product law."""
    rng = np.random.default_rng(int(10 * temp) + top_k)
    logits = (1.5 * rng.standard_normal((2, 6))).astype(np.float32)
    ref = np.array(mx.softmax(_mlx_lm_logprobs(log_softmax(mx.array(logits)), top_p, top_k) / temp, axis=-1))
    out = _choices(logits, 3000, temp=temp, top_p=top_p, top_k=top_k)
    joint = {(a, b): float(ref[0, a] * ref[1, b]) for a in range(6) for b in range(6) if ref[0, a] * ref[1, b] > 0}
    assert_fits([tuple(r) for r in out.tolist()], joint, f"T={temp} top_p={top_p} top_k={top_k}",
                impossible=lambda t: ref[0, t[0]] * ref[1, t[1]] == 0)


def test_draws_are_a_function_of_seed_and_position():
    """The noise of a position does not depend on where a batch of draws starts, and the
    same seed and position give the same choice; another seed gives other noise."""
    params = SamplingParams(temp=1.0, seed=7)
    a, b = params.draws(5).noise(4, 32), params.draws(7).noise(2, 32)
    np.testing.assert_array_equal(np.array(a[2:]), np.array(b))
    assert not np.allclose(np.array(a), np.array(SamplingParams(temp=1.0, seed=8).draws(5).noise(4, 32)))
    rows = params.draws(5).choose(mx.array(np.zeros((3, 32), np.float32)), rows=[3, 0, 3])
    np.testing.assert_array_equal(np.array(rows), np.array(mx.argmax(a, -1))[[3, 0, 3]])


def test_shared_noise_across_positions_is_caught():
    """Broken on purpose: one key for every position. Two positions with the same law then
    always agree, and the independence check of the test above fails."""
    logits = np.zeros((2, 6), np.float32)
    out = np.array(mx.stack([mx.argmax(mx.array(logits) + SamplingParams(temp=1.0, seed=s).draws(0).noise(1, 6), -1)
                             for s in range(600)]))
    joint = {(a, b): 1 / 36 for a in range(6) for b in range(6)}
    _, df, p_value = chi_square_gof([tuple(r) for r in out.tolist()], joint)
    assert p_value < ALPHA


def test_coupled_acceptance_rate_for_two_tokens():
    """Draft and target choose with the same noise: over two tokens they agree with
    probability 1 - TV(p, q), what rejection sampling accepts; the committed tokens
    follow p whatever the drafts."""
    p = np.array([[0.7, 0.3], [0.4, 0.6]], np.float32)
    q = np.array([[0.45, 0.55]], np.float32)
    agree, committed = [], []
    for seed in range(3000):
        draws = SamplingParams(temp=1.0, seed=seed).draws(10)
        drafts = draws.choose(mx.log(mx.array(q)))
        a, bonus = accept(drafts, draws.choose(mx.log(mx.array(p))))
        agree.append(int(a))
        committed.append(int(drafts[0]) if int(a) else int(bonus))
    expected = 1 - 0.5 * float(np.abs(p[0] - q[0]).sum())
    z = (np.mean(agree) - expected) / math.sqrt(expected * (1 - expected) / len(agree))
    assert abs(z) < 3.29, f"agreement {np.mean(agree):.3f} vs 1 - TV = {expected:.3f}: z = {z:.2f}"
    assert_fits(committed, _dist(p[0]), "committed token 0")


def test_accept_counts_the_agreeing_prefix():
    drafts, choices = mx.array([4, 5, 6]), mx.array([4, 5, 9, 1])
    assert [int(x) for x in accept(drafts, choices)] == [2, 9]
    assert [int(x) for x in accept(drafts, mx.array([4, 5, 6, 3]))] == [3, 3]
    assert [int(x) for x in accept(drafts, mx.array([0, 5, 6, 3]))] == [0, 0]


# ---------------------------------------------------------------------------
# End to end on the real default target
# ---------------------------------------------------------------------------

PROMPT = "Write a short poem about a dragon."
# Each sample costs two target forwards (the last prompt token again, then the verify of
# [t1, draft]): about 0.1-0.2 s on this CPU, hence these counts.
RANDOM_SAMPLES = 120
ORACLE_SAMPLES = 160


def _drafter_config(block_size: int, dflash2: bool = False) -> DrafterConfig:
    return smollm2_drafter_config(dflash2, intermediate_size=256, target_layer_ids=[29], block_size=block_size)


class OracleDrafter(Drafter):
    """Proposes from the target's own next-token distribution, scaled by `alpha`: for
    block position 1 it returns alpha * the target's final hidden state after
    [prompt, block token 0], so draft logits are alpha * the target's logits. Valid for the
    first cycle after the prompt, which is all a two-token generation uses."""

    def __init__(self, model, prompt: list[int], alpha: float, block_size: int):
        super().__init__(_drafter_config(block_size, dflash2=isinstance(self, Drafter2)))
        self.model, self.prompt, self.alpha = model, prompt, alpha
        self.target_cache = make_target_cache(model)
        model.model(mx.array(prompt)[None], self.target_cache)
        self.memo: dict[bytes, mx.array] = {}

    def __call__(self, block_embeddings: mx.array, cache) -> mx.array:
        assert cache[0].offset == len(self.prompt), "oracle drafter used past the first cycle"
        first = block_embeddings[:, :1]
        key = np.array(first).tobytes()
        if key not in self.memo:
            hidden = self.model.model(None, self.target_cache, input_embeddings=first)
            trim_prompt_cache(self.target_cache, 1)
            mx.eval(hidden)
            self.memo[key] = hidden
        return mx.broadcast_to(self.alpha * self.memo[key], block_embeddings.shape)


@pytest.fixture(scope="module")
def sampling_setup(default_model):
    model, tokenizer = default_model
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    cache = make_target_cache(model)
    first_logits = model(mx.array(prompt)[None], cache)[0, -1]
    mx.eval(first_logits)
    return model, tokenizer, prompt, cache, first_logits


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
        logprobs = _mlx_lm_logprobs(log_softmax(scale * logits), self.top_p, self.top_k)
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


class CoinPolicy(BlockSizePolicy):
    """Adaptive block sizes, as the loop sees them, at random: a plain step or a block of
    2, on a coin toss of its own (independent of the tokens)."""

    def __init__(self, seed: int):
        super().__init__(2)
        self.rng = np.random.default_rng(seed)

    def choose(self, limit=None) -> int:
        return min(int(self.rng.integers(1, 3)), limit or 2)


def _sample_pairs(setup, drafter, n: int, seed: int, policy=None, **sampling) -> tuple[list, list]:
    """n generations through our stream_generate, seeded seed * 10_000 + i; returns the
    first two tokens (t1, t2) and whether t2 was an accepted draft. A PromptCache keeps
    the prompt prefilled. Fixed blocks of 2 (a one-cycle, two-token generation), or with
    `policy` adaptive (three tokens, so that the first cycle may be a block of 2)."""
    model, tokenizer, prompt, _, _ = setup
    cache = make_prompt_cache(model, drafter)
    pairs, from_draft = [], []
    for i in range(n):
        r = list(stream_generate(model, tokenizer, prompt, drafter, max_tokens=3 if policy else 2,
                                 prompt_cache=cache, block_size=None if policy else 2, policy=policy,
                                 seed=seed * 10_000 + i, **sampling))
        assert len(r) >= 2 or r[0].token in tokenizer.eos_token_ids
        pairs.append((r[0].token, r[1].token if len(r) >= 2 else None))
        from_draft.append(len(r) >= 2 and r[1].from_draft)
    assert all(t2 is not None for _, t2 in pairs)
    return pairs, from_draft


def _assert_same_as_target_alone(setup, pairs, seed: int, count: int = 24, **sampling) -> None:
    """The first `count` generations equal the target decoding alone with the same seeds."""
    model, tokenizer, prompt, _, _ = setup
    cache = make_prompt_cache(model)
    for i, pair in enumerate(pairs[:count]):
        r = stream_generate(model, tokenizer, prompt, None, max_tokens=2, prompt_cache=cache,
                            seed=seed * 10_000 + i, **sampling)
        assert tuple(x.token for x in r) == pair, f"generation {i} differs from the target alone"


def _wrap_rest(pairs, cells):
    """Map a sample to its cell key: (t1, t2) if named, else (t1, None) if that row has a
    cell, else itself (the pooled rest)."""
    return [p if p in cells else ((p[0], None) if (p[0], None) in cells else p) for p in pairs]


def test_first_two_tokens_random_drafter(sampling_setup):
    """A random drafter: its drafts are almost always rejected, so t2 is the target's own
    choice after a rejection, which must still give exactly p(t2 | t1)."""
    mx.random.seed(0)
    drafter = Drafter(_drafter_config(block_size=2))
    mx.eval(drafter.parameters())
    pairs, from_draft = _sample_pairs(sampling_setup, drafter, RANDOM_SAMPLES, seed=11, temp=1.0)
    plain = PlainDistribution(sampling_setup, temp=1.0)
    cells = plain.joint_cells(RANDOM_SAMPLES)
    assert_fits(_wrap_rest(pairs, cells), cells, "random drafter, T=1")
    assert sum(from_draft) <= 0.05 * RANDOM_SAMPLES


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


@pytest.mark.parametrize("kind", ["random", "oracle"])
def test_first_two_tokens_adaptive_block_sizes(sampling_setup, kind):
    """With adaptive block sizes the first cycle is a plain step or a drafted block of 2
    (at random here): either way (t1, t2) follows plain sampling's joint law."""
    model, _, prompt, _, _ = sampling_setup
    if kind == "random":
        sampling, n = dict(temp=1.0), RANDOM_SAMPLES
        mx.random.seed(0)
        drafter = Drafter(_drafter_config(block_size=2))
        mx.eval(drafter.parameters())
    else:
        sampling, n = dict(temp=1.0, top_p=0.95, top_k=20), ORACLE_SAMPLES
        drafter = OracleDrafter(model, prompt, 2.0, block_size=2)
    policy = CoinPolicy(seed=5)
    pairs, from_draft = _sample_pairs(sampling_setup, drafter, n, seed=13, policy=policy, **sampling)
    plain = PlainDistribution(sampling_setup, **sampling)
    cells = plain.joint_cells(n)
    assert not [pair for pair in pairs if plain.impossible(pair)], "pairs outside the support were sampled"
    assert_fits(_wrap_rest(pairs, cells), cells, f"{kind} drafter, adaptive")
    if kind == "oracle":
        assert 0.2 * n < sum(from_draft) < 0.6 * n  # both kinds of first cycle happened
    _assert_same_as_target_alone(sampling_setup, [(a, b) for a, b in pairs], seed=13, count=12, **sampling)


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
    _assert_same_as_target_alone(sampling_setup, pairs, seed=14, count=12, temp=1.0)


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
    stat, df, p_value = chi_square_gof(t2.tolist(), _dist(p))
    assert p_value > ALPHA, f"DFlash2 cycle: chi-square {stat:.1f} on {df} dof, p-value {p_value:.2e}"
    if variant == "5-token draft vocabulary":
        assert set(d.tolist()) <= set(subset.tolist())
    law = np.bincount(d, minlength=p.shape[0]) / len(d)  # the selector's own law, estimated
    assert np.mean(d == t2) > float((law * p).sum()) + 0.1
