"""Adaptive block size: how many tokens the next cycle verifies.

A cycle of size b drafts b - 1 tokens and verifies b (b = 1 is a plain target step: no
drafter call). It commits 1 + (accepted drafts) tokens. The policy picks the b that
maximises expected committed tokens per second:

* acceptance: running estimates of p_k, the probability that draft k is accepted given
  that drafts 1..k-1 were. A cycle with a accepted drafts out of b - 1 observes k <= a
  as accepted and k = a + 1 as rejected; later positions are not seen (censored), which
  is exactly what a conditional estimate needs. Old observations fade (`memory`), at
  every drafted cycle, seen or not.
* cost: the measured wall time of cycles of each size (a slow running average: on a CPU
  a queued plain step computes when it is queued, so single plain steps are charged
  unevenly, and only their average is right); sizes not measured yet are scaled from
  the nearest measured one along a cost model.
* exploration: what is never verified is never measured, so now and then the policy
  probes a larger block: one more token than it believes best, then, while probes
  accept every draft, twice as far each time (a cheap first look; big blocks only once
  they look likely to pay). Probes that do not pay back off by `backoff` x, up to the
  interval at which probes cost at most `explore` of the time; a probe that beats the
  current choice is followed by another at once, so that a drafter that improves
  mid-answer is noticed within a few probes of the next one.

Draft trees (`tree.py`) widen the choice: a `TreePolicy` makes the chain policy's choice,
then puts a tree of a few node budgets (`Width`: what one cycle verifies) in its place
where the tree's expected rate beats it (a tree's expected tokens calibrated against the
walks seen so far, its cost measured), probing trees on a back-off schedule of their own.
`CycleWidths` turns a policy's choice (or a fixed block / tree budget) into each cycle's
width, within `max_tokens`.

Pure Python, no MLX: unit-tested on synthetic acceptance and cost streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence


class Width(NamedTuple):
    """What one cycle verifies: `size` tokens, a chain (1: a plain step) or, with `tree`,
    a draft tree of `size - 1` nodes below the root."""

    size: int
    tree: bool = False

    @property
    def nodes(self) -> int:
        return self.size - 1

    def __str__(self) -> str:
        return f"tree {self.nodes}" if self.tree else "plain" if self.size == 1 else f"chain {self.size}"


def default_cost_model(max_size: int) -> list[float]:
    """Relative cycle cost by size (index b - 1): 1 for a plain step, a drafter forward
    plus a b-token verify otherwise (shaped after a small float32 target on a CPU).
    Only a seed: measured cycles replace it, size by size."""
    return [1.0] + [1.5 + 0.05 * (b - 1) for b in range(2, max_size + 1)]


class BlockSizePolicy:
    """Chooses the block size of each cycle from measured acceptance and cycle costs.

    Call `choose()` before a cycle and `update(size, accepted, seconds)` after it. One
    policy can serve many generations with the same target and drafter (what it has
    learned carries over)."""

    def __init__(
        self,
        max_size: int,
        *,
        memory: float = 0.9,
        explore: float = 0.02,
        prior: float = 0.5,
        cost_model: Optional[Sequence[float]] = None,
        cost_memory: float = 0.9,
        surprise: float = 0.25,
        backoff: int = 4,
    ):
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, got {max_size}")
        self.max_size = max_size
        self.memory, self.explore, self.prior, self.cost_memory = memory, explore, prior, cost_memory
        self.surprise, self.backoff = surprise, backoff
        self.model = list(cost_model) if cost_model is not None else default_cost_model(max_size)
        if len(self.model) != max_size:
            raise ValueError(f"cost_model needs {max_size} entries, got {len(self.model)}")
        # Index k: draft position k (1-based; index 0 unused). Decayed counts.
        self.hits = [0.0] * max_size
        self.trials = [0.0] * max_size
        self.seconds: dict[int, float] = {}  # measured cycle cost by size
        self.samples: dict[tuple[int, int], int] = {}  # cycles charged, by (cost table, key)
        self.wait = 1  # cycles between probes
        self.since_probe = 0
        self.reach = 1  # how far past the best size the next probe looks
        self.probe: Optional[tuple[int, int]] = None  # (probed size, the size it challenged)

    def start(self) -> None:
        """A new generation begins: probe at its first cycle (a new prompt may suit the
        drafter better than the last answer did, and a backed-off schedule would take up
        to 1 / `explore` cycles to find out, as at a math prompt after code ones)."""
        self.wait = 1

    def acceptance(self, k: int) -> float:
        """Estimated P(draft k accepted | drafts before it accepted), k >= 1, with one
        pseudo-trial of prior: `prior`, or the estimate of draft k - 1 where that is lower
        (a position rarely reached is believed no better than the one before it: a drafter
        that misses draft 1 is not worth a longer block for a coin flip at draft 2)."""
        estimate = self.prior
        for j in range(1, k + 1):
            estimate = (self.hits[j] + min(self.prior, estimate)) / (self.trials[j] + 1.0)
        return estimate

    def costs(self) -> list[float]:
        """Estimated cost of a cycle of each size (index b - 1; seconds once anything is
        measured). Unmeasured drafted sizes come from a least-squares line through the
        measured ones, or, with fewer than two, from the cost model scaled to the nearest."""
        if not self.seconds:
            return list(self.model)
        drafted = {m: t for m, t in self.seconds.items() if m > 1}
        line = fit_line(drafted) if len(drafted) > 1 else None
        out = []
        for size in range(1, self.max_size + 1):
            if size in self.seconds:
                out.append(self.seconds[size])
            elif line is not None and size > 1:
                # never below a plain step: verifying more tokens cannot be cheaper
                out.append(max(line[0] + line[1] * size, self.seconds.get(1, 0.0), 1e-9))
            else:  # plain steps scale from plain steps, drafted cycles from drafted ones
                same = [m for m in self.seconds if (m == 1) == (size == 1)] or list(self.seconds)
                near = min(same, key=lambda m: (abs(m - size), m))
                out.append(self.model[size - 1] * self.seconds[near] / self.model[near - 1])
        return out

    def rates(self) -> list[float]:
        """Expected committed tokens per unit of cost, by size (index b - 1)."""
        costs, expected, total, run = self.costs(), [1.0], 1.0, 1.0
        for k in range(1, self.max_size):
            run *= self.acceptance(k)
            total += run
            expected.append(total)
        return [e / c for e, c in zip(expected, costs)]

    def best(self, limit: Optional[int] = None) -> int:
        """The size with the highest expected rate (the smallest among ties)."""
        top = min(self.max_size, limit or self.max_size)
        rates = self.rates()[:top]
        return 1 + rates.index(max(rates))

    def choose(self, limit: Optional[int] = None) -> int:
        """The size of the next cycle, at most `limit` (tokens still wanted)."""
        top = min(self.max_size, limit or self.max_size)
        best = self.best(top)
        self.since_probe += 1
        if best < top and self.since_probe >= self.wait:
            self.since_probe = 0
            self.probe = (min(top, best + self.reach), best)
            return self.probe[0]
        self.probe = None
        return best

    def choose_width(self, limit: Optional[int] = None) -> "Width":
        """The next cycle as a `Width` (a chain here; `TreePolicy` weighs trees too)."""
        return Width(self.choose(limit))

    def update_width(
        self, width: "Width", accepted: int, seconds: float, chain: Optional[tuple[int, int]] = None
    ) -> None:
        """`update` for a cycle chosen by `choose_width` (`chain`: see `TreePolicy`)."""
        self.update(width.size, accepted, seconds)

    def _charge(self, seconds_by: dict[int, float], key: int, seconds: float) -> None:
        """Fold one measured cycle into `seconds_by[key]`: the mean of the first samples,
        then a slow running average (so that one odd first sample, such as a plain step
        charged with the queued work before it, is outvoted within a few cycles)."""
        count = self.samples[id(seconds_by), key] = self.samples.get((id(seconds_by), key), 0) + 1
        old = seconds_by.get(key)
        if old is not None:  # a shared machine's spikes count, but at most triple
            weight = max(1 - self.cost_memory, 1 / count)
            seconds = (1 - weight) * old + weight * min(seconds, 3 * old)
        seconds_by[key] = seconds

    def update(self, size: int, accepted: int, seconds: float) -> None:
        """Record a finished cycle: `accepted` of its `size - 1` drafts, `seconds` of wall time."""
        self._charge(self.seconds, size, seconds)
        # A plain step queued before the probe was chosen reports after it: keep the probe.
        probe = self.probe if self.probe is not None and self.probe[0] == size else None
        if probe is not None:
            self.probe = None
        # How likely the estimates found the drafts this probe accepted beyond the challenged size.
        likely = math.prod(self.acceptance(k) for k in range(probe[1], accepted + 1)) if probe else 1.0
        self._learn(size, accepted)
        if probe is None:
            return
        self.reach = 2 * self.reach if accepted == size - 1 else 1  # all drafts accepted: look further
        # Paid: it beat what the challenged size would have committed on the same drafts.
        costs = self.costs()
        paid = (accepted + 1) / costs[size - 1] > (min(accepted, probe[1] - 1) + 1) / costs[probe[1] - 1]
        if likely < self.surprise or self.best() > probe[1]:
            self.wait = 1  # the drafter did better than believed: look again at once
        elif paid:  # a probe that pays costs nothing: keep looking about as often
            self.wait = max(1, self.wait // self.backoff)
        else:
            self.wait = min(self.backoff * self.wait, self._probe_interval(size, probe[1]))

    def _learn(self, size: int, accepted: int) -> None:
        """Fold a chain's acceptance (`accepted` of `size - 1` drafts) into the estimates."""
        seen = min(accepted + 1, size - 1)  # positions 1..a accepted, a+1 rejected
        for k in range(1, self.max_size if size > 1 else 1):  # a plain step drafts nothing
            # unseen positions fade too, towards the prior: what a past stretch taught about
            # deep drafts must not outlive it while only short blocks are drafted
            self.hits[k] = self.memory * self.hits[k] + (k <= accepted)
            self.trials[k] = self.memory * self.trials[k] + (k <= seen)

    def _probe_interval(self, probe: int, best: int) -> int:
        """Cycles between probes so that their extra cost stays within `explore`."""
        costs = self.costs()
        return _interval(costs[probe - 1], costs[best - 1], self.explore)


#: Tree sizes (draft nodes) an adaptive policy weighs beside chains, where the target has trees.
TREE_SIZES = (4, 8, 16, 32)


def tree_prior(nodes: int) -> float:
    """Before any walk: a tree of `nodes` commits this many times what the chain of as many
    rows (at most the block) does; shaped after an offline replay of the shipped drafter
    (B = 8: trees of 4 / 8 / 16 / 32 / 64 nodes 1.11 / 1.22 / 1.31 / 1.40 / 1.47x the chain)."""
    return 1.0 + 0.1 * max(0.0, math.log2(nodes) - 1.0)


class TreePolicy(BlockSizePolicy):
    """A `BlockSizePolicy` whose chosen chain a draft tree of `trees` nodes (depth <= max_size
    - 1) may replace: the chain decisions (estimates, probes) are exactly the chain policy's,
    and a tree is an upgrade weighed against the chain chosen.

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
    up to the interval at which probes lose at most `tree_explore` of the time."""

    def __init__(
        self,
        max_size: int,
        *,
        trees: Sequence[int] = TREE_SIZES,
        calibration: float = 2.0,
        walk_memory: float = 0.97,
        margin: float = 0.05,
        tree_explore: float = 0.01,
        **kwargs,
    ):
        super().__init__(max_size, **kwargs)
        self.trees = sorted({n for n in trees if n >= 1}) if max_size > 1 else []
        self.calibration, self.walk_memory, self.margin = calibration, walk_memory, margin
        self.tree_explore = tree_explore
        self.walks = {n: [0.0, 0.0] for n in self.trees}  # decayed (tokens committed, chain model's expectation)
        self.tree_seconds: dict[int, float] = {}
        self.tree_wait, self.since_tree = 1, 0  # the trees' own probing schedule
        self.tree_probe: Optional[tuple[Width, Width, float]] = None  # (probed, its rival, the rival's rate)

    def chain_expected(self, size: int) -> float:
        """Expected tokens a chain of `size` commits (1 for a plain step)."""
        total = run = 1.0
        for k in range(1, size):
            run *= self.acceptance(k)
            total += run
        return total

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
        if not width.tree:
            return self.chain_expected(width.size)
        return self.ratio(width.nodes) * self.chain_expected(min(width.size, self.max_size))

    def width_cost(self, width: Width, costs: list[float]) -> float:
        """Estimated cost of a cycle of `width` (`costs`: the chain sizes' estimates)."""
        if not width.tree:
            return costs[width.size - 1]
        if width.nodes in self.tree_seconds:
            return self.tree_seconds[width.nodes]
        drafted = {m: t for m, t in self.seconds.items() if m > 1}
        drafted.update({n + 1: t for n, t in self.tree_seconds.items()})
        if len(drafted) > 1:
            intercept, slope = fit_line(drafted)
            return max(intercept + slope * width.size, costs[0], 1e-9)
        last = self.max_size - 1  # beyond the block: the chain's slope, carried on
        step = costs[last] - costs[last - 1] if last > 1 else costs[last] - costs[0]
        return costs[min(width.size, self.max_size) - 1] + max(step, 0.0) * max(width.size - self.max_size, 0)

    def rate(self, width: Width, costs: Optional[list[float]] = None) -> float:
        """Expected committed tokens per unit of cost of a cycle of `width`."""
        return self.expected(width) / self.width_cost(width, costs or self.costs())

    def tree_rates(self) -> list[tuple[float, Width]]:
        """(expected rate, width) of each tree size, best first."""
        costs = self.costs()
        return sorted(((self.rate(Width(n + 1, True), costs), Width(n + 1, True)) for n in self.trees), reverse=True)

    def choose_width(self, limit: Optional[int] = None) -> Width:
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
            self._charge(self.tree_seconds, width.nodes, seconds)
            done, base = self.walks[width.nodes]  # old walks fade as new ones come (only then)
            rows = min(width.size, self.max_size)
            # what the chain of as many rows committed on the same draws (paired: far less noisy
            # than its estimates), else what the chain's estimates expected
            expected = min(chain[1], rows - 1) + 1 if chain is not None else self.chain_expected(rows)
            self.walks[width.nodes] = [self.walk_memory * done + accepted + 1, self.walk_memory * base + expected]
            if chain is not None:
                self._learn(*chain)
        else:
            self.update(width.size, accepted, seconds)
        if probe is not None:
            self._settle(width, probe[1], accepted, probe[2])

    def _settle(self, width: Width, rival: Width, accepted: int, rival_rate: float) -> None:
        """After a probe of `width` (a tree, or the chain under a tree) against `rival`
        (whose expected rate was `rival_rate`): shorten the interval if it paid, else back
        off, up to the interval at which probes lose at most `tree_explore` of the time (a
        probe's loss counts the tokens too: a chain can commit less than a tree)."""
        costs = self.costs()
        cost = self.width_cost(width, costs)
        if (accepted + 1) / cost > rival_rate:
            self.tree_wait = max(1, self.tree_wait // self.backoff)
            return
        rival_cost = self.width_cost(rival, costs)
        lost = max(0.0, cost - self.expected(width) * rival_cost / self.expected(rival))
        self.tree_wait = min(self.backoff * self.tree_wait, max(1, math.ceil(lost / (self.tree_explore * rival_cost))))


@dataclass
class CycleWidths:
    """The width of each cycle (a plain step, a chain, a tree): the policy's choice or the
    fixed one, never verifying a chain past `max_tokens` nor a tree deeper than it needs."""

    policy: Optional[BlockSizePolicy]  # None: fixed widths
    limit: int  # the fixed block size, or the largest the policy may choose; 1: no drafter
    drafting: bool
    max_tokens: Optional[int]
    fixed_tree: Optional[int] = None  # nodes of every cycle's tree (a fixed tree budget)
    trees: bool = False  # whether the target verifies trees

    def _left(self, produced: int) -> int:
        return max(1, self.max_tokens - produced) if self.max_tokens is not None else self.limit

    def next(self, produced: int) -> Width:
        """The width of the cycle after `produced` tokens. A policy's tree on a target
        without trees (a policy passed in) is its chain."""
        left = self._left(produced)
        if self.policy is not None:
            width = self.policy.choose_width(left)
            return width if self.trees or not width.tree else Width(min(width.size, self.limit, left))
        if not self.drafting:
            return Width(1)
        if self.fixed_tree:
            return Width(self.fixed_tree + 1, True)
        return Width(max(2, min(self.limit, left)))  # a fixed block verifies at least 2

    def depths(self, produced: int, nodes: int) -> tuple[int, int]:
        """(the depth of a tree of `nodes` after `produced` tokens, its candidates' depth):
        at least 1 and none deeper than max_tokens needs; the drafter's candidates stay
        within the block, prompt lookup's guess may go on below, as deep as the nodes go."""
        left = self.max_tokens - produced if self.max_tokens is not None else nodes + 1
        depth = max(1, min(nodes, left - 1))
        return depth, min(depth, self.limit - 1)

    def run_ahead(self, size: int, produced: int) -> bool:
        """Whether a plain step is queued before the token it feeds is read (not when the
        caller stops at max_tokens)."""
        return size == 1 and (self.max_tokens is None or produced < self.max_tokens)


def _interval(probe_cost: float, best_cost: float, explore: float) -> int:
    """Cycles between probes so that their extra cost stays within `explore` of the time."""
    return max(1, math.ceil(max(probe_cost - best_cost, 0.0) / (explore * best_cost)))


def fit_line(points: dict[float, float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through {x: y}."""
    n = len(points)
    mx_, my = sum(points) / n, sum(points.values()) / n
    sxx = sum((x - mx_) ** 2 for x in points)
    slope = sum((x - mx_) * (y - my) for x, y in points.items()) / sxx
    return my - slope * mx_, slope
