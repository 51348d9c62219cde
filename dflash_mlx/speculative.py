"""The DFlash decoding loop, layered like mlx-lm: `generate_step -> stream_generate -> generate`.

One cycle: the drafter fills [last token, MASK x (B-1)] in one forward; the target
verifies the whole block in one forward; the longest agreeing prefix is kept, plus one
token of the target's own; the target cache is trimmed back to the committed length and
the committed tokens' features become new drafter context. One host sync per cycle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache as make_target_cache
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .drafter import Drafter, check_fit
from .sampling import greedy_accept, log_softmax, probabilities, sample, speculative_accept
from .target import Target

PREFILL_STEP = 2048


@dataclass
class GenerationStats:
    """Live statistics of one generation (updated in place as it runs)."""

    block_size: int = 0
    cycles: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed per cycle
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
        counts = [0] * max(self.block_size, max(self.accepted_lengths, default=0))
        for n in self.accepted_lengths:
            counts[n - 1] += 1
        return counts

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generation_time if self.generation_time else 0.0


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


class PromptCache:
    """The target's KV cache, the drafter's context cache, and the tokens they hold.

    Pass the same object to successive `stream_generate` calls with the whole
    conversation as the prompt: only the part after the longest common prefix is
    prefilled."""

    def __init__(self, model: nn.Module, draft_model: Optional[Drafter] = None):
        self.target = make_target_cache(model)
        if not can_trim_prompt_cache(self.target):
            raise ValueError("this model's cache cannot be trimmed, which speculative decoding needs")
        self.tokens: list[int] = []  # what the target cache holds
        self.drafter: Optional[Drafter] = None
        self.draft: Optional[list] = None
        self.use_drafter(draft_model)

    def use_drafter(self, draft_model: Optional[Drafter]) -> None:
        if draft_model is not None and draft_model is not self.drafter:
            self.drafter, self.draft = draft_model, draft_model.make_cache()

    @property
    def draft_length(self) -> int:
        return self.draft[0].offset if self.draft else 0

    def reuse(self, prompt: Sequence[int], with_drafter: bool) -> int:
        """Trim to the longest prefix shared with `prompt` (keeping at least one prompt
        token to prefill) and return its length."""
        keep = 0
        for a, b in zip(self.tokens, prompt[:-1]):
            if a != b:
                break
            keep += 1
        if with_drafter:
            keep = min(keep, self.draft_length)
        trim_prompt_cache(self.target, len(self.tokens) - keep)
        self.tokens = self.tokens[:keep]
        if self.draft and self.draft_length > keep:
            trim_prompt_cache(self.draft, self.draft_length - keep)
        return keep


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
) -> Generator[tuple[list[int], int, list[mx.array]], None, None]:
    """Yield, per cycle, the committed tokens, how many of them are accepted drafts
    (they come first), and the target's log-probabilities for each. With `max_tokens`,
    blocks shrink near the end so nothing past it is verified. Runs forever: the
    caller stops. With `draft_model=None` the target decodes alone, one token a cycle."""
    _check_args(prompt, block_size, temp)
    block_size = (block_size or draft_model.config.block_size) if draft_model else 1
    stats = stats if stats is not None else GenerationStats()
    stats.block_size = block_size
    target = Target(model, draft_model.config.target_layer_ids if draft_model else ())
    if draft_model is not None:
        check_fit(draft_model.config, num_layers=target.num_layers,
                  hidden_size=target.hidden_size, vocab_size=target.vocab_size)
    cache = prompt_cache if prompt_cache is not None else PromptCache(model, draft_model)
    cache.use_drafter(draft_model)

    def distribution(logits: mx.array) -> mx.array:
        return probabilities(logits, temp, top_p, top_k)

    def choose(logits: mx.array) -> mx.array:
        return mx.argmax(logits, axis=-1) if temp == 0 else sample(distribution(logits))

    # Prefill, feeding the captured features straight into the drafter's context.
    tic = time.perf_counter()
    start = stats.prompt_cached = cache.reuse(prompt, with_drafter=draft_model is not None)
    todo = list(prompt[start:])
    for i in range(0, len(todo), PREFILL_STEP):
        chunk = todo[i : i + PREFILL_STEP]
        hidden, features = target.forward(mx.array(chunk)[None], cache.target, capture=draft_model is not None)
        if draft_model is not None:
            draft_model.append_context(features, cache.draft)
        cache.tokens += chunk
        mx.eval([c.state for c in cache.target] + ([c.keys for c in cache.draft] if cache.draft else []))
        if prompt_progress_callback:
            prompt_progress_callback(start + i + len(chunk), len(prompt))
    logits = target.lm_head(hidden[:, -1])[0]
    token = choose(logits).item()
    stats.prompt_time = time.perf_counter() - tic
    yield [token], 0, [log_softmax(logits)]

    if draft_model is None:
        while True:
            tic = time.perf_counter()
            hidden, _ = target.forward(mx.array([[token]]), cache.target, capture=False)
            cache.tokens.append(token)
            logits = target.lm_head(hidden)[0, -1]
            token = choose(logits).item()
            stats.verify_time += time.perf_counter() - tic
            stats.cycles += 1
            stats.accepted_lengths.append(1)
            yield [token], 0, [log_softmax(logits)]

    mask_id = draft_model.config.mask_token_id
    produced = 1
    while True:
        tic = time.perf_counter()
        size = block_size if max_tokens is None else max(2, min(block_size, max_tokens - produced))
        block = mx.array([[token] + [mask_id] * (size - 1)])
        draft_logits = draft_model.propose(block, cache.draft, target)
        if temp == 0:
            drafts = mx.argmax(draft_logits, axis=-1)
        else:
            draft_probs = distribution(draft_logits)
            drafts = sample(draft_probs)
        if profile:
            mx.eval(drafts)
            stats.draft_time += time.perf_counter() - tic
            tic = time.perf_counter()
        else:
            mx.async_eval(drafts)  # drafting runs while the verify graph is built
        hidden, features = target.forward(mx.concatenate([block[0, :1], drafts])[None], cache.target)
        logits = target.lm_head(hidden)[0]
        if temp == 0:
            accepted, bonus = greedy_accept(drafts, logits)
        else:
            accepted, bonus = speculative_accept(drafts, draft_probs, distribution(logits))
        *drafted, accepted, bonus = mx.concatenate([drafts, accepted[None], bonus[None]]).tolist()
        # Keep [token, accepted drafts] in the target cache; their features become context.
        trim_prompt_cache(cache.target, size - accepted - 1)
        cache.tokens += [token] + drafted[:accepted]
        draft_model.append_context(features[:, : accepted + 1], cache.draft)
        stats.verify_time += time.perf_counter() - tic  # includes drafting unless profiling
        stats.cycles += 1
        stats.accepted_lengths.append(accepted + 1)
        stats.drafted_tokens += size - 1
        stats.accepted_drafted_tokens += accepted
        token = bonus
        produced += accepted + 1
        logprobs = log_softmax(logits[: accepted + 1])
        yield drafted[:accepted] + [bonus], accepted, list(logprobs)


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
) -> Generator[GenerationResponse, None, None]:
    """Generate with DFlash speculative decoding, one `GenerationResponse` per token.

    `draft_model=None` decodes with the target alone. The last response has a
    `finish_reason` ("stop" for EOS or a stop string, "length" at max_tokens); every
    response's `stats` holds tau, the accepted-length histogram, timings and tokens/s.
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
    steps = generate_step(tokens, model, draft_model, block_size=block_size, max_tokens=max_tokens,
                          temp=temp, top_p=top_p,
                          top_k=top_k, prompt_cache=prompt_cache, stats=stats, profile=profile,
                          prompt_progress_callback=prompt_progress_callback)
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
                yield GenerationResponse(
                    text=text, token=token, logprobs=lp, from_draft=i < n_drafted,
                    prompt_tokens=len(tokens),
                    prompt_tps=(len(tokens) - stats.prompt_cached) / stats.prompt_time if stats.prompt_time else 0.0,
                    generation_tokens=n, generation_tps=stats.tokens_per_second,
                    peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish, stats=stats)
                if finish:
                    return
    finally:
        steps.close()


def generate(model: nn.Module, tokenizer, prompt: Union[str, Sequence[int]], draft_model: Optional[Drafter] = None,
             verbose: bool = False, **kwargs) -> str:
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
    if s is not None and s.drafted_tokens:
        lines.append(f"Acceptance: tau {s.mean_acceptance:.2f} over {s.cycles} cycles (block {s.block_size}); "
                     f"histogram {s.histogram}")
        if s.draft_time:
            lines.append(f"Time: draft {s.draft_time:.2f}s, verify {s.verify_time:.2f}s")
    return "\n".join(lines)
