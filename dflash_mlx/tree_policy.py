"""The tree policy: a chain policy whose choice a draft tree (`tree.py`) may replace.

A `TreePolicy` makes the chain policy's choice, then puts a tree of a few node budgets in
its place where the tree's expected rate beats it (a tree's expected tokens calibrated
against the walks seen so far, its cost measured), probing trees on a back-off schedule of
their own. Pure Python, no MLX: unit-tested on synthetic streams.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from .acceptance import Cost, charge
from .policy import STALE, BlockSizePolicy, Width, fit_line, probe_budget

#: Tree sizes (draft nodes) an adaptive policy weighs beside chains, where the target has trees.
TREE_SIZES = (4, 8, 16, 32)


def tree_prior(nodes: int) -> float:
    """Before any walk: a tree of `nodes` commits this many times what the chain of as many
    rows (at most the block) does; shaped after an offline replay of the shipped drafter
    (B = 8: trees of 4 / 8 / 16 / 32 / 64 nodes 1.11 / 1.22 / 1.31 / 1.40 / 1.47x the chain)."""
    return 1.0 + 0.1 * max(0.0, math.log2(nodes) - 1.0)


class TreePolicy(BlockSizePolicy):
    """A `BlockSizePolicy` whose chosen chain a draft tree of `trees` nodes may replace (the
    drafter's candidates at most max_size - 1 deep; prompt lookup's guess, a path of its own,
    may go deeper: `plan.Plan.depths`): the chain decisions (estimates, probes) are exactly
    the chain policy's, and a tree is an upgrade weighed against the chain chosen.

    Expected tokens of a tree of n nodes: a calibrated ratio r(n) times what the chain of
    min(n + 1, max_size) rows is expected to commit (the chain's acceptance estimates).
    r(n) starts at `tree_prior(n)` and follows the walks: decayed sums of committed tokens
    over what the chain model expected at each walk (fading by `walk_memory` at each walk
    of that size: a ratio to the chain's estimates holds while the tree is not walked),
    shrunk towards the prior by `calibration` pseudo-walks; sizes never walked borrow the
    calibration (r / prior) of the nearest walked one. Cost: measured per tree size;
    unmeasured ones from the line through every measured drafted cycle by rows verified
    (a tree of n costs about what n + 1 chain rows do).

    A tree replaces the chain only where its expected rate beats the chain's by `margin`
    (rates within a few percent are noise, and a tree's rows are the dearer guess). Trees
    are probed on their own schedule, never in a cycle the chain policy probes (nor does
    the chain policy probe while a tree takes the chain's place): the most promising tree
    other than the choice, or, while a tree is chosen, the chain (its cost; its acceptance
    estimates learn from every walk, which shows what the chain's own drafts would have had
    accepted, so a tree chosen in a dip of the chain's estimates does not outstay it). A probe that pays
    shortens the interval by `backoff` x, one that does not lengthens it by `backoff` x,
    up to the interval at which probes lose at most `tree_explore` of the time, a budget
    that shrinks while probes in a row accept nothing (`policy.probe_budget`)."""

    def __init__(
        self,
        max_size: int,
        *,
        trees: Sequence[int] = TREE_SIZES,
        calibration: float = 2.0,
        walk_memory: float = 0.97,
        margin: float = 0.05,
        tree_explore: float = 0.01,
        **kwargs: Any,
    ):
        super().__init__(max_size, **kwargs)
        self.trees = sorted({n for n in trees if n >= 1}) if max_size > 1 else []
        self.calibration, self.walk_memory, self.margin = calibration, walk_memory, margin
        self.tree_explore = tree_explore
        self.walks = {n: [0.0, 0.0] for n in self.trees}  # decayed (tokens committed, chain model's expectation)
        self.tree_seconds: dict[int, Cost] = {}
        self.tree_wait, self.since_tree = 1, 0  # the trees' own probing schedule
        self.tree_misses = 0  # tree probes in a row that accepted nothing
        self.tree_probe: Optional[tuple[Width, Width, float]] = None  # (probed, its rival, the rival's rate)

    def chain_expected(self, size: int) -> float:
        """Expected tokens a chain of `size` commits (`Acceptance.expected`)."""
        return self.drafts.expected(size)

    def ratio(self, nodes: int) -> float:
        """r(n): a tree's tokens over its chain's, as calibrated so far."""

        def own(n: int) -> Optional[float]:
            done, base = self.walks[n]
            if base <= 0:
                return None
            pseudo = self.calibration * self.chain_expected(min(n + 1, self.max_size))
            return (done + pseudo * tree_prior(n)) / (base + pseudo)

        if own(nodes) is not None:
            return own(nodes)
        walked = [n for n in self.trees if own(n) is not None]
        if not walked:
            return tree_prior(nodes)
        near = min(walked, key=lambda n: (abs(math.log2(n / nodes)), n))
        return tree_prior(nodes) * own(near) / tree_prior(near)

    def expected(self, width: Width) -> float:
        """Expected tokens a cycle of `width` commits: a chain's estimate, or r(n) times the
        estimate of the chain of as many rows (at most the block)."""
        if not width.tree:
            return self.chain_expected(width.size)
        return self.ratio(width.nodes) * self.chain_expected(min(width.size, self.max_size))

    def width_cost(self, width: Width, costs: list[float]) -> float:
        """Estimated cost of a cycle of `width` (`costs`: the chain sizes' estimates)."""
        if not width.tree:
            return costs[width.size - 1]
        if width.nodes in self.tree_seconds:
            return self.measured(width.size, self.tree_seconds[width.nodes], self.drafted_costs())
        drafted = {m: c.mean for m, c in self.drafted_costs().items()}
        if len(drafted) > 1:
            intercept, slope = fit_line(drafted)
            return max(intercept + slope * width.size, costs[0], 1e-9)
        last = self.max_size - 1  # beyond the block: the chain's slope, carried on
        step = costs[last] - costs[last - 1] if last > 1 else costs[last] - costs[0]
        return costs[min(width.size, self.max_size) - 1] + max(step, 0.0) * max(width.size - self.max_size, 0)

    def drafted_costs(self) -> dict[int, Cost]:
        """The measured drafted cycles by rows verified: chains, and trees (n nodes: n + 1 rows)."""
        chains = {m: c for m, c in self.seconds.items() if m > 1}
        return {**chains, **{n + 1: c for n, c in self.tree_seconds.items()}}

    def rate(self, width: Width, costs: Optional[list[float]] = None) -> float:
        """Expected committed tokens per unit of cost of a cycle of `width`."""
        return self.expected(width) / self.width_cost(width, costs or self.costs())

    def tree_rates(self) -> list[tuple[float, Width]]:
        """(expected rate, width) of each tree size, best first."""
        costs = self.costs()
        return sorted(((self.rate(Width(n + 1, True), costs), Width(n + 1, True)) for n in self.trees), reverse=True)

    @property
    def probing(self) -> bool:
        """Whether the last choice is a probe, the chain's or a tree probe's (the chain under a
        tree, too: a chain of prompt lookup's guess would not be reported, and the probe lost)."""
        return super().probing or self.tree_probe is not None

    def choose_width(self, limit: Optional[int] = None) -> Width:
        """The next cycle: the chain policy's choice (its probe included), a tree in its place
        where the tree's expected rate beats it by `margin`, or a tree probe; chains only
        while `limit` is below the block (the end of a generation) or no chain is timed yet."""
        chain = Width(self.choose(limit))
        self.tree_probe = None
        if not self.trees or not self.seconds or (limit is not None and limit < self.max_size):
            # near the end of a generation: chains; before any chain cycle is timed, too (the
            # chain costs are the cost model's units then, a timed tree's are seconds)
            return chain
        best = Width(self.best(limit))
        rates = sorted(self.tree_rates() + [(self.rate(best), best)], reverse=True)
        if rates[0][1].tree and rates[0][0] > (1 + self.margin) * self.rate(best):
            self.probe, choice = None, rates[0][1]  # a tree in the chain's place: a chain probe waits too
        elif self.probe is not None:
            return chain  # the chain policy's probe runs as it would alone
        else:
            choice = chain
        # the most promising other tree, or under a tree the chain (its estimates stay fresh)
        others = [w for _, w in rates if w != choice and (w.tree or choice.tree)]
        self.since_tree += 1
        if not others or self.since_tree < self.tree_wait:
            return choice
        self.since_tree = 0
        self.tree_probe = (others[0], choice, self.rate(choice))
        return others[0]

    def update_width(
        self, width: Width, accepted: int, seconds: float, chain: Optional[tuple[int, int]] = None
    ) -> None:
        """Record a finished cycle. For a tree, `chain` = (size, accepted) of the chain its
        tokens show (what the chain's drafts would have had accepted on the same draws): the
        chain's estimates learn from it as from a chain cycle, after the walk is calibrated
        against what they expected."""
        probe = self.tree_probe if self.tree_probe is not None and self.tree_probe[0] == width else None
        self.tree_probe = None
        if width.tree:
            charge(self.tree_seconds, width.nodes, seconds, self.cost_memory, self.chosen, STALE)
            done, base = self.walks[width.nodes]  # old walks fade as new ones come (only then)
            rows = min(width.size, self.max_size)
            # what the chain of as many rows committed on the same draws (paired: far less noisy
            # than its estimates), else what the chain's estimates expected
            expected = min(chain[1], rows - 1) + 1 if chain is not None else self.chain_expected(rows)
            self.walks[width.nodes] = [self.walk_memory * done + accepted + 1, self.walk_memory * base + expected]
            if chain is not None:
                self.drafts.learn(*chain)
        else:
            self.update(width.size, accepted, seconds)
        if probe is not None:
            self._settle(width, probe[1], accepted, probe[2])

    def _settle(self, width: Width, rival: Width, accepted: int, rival_rate: float) -> None:
        """After a probe of `width` (a tree, or the chain under a tree) against `rival`
        (whose expected rate was `rival_rate`): shorten the interval if it paid, else back
        off, up to the interval at which probes lose at most `tree_explore` of the time (a
        probe's loss counts the tokens too: a chain can commit less than a tree)."""
        self.tree_misses = 0 if accepted else self.tree_misses + 1
        costs = self.costs()
        cost = self.width_cost(width, costs)
        if (accepted + 1) / cost > rival_rate:
            self.tree_wait = max(1, self.tree_wait // self.backoff)
            return
        rival_cost = self.width_cost(rival, costs)
        lost = max(0.0, cost - self.expected(width) * rival_cost / self.expected(rival))
        budget = probe_budget(self.tree_explore, self.tree_misses)
        self.tree_wait = min(self.backoff * self.tree_wait, max(1, math.ceil(lost / (budget * rival_cost))))
