"""The DFlash decoding loop, layered like mlx-lm: `generate_step -> stream_generate -> generate`.

One cycle: the drafter fills [last token, MASK x (b-1)] in one forward; the target
verifies the whole block in one forward; the longest agreeing prefix is kept, plus one
token of the target's own; the target cache is trimmed back to the committed length and
the committed tokens' features become new drafter context. A cycle reads the host once
(a chain, a tree grown and walked on the device, a plain step), and the next cycle's
drafts are queued right after, before the loop's bookkeeping and
the caller's work on the tokens; plain steps are pipelined as in mlx-lm (the next is queued
before this one's token is read), so a run of them costs what plain decoding does
(`cycles.py`, `host.py`).

A generation is wired from three things: the model `Pair` (the target adapter, the
drafter, the kernel choice, the capabilities and the adaptive policy, what is learned of
the drafter: built once per pair, `pair.py`), the `Sequence` it continues (its caches,
tokens and prompt lookup's record: `sequence.py`) and its
`Plan` (target alone, a fixed width, or an adaptive policy: `plan.py`). Each cycle's
width (`policy.Width`: a plain step, a chain of b, a draft tree of n nodes) comes from
the plan; `Cycles` runs it; `_Clock` charges it its time.

`DecodeOptions.tree_budget=N` verifies a draft tree of up to N nodes instead of a chain
(`tree.py`, DDTree) on targets whose family and caches allow it (plain attention
decoders: llama, mistral, qwen2, qwen3, qwen3_moe; hybrid and sliding-window targets
keep the chain). With an adaptive block size (the default), a `TreePolicy` chooses per
cycle between a plain step, a chain of b and a tree of n nodes, from measured acceptance
and cost; `tree_budget=0`: chains only. Every tree also holds prompt lookup's guess, what
followed the latest earlier occurrence of the context's last tokens (`DecodeOptions.lookup`,
`lookup.py`), and a chain may verify that guess in place of the drafter's drafts.
"""

from __future__ import annotations

import numbers
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .acceptance import Records
from .cache import PromptCache
from .cycles import Cycle, Cycles
from .distributed import leaders_seconds
from .drafter import Drafter
from .options import DecodeOptions
from .pair import Pair
from .policy import BlockSizePolicy, Width
from .sequence import Sequence as DecodeSequence
from .stats import GenerationStats, histogram
from .text import TokenText, as_tokens, token_ids

#: What `prompt_cache` may be: a sequence (`make_prompt_cache`), or a bare `PromptCache`.
PromptState = Union[DecodeSequence, PromptCache]


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


def make_prompt_cache(model: nn.Module, draft_model: Optional[Drafter] = None) -> DecodeSequence:
    """A sequence to continue across calls (multi-turn chat): its caches and prompt
    lookup's record, carried from turn to turn (what is learned of the drafter is the
    pair's: `Pair.policy`)."""
    return DecodeSequence(PromptCache(model, draft_model))


def generate_step(
    prompt: Union[Sequence[int], mx.array, np.ndarray],
    model: nn.Module,
    draft_model: Optional[Drafter] = None,
    options: Optional[DecodeOptions] = None,
    *,
    max_tokens: Optional[int] = None,
    prompt_cache: Optional[PromptState] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stats: Optional[GenerationStats] = None,
    policy: Optional[BlockSizePolicy] = None,
    **changes: Any,
) -> Generator[tuple[list[int], int, list[mx.array]], None, None]:
    """Yield, per cycle, the committed tokens, how many of them are accepted drafts
    (they come first), and the target's log-probabilities (V,) for each. Runs forever: the
    caller stops. With `max_tokens` (None or -1: no limit), blocks shrink near the end so
    nothing past it is verified. With `draft_model=None` the target decodes alone, one token a cycle.
    `prompt`: token ids, a list or a 1-D MLX or NumPy array (mlx-lm's takes an `mx.array`).

    `options` say how to decode (`DecodeOptions`; keyword `changes` to its fields, as
    mlx-lm's keyword arguments, are applied on top). The models decode through their
    `Pair` (`Pair.of`: built once); `prompt_cache` is the sequence continued (a fresh one
    by default). An adaptive block size uses `policy` (by default the pair's, which
    persists across calls). Plain steps run one ahead: when the caller stops after a
    token (EOS, a stop string), the step that feeds it is already queued and stays in the
    prompt cache (never past `max_tokens`)."""
    options = DecodeOptions.of(options, **changes)
    max_tokens = _token_limit(max_tokens)
    prompt = token_ids(prompt)  # an array's elements would reach the caches' token lists
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    pair = Pair.of(model, draft_model, options.use_kernels)
    sequence = DecodeSequence.of(prompt_cache, pair)
    plan = sequence.plan(options, pair, policy, max_tokens)
    cycles = Cycles(pair, sequence.cache, sequence.records(plan, pair), plan)
    stats = stats if stats is not None else GenerationStats()
    clock = _Clock(stats, plan.policy, cycles.records)
    cache = sequence.cache
    start = cache.reuse(prompt, with_drafter=draft_model is not None, kv=plan.kv)
    stats.start(plan.limit, plan.policy is not None, plan.fixed_tree, start)
    done = cycles.prefill(prompt, start, prompt_progress_callback)
    produced = 1
    while True:
        if done.ready:  # a drafted block: its acceptance informs this choice
            clock.charge(done)
        width = plan.next(produced)
        room = plan.kv_room(cache)
        if room is not None and width.size > room:  # the cycle stops where quantization starts
            width = Width(room)
        # Queue the next plain step on the lazy token before reading it (unless the caller
        # stops here at max_tokens): the host sync then overlaps the next step's compute.
        nxt = cycles.plain(done) if plan.run_ahead(width.size, produced) else None
        if not done.ready:
            cycles.read(done)
            clock.charge(done)
        # The next cycle's drafts are queued before the bookkeeping and the caller's work.
        drafted = cycles.draft(done, width, *plan.depths(produced, width.nodes))
        stats.draft_cache(*cache.draft_memory())
        with clock.paused():
            yield done.tokens, done.accepted, done.logprobs
        if nxt is None:
            nxt = cycles.run(done, drafted)
        produced += len(nxt.tokens) if nxt.ready else 1
        done = nxt


def make_policy(model: nn.Module, draft_model: Drafter, trees: bool = True) -> BlockSizePolicy:
    """A fresh adaptive policy of one's own to carry across calls (`policy=`), apart from
    the one the pair shares with every call that passes none (`Pair.policy`): a `TreePolicy`
    (plain steps, chains and draft trees: the loop's default) where the target has trees
    and `trees` is on, else the chain-only `BlockSizePolicy`."""
    return Pair.of(model, draft_model).new_policy(trees)


class _Clock:
    """Charges each finished cycle the loop's time since the last charge, so that every
    second is charged once: on a CPU, queueing a plain step computes it there and then
    (charged to the cycle read next); on a GPU the read waits for it. The caller's time
    between a yield and the resume is skipped (`paused`)."""

    def __init__(self, stats: GenerationStats, policy: Optional[BlockSizePolicy], records: Records):
        self.stats, self.policy, self.records = stats, policy, records
        self.mark = time.perf_counter()

    def charge(self, cycle: Cycle) -> None:
        """Charge a finished cycle to the stats and teach the records (the prefill:
        prompt_time). A chain that verified prompt lookup's guess taught the lookup's
        record already, and is neither the drafter's outcome nor its width's cost."""
        now = time.perf_counter()
        seconds, self.mark = now - self.mark, now
        if cycle.size == 0:
            self.stats.prefilled(seconds)
            return
        if not cycle.guessed and self.policy is not None:  # under mlx.launch every rank adapts to rank 0's times
            self.policy.update_width(cycle.width, cycle.accepted, leaders_seconds(seconds), cycle.chain)
        elif not cycle.guessed:
            self.records.drafts.learn(*cycle.shown)
        self.stats.record(cycle.size, cycle.accepted, cycle.tree, cycle.guessed, seconds, cycle.drafting)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop the clock while the block runs (the caller's time at a yield)."""
        paused = time.perf_counter()
        try:
            yield
        finally:
            self.mark += time.perf_counter() - paused


def stream_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: Union[str, Sequence[int], mx.array],
    draft_model: Optional[Drafter] = None,
    options: Optional[DecodeOptions] = None,
    *,
    max_tokens: Optional[int] = 256,
    stop: Union[str, Sequence[str], None] = (),
    prompt_cache: Optional[PromptState] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    policy: Optional[BlockSizePolicy] = None,
    **changes: Any,
) -> Generator[GenerationResponse, None, None]:
    """Generate with DFlash speculative decoding, one `GenerationResponse` per token.

    `tokenizer`: mlx-lm's `TokenizerWrapper`, or a tokenizer it wraps. `draft_model=None`
    decodes with the target alone. `options` (`DecodeOptions`) say how
    to decode; as in mlx-lm, its fields may also be given as keywords (`temp=0.7`,
    `block_size=8`, `kernels=False`, ...), applied on top. An adaptive block size
    (`block_size=None`) is chosen every cycle (see `BlockSizePolicy`) by the pair's policy,
    which learns across calls, or by `policy`, one's own from `make_policy`. The last response
    has a `finish_reason` ("stop" for EOS or a stop string, "length" at max_tokens; -1 or
    None: no limit, as in mlx-lm);
    every response's `stats` holds tau, the accepted-length histogram, timings and tokens/s.
    """
    options = DecodeOptions.of(options, **changes)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    tokens = as_tokens(tokenizer, prompt)
    limit = _token_limit(max_tokens)
    text = TokenText(tokenizer, stop, limit)
    stats = GenerationStats()
    steps = generate_step(
        tokens,
        model,
        draft_model,
        options,
        max_tokens=limit,
        prompt_cache=prompt_cache,
        prompt_progress_callback=prompt_progress_callback,
        stats=stats,
        policy=policy,
    )
    n, tic = 0, time.perf_counter()
    try:
        for committed, n_drafted, logprobs in steps:
            if n == 0:
                tic = time.perf_counter()
            for i, (token, lp) in enumerate(zip(committed, logprobs)):
                n += 1
                segment, finish = text.push(token, n)
                stats.emitted(n, time.perf_counter() - tic)
                yield _response(stats, segment, token, lp, i < n_drafted, len(tokens), finish)
                if finish:
                    return
    finally:
        steps.close()


def _token_limit(max_tokens: Any) -> Optional[int]:
    """`max_tokens` checked: a positive integer, or -1 or None for no limit (None), as in mlx-lm."""
    if max_tokens is None:
        return None
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, numbers.Integral)
        or max_tokens < -1
        or max_tokens == 0
    ):
        raise ValueError(f"max_tokens must be a positive integer or -1 (no limit), got {max_tokens!r}")
    return None if max_tokens == -1 else int(max_tokens)


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
    tokenizer: Any,
    prompt: Union[str, Sequence[int]],
    draft_model: Optional[Drafter] = None,
    options: Optional[DecodeOptions] = None,
    *,
    verbose: bool = False,
    **kwargs: Any,
) -> str:
    """Generate a complete response, taking `options` and keywords as `stream_generate`
    does; with `verbose`, stream it to stdout and print the stats (else print nothing)."""
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, draft_model, options, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print(format_stats(response))
    return text


def format_stats(response: GenerationResponse) -> str:
    """A few lines of human-readable stats for a finished generation."""
    s = response.stats.to_dict() if response.stats is not None else {"block_size": 0}
    cached = f" ({s['prompt_cached']} from the prompt cache)" if s.get("prompt_cached") else ""
    first = f", first token after {s['prompt_time']:.2f} s" if s.get("prompt_time") else ""
    lines = [
        f"Prompt: {response.prompt_tokens} tokens{cached}, {response.prompt_tps:.1f} tokens/s{first}",
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens/s",
        f"Peak memory: {response.peak_memory:.3f} GB",
    ]
    if s["block_size"] > 1:
        accepted = s["accepted_length_histogram"]
        lines.append(f"Acceptance: tau {s['tau']:.2f} over {s['cycles']} cycles; histogram {accepted}")
        kind = f"adaptive, 1..{s['block_size']}" if s["adaptive"] else f"fixed {s['block_size']}"
        chains = histogram((b for b, tree in zip(s["block_sizes"], s["trees"]) if not tree), s["block_size"])
        lines.append(f"Block size of the chains ({kind}): histogram {chains}")
        if any(s["trees"]):
            widths = ", ".join(f"{w}: {n}" for w, n in s["widths"].items())
            lines.append(f"Widths: {widths}; {s['drafted_tokens']} draft nodes verified")
        lines.append(f"Drafter cache: {s['draft_cache_tokens']} tokens, {s['draft_cache_bytes'] / 1e6:.1f} MB")
        if s["lookup_chains"]:
            n = s["lookup_chains"]
            lines.append(f"Prompt lookup: its guess replaced the drafter's in {n} chain{'s' if n != 1 else ''}")
        if s["draft_time"]:
            lines.append(f"Time: draft {s['draft_time']:.2f}s, verify {s['verify_time']:.2f}s")
    return "\n".join(lines)
