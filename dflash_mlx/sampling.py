"""Sampling and acceptance: one rule for greedy and sampled decoding.

The token at sequence position t is the argmax of its scores: the target's logits when
greedy; else the filtered, tempered log-probabilities (mlx-lm's `make_sampler` order:
top-p, then top-k, on the untempered log-probabilities, then the temperature) plus Gumbel
noise drawn from a key made of (seed, t) alone, which is an exact sample of that
distribution (the Gumbel-max trick).

The drafter proposes by the same rule with the same noise, and a draft is accepted when
it equals the target's own choice at its position. Two things follow:
- the committed tokens do not depend on the drafts, the block size or the tree: the same
  seed gives the same text for any of them, and for the target alone through this loop;
- each committed token is an exact sample of the target's distribution given the tokens
  before it, because the noise at t is independent of everything that decided the prefix.
Sharing the noise couples draft and target: a draft distribution q close to the target's
p agrees with it about as often as rejection sampling would accept (for two candidate
tokens exactly as often: 1 - TV(p, q)), with no residual distribution to sample from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import mlx.core as mx

_MASK64 = (1 << 64) - 1


def filter_logprobs(logprobs: mx.array, top_p: float = 1.0, top_k: int = 0) -> mx.array:
    """Set tokens outside the nucleus (top_p) and outside the k most likely (exactly k) to -inf."""
    if 0 < top_p < 1:
        order = mx.argsort(-logprobs, axis=-1)
        ranked = mx.take_along_axis(logprobs, order, axis=-1)
        # Keep a token while the mass of the tokens ranked above it is below top_p.
        mass_above = mx.cumsum(mx.exp(ranked.astype(mx.float32)), axis=-1) - mx.exp(ranked.astype(mx.float32))
        kept = (mass_above < top_p).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(ranked, kept - 1, axis=-1)
        logprobs = mx.where(logprobs < threshold, -mx.inf, logprobs)
    if 0 < top_k < logprobs.shape[-1]:
        # Exactly k kept, ties at the k-th included (a threshold would keep them all), by
        # the partition mlx-lm's top-k takes, so that tied tokens are chosen as there.
        dropped = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
        logprobs = mx.put_along_axis(logprobs, dropped, mx.array(-mx.inf, logprobs.dtype), axis=-1)
    return logprobs


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities (..., V) in float32 of logits (..., V) of any float dtype."""
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that scrambles every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_keys(seed: int, start: int, n: int) -> mx.array:
    """PRNG keys (n, 2) for positions start .. start + n - 1 of a generation seeded `seed`."""
    base = _mix64(seed & _MASK64)
    keys = [_mix64(base ^ t) for t in range(start, start + n)]
    return mx.array([[k >> 32, k & 0xFFFFFFFF] for k in keys], dtype=mx.uint32)


def fresh_seed() -> int:
    """A seed drawn from MLX's global generator (so `mx.random.seed` makes runs repeatable)."""
    hi, lo = mx.random.randint(0, 2**31, shape=(2,)).tolist()
    return (hi << 31) | lo


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are picked: greedy at `temp == 0`, else sampled from the filtered,
    tempered distribution with noise keyed by (`seed`, position). The one place the
    loop's greedy-or-sample decision is made."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        """Whether tokens are the argmax of the logits (`temp == 0`)."""
        return self.temp == 0

    def draws(self, start: int) -> "Draws":
        """The choices of the tokens at positions start, start + 1, ..."""
        return Draws(self, start)

    def choose(self, logits: mx.array, start: int) -> mx.array:
        """Tokens (n,) for logits (n, V) whose rows choose positions start .. start + n - 1."""
        return self.draws(start).choose(logits)


class Draws:
    """The choices of consecutive positions from `start`. The noise is made once (lazily)
    and shared by everyone who chooses there in a cycle: the drafter and the target."""

    def __init__(self, params: SamplingParams, start: int):
        self.params, self.start = params, start
        self._noise: Optional[mx.array] = None

    @property
    def greedy(self) -> bool:
        """Whether the choices are the argmax of the logits (no noise)."""
        return self.params.greedy

    @property
    def temp(self) -> float:
        """The sampling temperature."""
        return self.params.temp

    def noise(self, n: int, vocab: int) -> mx.array:
        """Gumbel noise (n, vocab) of positions start .. start + n - 1."""
        if self._noise is None or self._noise.shape[0] < n or self._noise.shape[1] != vocab:
            keys = position_keys(self.params.seed, self.start, n)
            self._noise = mx.vmap(lambda key: mx.random.gumbel(shape=(vocab,), key=key))(keys)
        return self._noise[:n]

    def scores(self, logits: mx.array, rows: Union[None, Sequence[int], mx.array] = None, deepest: int = 0) -> mx.array:
        """Scores (n, V) whose argmax is the choice: logits when greedy, else the filtered
        tempered log-probabilities plus the noise of each row's position (row i of logits
        is position start + i, or start + rows[i] when `rows` is given; an array of rows,
        lazy, needs `deepest`, a bound on them)."""
        if self.greedy:
            return logits
        p = self.params
        scores = filter_logprobs(log_softmax(logits), p.top_p, p.top_k) / p.temp
        if rows is None:
            return scores + self.noise(logits.shape[0], logits.shape[-1])
        if not isinstance(rows, mx.array):
            rows, deepest = mx.array(rows), max(rows)
        return scores + self.noise(deepest + 1, logits.shape[-1])[rows]

    def choose(self, logits: mx.array, rows: Union[None, Sequence[int], mx.array] = None, deepest: int = 0) -> mx.array:
        """One token per row of logits (see `scores`)."""
        return mx.argmax(self.scores(logits, rows, deepest), axis=-1)


def accept(drafts: mx.array, choices: mx.array) -> tuple[mx.array, mx.array]:
    """drafts (b-1,), choices (b,): the target's choice after [last, drafts...]. Returns
    (accepted count a: the drafts that agree before the first that does not, the target's
    token after them)."""
    a = mx.cumprod((drafts == choices[:-1]).astype(mx.int32)).sum()
    return a, choices[a]
