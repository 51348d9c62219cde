"""One sequence's own state, apart from what every sequence shares (the model `Pair`).

A sequence (a conversation, a server slot) owns its caches and the tokens they hold
(`PromptCache`), what it has learned of the drafter (`acceptance.Records`) and its adaptive
policy, which carry from one turn to the next. Nothing here is shared: several sequences
decode through one pair, each with its own `Sequence`.
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
    """A `PromptCache` and what its sequence learned: prompt lookup's record and the
    adaptive policy (whose `Acceptance` is the drafter's record)."""

    def __init__(self, cache: PromptCache):
        self.cache = cache
        self.policy: Optional[BlockSizePolicy] = None
        self.guesses = GuessRecord()

    @property
    def tokens(self) -> list[int]:
        """The tokens its caches hold."""
        return self.cache.tokens

    @classmethod
    def of(cls, state: Union[None, PromptCache, "Sequence"], pair: Pair) -> "Sequence":
        """`state` itself, a bare `PromptCache` in a new sequence (what it learns lasts one
        generation), or, for None, a new sequence on fresh caches for `pair` (anything else:
        a TypeError naming `prompt_cache`)."""
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
        with an adaptive width, `policy` or this sequence's own (kept for its next turn)."""
        cache = self.cache
        if pair.drafter is not None and pair.drafter is not cache.drafter:  # learned of another drafter
            self.policy, self.guesses = None, GuessRecord()
        cache.use_drafter(pair.drafter)
        check_kv(cache, options)
        if pair.drafter is not None:
            cache.bound_drafter(options.window(pair.drafter), options.draft_sink)
        plan = Plan.make(options, pair, policy or self.policy, max_tokens)
        self.policy = plan.policy or self.policy
        return plan

    def records(self, plan: Plan) -> Records:
        """The records a generation on `plan` reads and writes: the policy's drafter record
        (fixed widths: a fresh one, for this generation) and this sequence's lookup record."""
        drafts = plan.policy.drafts if plan.policy is not None else Acceptance(plan.block)
        return Records(drafts, self.guesses)
