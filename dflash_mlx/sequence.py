"""One sequence's own state, apart from what every sequence shares (the model `Pair`).

A sequence (a conversation, a server slot) owns its caches and the tokens they hold
(`PromptCache`) and prompt lookup's record of its text (`acceptance.GuessRecord`), which
carry from one turn to the next. What is learned of the drafter (its acceptance, the cycle
costs: the adaptive policy) belongs to the pair (`Pair.policy`) and lasts across sequences.
Several sequences decode through one pair, each with its own `Sequence`.
"""

from __future__ import annotations

from typing import Optional, Union

from .acceptance import Acceptance, GuessRecord, Records
from .cache import PromptCache
from .options import DecodeOptions
from .pair import Pair
from .plan import Plan, check_kv
from .policy import BlockSizePolicy


class Sequence:
    """A `PromptCache` and prompt lookup's record of its text."""

    def __init__(self, cache: PromptCache):
        self.cache = cache
        self.guesses = GuessRecord()

    @property
    def tokens(self) -> list[int]:
        """The tokens its caches hold."""
        return self.cache.tokens

    @classmethod
    def of(cls, state: Union[None, PromptCache, "Sequence"], pair: Pair) -> "Sequence":
        """`state` itself, a bare `PromptCache` in a new sequence (its lookup record lasts
        one generation), or, for None, a new sequence on fresh caches for `pair` (anything
        else: a TypeError naming `prompt_cache`)."""
        if isinstance(state, Sequence):
            return state
        if state is not None and not isinstance(state, PromptCache):  # e.g. mlx-lm's list of caches
            raise TypeError(f"prompt_cache must come from dflash_mlx.make_prompt_cache, got {type(state).__name__}")
        return cls(state if state is not None else PromptCache(pair.model, pair.drafter))

    def plan(
        self,
        options: DecodeOptions,
        pair: Pair,
        policy: Optional[BlockSizePolicy] = None,
        max_tokens: Optional[int] = None,
    ) -> Plan:
        """Ready the caches for a generation through `pair` as `options` say, and plan it:
        with an adaptive width, `policy` or the pair's."""
        cache = self.cache
        cache.use_drafter(pair.drafter)
        check_kv(cache, options)
        if pair.drafter is not None:
            cache.bound_drafter(options.window(pair.drafter), options.draft_sink)
        return Plan.make(options, pair, policy, max_tokens)

    def records(self, plan: Plan, pair: Pair) -> Records:
        """The records a generation on `plan` reads and writes: the policy's drafter record
        (fixed widths: the pair's; the target alone: a fresh one) and this sequence's lookup
        record."""
        learned = plan.policy or pair.policy
        return Records(learned.drafts if learned is not None else Acceptance(plan.block), self.guesses)
