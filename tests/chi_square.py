"""Test helper: Pearson's chi-square goodness-of-fit test against an EXACT distribution
(computed, not sampled), cells with an expected count below MIN_EXPECTED pooled, at a
false-alarm rate ALPHA per test; the sampling tests use it with fixed seeds, so a run is
reproducible and a pass is not luck of the day."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

ALPHA = 1e-3  # false-alarm rate of each statistical test
MIN_EXPECTED = 5.0  # cells expected to hold fewer samples are pooled


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
    rest = (sum(c for k, c in counts.items() if k not in kept), n * max(0.0, 1.0 - sum(probs[k] for k in kept)))
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


def as_probs(p_row: np.ndarray) -> dict:
    """A probability row as {outcome: probability} over its nonzero entries."""
    return {int(i): float(v) for i, v in enumerate(p_row) if v > 0}
