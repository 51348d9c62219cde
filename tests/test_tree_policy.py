"""The adaptive policy with draft trees (`adaptive.TreePolicy`) on synthetic streams (no MLX):
a chain of b accepts each draft with a conditional probability; a tree of n nodes accepts
each depth with a higher one (more candidates per depth); each width costs what its rows
cost on a CPU-shaped curve. The policy sees only what the loop would show it."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from dflash_mlx.adaptive import BlockSizePolicy, TreePolicy, Width, tree_prior

B = 8


def rows_cost(width: Width) -> float:
    """A plain step 1; a drafted cycle 1.6 + 0.05 per row verified (trees and chains alike)."""
    return 1.0 if width.size == 1 else 1.6 + 0.05 * width.size


def stream(policy, chain_accept: float, tree_accept, cycles: int, seed: int = 0, cost=rows_cost):
    """(width, accepted) per cycle; tree_accept(n): a tree of n's per-depth acceptance."""
    rng, out = random.Random(seed), []
    for _ in range(cycles):
        w = policy.choose_width()
        p = tree_accept(w.nodes) if w.tree else chain_accept
        depth = min(w.size, B) - 1
        a = 0
        while a < depth and rng.random() < p:
            a += 1
        policy.update_width(w, a, cost(w))
        out.append((w, a))
    return out


def rate(cycles, cost=rows_cost) -> float:
    return sum(a + 1 for _, a in cycles) / sum(cost(w) for w, _ in cycles)


def test_widths_are_ordered_by_rows_and_capped():
    policy = TreePolicy(B, trees=(4, 16))
    assert policy.widths() == sorted(policy.widths())
    assert [str(w) for w in policy.widths(3)] == ["plain", "chain 2", "chain 3", "tree 4", "tree 16"]
    assert [str(w) for w in policy.widths(1)] == ["plain"]
    assert Width(17, True).nodes == 16 and str(Width(1)) == "plain"
    assert BlockSizePolicy(B).choose_width() in [Width(b) for b in range(1, B + 1)]


def test_trees_that_pay_are_chosen():
    """Chain acceptance 0.6; a tree of n nodes accepts each depth at 0.6 + 0.05 log2 n."""
    import math

    policy = TreePolicy(B)
    cycles = stream(policy, 0.6, lambda n: min(0.95, 0.6 + 0.05 * math.log2(n)), 600)
    kinds = Counter(str(w) for w, _ in cycles[-300:])
    assert sum(c for k, c in kinds.items() if k.startswith("tree")) >= 240, kinds
    best_fixed = max(
        rate(stream(TreePolicy(B, trees=(n,)), 0.6, lambda m: min(0.95, 0.6 + 0.05 * math.log2(m)), 600))
        for n in (4, 8, 16, 32)
    )
    assert rate(cycles[-300:]) >= 0.93 * best_fixed


def test_trees_that_do_not_pay_are_left():
    """Trees accept no more than the chain does and cost a third of a step more (their
    second host sync): chains win, and the policy is about as fast as the chain-only one."""

    def cost(w: Width) -> float:
        return rows_cost(w) + (0.3 if w.tree else 0.0)

    policy = TreePolicy(B)
    cycles = stream(policy, 0.7, lambda n: 0.7, 600, seed=1, cost=cost)
    kinds = Counter(str(w) for w, _ in cycles[-300:])
    assert sum(c for k, c in kinds.items() if k.startswith("tree")) <= 45, kinds
    chain_only = stream(BlockSizePolicy(B), 0.7, None, 600, seed=1, cost=cost)
    assert rate(cycles[-300:], cost) >= 0.95 * rate(chain_only[-300:], cost)


def test_nothing_accepted_settles_on_plain_steps():
    policy = TreePolicy(B)
    cycles = stream(policy, 0.0, lambda n: 0.0, 500, seed=2)
    assert Counter(str(w) for w, _ in cycles[-250:])["plain"] >= 0.9 * 250
    assert rate(cycles[-250:]) >= 0.95


@pytest.mark.parametrize("truth", [1.0, 1.6])
def test_calibration_follows_the_walks(truth):
    """Walks that commit `truth` x the chain model's expectation pull r(n) there from the prior;
    a size never walked borrows the calibration."""
    policy = TreePolicy(B, trees=(4, 16))
    for _ in range(60):
        expected = policy.chain_expected(B)
        policy.update_width(Width(17, True), round(truth * expected) - 1, 2.0)
    assert abs(policy.ratio(16) - truth) < 0.25 * truth
    assert policy.ratio(4) == pytest.approx(tree_prior(4) * policy.ratio(16) / tree_prior(16))
