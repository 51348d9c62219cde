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
drafter's drafts when the records say it will keep more (`acceptance.Records.chain_guess`).

How much a guessed token is worth against the drafter's candidates depends on the text:
code repeats itself more than math does. `acceptance.GuessRecord` keeps a decayed count of
how often the guesses turned out right and scores the next guess by it.
"""

from __future__ import annotations

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
