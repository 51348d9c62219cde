"""The adaptive policy with draft trees (`tree_policy.TreePolicy`) on synthetic streams (no MLX):
a chain of b accepts each draft with a conditional probability; a tree of n nodes accepts
each depth with a higher one (more candidates per depth); each width costs what its rows
cost on a CPU-shaped curve. The policy sees only what the loop would show it."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from dflash_mlx.plan import Plan
from dflash_mlx.policy import BlockSizePolicy, Width
from dflash_mlx.tree_policy import TreePolicy, tree_prior
from fixed_policies import rows_cost

B = 8


def stream(policy, chain_accept, tree_accept, cycles: int, seed: int = 0, cost=rows_cost, show_chain=True):
    """(width, accepted) per cycle; tree_accept(n, p): a tree of n's per-depth acceptance
    where the chain's is p;
    chain_accept: the chain's, or a function of the cycle's index (a drifting drafter).
    A tree's depths share their draws with the chain's (the chain hits only where the
    tree does), and, as the loop does, a tree cycle shows the policy the chain's outcome
    up to the first miss (`show_chain`)."""
    rng, out = random.Random(seed), []
    for i in range(cycles):
        w = policy.choose_width()
        p_chain = chain_accept(i) if callable(chain_accept) else chain_accept
        p = max(p_chain, tree_accept(w.nodes, p_chain)) if w.tree else p_chain
        depth = min(w.size, B) - 1
        draws = [rng.random() for _ in range(depth)]
        a = next((k for k, u in enumerate(draws) if u >= p), depth)
        hits = next((k for k, u in enumerate(draws) if u >= p_chain), depth)
        chain = (hits + 2, hits) if hits < depth else (hits + 1, hits)
        policy.update_width(w, a, cost(w), chain if w.tree and show_chain else None)
        out.append((w, a))
    return out


class Fixed:
    """Every cycle the same width."""

    def __init__(self, width: Width):
        self.width = width

    def choose_width(self) -> Width:
        return self.width

    def update_width(self, width: Width, accepted: int, seconds: float, chain=None) -> None:
        pass


def rate(cycles, cost=rows_cost) -> float:
    return sum(a + 1 for _, a in cycles) / sum(cost(w) for w, _ in cycles)


def test_width_names_and_limits():
    assert Width(17, True).nodes == 16 and str(Width(17, True)) == "tree 16"
    assert str(Width(1)) == "plain" and str(Width(3)) == "chain 3"
    assert BlockSizePolicy(B).choose_width() in [Width(b) for b in range(1, B + 1)]
    policy = TreePolicy(B)
    for _ in range(30):  # one token left: a plain step, never a tree
        assert policy.choose_width(1) == Width(1)
        policy.update_width(Width(1), 0, 1.0)


def test_a_trees_depth_goes_as_far_as_its_nodes_and_max_tokens():
    widths = Plan(B, B, TreePolicy(B), None, True, max_tokens=None)  # below the block: the guess's room
    assert [widths.depths(0, n) for n in (1, 4, 16)] == [(1, 1), (4, 4), (16, B - 1)]
    widths = Plan(B, B, TreePolicy(B), None, True, max_tokens=20)  # a cycle commits at most depth + 1
    assert [widths.depths(p, 16)[0] for p in (0, 10, 17, 19, 20)] == [16, 9, 2, 1, 1]
    assert [widths.depths(p, 16)[1] for p in (0, 10, 17, 19, 20)] == [B - 1, B - 1, 2, 1, 1]
    assert Plan(4, B, None, 16, True, None).depths(0, 16) == (16, 3)  # a smaller block


def test_chain_choices_are_the_chain_policys():
    """Where it neither chooses nor probes a tree, a `TreePolicy` makes exactly the chain
    policy's choice (its probes included): a chain policy fed the same chain cycles agrees
    cycle by cycle."""
    trees, chains, rng = TreePolicy(B), BlockSizePolicy(B), random.Random(7)
    agreed = 0
    for _ in range(400):
        w, b = trees.choose_width(), chains.choose()
        if not w.tree and trees.tree_probe is None:  # the chain policy's own choice
            assert w == Width(b)
            agreed += 1
        else:  # a tree took its place (or probes the trees' schedule): its probe waits
            chains.probe = None
        a = 0
        while a < min(w.size, B) - 1 and rng.random() < 0.3:
            a += 1
        trees.update_width(w, a, cpu_cost(w))
        if not w.tree:
            chains.update(w.size, a, cpu_cost(w))
    assert agreed >= 300


def test_trees_that_pay_are_chosen():
    """Chain acceptance 0.6; a tree of n nodes accepts each depth at 0.6 + 0.05 log2 n."""
    policy = TreePolicy(B)
    cycles = stream(policy, 0.6, lambda n, p: min(0.95, 0.6 + 0.05 * math.log2(n)), 600)
    kinds = Counter(str(w) for w, _ in cycles[-300:])
    assert sum(c for k, c in kinds.items() if k.startswith("tree")) >= 240, kinds
    best_fixed = max(
        rate(stream(TreePolicy(B, trees=(n,)), 0.6, lambda m, p: min(0.95, 0.6 + 0.05 * math.log2(m)), 600))
        for n in (4, 8, 16, 32)
    )
    assert rate(cycles[-300:]) >= 0.93 * best_fixed


def test_trees_that_do_not_pay_are_left():
    """Trees accept no more than the chain does and cost a third of a step more (their
    second host sync): chains win, and the policy is about as fast as the chain-only one."""

    def cost(w: Width) -> float:
        return rows_cost(w) + (0.3 if w.tree else 0.0)

    policy = TreePolicy(B)
    cycles = stream(policy, 0.7, lambda n, p: 0.7, 600, seed=1, cost=cost)
    kinds = Counter(str(w) for w, _ in cycles[-300:])
    assert sum(c for k, c in kinds.items() if k.startswith("tree")) <= 45, kinds
    chain_only = stream(BlockSizePolicy(B), 0.7, None, 600, seed=1, cost=cost)
    assert rate(cycles[-300:], cost) >= 0.95 * rate(chain_only[-300:], cost)


#: T(n) / T(1), a verify of n rows on the 2-core CPU (BENCHMARKS.md, `dflash bench verify-cost`).
CPU_ROWS = {1: 1.0, 2: 1.02, 3: 1.18, 4: 1.33, 5: 1.38, 8: 1.49, 9: 1.55, 16: 1.87, 17: 2.14, 32: 2.61, 33: 2.65}


def cpu_cost(width: Width) -> float:
    """A cycle on the CPU: its rows' verify (interpolated in `CPU_ROWS`) plus a tenth of a
    step for the drafter (6 of 68 ms) where it drafts."""
    if width.size == 1:
        return 1.0
    below = max(n for n in CPU_ROWS if n <= width.size)
    above = min(n for n in CPU_ROWS if n >= width.size)
    share = (width.size - below) / (above - below) if above > below else 0.0
    return CPU_ROWS[below] + share * (CPU_ROWS[above] - CPU_ROWS[below]) + 0.1


def gpu_cost(width: Width) -> float:
    """An Apple GPU: a verify of up to 64 rows costs about what one row does."""
    return 1.0 if width.size == 1 else 1.1 + 0.002 * width.size


def chat_tree(nodes: int, chain: float = 0.3) -> float:
    """Chat-like: the chain accepts each draft at 0.3 (tau 1.43 at B = 8), a tree of 16
    nodes each depth at 0.46 (tau 1.84), log-linear in the nodes between."""
    return 0.3 + 0.04 * math.log2(nodes)


def long_run(policy_of, cost, seeds=range(3), cycles=1500) -> float:
    """The mean rate over seeds of fresh policies on the chat-like stream."""
    return sum(rate(stream(policy_of(), 0.3, chat_tree, cycles, seed, cost), cost) for seed in seeds) / len(seeds)


def test_on_a_cpu_trees_cost_almost_nothing():
    """CPU-like costs, chat-like acceptance: trees do not pay (a fixed tree of 4 is slower
    than the chain policy), and weighing them loses at most 2% against the chain policy."""
    chains = long_run(lambda: BlockSizePolicy(B), cpu_cost)
    assert long_run(lambda: TreePolicy(B), cpu_cost) >= 0.98 * chains
    assert rate(stream(Fixed(Width(5, True)), 0.3, chat_tree, 1500, cost=cpu_cost), cpu_cost) < chains


def test_on_a_gpu_trees_are_chosen_and_win():
    """GPU-like flat costs, the same acceptance: the policy settles on trees and beats the
    chain policy by far (its best chain is B: more rows cost nothing, but trees commit more)."""
    policy = TreePolicy(B)
    cycles = stream(policy, 0.3, chat_tree, 1500, cost=gpu_cost)
    assert sum(w.tree for w, _ in cycles[-500:]) >= 400
    assert long_run(lambda: TreePolicy(B), gpu_cost) >= 1.15 * long_run(lambda: BlockSizePolicy(B), gpu_cost)


def test_nothing_accepted_settles_on_plain_steps():
    policy = TreePolicy(B)
    cycles = stream(policy, 0.0, lambda n, p: 0.0, 500, seed=2)
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


def test_a_walk_moves_the_chain_estimates():
    """A tree cycle shows what the chain's drafts would have had accepted: a miss at draft 1
    lowers the chain's estimate of it, a chain accepted throughout raises it."""
    low, high = TreePolicy(B), TreePolicy(B)
    for _ in range(10):
        low.update_width(Width(17, True), 3, 2.0, (2, 0))
        high.update_width(Width(17, True), 3, 2.0, (5, 4))
    assert low.acceptance(1) < 0.1 < 0.9 < high.acceptance(1)
    assert high.acceptance(5) == pytest.approx(TreePolicy(B).acceptance(5))  # unseen past the walk: the prior


def drifting(i: int) -> float:
    """A drafter whose acceptance swings between prompt kinds: 0.75 (math-like) and 0.25
    (chat-like), 150 cycles each."""
    return 0.75 if (i // 150) % 2 == 0 else 0.25


def test_trees_do_not_outstay_a_dip_on_a_cpu():
    """Drifting acceptance, CPU-like costs: weighing trees loses at most 2% against the chain
    policy, because the walks keep the chain's estimates fresh (without them a tree chosen
    in a dip of those estimates stays, and the policy falls behind)."""

    def run(policy_of, show=True):
        return sum(
            rate(stream(policy_of(), drifting, lambda n, p: p + 0.04 * math.log2(n), 1800, s, cpu_cost, show), cpu_cost)
            for s in range(4)
        )

    chains = run(lambda: BlockSizePolicy(B))
    assert run(lambda: TreePolicy(B)) >= 0.98 * chains


def test_trees_wait_for_the_chains_clock():
    """A fresh policy weighs trees only once a chain cycle is timed: before that the chain
    costs are the cost model's relative units, and a tree timed in seconds (0.3 s here, a
    long context's) would look three times cheaper than a plain step (1.0)."""
    policy = TreePolicy(B)
    policy.update_width(Width(5, True), 1, 0.3, (2, 0))  # a tree cycle: timed, its chain missed draft 1
    assert not policy.seconds and not policy.choose_width().tree
    policy.update_width(Width(1), 0, 0.1)  # a plain step, timed: now both are in seconds
    assert policy.rate(Width(5, True)) < policy.rate(Width(1)) == pytest.approx(10.0)


def test_a_slow_start_does_not_stick():
    """The machine runs 2.5x slower for the first 40 cycles (a cold start, a busy neighbour),
    then at its speed: the widths measured in that stretch are measured again, and the policy
    soon does about as well as one that never saw the slow start (before the fix: 6% worse)."""

    def run(slow_cycles: int, seed: int) -> float:
        seen = [0]

        def cost(w: Width) -> float:
            seen[0] += 1
            return cpu_cost(w) * (2.5 if seen[0] <= slow_cycles else 1.0)

        tree = lambda n, p: min(0.95, p + 0.06 * math.log2(n))  # noqa: E731
        return rate(stream(TreePolicy(B), 0.45, tree, 1200, seed, cost)[-800:], cpu_cost)

    seeds = range(8)
    assert sum(run(40, s) for s in seeds) >= 0.97 * sum(run(0, s) for s in seeds)
