"""The model pair: a target and its drafter, built once and shared by every generation.

What depends on the two models alone, and not on a request, is settled here once: the
target adapter (`targets.make_target`), the kernel choice (`Target.use_kernels`, which
checks and times the custom kernels on this machine: `kernels/choice.py`), whether the
drafter fits the target (`drafter.check_fit`), and whether the target's caches allow draft
trees. What is learned of the pair also lives here and lasts across calls and requests: the
adaptive policy (`policy`: the drafter's acceptance by block position, the cycle costs), so
that a one-shot call does not probe afresh a drafter the pair has already shown to be
useless. Caches, tokens and prompt lookup's record are each sequence's own (`sequence.py`),
so several sequences decode through one pair.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache as make_target_cache

from .drafter import Drafter, check_fit
from .policy import BlockSizePolicy
from .target import Target
from .targets import make_target
from .tree_policy import TreePolicy


class Pair:
    """A target model and its drafter (None: the target alone), checked against each other.

    `target`: the adapter whose forward also returns the drafter's feature layers;
    `block`: the drafter's block size B (1 without a drafter); `trees`: whether the target
    verifies draft trees; `policy`: the adaptive policy every generation through the pair
    learns in (None without a drafter), shared with the pair of the same models built with
    the other kernel switch (`learned`)."""

    def __init__(
        self,
        model: nn.Module,
        drafter: Optional[Drafter] = None,
        kernels: bool = False,
        learned: Optional[BlockSizePolicy] = None,
    ):
        if drafter is not None and not isinstance(drafter, Drafter):  # e.g. mlx-lm's max_tokens, given in its place
            raise TypeError(f"draft_model must be a DFlash drafter (load_draft) or None, got {type(drafter).__name__}")
        self.model, self.drafter = model, drafter
        layers = drafter.config.target_layer_ids if drafter is not None else ()
        self.target: Target = make_target(model, layers).use_kernels(kernels)
        self.wants_kernels = kernels
        if drafter is not None:
            t = self.target
            check_fit(drafter.config, num_layers=t.num_layers, hidden_size=t.hidden_size, vocab_size=t.vocab_size)
        self.block = drafter.config.block_size if drafter is not None else 1
        # empty caches (no arrays yet): their kinds say whether trees can be verified
        self.trees = drafter is not None and self.target.supports_trees(make_target_cache(model))
        self.policy: Optional[BlockSizePolicy] = None
        if drafter is not None:
            self.policy = learned if learned is not None else self.new_policy()

    def new_policy(self, trees: bool = True) -> BlockSizePolicy:
        """A fresh adaptive policy for this pair: a `TreePolicy` (plain steps, chains and
        draft trees) where the pair verifies trees and `trees` is on, else the chain-only one."""
        return TreePolicy(self.block) if trees and self.trees else BlockSizePolicy(self.block)

    def same(self, model: Any, drafter: Any, kernels: bool) -> bool:
        """Whether this pair was built from these models with this kernel switch."""
        return self.model is model and self.drafter is drafter and self.wants_kernels == kernels

    @classmethod
    def of(cls, model: nn.Module, drafter: Optional[Drafter] = None, kernels: bool = False) -> "Pair":
        """The pair of `model` and `drafter`: one built recently when it is theirs (a chat,
        a server, a benchmark decode through one pair, or two: with and without the
        drafter), else a new one, kept for next time."""
        found = next((p for p in _recent if p.same(model, drafter, kernels)), None)
        if found is None:
            sibling = next((p for p in _recent if p.same(model, drafter, not kernels)), None)
            found = cls(model, drafter, kernels, sibling.policy if sibling is not None else None)
        _recent[:] = [found] + [p for p in _recent if p is not found][: RECENT - 1]
        return found


#: Pairs `Pair.of` keeps (most recently used first): a few, so that no model outlives its use for long.
RECENT = 4
_recent: list[Pair] = []
