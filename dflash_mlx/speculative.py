"""The DFlash decoding loop, layered like mlx-lm: `generate_step -> stream_generate -> generate`.

One cycle: the drafter fills [last token, MASK x (b-1)] in one forward; the target
verifies the whole block in one forward; the longest agreeing prefix is kept, plus one
token of the target's own; the target cache is trimmed back to the committed length and
the committed tokens' features become new drafter context. One host sync per cycle;
plain steps are pipelined as in mlx-lm (the next is queued before this one's token is
read), so a run of them costs what plain decoding does (`cycles.py`).

The block size b is fixed (`block_size=N`) or chosen before every cycle by a
`BlockSizePolicy` (`block_size=None`), from 1 (a plain target step, no drafter call;
its features join the drafter's context lazily, before the next draft) up to the
drafter's B.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .adaptive import BlockSizePolicy
from .cache import PromptCache
from .cycles import Cycle, Cycles
from .drafter import Drafter, check_fit
from .kernels import metal_ready
from .sampling import SamplingParams
from .target import Target


def histogram(values: Iterable[int], size: int = 0) -> list[int]:
    """counts[n - 1] = how many of `values` equal n, for n = 1 .. max(size, max(values))."""
    values = list(values)
    counts = [0] * max(size, max(values, default=0))
    for n in values:
        counts[n - 1] += 1
    return counts


@dataclass
class GenerationStats:
    """Live statistics of one generation (updated in place as it runs)."""

    block_size: int = 0  # the fixed block size, or the largest an adaptive one may pick
    adaptive: bool = False
    cycles: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed per cycle
    block_sizes: list[int] = field(default_factory=list)  # tokens verified per cycle (1: a plain step)
    drafted_tokens: int = 0  # draft tokens proposed
    accepted_drafted_tokens: int = 0
    draft_time: float = 0.0  # seconds; split from verify_time only when profiling
    verify_time: float = 0.0
    prompt_time: float = 0.0
    prompt_cached: int = 0  # prompt tokens reused from a PromptCache, not prefilled
    generation_time: float = 0.0
    generated_tokens: int = 0

    @property
    def mean_acceptance(self) -> float:
        """tau: mean tokens committed per draft/verify cycle (1 .. block_size)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

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
        return self.generated_tokens / self.generation_time if self.generation_time else 0.0

    def record(self, size: int, accepted: int) -> None:
        """Count one cycle that verified `size` tokens and accepted `accepted` drafts."""
        self.cycles += 1
        self.accepted_lengths.append(accepted + 1)
        self.block_sizes.append(size)
        self.drafted_tokens += size - 1
        self.accepted_drafted_tokens += accepted


@dataclass
class GenerationResponse:
    """mlx-lm's `GenerationResponse` fields, plus the live `stats`. `prompt_tps` counts
    the prompt tokens actually prefilled (not those reused from a PromptCache)."""

    text: str
    token: int
    logprobs: mx.array
    from_draft: bool
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    stats: Optional[GenerationStats] = None


def make_prompt_cache(model: nn.Module, draft_model: Optional[Drafter] = None) -> PromptCache:
    """A cache to reuse across calls (multi-turn chat)."""
    return PromptCache(model, draft_model)


def _check_args(prompt: Sequence[int], block_size: Optional[int], temp: float) -> None:
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    if block_size is not None and block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    if temp < 0:
        raise ValueError(f"temp must be >= 0, got {temp}")


def generate_step(
    prompt: Sequence[int],
    model: nn.Module,
    draft_model: Optional[Drafter] = None,
    *,
    block_size: Optional[int] = None,
    max_tokens: Optional[int] = None,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    prompt_cache: Optional[PromptCache] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stats: Optional[GenerationStats] = None,
    profile: bool = False,
    policy: Optional[BlockSizePolicy] = None,
    kernels: Optional[bool] = None,
) -> Generator[tuple[list[int], int, list[mx.array]], None, None]:
    """Yield, per cycle, the committed tokens, how many of them are accepted drafts
    (they come first), and the target's log-probabilities for each. Runs forever: the
    caller stops. With `max_tokens`, blocks shrink near the end so nothing past it is
    verified. With `draft_model=None` the target decodes alone, one token a cycle.

    `block_size=None` adapts the block size every cycle with `policy` (by default the
    prompt cache's, which persists across calls that share the cache). Plain steps run
    one ahead: when the caller stops after a token (EOS, a stop string), the step that
    feeds it is already queued and stays in the prompt cache (never past `max_tokens`).

    `kernels` runs a quantized target's verify projections through the custom Metal
    kernel (dflash_mlx.kernels); None: on wherever it can run (an Apple GPU)."""
    _check_args(prompt, block_size, temp)
    stats = stats if stats is not None else GenerationStats()
    target = Target(model, draft_model.config.target_layer_ids if draft_model else ())
    target.use_kernels(metal_ready() if kernels is None else kernels)
    if draft_model is not None:
        check_fit(
            draft_model.config,
            num_layers=target.num_layers,
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
        )
    cache = prompt_cache if prompt_cache is not None else PromptCache(model, draft_model)
    cache.use_drafter(draft_model)
    if draft_model is not None and block_size is None:
        policy = policy or cache.policy or BlockSizePolicy(draft_model.config.block_size)
        cache.policy = policy
    else:
        policy = None
    stats.block_size = (block_size or draft_model.config.block_size) if draft_model else 1
    stats.adaptive = policy is not None
    sampling = SamplingParams(temp, top_p, top_k)
    cycles = Cycles(target, draft_model, cache, sampling, profile, full_blocks=policy is not None)

    # `mark`: where the loop's clock stood when it last charged a cycle; the caller's time
    # between a yield and the resume is skipped. Each cycle is charged the loop's time
    # since the last charge, so that every second is charged once: on a CPU, queueing a
    # plain step computes it there and then (charged to the cycle read next), on a GPU
    # the read waits for it.
    mark = time.perf_counter()
    start = stats.prompt_cached = cache.reuse(prompt, with_drafter=draft_model is not None)
    done = cycles.prefill(prompt, start, prompt_progress_callback)
    produced = 1
    while True:
        if done.ready:  # a drafted block: its acceptance informs this choice
            mark = _account(done, stats, policy, mark)
        size = _choose_size(policy, stats, draft_model is not None, max_tokens, produced)
        # Queue the next plain step on the lazy token before reading it (unless the caller
        # stops here at max_tokens): the host sync then overlaps the next step's compute.
        early = size == 1 and (max_tokens is None or produced < max_tokens)
        nxt = cycles.plain(done.tokens[-1] if done.ready else done.tokens) if early else None
        was_ready = done.ready
        committed = done.read()
        if not was_ready:
            mark = _account(done, stats, policy, mark)
        if nxt is not None:
            cache.tokens.append(committed[-1])  # the queued step's input: cache and tokens agree at the yield
        paused = time.perf_counter()
        yield committed, done.accepted, done.logprobs
        mark += time.perf_counter() - paused
        if nxt is None:
            nxt = cycles.plain(committed[-1]) if size == 1 else cycles.speculate(committed[-1], size)
            if size == 1:
                cache.tokens.append(committed[-1])
        produced += len(nxt.tokens) if nxt.ready else 1
        done = nxt


def _choose_size(
    policy: Optional[BlockSizePolicy], stats: GenerationStats, drafting: bool, max_tokens: Optional[int], produced: int
) -> int:
    """The next cycle's block size, never verifying past `max_tokens`."""
    left = max(1, max_tokens - produced) if max_tokens is not None else stats.block_size
    if policy is not None:
        return policy.choose(left)
    return max(2, min(stats.block_size, left)) if drafting else 1  # a fixed block verifies at least 2


def _account(cycle: Cycle, stats: GenerationStats, policy: Optional[BlockSizePolicy], since: float) -> float:
    """Charge a finished cycle the loop's time since `since` (the stats and the policy;
    the prefill: prompt_time). Returns the new mark."""
    now = time.perf_counter()
    seconds = now - since
    if cycle.size == 0:
        stats.prompt_time = seconds
        return now
    if policy is not None:
        policy.update(cycle.size, cycle.accepted, seconds)
    stats.draft_time += cycle.drafting
    stats.verify_time += seconds - cycle.drafting  # includes drafting unless profiling
    stats.record(cycle.size, cycle.accepted)
    return now


class _StopStrings:
    """Holds back text that could be the start of a stop string."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0

    def push(self, segment: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was hit)."""
        self.text += segment
        hits = [i for i in (self.text.find(s, max(0, self.sent - self.hold)) for s in self.stop) if i >= 0]
        if hits:
            out, self.sent = self.text[self.sent : min(hits)], len(self.text)
            return out, True
        end = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


def _as_tokens(tokenizer: TokenizerWrapper, prompt: Union[str, Sequence[int], mx.array]) -> list[int]:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    if isinstance(prompt, mx.array):
        return prompt.tolist()
    return list(prompt)


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, Sequence[int], mx.array],
    draft_model: Optional[Drafter] = None,
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: Optional[int] = None,
    seed: Optional[int] = None,
    stop: Sequence[str] = (),
    prompt_cache: Optional[PromptCache] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    profile: bool = False,
    policy: Optional[BlockSizePolicy] = None,
    kernels: Optional[bool] = None,
) -> Generator[GenerationResponse, None, None]:
    """Generate with DFlash speculative decoding, one `GenerationResponse` per token.

    `draft_model=None` decodes with the target alone. `block_size=None` picks the block
    size every cycle (see `BlockSizePolicy`; pass `policy` to carry one across calls,
    or a `prompt_cache`, which keeps its own). The last response has a
    `finish_reason` ("stop" for EOS or a stop string, "length" at max_tokens); every
    response's `stats` holds tau, the accepted-length histogram, timings and tokens/s.
    `kernels=False` turns the custom Metal kernels off (default: on on Apple GPUs).
    """
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    tokens = _as_tokens(tokenizer, prompt)
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    _check_args(tokens, block_size, temp)
    if seed is not None:
        mx.random.seed(seed)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    stops = _StopStrings(stop)
    eos = tokenizer.eos_token_ids
    stats = GenerationStats()
    options = dict(block_size=block_size, max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k)
    options.update(prompt_cache=prompt_cache, prompt_progress_callback=prompt_progress_callback, policy=policy)
    options.update(kernels=kernels)
    steps = generate_step(tokens, model, draft_model, stats=stats, profile=profile, **options)
    n = 0
    tic = time.perf_counter()
    try:
        for committed, n_drafted, logprobs in steps:
            if n == 0:
                tic = time.perf_counter()
            for i, (token, lp) in enumerate(zip(committed, logprobs)):
                n += 1
                if token not in eos:  # as in mlx-lm, EOS is yielded but adds no text
                    detokenizer.add_token(token)
                last = token in eos or n == max_tokens
                if last:
                    detokenizer.finalize()
                text, hit = stops.push(detokenizer.last_segment)
                finish = "stop" if hit or token in eos else "length" if last else None
                if last and not hit:
                    text += stops.flush()
                stats.generated_tokens = n
                stats.generation_time = time.perf_counter() - tic
                yield _response(stats, text, token, lp, i < n_drafted, len(tokens), finish)
                if finish:
                    return
    finally:
        steps.close()


def _response(
    stats: GenerationStats,
    text: str,
    token: int,
    logprobs: mx.array,
    from_draft: bool,
    prompt_tokens: int,
    finish: Optional[str],
) -> GenerationResponse:
    prefilled = prompt_tokens - stats.prompt_cached
    return GenerationResponse(
        text=text,
        token=token,
        logprobs=logprobs,
        from_draft=from_draft,
        prompt_tokens=prompt_tokens,
        prompt_tps=prefilled / stats.prompt_time if stats.prompt_time else 0.0,
        generation_tokens=stats.generated_tokens,
        generation_tps=stats.tokens_per_second,
        peak_memory=mx.get_peak_memory() / 1e9,
        finish_reason=finish,
        stats=stats,
    )


def generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, Sequence[int]],
    draft_model: Optional[Drafter] = None,
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate a complete response; with `verbose`, stream it and print the stats."""
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, draft_model, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print(format_stats(response))
    return text


def format_stats(response: GenerationResponse) -> str:
    """A few lines of human-readable stats for a finished generation."""
    s = response.stats
    lines = [
        f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens/s",
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens/s",
        f"Peak memory: {response.peak_memory:.3f} GB",
    ]
    if s is not None and s.block_size > 1:
        lines.append(f"Acceptance: tau {s.mean_acceptance:.2f} over {s.cycles} cycles; histogram {s.histogram}")
        kind = f"adaptive, 1..{s.block_size}" if s.adaptive else f"fixed {s.block_size}"
        lines.append(f"Block size ({kind}): histogram {s.size_histogram}")
        if s.draft_time:
            lines.append(f"Time: draft {s.draft_time:.2f}s, verify {s.verify_time:.2f}s")
    return "\n".join(lines)
