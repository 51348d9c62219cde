"""What one generation did, counted as it runs: `GenerationStats`, and its one plain view.

Its fields are written only by its own methods: the loop calls `start`, `prefilled`,
`record` (each cycle) and `draft_cache`, the token stream `emitted`. The chat's panel, the server's `dflash` object, the
benchmark and `dflash eval` all read the same numbers through `to_dict()` (or the
properties), so tau and the histograms are computed in this one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional


def histogram(values: Iterable[int], size: int = 0) -> list[int]:
    """counts[n - 1] = how many of `values` equal n, for n = 1 .. max(size, max(values))."""
    values = list(values)
    counts = [0] * max(size, max(values, default=0))
    for n in values:
        counts[n - 1] += 1
    return counts


def tau(committed: int, cycles: int) -> float:
    """Mean acceptance length: tokens committed per draft/verify cycle (0 before any)."""
    return committed / cycles if cycles else 0.0


@dataclass
class GenerationStats:
    """Live statistics of one generation (updated in place as it runs)."""

    block_size: int = 0  # the fixed block size, or the largest an adaptive one may pick
    adaptive: bool = False
    cycles: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed per cycle
    block_sizes: list[int] = field(default_factory=list)  # tokens verified per cycle (1: a plain step)
    trees: list[bool] = field(default_factory=list)  # per cycle: a draft tree (of block_sizes - 1 nodes)?
    tree_budget: Optional[int] = None  # the fixed tree size; None: adaptive (or chains only)
    drafted_tokens: int = 0  # draft tokens proposed
    accepted_drafted_tokens: int = 0
    lookup_chains: int = 0  # chain cycles that verified prompt lookup's guess, not the drafter's drafts
    draft_time: float = 0.0  # seconds; split from verify_time only when profiling
    verify_time: float = 0.0
    prompt_time: float = 0.0
    prompt_cached: int = 0  # prompt tokens reused from a PromptCache, not prefilled
    generation_time: float = 0.0
    generated_tokens: int = 0
    draft_cache_tokens: int = 0  # context tokens the drafter's cache keeps (its window and sink)
    draft_cache_bytes: int = 0  # their K/V, all layers

    @property
    def committed(self) -> int:
        """Tokens committed by the cycles (the first token, from the prefill, is not one)."""
        return sum(self.accepted_lengths)

    @property
    def mean_acceptance(self) -> float:
        """tau: mean tokens committed per draft/verify cycle (at least 1; a tree cycle can
        commit more than block_size where prompt lookup's guess runs past the block)."""
        return tau(self.committed, len(self.accepted_lengths))

    @property
    def histogram(self) -> list[int]:
        """histogram[n - 1] = number of cycles that committed n tokens."""
        return histogram(self.accepted_lengths, self.block_size)

    @property
    def size_histogram(self) -> list[int]:
        """size_histogram[b - 1] = number of cycles that verified b tokens."""
        return histogram(self.block_sizes, self.block_size)

    @property
    def tokens_per_second(self) -> float:
        """Tokens given to the caller per second of `generation_time` (0 before any)."""
        return self.generated_tokens / self.generation_time if self.generation_time else 0.0

    @property
    def widths(self) -> dict[str, int]:
        """Cycles by what they verified ("plain", "chain b", "tree n"), most frequent first."""
        counts: dict[str, int] = {}
        for size, tree in zip(self.block_sizes, self.trees):
            key = f"tree {size - 1}" if tree else "plain" if size == 1 else f"chain {size}"
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def start(self, block_size: int, adaptive: bool, tree_budget: Optional[int], prompt_cached: int) -> None:
        """A generation begins: its widths (the largest chain, whether adaptive, the fixed
        tree size) and how many prompt tokens came from the prompt cache."""
        self.block_size, self.adaptive, self.tree_budget = block_size, adaptive, tree_budget
        self.prompt_cached = prompt_cached

    def prefilled(self, seconds: float) -> None:
        """The prompt's prefill took `seconds` (up to its first token)."""
        self.prompt_time = seconds

    def draft_cache(self, tokens: int, nbytes: int) -> None:
        """The drafter's cache now keeps `tokens` context tokens in `nbytes` of K/V."""
        self.draft_cache_tokens, self.draft_cache_bytes = tokens, nbytes

    def emitted(self, tokens: int, seconds: float) -> None:
        """`tokens` tokens given to the caller so far, `seconds` after the first."""
        self.generated_tokens, self.generation_time = tokens, seconds

    def record(
        self,
        size: int,
        accepted: int,
        tree: bool = False,
        guessed: bool = False,
        seconds: float = 0.0,
        drafting: float = 0.0,
    ) -> None:
        """Count one cycle that verified `size` tokens (a tree: `size - 1` nodes; `guessed`:
        a chain of prompt lookup's guess), accepted `accepted` drafts and took `seconds`,
        `drafting` of them drafting (0 unless profiled; unprofiled, verify_time holds both)."""
        self.draft_time += drafting
        self.verify_time += seconds - drafting
        self.cycles += 1
        self.lookup_chains += guessed
        self.accepted_lengths.append(accepted + 1)
        self.block_sizes.append(size)
        self.trees.append(tree)
        self.drafted_tokens += size - 1
        self.accepted_drafted_tokens += accepted

    def absorb(self, later: "GenerationStats") -> None:
        """Add `later`, the stats of a later stretch of the same request (a server's request
        that decoded alone, then in a batch, then alone again): its cycles, tokens and times
        add up; the widths it allowed widen these; the prompt figures stay this one's."""
        self.block_size = max(self.block_size, later.block_size)
        self.adaptive = self.adaptive or later.adaptive
        self.tree_budget = self.tree_budget if later.tree_budget is None else later.tree_budget
        self.cycles += later.cycles
        self.accepted_lengths += later.accepted_lengths
        self.block_sizes += later.block_sizes
        self.trees += later.trees
        self.drafted_tokens += later.drafted_tokens
        self.accepted_drafted_tokens += later.accepted_drafted_tokens
        self.lookup_chains += later.lookup_chains
        self.draft_time += later.draft_time
        self.verify_time += later.verify_time
        self.generation_time += later.generation_time
        self.generated_tokens += later.generated_tokens
        self.draft_cache_tokens, self.draft_cache_bytes = later.draft_cache_tokens, later.draft_cache_bytes

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-able copy of the numbers, derived ones included: the one view
        the chat, the server, the benchmark and `dflash eval` read."""
        return {
            "tau": self.mean_acceptance,
            "cycles": self.cycles,
            "committed_tokens": self.committed,
            "accepted_lengths": list(self.accepted_lengths),
            "accepted_length_histogram": self.histogram,
            "block_size": self.block_size,
            "adaptive": self.adaptive,
            "block_sizes": list(self.block_sizes),
            "block_size_histogram": self.size_histogram,
            "trees": list(self.trees),
            "tree_budget": self.tree_budget,
            "widths": self.widths,
            "drafted_tokens": self.drafted_tokens,
            "accepted_drafted_tokens": self.accepted_drafted_tokens,
            "lookup_chains": self.lookup_chains,
            "generated_tokens": self.generated_tokens,
            "tokens_per_second": self.tokens_per_second,
            "prompt_cached": self.prompt_cached,
            "prompt_time": self.prompt_time,
            "generation_time": self.generation_time,
            "draft_time": self.draft_time,
            "verify_time": self.verify_time,
            "draft_cache_tokens": self.draft_cache_tokens,
            "draft_cache_bytes": self.draft_cache_bytes,
        }
