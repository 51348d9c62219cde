"""Keyed draws on synthetic distributions, and the filters against mlx-lm's.

* `filter_logprobs` agrees with mlx-lm's `apply_top_p` / `apply_top_k`, and so does the
  distribution sampling draws from (the filters, then the temperature); top-k keeps
  exactly k tokens where the k-th ties with others, as mlx-lm's does.
* Each position's choice follows the filtered distribution and positions are independent
  (a broken variant sharing one key is caught); the noise is a function of (seed,
  position) alone; draft and target choosing with the same noise agree with probability
  1 - TV(p, q) over two tokens. Statistics: `chi_square.py`.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS preload before the first mlx import)

import math

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.sampling import SamplingParams, accept, filter_logprobs, log_softmax

from chi_square import ALPHA, as_probs, assert_fits, chi2_sf, chi_square_gof
from references import mlx_lm_logprobs


def test_chi2_sf_known_values():
    # textbook 95% / 99.9% quantiles
    for x, df, sf in [
        (3.841458820694124, 1, 0.05),
        (18.307038053275146, 10, 0.05),
        (10.827566170662733, 1, 1e-3),
        (59.70306137973097, 30, 1e-3),
        (2.0, 2, math.exp(-1.0)),
        (0.5, 3, 0.918891411654),
    ]:
        assert chi2_sf(x, df) == pytest.approx(sf, rel=1e-5)


# ---------------------------------------------------------------------------
# Filters agree with mlx-lm
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "top_p,top_k",
    [
        (1.0, 0),
        (0.05, 0),
        (0.5, 0),
        (0.9, 0),
        (0.999, 0),
        (1.0, 1),
        (1.0, 7),
        (1.0, 300),
        (1.0, 999),
        (0.9, 20),
        (0.3, 200),
        (0.95, 1),
    ],
)
def test_filters_agree_with_mlx_lm(top_p, top_k):
    rng = np.random.default_rng(7)
    # rows of very different shapes: flat, peaked, heavy-tailed
    scale = np.array([0.3, 1.0, 3.0, 8.0])[:, None]
    logits = mx.array((scale * rng.standard_normal((4, 1000))).astype(np.float32))
    logprobs = log_softmax(logits)
    ours = np.array(filter_logprobs(logprobs, top_p, top_k))
    ref = np.array(mlx_lm_logprobs(logprobs, top_p, top_k))
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref))
    np.testing.assert_array_equal(ours[np.isfinite(ours)], ref[np.isfinite(ref)])
    for temp in (0.5, 1.0, 1.7):
        want = mx.softmax(mlx_lm_logprobs(logprobs, top_p, top_k) * (1.0 / temp), axis=-1)
        ours = mx.softmax(filter_logprobs(log_softmax(logits), top_p, top_k) / temp, axis=-1)
        np.testing.assert_allclose(np.array(ours), np.array(want), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("top_p,top_k", [(1.0, 1), (1.0, 2), (1.0, 4), (0.99, 3)])
def test_top_k_keeps_k_tokens_where_they_tie(top_p, top_k):
    logprobs = log_softmax(mx.array([[0.0, -1.0, -1.0, -1.0, -1.0, -2.0, -3.0], [1.0] * 4 + [0.0] * 3]))
    ours = np.isfinite(np.array(filter_logprobs(logprobs, top_p, top_k)))
    assert (ours.sum(axis=-1) == top_k).all(), ours
    np.testing.assert_array_equal(ours, np.isfinite(np.array(mlx_lm_logprobs(logprobs, top_p, top_k))))


# ---------------------------------------------------------------------------
# Keyed draws on synthetic distributions
# ---------------------------------------------------------------------------


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
    ref = np.array(mx.softmax(mlx_lm_logprobs(log_softmax(mx.array(logits)), top_p, top_k) / temp, axis=-1))
    out = _choices(logits, 3000, temp=temp, top_p=top_p, top_k=top_k)
    joint = {(a, b): float(ref[0, a] * ref[1, b]) for a in range(6) for b in range(6) if ref[0, a] * ref[1, b] > 0}
    assert_fits(
        [tuple(r) for r in out.tolist()],
        joint,
        f"T={temp} top_p={top_p} top_k={top_k}",
        impossible=lambda t: ref[0, t[0]] * ref[1, t[1]] == 0,
    )


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
    out = np.array(
        mx.stack(
            [
                mx.argmax(mx.array(logits) + SamplingParams(temp=1.0, seed=s).draws(0).noise(1, 6), -1)
                for s in range(600)
            ]
        )
    )
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
    assert_fits(committed, as_probs(p[0]), "committed token 0")


def test_accept_counts_the_agreeing_prefix():
    drafts, choices = mx.array([4, 5, 6]), mx.array([4, 5, 9, 1])
    assert [int(x) for x in accept(drafts, choices)] == [2, 9]
    assert [int(x) for x in accept(drafts, mx.array([4, 5, 6, 3]))] == [3, 3]
    assert [int(x) for x in accept(drafts, mx.array([0, 5, 6, 3]))] == [0, 0]
