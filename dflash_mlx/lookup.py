"""Prompt lookup: drafts copied from the context itself, at no forward's cost.

Answers repeat their context: code reuses the names it defined, chat restates the question
and keeps to the pattern of its own lists. Where the last few committed tokens occurred
before, the tokens that followed them then are a guess at what follows now (prompt lookup
decoding). A draft tree takes that guess as one more path (`tree.build_tree`'s `guess`),
as deep as its nodes go, below the drafter's block too (a copied span can be long):
the target verifies it like any draft, so the output does not change, only how many
tokens a cycle commits. It helps where the small drafter is weakest: on the shipped
SmolLM2 pair, held-out chat and code. A chain cycle (the only kind where a target has
recurrent or sliding-window layers, or is sharded) verifies the guess in place of the
drafter's drafts when the records say it will keep more (`chain_guess`).

How much a guessed token is worth against the drafter's candidates depends on the text:
code repeats itself more than math does. `GuessRecord` keeps a decayed count of how often
the guesses turned out right and scores the next guess by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

#: The longest suffix matched, and how far back a match is looked for (tokens).
MAX_NGRAM = 4
WINDOW = 8192


def lookup(context: Sequence[int] | np.ndarray, k: int, max_ngram: int = MAX_NGRAM, window: int = WINDOW) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    of `context` (`max_ngram` tokens down to one) within its last `window` tokens; [] if
    no suffix occurs earlier."""
    ctx = np.asarray(context[-window:] if window else context, dtype=np.int64)
    size = len(ctx)
    for n in range(min(max_ngram, size - 1), 0, -1):
        starts = np.ones(size - n, dtype=bool)  # ctx[i : i + n] == the suffix, for i < size - n
        for j in range(n):
            starts &= ctx[j : size - n + j] == ctx[size - n + j]
        hits = np.flatnonzero(starts)
        if hits.size:
            follow = int(hits[-1]) + n
            return ctx[follow : follow + k].tolist()
    return []


@dataclass
class GuessRecord:
    """How often guessed tokens were right, recent cycles weighing most: `probability` is
    (hits + 1) / (tries + 2) over counts that decay by `decay` each cycle (1/2 before any)."""

    hits: float = 0.0
    tries: float = 0.0
    decay: float = 0.95

    @property
    def probability(self) -> float:
        return (self.hits + 1) / (self.tries + 2)

    @property
    def logprob(self) -> float:
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


def expected_hits(probability: float, n: int) -> float:
    """Expected right tokens of a chain of `n` guesses, each right with `probability`
    given that the ones before it were (a wrong one ends the chain)."""
    return sum(probability**k for k in range(1, n + 1))


def chain_guess(guess: Sequence[int], drafts: int, guesses: GuessRecord, drafter: GuessRecord) -> list[int]:
    """The guess, where verifying it (at most `drafts` tokens) is expected to keep more
    tokens than the drafter's `drafts` would, by each one's record; else []."""
    guess = list(guess[:drafts])
    keep = expected_hits(guesses.probability, len(guess)) > expected_hits(drafter.probability, drafts)
    return guess if guess and keep else []
