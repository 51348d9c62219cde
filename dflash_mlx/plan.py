"""One plan per generation, made from its `DecodeOptions` and the model `Pair`: how it decodes.

A generation decodes one of three ways: the target alone (no drafter: plain steps), a
fixed width (a chain of `block_size`, or a tree of `tree_budget` nodes), or an adaptive
policy that chooses each cycle's width (`policy.BlockSizePolicy`, or `tree_policy.TreePolicy`
where the pair verifies trees). This is the one place in the loop that reads `block_size`
and `tree_budget`: the widths a cycle may verify, the drafter block its drafts come from and
the depths of its trees are all the plan's answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mlx_lm.models.cache import RotatingKVCache

from .cache import KV, PromptCache
from .options import DecodeOptions
from .pair import Pair
from .policy import BlockSizePolicy, Width
from .sampling import SamplingParams


@dataclass
class Plan:
    """How one generation decodes. `limit`: the most tokens a chain verifies (1: the target
    alone; the fixed block size; or, adaptive, the drafter's block B)."""

    limit: int
    block: int  # the drafter's block B, which trees (and adaptive chains) are drafted from
    policy: Optional[BlockSizePolicy]  # None: fixed widths
    fixed_tree: Optional[int]  # nodes of every cycle's tree (a fixed tree budget)
    trees: bool  # whether cycles may be trees
    max_tokens: Optional[int]
    sampling: SamplingParams = SamplingParams()
    lookup: int = 0  # prompt lookup's longest suffix (0: off)
    profile: bool = False
    kv: Optional[KV] = None  # the target's KV cache quantization (None: off)

    @classmethod
    def make(
        cls,
        options: DecodeOptions,
        pair: Pair,
        policy: Optional[BlockSizePolicy] = None,
        max_tokens: Optional[int] = None,
    ) -> "Plan":
        """The plan of a generation: with an adaptive width, `policy` (a caller's own,
        `make_policy`), else the pair's (`Pair.policy`: what every generation through the
        pair has learned, weighing trees where the pair has them even in a generation
        without, `tree_budget=0`). Fixed widths use none."""
        drafter = pair.drafter
        limit = options.block_limit(drafter)
        trees = pair.trees and options.tree_budget != 0
        fixed_tree = options.tree_budget if trees and options.tree_budget else None
        if options.adaptive(drafter) and fixed_tree is None:
            policy = policy or pair.policy
            policy.start()
        else:
            policy = None
        kv = None if options.kv_bits is None else (options.kv_bits, options.kv_group_size, options.quantized_kv_start)
        sampling, lookup, profile = options.sampling(), options.lookup, options.profile
        return cls(limit, pair.block, policy, fixed_tree, trees, max_tokens, sampling, lookup, profile, kv)

    def draft_block(self, width: Width) -> int:
        """The block a cycle of `width` is drafted from: a tree's candidates come from the
        drafter's whole block B (however many nodes the tree has); an adaptive chain's from
        at least B (it was trained on full blocks, and drafts from one are more often
        accepted; on a CPU the head over a few more rows costs little beside the verify);
        a fixed chain's from its own size."""
        if width.tree:
            return self.block
        return max(width.size, self.block) if self.policy is not None else width.size

    @property
    def probing(self) -> bool:
        """Whether the policy's last choice is a probe (`BlockSizePolicy.probing`: a chain
        that must draft, whatever prompt lookup offers)."""
        return self.policy is not None and self.policy.probing

    def _left(self, produced: int) -> int:
        return max(1, self.max_tokens - produced) if self.max_tokens is not None else self.limit

    def next(self, produced: int) -> Width:
        """The width of the cycle after `produced` tokens, never a chain past `max_tokens`.
        Where trees are off (`tree_budget=0`, a target without them), a policy that weighs
        trees makes the chain policy's choice alone."""
        left = self._left(produced)
        if self.policy is not None:
            return self.policy.choose_width(left) if self.trees else Width(self.policy.choose(left))
        if self.limit == 1:
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

    def kv_room(self, cache: PromptCache) -> Optional[int]:
        """How many tokens the next forward may take while the KV cache stays in full
        precision (at least 1), or None when that does not matter (no quantization, or done)."""
        if self.kv is None:
            return None
        offsets = [c.offset for c in cache.target if hasattr(c, "to_quantized")]
        return max(1, self.kv[2] - offsets[0]) if offsets else None


def check_kv(cache: PromptCache, options: DecodeOptions) -> None:
    """A ValueError (one line) where `cache` cannot be quantized as `options` say: a
    target with sliding-window layers (mlx-lm cannot quantize those). A cache quantized
    otherwise is prefilled again (`PromptCache.reuse`)."""
    if options.kv_bits is not None and any(isinstance(c, RotatingKVCache) for c in cache.target):
        raise ValueError("kv_bits needs a target without sliding-window layers (mlx-lm cannot quantize them)")
