"""The acceptance model: what a sequence has learned of how often drafts are right, and what
cycles cost. The block-size policies (`policy.py`, `tree_policy.py`) and the chain/lookup
choice (`Records.chain_guess`) read the same records.

* `Acceptance`: the drafter's chain drafts, per block position: running estimates of p_k,
  the probability that draft k is accepted given that drafts 1..k-1 were. A chain with a
  accepted drafts out of b - 1 observes k <= a as accepted and k = a + 1 as rejected;
  later positions are not seen (censored), which is exactly what a conditional estimate
  needs. Old observations fade (`memory`) at every drafted chain, seen or not. Only the
  drafter's own chains (and, from a tree, the chain its tokens show) teach it: a chain
  that verified prompt lookup's guess teaches the lookup's record alone.
* `GuessRecord`: prompt lookup's guesses (`lookup.py`), a decayed count of right tokens.
* `Cost`: the measured seconds of one kind of cycle: a mean and a count.

Pure Python, no MLX: unit-tested on synthetic streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence, TypeVar


class Acceptance:
    """Decayed per-position counts of the drafter's chain drafts (index k: draft k, from 1;
    index 0 unused), `memory` the fade per drafted chain, `prior` one pseudo-trial's hit."""

    def __init__(self, size: int, memory: float = 0.9, prior: float = 0.5):
        self.size, self.memory, self.prior = size, memory, prior
        self.hits = [0.0] * size
        self.trials = [0.0] * size

    def estimate(self, k: int) -> float:
        """Estimated P(draft k accepted | drafts before it accepted), k >= 1, with one
        pseudo-trial of prior: `prior`, or the estimate of draft k - 1 where that is lower
        (a position rarely reached is believed no better than the one before it: a drafter
        that misses draft 1 is not worth a longer block for a coin flip at draft 2)."""
        estimate = self.prior
        for j in range(1, min(k, self.size - 1) + 1):
            estimate = (self.hits[j] + min(self.prior, estimate)) / (self.trials[j] + 1.0)
        return estimate

    def expected(self, size: int) -> float:
        """Expected tokens a chain of `size` commits (1 for a plain step): 1 + the sum over
        k < size of P(drafts 1..k all accepted)."""
        total = run = 1.0
        for k in range(1, size):
            run *= self.estimate(k)
            total += run
        return total

    def learn(self, size: int, accepted: int) -> None:
        """Fold a chain's outcome (`accepted` of its `size - 1` drafts) into the estimates."""
        seen = min(accepted + 1, size - 1)  # positions 1..a accepted, a+1 rejected
        for k in range(1, self.size if size > 1 else 1):  # a plain step drafts nothing
            # unseen positions fade too, towards the prior: what a past stretch taught about
            # deep drafts must not outlive it while only short blocks are drafted
            self.hits[k] = self.memory * self.hits[k] + (k <= accepted)
            self.trials[k] = self.memory * self.trials[k] + (k <= seen)


@dataclass
class GuessRecord:
    """How often guessed tokens were right, recent cycles weighing most: `probability` is
    (hits + 1) / (tries + 2) over counts that decay by `decay` each cycle (1/2 before any)."""

    hits: float = 0.0
    tries: float = 0.0
    decay: float = 0.95

    @property
    def probability(self) -> float:
        """The chance that the next guessed token is right (1/2 before any)."""
        return (self.hits + 1) / (self.tries + 2)

    @property
    def logprob(self) -> float:
        """log(`probability`): a guessed token's score in a draft tree (`tree.build_tree`)."""
        return math.log(self.probability)

    def observe(self, guess: Sequence[int], committed: Sequence[int]) -> None:
        """Count one cycle: a guessed token was tried if the committed tokens (the target's
        own choices) reach it and match every guessed token before it. Cycles without a
        guess leave the record as it is."""
        if not len(guess):
            return
        self.hits *= self.decay
        self.tries *= self.decay
        for want, got in zip(guess, committed):
            self.tries += 1
            if want != got:
                break
            self.hits += 1

    def expected(self, n: int) -> float:
        """Expected right tokens of a chain of `n` guesses (a wrong one ends the chain)."""
        return sum(self.probability**k for k in range(1, n + 1))


@dataclass
class Records:
    """One sequence's acceptance records: the drafter's chains and prompt lookup's guesses."""

    drafts: Acceptance
    guesses: GuessRecord = field(default_factory=GuessRecord)

    def chain_guess(self, guess: Sequence[int], drafts: int) -> list[int]:
        """The guess (at most `drafts` tokens), where verifying it is expected to keep more
        tokens than the drafter's `drafts` would; else []."""
        guess = list(guess[:drafts])
        keep = self.guesses.expected(len(guess)) > self.drafts.expected(drafts + 1) - 1
        return guess if guess and keep else []


#: What costs are keyed by: a chain's size, a policy's width, a batch's (rows, width).
Key = TypeVar("Key", bound=Hashable)


@dataclass
class Cost:
    """The measured seconds of one kind of cycle: the mean of the first samples, then a
    slow running average (so that one odd first sample, such as a plain step charged with
    the queued work before it, is outvoted within a few cycles)."""

    mean: float
    count: int = 1
    at: int = 0  # the owner's cycle count at the last sample (how fresh the mean is)

    def add(self, seconds: float, memory: float, age: float = 0.0) -> None:
        """Fold one sample in (a shared machine's spikes count, but at most triple). `age`:
        how old the mean is, from 0 (measured just before) to 1 (so old that the machine's
        speed may have changed since: the sample replaces it)."""
        self.count += 1
        weight = max(1 - memory, 1 / self.count, min(age, 1.0))
        self.mean = (1 - weight) * self.mean + weight * min(seconds, 3 * self.mean)


def charge(
    costs: dict[Key, Cost], key: Key, seconds: float, memory: float, at: int = 0, stale: Optional[int] = None
) -> None:
    """Fold one cycle measured at the owner's cycle `at` into `costs[key]` (a new record at
    its first sample); with `stale`, a mean that many cycles old is replaced, younger ones
    weigh less the older they are (`Cost.add`'s age)."""
    record: Optional[Cost] = costs.get(key)
    if record is None:
        costs[key] = Cost(seconds, at=at)
    else:
        record.add(seconds, memory, (at - record.at) / stale if stale else 0.0)
        record.at = at
