"""User messages the target wrote: cleaned to one message, and checked against those seen.

The self-instruct writer (`selfinstruct`) and the multi-turn follow-ups (`conversations`)
both have the target write user messages. What it writes is cut to one clean message
(first line, up to the closing quote, at most two sentences, answer-like sentences cut,
length bounds), and a message that equals or nearly equals one seen before (normalised
text; word 3-gram Jaccard for near duplicates) is not kept: in particular none that
repeats a held-out prompt.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Iterable, Optional

#: sentences that show the target answering (or talking about itself) instead of asking
_ANSWER_LIKE = re.compile(
    r"\b(I'm not sure|I am not sure|I'm here to|as an AI|I'm an AI|SmolLM|"
    r"I can help|I'm sorry|I am sorry|happy to help|Sure[,!])",
    re.IGNORECASE,
)
_MARKER = re.compile(r"^\s*(?:\d+[.)]|[-*\u2022])\s+")
_LABEL = re.compile(r"^\s*(?:question|request|message|instruction|user|q)\s*:\s*", re.IGNORECASE)


def clean_instruction(text: str, min_words: int = 4, max_words: int = 60) -> Optional[str]:
    """One user message out of what the target wrote (opener included), or None when
    nothing usable is left: the first line up to a closing quote, list markers and labels
    removed, at most two sentences (ending at the first question), sentences that sound
    like an answer cut, ending in . ? or !, `min_words`..`max_words` words, mostly letters."""
    line = text.split('"')[0].strip().split("\n")[0]
    line = _LABEL.sub("", _MARKER.sub("", line)).strip(" *'`")
    kept: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+", line):
        if not sentence or _ANSWER_LIKE.search(sentence):
            break
        kept.append(sentence)
        if sentence.endswith("?") or len(kept) == 2:
            break
    out = " ".join(kept).strip()
    words = out.split()
    if not out or out[-1] not in ".?!" or not min_words <= len(words) <= max_words:
        return None
    letters = sum(c.isalpha() or c.isspace() for c in out)
    return out if letters >= 0.8 * len(out) else None


def normalize(text: str) -> str:
    """Lowercase words without punctuation, single-spaced: what exact duplicates share."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def shingles(text: str, n: int = 3) -> frozenset:
    """The word n-grams of the normalised text (the whole text when it is shorter)."""
    words = normalize(text).split()
    if len(words) < n:
        return frozenset([tuple(words)])
    return frozenset(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


class NearDuplicates:
    """Texts seen so far, and whether a new one equals one of them (normalised) or shares
    at least `threshold` of its word 3-grams with one (Jaccard), via an inverted index."""

    def __init__(self, texts: Iterable[str] = (), threshold: float = 0.5):
        self.threshold = threshold
        self.exact: set[str] = set()
        self.sets: list[frozenset] = []
        self.index: dict[tuple, list[int]] = defaultdict(list)
        for t in texts:
            self.add(t)

    def add(self, text: str) -> None:
        """Remember `text`."""
        self.exact.add(normalize(text))
        grams = shingles(text)
        for g in grams:
            self.index[g].append(len(self.sets))
        self.sets.append(grams)

    def match(self, text: str) -> Optional[str]:
        """'exact' or 'near' when `text` duplicates a remembered text, else None."""
        if normalize(text) in self.exact:
            return "exact"
        grams = shingles(text)
        shared: dict[int, int] = defaultdict(int)
        for g in grams:
            for j in self.index.get(g, ()):
                shared[j] += 1
        for j, n in shared.items():
            if n / (len(grams) + len(self.sets[j]) - n) >= self.threshold:
                return "near"
        return None
