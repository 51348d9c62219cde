"""Sampling and acceptance: greedy, and lossless speculative (rejection) sampling.

Filters follow mlx-lm's `make_sampler`: top-p, then top-k, on the untempered
log-probabilities, then the temperature. Draft and target distributions go through the
same filters, which keeps rejection sampling exact for the filtered target distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import mlx.core as mx


def filter_logprobs(logprobs: mx.array, top_p: float = 1.0, top_k: int = 0) -> mx.array:
    """Set tokens outside the nucleus (top_p) and outside the k most likely to -inf."""
    if 0 < top_p < 1:
        order = mx.argsort(-logprobs, axis=-1)
        ranked = mx.take_along_axis(logprobs, order, axis=-1)
        # Keep a token while the mass of the tokens ranked above it is below top_p.
        mass_above = mx.cumsum(mx.exp(ranked.astype(mx.float32)), axis=-1) - mx.exp(ranked.astype(mx.float32))
        kept = (mass_above < top_p).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(ranked, kept - 1, axis=-1)
        logprobs = mx.where(logprobs < threshold, -mx.inf, logprobs)
    if 0 < top_k < logprobs.shape[-1]:
        kth = mx.sort(logprobs, axis=-1)[..., -top_k, None]  # the k-th largest (top_k = 1 too)
        logprobs = mx.where(logprobs < kth, -mx.inf, logprobs)
    return logprobs


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def probabilities(logits: mx.array, temp: float, top_p: float = 1.0, top_k: int = 0) -> mx.array:
    """The distribution sampling draws from, as in mlx-lm: filters, then temperature."""
    return mx.softmax(filter_logprobs(log_softmax(logits), top_p, top_k) / temp, axis=-1)


def sample(probs: mx.array) -> mx.array:
    """One token per row of a probability matrix."""
    return mx.random.categorical(mx.log(probs), axis=-1)


def greedy_accept(drafts: mx.array, target_logits: mx.array) -> tuple[mx.array, mx.array]:
    """drafts (B-1,), target_logits (B, V) over [last, drafts...]. Returns (accepted
    count a, the target's token after the a accepted drafts)."""
    posterior = mx.argmax(target_logits, axis=-1)
    a = mx.cumprod((drafts == posterior[:-1]).astype(mx.int32)).sum()
    return a, posterior[a]


def speculative_accept(drafts: mx.array, draft_probs: mx.array, target_probs: mx.array
                       ) -> tuple[mx.array, mx.array]:
    """Rejection sampling (Leviathan et al.; Chen et al.): accept draft k with probability
    min(1, p/q); at the first rejection sample from norm(max(p - q, 0)); after a fully
    accepted block sample from p. The committed tokens are distributed exactly as p."""
    rows = mx.arange(drafts.shape[0])
    p = target_probs[rows, drafts]
    q = draft_probs[rows, drafts]
    accept = mx.random.uniform(shape=p.shape) * q < p
    a = mx.cumprod(accept.astype(mx.int32)).sum()
    residual = mx.maximum(target_probs[:-1] - draft_probs, 0)
    residual = mx.concatenate([residual, target_probs[-1:]], axis=0)
    total = residual.sum(axis=-1, keepdims=True)
    # p == q leaves nothing to resample; such a row is never rejected, so any fallback is exact.
    residual = mx.where(total > 0, residual / mx.maximum(total, 1e-30), target_probs)
    return a, sample(residual)[a]


class Draft(NamedTuple):
    """A drafter's proposal for one block: what acceptance needs to know about it."""

    tokens: mx.array  # (B-1,) the drafted tokens
    probs: Optional[mx.array] = None  # q, each token's distribution; None: greedy drafts
    # q's columns: None for the whole vocabulary (B-1, V); else the token ids (B-1, k) of
    # the k candidates q is over (DFlash2's selector drafts among each position's top k)
    indices: Optional[mx.array] = None

    def first(self, n: int) -> "Draft":
        """The proposal for the first `n` drafted positions only."""
        return Draft(*(None if x is None else x[:n] for x in self))

    def dense_probs(self, vocab_size: int) -> mx.array:
        """q over the whole vocabulary (B-1, V): zero outside the candidates."""
        if self.indices is None:
            return self.probs
        zeros = mx.zeros((self.probs.shape[0], vocab_size), dtype=self.probs.dtype)
        return mx.put_along_axis(zeros, self.indices, self.probs, axis=-1)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are picked: greedy at `temp == 0`, else sampled from the filtered,
    tempered distribution. The one place the loop's greedy-or-sample decision is made."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def probs(self, logits: mx.array) -> mx.array:
        """The distribution sampling draws from (not used when greedy)."""
        return probabilities(logits, self.temp, self.top_p, self.top_k)

    def choose(self, logits: mx.array) -> mx.array:
        """One token per row of logits."""
        return mx.argmax(logits, axis=-1) if self.greedy else sample(self.probs(logits))

    def draft(self, logits: mx.array) -> Draft:
        """Draft tokens per row of draft logits, and the distribution they came from
        (None when greedy: acceptance then only compares tokens)."""
        if self.greedy:
            return Draft(mx.argmax(logits, axis=-1))
        probs = self.probs(logits)
        return Draft(sample(probs), probs)

    def accept(self, draft: Draft, target_logits: mx.array) -> tuple[mx.array, mx.array]:
        """(accepted draft count, the target's next token): greedy comparison, or
        lossless rejection sampling when the drafts were sampled (q zero outside a
        draft's candidates, so the residual max(p - q, 0) differs from p only there)."""
        if draft.probs is None:
            return greedy_accept(draft.tokens, target_logits)
        q = draft.dense_probs(target_logits.shape[-1])
        return speculative_accept(draft.tokens, q, self.probs(target_logits))
