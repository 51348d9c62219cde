"""The two runs that tests compare: mlx-lm's own greedy decoding (the reference every
lossless test checks against) and ours: the first tokens of our `generate_step` with its
stats, or every response of our `stream_generate`; mlx-lm's greedy text through its
`stream_generate` (`mlx_lm_greedy`). And mlx-lm's own sampling filters
(`mlx_lm_logprobs`), which the sampling tests' exact distributions are computed with."""

from __future__ import annotations

from contextlib import closing
from dataclasses import asdict
from typing import Any, Optional, Sequence

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx_lm.generate import generate_step as mlx_lm_generate_step
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from dflash_mlx.drafter import Drafter
from dflash_mlx.sampling import SamplingParams
from dflash_mlx.speculative import GenerationResponse, GenerationStats, generate_step, stream_generate


def greedy_reference(model: nn.Module, prompt: Sequence[int], n: int, **kw: Any) -> list[int]:
    """mlx-lm's own greedy decoding: the first `n` tokens of `mlx_lm.generate.generate_step`
    on `prompt`; `kw` go to it (`kv_bits`, `quantized_kv_start`, ...)."""
    steps = mlx_lm_generate_step(mx.array(prompt), model, max_tokens=n, **kw)
    return [int(token) for token, _ in steps]


def dflash_tokens(
    model: nn.Module,
    prompt: Sequence[int],
    drafter: Optional[Drafter],
    n: int,
    *,
    stats: Optional[GenerationStats] = None,
    sampling: Optional[SamplingParams] = None,
    whole_cycles: bool = False,
    **kw: Any,
) -> tuple[list[int], GenerationStats]:
    """The first `n` tokens of our `generate_step` on `prompt` and the run's `stats` (fresh
    ones unless given). `kw` go to `generate_step`, `max_tokens=n` unless given (None: no
    limit, so blocks do not shrink near `n`), and `sampling`'s fields as keywords.
    `whole_cycles`: every token of the cycles run, the last one's past `n` too."""
    stats = stats if stats is not None else GenerationStats()
    options = {"max_tokens": n, **(asdict(sampling) if sampling is not None else {}), **kw}
    tokens: list[int] = []
    with closing(generate_step(prompt, model, drafter, stats=stats, **options)) as steps:
        for committed, _, _ in steps:
            tokens += committed
            if len(tokens) >= n:
                break
    return (tokens if whole_cycles else tokens[:n]), stats


def target_alone(model: nn.Module, prompt: Sequence[int], n: int, sampling: SamplingParams) -> list[int]:
    """The target's own first `n` tokens for `prompt` with `sampling`: mlx-lm's greedy
    decoding, or our loop without a drafter where it samples (its draws, keyed by the seed
    and the position, are the ones a batch or a speculating sequence must reproduce)."""
    if sampling.greedy:
        return greedy_reference(model, prompt, n)
    return dflash_tokens(model, prompt, None, n, sampling=sampling)[0]


def ours(
    model: nn.Module, tokenizer: Any, prompt: Sequence[int], drafter: Optional[Drafter], **kw: Any
) -> tuple[list[int], list[GenerationResponse]]:
    """Our `stream_generate` on `prompt` (`kw` go to it): its tokens and its responses."""
    responses = list(stream_generate(model, tokenizer, prompt, drafter, **kw))
    return [r.token for r in responses], responses


def mlx_lm_logprobs(logprobs: mx.array, top_p: float, top_k: int) -> mx.array:
    """mlx-lm's `make_sampler` chain: top-p, then top-k."""
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    if top_k > 0:
        logprobs = apply_top_k(logprobs, top_k)
    return logprobs


def mlx_lm_greedy(default_model, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """mlx-lm's own greedy answer to `prompt` through `mlx_lm.stream_generate` on
    `default_model` (model, tokenizer): its text and how many tokens."""
    model, tokenizer = default_model
    out = list(mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens))
    return "".join(r.text for r in out), len(out)
