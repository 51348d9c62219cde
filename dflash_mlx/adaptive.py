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

Pure Python, no MLX: unit-tested on synthetic acceptance and cost streams.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence


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
        self.wait = 1  # cycles between probes
        self.since_probe = 0
        self.reach = 1  # how far past the best size the next probe looks
        self.probe: Optional[tuple[int, int]] = None  # (probed size, the size it challenged)

    def acceptance(self, k: int) -> float:
        """Estimated P(draft k accepted | drafts before it accepted), k >= 1."""
        return (self.hits[k] + self.prior) / (self.trials[k] + 1.0)

    def costs(self) -> list[float]:
        """Estimated cost of a cycle of each size (index b - 1; seconds once anything is
        measured). Unmeasured drafted sizes come from a least-squares line through the
        measured ones, or, with fewer than two, from the cost model scaled to the nearest."""
        if not self.seconds:
            return list(self.model)
        drafted = {m: t for m, t in self.seconds.items() if m > 1}
        line = _fit_line(drafted) if len(drafted) > 1 else None
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

    def update(self, size: int, accepted: int, seconds: float) -> None:
        """Record a finished cycle: `accepted` of its `size - 1` drafts, `seconds` of wall time."""
        old = self.seconds.get(size)
        if old is not None:  # a shared machine's spikes count, but at most triple
            seconds = self.cost_memory * old + (1 - self.cost_memory) * min(seconds, 3 * old)
        self.seconds[size] = seconds
        # A plain step queued before the probe was chosen reports after it: keep the probe.
        probe = self.probe if self.probe is not None and self.probe[0] == size else None
        if probe is not None:
            self.probe = None
        # How likely the estimates found the drafts this probe accepted beyond the challenged size.
        likely = math.prod(self.acceptance(k) for k in range(probe[1], accepted + 1)) if probe else 1.0
        seen = min(accepted + 1, size - 1)  # positions 1..a accepted, a+1 rejected
        for k in range(1, self.max_size if size > 1 else 1):  # a plain step drafts nothing
            # unseen positions fade too, towards the prior: what a past stretch taught about
            # deep drafts must not outlive it while only short blocks are drafted
            self.hits[k] = self.memory * self.hits[k] + (k <= accepted)
            self.trials[k] = self.memory * self.trials[k] + (k <= seen)
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

    def _probe_interval(self, probe: int, best: int) -> int:
        """Cycles between probes so that their extra cost stays within `explore`."""
        costs = self.costs()
        extra = max(costs[probe - 1] - costs[best - 1], 0.0)
        return max(1, math.ceil(extra / (self.explore * costs[best - 1])))


def _fit_line(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through {x: y}."""
    n = len(points)
    mx_, my = sum(points) / n, sum(points.values()) / n
    sxx = sum((x - mx_) ** 2 for x in points)
    slope = sum((x - mx_) * (y - my) for x, y in points.items()) / sxx
    return my - slope * mx_, slope
