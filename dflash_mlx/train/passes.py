"""Which sequences each pass of a training run covers, and in what order.

An epoch is one pass over the data, or with `--feature-chunk` several: the feature store
grows by at most a chunk (in data order) at each epoch, and the epoch covers the stored
sequences, so that training starts at once on a new machine instead of after hours of
target passes. A run resumed on a machine that lacks features the run had catches up in
passes of a chunk, each over every n-th sequence it had (a sample of the whole data, which
is in source order: contiguous chunks of one source moved the drafter toward it), trained
on `--catch-up-passes` times in a row (a slice's features cost a few passes of training on
it: a new machine would otherwise spend most of its time on them); moved again, it goes on
at its slice.

The pass lives in `TrainState`, so that a checkpoint resumes it: `first` (its first data
index, or a catch-up's slice number), `epoch_size` (0 until its features are computed),
`pos` (sequences of it used), `catch_up` and `repeat` (a catch-up slice's passes done), and
`featured` (the run's sequences with features, on whichever machine). A pass's order is
seeded by (seed, epoch, repeat).
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Callable

from .checkpoint import TrainState


class Passes:
    """The passes of one run over its data. `stored(key)` says whether a sequence has
    features here; `chunk` is --feature-chunk (0: the whole data at once), `repeats`
    --catch-up-passes."""

    def __init__(self, state: TrainState, chunk: int, stored: Callable[[str], bool], repeats: int = 1):
        self.state, self.chunk, self.stored, self.repeats = state, chunk, stored, repeats
        self.keys: list[str] = []  # the data's sequence keys, in data order

    def set_data(self, keys: list[str]) -> None:
        """The data (re)read; a pass past the end of data that shrank starts over at 0."""
        self.keys = keys
        st = self.state
        if st.first >= len(keys):
            st.first, st.pos, st.epoch_size, st.catch_up, st.repeat = 0, 0, 0, False, 0

    def stored_run(self, first: int, limit: int) -> int:
        """How many sequences from data index `first` on, at most `limit`, have features here."""
        return sum(1 for _ in itertools.takewhile(self.stored, self.keys[first : first + limit]))

    def slices(self) -> int:
        """Catch-up passes over the run's `featured` sequences: one a chunk."""
        return max(1, math.ceil(min(self.state.featured, len(self.keys)) / self.chunk))

    def indices(self) -> list[int]:
        """The data indices of the current pass: a catch-up's slice (every n-th sequence the
        run had, from `first`), else `epoch_size` sequences from `first`."""
        st = self.state
        if st.catch_up:
            return list(range(st.first, min(st.featured, len(self.keys)), self.slices()))
        return list(range(st.first, st.first + st.epoch_size))

    def to_feature(self) -> list[int]:
        """The data indices whose features the coming pass needs (some may be stored): while
        this machine lacks some the run had, the catch-up's slice (a catch-up begins here, at
        slice 0); an epoch not begun, what the run had and one chunk more; else what it had."""
        st = self.state
        if not self.chunk:  # every feature at once: a catch-up saved under --feature-chunk ends
            if st.catch_up:
                st.catch_up, st.first, st.pos, st.epoch_size, st.repeat = False, 0, 0, 0, 0
            return list(range(len(self.keys)))
        if not all(map(self.stored, self.keys[: st.featured])):
            if not st.catch_up:
                st.catch_up, st.first, st.pos, st.epoch_size, st.repeat = True, 0, 0, 0, 0
            return self.indices()
        grow = self.chunk if st.epoch_size == 0 and st.first == 0 and not st.catch_up else 0
        return list(range(min(st.featured + grow, len(self.keys))))

    def features_done(self) -> None:
        """The store now holds the coming pass's features: count them into `featured`."""
        self.state.featured = max(self.state.featured, self.stored_run(0, len(self.keys)))

    def needs_next(self, batch_size: int) -> bool:
        """Whether the next batch begins a pass: none is begun, or this one is used up."""
        st = self.state
        return st.epoch_size == 0 or st.pos > 0 and st.pos + batch_size > st.epoch_size

    def advance(self) -> None:
        """After a pass, the next one: the catch-up's slice again (--catch-up-passes), else its
        next slice, else the rest of what the run has had, else the next epoch. It is not
        begun until its features are computed (`begin`): a checkpoint saved before them
        resumes it."""
        st = self.state
        if st.catch_up and st.repeat + 1 < self.repeats:
            st.repeat += 1
        elif st.catch_up and st.first + 1 < self.slices():
            st.first, st.repeat = st.first + 1, 0
        elif not st.catch_up and st.first + st.epoch_size < min(st.featured, len(self.keys)):
            st.first += st.epoch_size
        else:
            st.epoch, st.first, st.catch_up, st.repeat = st.epoch + 1, 0, False, 0
        st.pos, st.epoch_size = 0, 0

    def begin(self) -> None:
        """Begin the pass whose features are stored: a catch-up's slice, else the stored run
        from `first`."""
        st = self.state
        st.pos = 0
        st.epoch_size = len(self.indices()) if st.catch_up else self.stored_run(st.first, len(self.keys))

    def all_stored(self) -> bool:
        """Whether this machine has the features of the pass in the state (a pass begun
        elsewhere may lack them: then it is begun again over what is here)."""
        return all(self.stored(self.keys[i]) for i in self.indices())

    def take(self, batch_size: int, seed: int) -> list[int]:
        """The next batch's data indices: the pass in its order (seeded by `seed`, the epoch
        and the repeat), wrapping around at its end."""
        st = self.state
        order = self.indices()
        random.Random(f"{seed}/{st.epoch}/{st.repeat}").shuffle(order)
        idx = [order[(st.pos + j) % st.epoch_size] for j in range(batch_size)]
        st.pos += batch_size
        return idx
