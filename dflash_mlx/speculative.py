"""The DFlash decoding loop, layered like mlx-lm: `generate_step -> stream_generate -> generate`.

One cycle: the drafter fills [last token, MASK x (b-1)] in one forward; the target
verifies the whole block in one forward; the longest agreeing prefix is kept, plus one
token of the target's own; the target cache is trimmed back to the committed length and
the committed tokens' features become new drafter context. One host sync per cycle;
plain steps are pipelined as in mlx-lm (the next is queued before this one's token is
read), so a run of them costs what plain decoding does (`cycles.py`).

The block size b is fixed (`DecodeOptions.block_size`) or chosen before every cycle by
a `BlockSizePolicy` (`block_size=None`), from 1 (a plain target step, no drafter call;
its features join the drafter's context lazily, before the next draft) up to the
drafter's B. `generate_step` wires a generation together (`_setup`), asks `CycleWidths` for
each cycle's size, and charges each cycle its time (`_Clock`); the cycles themselves,
and the tokens the caches hold, are `cycles.Cycles`'.

`DecodeOptions.tree_budget=N` verifies a draft tree of up to N nodes instead of a chain
(`tree.py`, DDTree) on targets whose family and caches allow it (plain attention
decoders: llama, mistral, qwen2, qwen3, qwen3_moe; hybrid and sliding-window targets
keep the chain). With an adaptive block size (the default), a `TreePolicy` chooses per
cycle between a plain step, a chain of b and a tree of n nodes, from measured acceptance
and cost: trees where rows are cheap (a GPU), mostly chains where they are not (a CPU);
`tree_budget=0`: chains only, whatever the policy. Every tree also holds prompt lookup's
guess, what followed the latest earlier occurrence of the context's last tokens
(`DecodeOptions.lookup`, `lookup.py`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache as make_target_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .adaptive import BlockSizePolicy, CycleWidths, TreePolicy, Width
from .cache import PromptCache
from .cycles import Cycle, Cycles
from .distributed import leaders_seconds
from .drafter import Drafter, check_fit
from .options import DecodeOptions
from .stats import GenerationStats
from .targets import make_target


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


def generate_step(
    prompt: Sequence[int],
    model: nn.Module,
    draft_model: Optional[Drafter] = None,
    options: Optional[DecodeOptions] = None,
    *,
    max_tokens: Optional[int] = None,
    prompt_cache: Optional[PromptCache] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    stats: Optional[GenerationStats] = None,
    policy: Optional[BlockSizePolicy] = None,
    **changes,
) -> Generator[tuple[list[int], int, list[mx.array]], None, None]:
    """Yield, per cycle, the committed tokens, how many of them are accepted drafts
    (they come first), and the target's log-probabilities for each. Runs forever: the
    caller stops. With `max_tokens`, blocks shrink near the end so nothing past it is
    verified. With `draft_model=None` the target decodes alone, one token a cycle.

    `options` say how to decode (`DecodeOptions`; keyword `changes` to its fields, as
    mlx-lm's keyword arguments, are applied on top). An adaptive block size uses
    `policy` (by default the prompt cache's, which persists across calls that share the
    cache). Plain steps run one ahead: when the caller stops after a token (EOS, a stop
    string), the step that feeds it is already queued and stays in the prompt cache
    (never past `max_tokens`)."""
    options = DecodeOptions.of(options, **changes)
    if len(prompt) == 0:
        raise ValueError("the prompt is empty")
    limit = options.block_limit(draft_model)
    cycles, policy, trees = _setup(model, draft_model, options, prompt_cache, policy, limit)
    stats = stats if stats is not None else GenerationStats()
    fixed_tree = options.tree_budget if trees and options.tree_budget else None
    stats.block_size, stats.adaptive, stats.tree_budget = limit, policy is not None, fixed_tree
    sizes = CycleWidths(policy, limit, draft_model is not None, max_tokens, fixed_tree, trees)
    clock = _Clock(stats, policy)
    start = stats.prompt_cached = cycles.cache.reuse(prompt, with_drafter=draft_model is not None)
    done = cycles.prefill(prompt, start, prompt_progress_callback)
    produced = 1
    while True:
        if done.ready:  # a drafted block: its acceptance informs this choice
            clock.charge(done)
        width = sizes.next(produced)
        room = cycles.cache.kv_room()
        if room is not None and width.size > room:  # the cycle stops where quantization starts
            width = Width(room)
        size = width.size
        # Queue the next plain step on the lazy token before reading it (unless the caller
        # stops here at max_tokens): the host sync then overlaps the next step's compute.
        nxt = cycles.plain(done) if sizes.run_ahead(size, produced) else None
        if not done.ready:
            cycles.read(done)
            clock.charge(done)
        stats.draft_cache_tokens, stats.draft_cache_bytes = cycles.cache.draft_memory()
        with clock.paused():
            yield done.tokens, done.accepted, done.logprobs
        if nxt is None and width.tree:
            nxt = cycles.tree(done.last, width.nodes, *sizes.depths(produced, width.nodes))
        elif nxt is None:
            nxt = cycles.plain(done) if size == 1 else cycles.speculate(done.last, size)
        produced += len(nxt.tokens) if nxt.ready else 1
        done = nxt


def _setup(
    model: nn.Module,
    draft_model: Optional[Drafter],
    options: DecodeOptions,
    cache: Optional[PromptCache],
    policy: Optional[BlockSizePolicy],
    limit: int,
) -> tuple[Cycles, Optional[BlockSizePolicy], bool]:
    """The target adapter, the cache and the block-size policy (at most `limit`) of one
    generation, checked against each other. Returns the cycles, the policy (None for a
    fixed block size or tree budget) and whether cycles may be trees."""
    target = make_target(model, draft_model.config.target_layer_ids if draft_model else ())
    target.use_kernels(options.use_kernels)
    if draft_model is not None:
        check_fit(
            draft_model.config,
            num_layers=target.num_layers,
            hidden_size=target.hidden_size,
            vocab_size=target.vocab_size,
        )
    cache = cache if cache is not None else PromptCache(model, draft_model)
    cache.use_drafter(draft_model)
    cache.quantize_with(options)
    cache.bound_drafter(options)
    trees = draft_model is not None and options.tree_budget != 0 and target.supports_trees(cache.target)
    if options.adaptive(draft_model) and not (trees and options.tree_budget):
        default = TreePolicy(limit) if trees else BlockSizePolicy(limit)
        policy = cache.policy = policy or cache.policy or default
        policy.start()
    else:
        policy = None
    full_blocks = policy is not None
    cycles = Cycles(target, draft_model, cache, options.sampling(), options.profile, full_blocks, options.lookup)
    return cycles, policy, trees


def make_policy(model: nn.Module, draft_model: Drafter, trees: bool = True) -> BlockSizePolicy:
    """A fresh adaptive policy to carry across calls (`policy=`): a `TreePolicy` (plain
    steps, chains and draft trees: what the loop makes by default) where the target has
    trees and `trees` is on, else the chain-only `BlockSizePolicy`."""
    B = draft_model.config.block_size
    trees = trees and make_target(model).supports_trees(make_target_cache(model))
    return TreePolicy(B) if trees else BlockSizePolicy(B)


class _Clock:
    """Charges each finished cycle the loop's time since the last charge, so that every
    second is charged once: on a CPU, queueing a plain step computes it there and then
    (charged to the cycle read next); on a GPU the read waits for it. The caller's time
    between a yield and the resume is skipped (`paused`)."""

    def __init__(self, stats: GenerationStats, policy: Optional[BlockSizePolicy]):
        self.stats, self.policy = stats, policy
        self.mark = time.perf_counter()

    def charge(self, cycle: Cycle) -> None:
        """Charge a finished cycle to the stats and the policy (the prefill: prompt_time)."""
        now = time.perf_counter()
        seconds, self.mark = now - self.mark, now
        if cycle.size == 0:
            self.stats.prompt_time = seconds
            return
        if self.policy is not None:  # under mlx.launch every rank adapts to rank 0's times
            width = Width(cycle.size, cycle.tree)
            self.policy.update_width(width, cycle.accepted, leaders_seconds(seconds), cycle.chain)
        self.stats.draft_time += cycle.drafting
        self.stats.verify_time += seconds - cycle.drafting  # includes drafting unless profiling
        self.stats.record(cycle.size, cycle.accepted, cycle.tree, cycle.guessed)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop the clock while the block runs (the caller's time at a yield)."""
        paused = time.perf_counter()
        try:
            yield
        finally:
            self.mark += time.perf_counter() - paused


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


class _Text:
    """The text a stream of tokens adds, token by token, as mlx-lm gives it: EOS is
    yielded but adds no text, and text that could start a stop string waits."""

    def __init__(self, tokenizer: TokenizerWrapper, stop: Sequence[str], max_tokens: int):
        self.detokenizer = tokenizer.detokenizer
        self.detokenizer.reset()
        self.stops, self.eos, self.max_tokens = _StopStrings(stop), tokenizer.eos_token_ids, max_tokens

    def push(self, token: int, n: int) -> tuple[str, Optional[str]]:
        """The text that token number `n` (from 1) releases, and the finish reason where the
        stream ends with it ("stop": EOS or a stop string, "length": `max_tokens`)."""
        eos = token in self.eos
        if not eos:
            self.detokenizer.add_token(token)
        last = eos or n == self.max_tokens
        if last:
            self.detokenizer.finalize()
        text, hit = self.stops.push(self.detokenizer.last_segment)
        if last and not hit:
            text += self.stops.flush()
        return text, "stop" if hit or eos else "length" if last else None


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
    options: Optional[DecodeOptions] = None,
    *,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    prompt_cache: Optional[PromptCache] = None,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    policy: Optional[BlockSizePolicy] = None,
    **changes,
) -> Generator[GenerationResponse, None, None]:
    """Generate with DFlash speculative decoding, one `GenerationResponse` per token.

    `draft_model=None` decodes with the target alone. `options` (`DecodeOptions`) say how
    to decode; as in mlx-lm, its fields may also be given as keywords (`temp=0.7`,
    `block_size=8`, `kernels=False`, ...), applied on top. An adaptive block size
    (`block_size=None`) is chosen every cycle (see `BlockSizePolicy`; pass `policy` to
    carry one across calls, or a `prompt_cache`, which keeps its own). The last response
    has a `finish_reason` ("stop" for EOS or a stop string, "length" at max_tokens);
    every response's `stats` holds tau, the accepted-length histogram, timings and tokens/s.
    """
    options = DecodeOptions.of(options, **changes)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    tokens = _as_tokens(tokenizer, prompt)
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    text = _Text(tokenizer, stop, max_tokens)
    stats = GenerationStats()
    steps = generate_step(
        tokens,
        model,
        draft_model,
        options,
        max_tokens=max_tokens,
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
                stats.generated_tokens, stats.generation_time = n, time.perf_counter() - tic
                yield _response(stats, segment, token, lp, i < n_drafted, len(tokens), finish)
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
    s = response.stats.to_dict() if response.stats is not None else {"block_size": 0}
    cached = f" ({s['prompt_cached']} from the prompt cache)" if s.get("prompt_cached") else ""
    first = f", first token after {s['prompt_time']:.2f} s" if s.get("prompt_time") else ""
    lines = [
        f"Prompt: {response.prompt_tokens} tokens{cached}, {response.prompt_tps:.1f} tokens/s{first}",
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens/s",
        f"Peak memory: {response.peak_memory:.3f} GB",
    ]
    if s["block_size"] > 1:
        histogram = s["accepted_length_histogram"]
        lines.append(f"Acceptance: tau {s['tau']:.2f} over {s['cycles']} cycles; histogram {histogram}")
        kind = f"adaptive, 1..{s['block_size']}" if s["adaptive"] else f"fixed {s['block_size']}"
        lines.append(f"Block size ({kind}): histogram {s['block_size_histogram']}")
        if any(s["trees"]):
            widths = ", ".join(f"{w}: {n}" for w, n in s["widths"].items())
            lines.append(f"Widths: {widths}; {s['drafted_tokens']} draft nodes verified")
        lines.append(f"Drafter cache: {s['draft_cache_tokens']} tokens, {s['draft_cache_bytes'] / 1e6:.1f} MB")
        if s["lookup_chains"]:
            lines.append(f"Prompt lookup: {s['lookup_chains']} chains verified its guess in place of the drafter's")
        if s["draft_time"]:
            lines.append(f"Time: draft {s['draft_time']:.2f}s, verify {s['verify_time']:.2f}s")
    return "\n".join(lines)
