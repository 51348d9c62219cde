"""The chain policy: how many tokens the next cycle verifies (`Width`; the batch still counts widths in integers).

A cycle of size b drafts b - 1 tokens and verifies b (b = 1 is a plain target step: no
drafter call). It commits 1 + (accepted drafts) tokens. The policy picks the b that
maximises expected committed tokens per second:

* acceptance: the sequence's `acceptance.Acceptance` (p_k, the probability that draft k
  is accepted given that drafts 1..k-1 were).
* cost: the measured wall time of cycles of each size (`acceptance.Cost`, a slow running
  average: on a CPU a queued plain step computes when it is queued, so single plain steps
  are charged unevenly, and only their average is right); sizes not measured yet are
  scaled from the nearest measured one along a cost model. A measured cost goes stale
  after `STALE` choices without a sample: its next sample replaces it (a plain step's
  too), and until then a drafted width's is believed no dearer than the fresh ones
  predict (a width timed in a slow stretch, such as the first cycles of a cold process,
  is otherwise never chosen, so never timed again).
* exploration: what is never verified is never measured, so now and then the policy
  probes a larger block: one more token than it believes best, then, while probes
  accept every draft, twice as far each time (a cheap first look; big blocks only once
  they look likely to pay). Probes that do not pay back off by `backoff` x, up to the
  interval at which probes cost at most `explore` of the time; a probe that beats the
  current choice is followed by another at once, so that a drafter that improves
  mid-answer is noticed within a few probes of the next one. Probes that find no draft
  accepted at all, one after another, shrink that budget (`probe_budget`): a drafter that
  has shown nothing in more than `MISSES_FREE` probes in a row is probed ever more rarely,
  down to a tenth of `explore`, and one accepted draft restores it. A new generation
  probes at its first cycle unless the drafter is such a one, then keeps the backed-off
  schedule: a drafter that does not pay costs at most one probe per answer, not a
  schedule started over. Probes look up; looking down, while the chosen chain is
  expected to commit less than 1 + `RECHECK_MARGIN` tokens, a plain step is measured again
  as often as costs at most `explore` of the tokens (a plain step whose slow samples, such
  as ones taken while the machine warmed up, made drafts that hardly pay look worth it
  would otherwise never be measured again).

Draft trees widen the choice (`tree_policy.TreePolicy`); `plan.Plan` turns a policy's
choice (or a fixed width) into each cycle's width.

Pure Python, no MLX: unit-tested on synthetic acceptance and cost streams.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

from .acceptance import Acceptance, Cost, charge


class Width(NamedTuple):
    """What one cycle verifies: `size` tokens, a chain (1: a plain step) or, with `tree`,
    a draft tree of `size - 1` nodes below the root."""

    size: int
    tree: bool = False

    @property
    def nodes(self) -> int:
        """Tokens verified below the last committed one: a chain's drafts, a tree's nodes."""
        return self.size - 1

    def __str__(self) -> str:
        return f"tree {self.nodes}" if self.tree else "plain" if self.size == 1 else f"chain {self.size}"


#: While the chosen chain is expected to commit less than 1 + RECHECK_MARGIN tokens, plain
#: steps are measured again now and then (see the module docstring).
RECHECK_MARGIN = 0.25
#: Choices after which a measured cost is stale: its next sample replaces it (`acceptance.charge`),
#: and a drafted width's is meanwhile believed no dearer than fresh ones predict (`BlockSizePolicy.measured`).
STALE = 50
#: Probes in a row that may find nothing before the probe budget shrinks (a drafter whose
#: first draft is accepted 40% of the time misses 4 in a row about one time in eight).
MISSES_FREE = 3


def probe_budget(explore: float, misses: int) -> float:
    """The share of time probes may cost after `misses` probes in a row accepted no draft:
    `explore`, then, past `MISSES_FREE`, `explore` / (1 + m / 4) for the m misses beyond,
    down to a tenth (a drafter that keeps showing nothing is unlikely to have changed at the
    next probe; one that has is found a little later)."""
    return explore / (1 + min(max(misses - MISSES_FREE, 0), 36) / 4)


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
        drafts: Optional[Acceptance] = None,
    ):
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, got {max_size}")
        self.max_size = max_size
        self.explore, self.cost_memory = explore, cost_memory
        self.surprise, self.backoff = surprise, backoff
        self.model = list(cost_model) if cost_model is not None else default_cost_model(max_size)
        if len(self.model) != max_size:
            raise ValueError(f"cost_model needs {max_size} entries, got {len(self.model)}")
        self.drafts = drafts if drafts is not None else Acceptance(max_size, memory, prior)
        self.seconds: dict[int, Cost] = {}  # measured cycle cost by size
        self.wait = 1  # cycles between probes
        self.since_probe = 0
        self.reach = 1  # how far past the best size the next probe looks
        self.probe: Optional[tuple[int, int]] = None  # (probed size, the size it challenged)
        self.since_plain = 0  # cycles since the last plain step
        self.misses = 0  # probes in a row that accepted no draft
        self.chosen = 0  # choices made: the clock that says how fresh a measured cost is

    def start(self) -> None:
        """A new generation begins: probe at its first cycle (a new prompt may suit the
        drafter better than the last answer did, and a backed-off schedule would take up to
        1 / `explore` cycles to find out, as at a math prompt after code ones), unless more
        than `MISSES_FREE` probes in a row found nothing (an untrained drafter). The schedule
        itself is kept: a probe that does not pay backs off from where it was."""
        if self.misses <= MISSES_FREE:
            self.since_probe = max(self.since_probe, self.wait - 1)

    def acceptance(self, k: int) -> float:
        """Estimated P(draft k accepted | drafts before it accepted) (`Acceptance.estimate`)."""
        return self.drafts.estimate(k)

    def costs(self) -> list[float]:
        """Estimated cost of a cycle of each size (index b - 1; seconds once anything is
        measured): measured sizes their `measured` cost; unmeasured drafted sizes from a
        least-squares line through the measured ones, or, with fewer than two, from the cost
        model scaled to the nearest."""
        if not self.seconds:
            return list(self.model)
        seconds = {m: self.measured(m, c) for m, c in self.seconds.items()}
        drafted = {m: t for m, t in seconds.items() if m > 1}
        line = fit_line(drafted) if len(drafted) > 1 else None
        out = []
        for size in range(1, self.max_size + 1):
            if size in seconds:
                out.append(seconds[size])
            elif line is not None and size > 1:
                # never below a plain step: verifying more tokens cannot be cheaper
                out.append(max(line[0] + line[1] * size, seconds.get(1, 0.0), 1e-9))
            else:  # plain steps scale from plain steps, drafted cycles from drafted ones
                same = [m for m in seconds if (m == 1) == (size == 1)] or list(seconds)
                near = min(same, key=lambda m: (abs(m - size), m))
                out.append(self.model[size - 1] * seconds[near] / self.model[near - 1])
        return out

    def measured(self, rows: int, cost: Cost, drafted: Optional[dict[int, Cost]] = None) -> float:
        """A measured cycle's cost (`rows` verified): its mean, or, for a drafted cycle not
        measured in the last `STALE` choices, at most what the fresh ones of `drafted` (by
        rows; default: the chains) predict for its rows. A width measured in a slow stretch
        (the machine's first cycles, a busy neighbour) would otherwise look dear for good:
        never chosen, never measured again. A cost believed too low is mended by the one
        cycle that chooses it."""
        if rows == 1 or self.chosen - cost.at < STALE:
            return cost.mean
        fresh = self.fresh_cost(rows, self.seconds if drafted is None else drafted)
        return cost.mean if fresh is None else min(cost.mean, fresh)

    def fresh_cost(self, rows: int, drafted: dict[int, Cost]) -> Optional[float]:
        """What a drafted cycle of `rows` rows costs by the drafted cycles of `drafted` (by
        rows) measured in the last `STALE` choices: the line through them (two sizes or more,
        where it rises), else their level along the cost model; None where there are none."""
        fresh = {m: c.mean for m, c in drafted.items() if m > 1 and self.chosen - c.at < STALE}
        if not fresh:
            return None
        if len(fresh) > 1:
            intercept, slope = fit_line(fresh)
            if slope >= 0:
                return intercept + slope * rows
        level = sum(t / self.model_cost(m) for m, t in fresh.items()) / len(fresh)
        return level * self.model_cost(rows)

    def model_cost(self, rows: int) -> float:
        """The cost model at `rows` (carried on along its last step past the block)."""
        if rows <= self.max_size:
            return self.model[rows - 1]
        step = self.model[-1] - self.model[-2] if self.max_size > 1 else 0.0
        return self.model[-1] + step * (rows - self.max_size)

    def rates(self) -> list[float]:
        """Expected committed tokens per unit of cost, by size (index b - 1)."""
        costs = self.costs()
        return [self.drafts.expected(b) / costs[b - 1] for b in range(1, self.max_size + 1)]

    def best(self, limit: Optional[int] = None) -> int:
        """The size with the highest expected rate (the smallest among ties)."""
        top = min(self.max_size, limit or self.max_size)
        rates = self.rates()[:top]
        return 1 + rates.index(max(rates))

    def choose(self, limit: Optional[int] = None) -> int:
        """The size of the next cycle, at most `limit` (tokens still wanted)."""
        top = min(self.max_size, limit or self.max_size)
        best = self.best(top)
        self.chosen += 1
        self.since_probe += 1
        self.since_plain = 0 if best == 1 else self.since_plain + 1
        self.probe = None
        gain = self.drafts.expected(best) - 1  # tokens a cycle of `best` is expected to add to a plain step's
        if best > 1 and gain < RECHECK_MARGIN and self.since_plain * self.explore >= gain:
            self.since_plain = 0
            return 1  # drafts that hardly pay: measure a plain step again (its cost may be a stale sample)
        if best < top and self.since_probe >= self.wait:
            self.since_probe = 0
            self.probe = (min(top, best + self.reach), best)
            return self.probe[0]
        return best

    @property
    def probing(self) -> bool:
        """Whether the last choice is a probe: it is there to measure the drafter, so it
        drafts, whatever prompt lookup offers."""
        return self.probe is not None

    def choose_width(self, limit: Optional[int] = None) -> Width:
        """The next cycle as a `Width` (a chain here; `TreePolicy` weighs trees too)."""
        return Width(self.choose(limit))

    def update_width(
        self, width: Width, accepted: int, seconds: float, chain: Optional[tuple[int, int]] = None
    ) -> None:
        """`update` for a cycle chosen by `choose_width` (`chain`: see `TreePolicy`)."""
        self.update(width.size, accepted, seconds)

    def update(self, size: int, accepted: int, seconds: float) -> None:
        """Record a finished cycle: `accepted` of its `size - 1` drafts, `seconds` of wall time."""
        charge(self.seconds, size, seconds, self.cost_memory, self.chosen, STALE)
        # A plain step queued before the probe was chosen reports after it: keep the probe.
        probe = self.probe if self.probe is not None and self.probe[0] == size else None
        if probe is not None:
            self.probe = None
        # How likely the estimates found the drafts this probe accepted beyond the challenged size.
        likely = math.prod(self.acceptance(k) for k in range(probe[1], accepted + 1)) if probe else 1.0
        self.drafts.learn(size, accepted)
        if probe is None:
            return
        self.reach = 2 * self.reach if accepted == size - 1 else 1  # all drafts accepted: look further
        self.misses = 0 if accepted else self.misses + 1
        # Paid: it beat what the challenged size would have committed on the same drafts.
        costs = self.costs()
        paid = (accepted + 1) / costs[size - 1] > (min(accepted, probe[1] - 1) + 1) / costs[probe[1] - 1]
        if likely < self.surprise or self.best() > probe[1]:
            self.wait = 1  # the drafter did better than believed: look again at once
        elif paid:  # a probe that pays costs nothing: keep looking about as often
            self.wait = max(1, self.wait // self.backoff)
        else:
            self.wait = min(self.backoff * self.wait, self._probe_interval(size, probe[1]))

    def _probe_interval(self, probe: int, best: int) -> int:
        """Cycles between probes so that their extra cost stays within `explore`."""
        costs = self.costs()
        return interval(costs[probe - 1], costs[best - 1], probe_budget(self.explore, self.misses))


def interval(probe_cost: float, best_cost: float, explore: float) -> int:
    """Cycles between probes so that their extra cost stays within `explore` of the time."""
    return max(1, math.ceil(max(probe_cost - best_cost, 0.0) / (explore * best_cost)))


def fit_line(points: dict[float, float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through {x: y}."""
    n = len(points)
    mx_, my = sum(points) / n, sum(points.values()) / n
    sxx = sum((x - mx_) ** 2 for x in points)
    slope = sum((x - mx_) * (y - my) for x, y in points.items()) / sxx
    return my - slope * mx_, slope
