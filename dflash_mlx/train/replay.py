"""Greedy tau without the target in the loop: a drafter replayed along the target's own answers.

Under greedy decoding the committed text is the target's greedy continuation whatever the
drafter proposes, and the drafter's context is the target's features of that text. Once a
prompt's continuation and its features are known (one plain decode and one forward, done
once: a `Reference`), a drafter's greedy tau on it needs only the drafter's own forwards: each
cycle drafts from the committed prefix and keeps the drafts that match the continuation. The
cycles are those of `stream_generate` with a fixed block (blocks shrink the same way near
`max_tokens`, and the cycle that reaches EOS counts whole), so the result is what `evaluate`
measures, up to float rounding of one long target forward against the loop's prefill and
verify forwards. That makes learning curves cheap: training measures held-out tau often.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx

from ..atomic import write_text_atomic
from ..cache import PromptCache
from ..drafter import Drafter
from ..messages import apply_chat_template, prompt_kind
from ..sampling import SamplingParams
from ..target import Target
from ..speculative import generate_step
from ..targets import make_target
from .evaluate import summarize


@dataclass(frozen=True)
class Reference:
    """A prompt's greedy answer by the target and the target's features along it."""

    kind: str
    prompt_len: int
    tokens: list[int]  # the first max_tokens + block_size greedy tokens (a stream yields the first `length`)
    length: int  # tokens a stream with this max_tokens yields (through the first EOS)
    features: mx.array  # (1, prompt_len + len(tokens), k * hidden)


def greedy_answers(
    model: Any, prompt_ids: Sequence[list[int]], n: int, answers: Optional[Path] = None
) -> list[list[int]]:
    """The target's first `n` greedy tokens after each prompt (EOS does not stop it), kept in
    the JSON file `answers` when given: made once, then read back for the same prompts."""
    key = [hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16] for ids in prompt_ids]
    if answers is not None and answers.is_file():
        saved = json.loads(answers.read_text())
        if saved.get("keys") == key and saved.get("tokens") == n:
            return saved["answers"]
    out = []
    for ids in prompt_ids:
        steps = generate_step(ids, model, None)
        out.append([committed[0] for committed, _, _ in itertools.islice(steps, n)])
        steps.close()
    if answers is not None:
        write_text_atomic(answers, json.dumps({"keys": key, "tokens": n, "answers": out}))
    return out


def references(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[dict],
    layer_ids: Sequence[int],
    *,
    max_tokens: int,
    block_size: int,
    answers: Optional[Path] = None,
) -> list[Reference]:
    """The target's greedy continuation of every prompt (chat template applied; kept in
    `answers`, see `greedy_answers`) and its features at `layer_ids`, for `replay_tau` with
    blocks of at most `block_size`."""
    target, eos, out = make_target(model, layer_ids), set(tokenizer.eos_token_ids), []
    prompt_ids = [apply_chat_template(tokenizer, p["messages"]) for p in prompts]
    for p, ids, tokens in zip(prompts, prompt_ids, greedy_answers(model, prompt_ids, max_tokens + block_size, answers)):
        out.append(reference(target, prompt_kind(p), ids, tokens, eos, max_tokens))
    return out


def reference(
    target: Target, kind: str, prompt: list[int], tokens: list[int], eos: set[int], max_tokens: int
) -> Reference:
    """The `Reference` of `prompt` answered by `tokens` (the target's own continuation): what a
    stream with `max_tokens` yields of them (through the first EOS), and the target's features."""
    length = min(max_tokens, len(tokens), next((i + 1 for i, t in enumerate(tokens) if t in eos), max_tokens))
    _, features = target.forward(
        mx.array(prompt + tokens)[None], PromptCache(target.model).target
    )  # (1, L, k * hidden)
    mx.eval(features)
    return Reference(kind, len(prompt), tokens, length, features)


def replay_lengths(drafter: Drafter, target: Target, ref: Reference, max_tokens: int, block_size: int) -> list[int]:
    """Tokens committed per cycle when `drafter` decodes `ref`'s prompt greedily with a
    fixed block of `block_size` (at most the size `ref` was made for)."""
    cache = PromptCache(target.model, drafter).draft
    drafter.append_context(ref.features[:, : ref.prompt_len], cache)
    mask, draws = drafter.config.mask_token_id, SamplingParams().draws(0)
    n, produced, lengths = 0, 1, []  # n: index in ref.tokens of the last committed token
    while produced < ref.length:
        size = max(2, min(block_size, max_tokens - produced))  # as `Plan.next` shrinks a fixed block
        block = mx.array([[ref.tokens[n]] + [mask] * (size - 1)])
        drafts = drafter.draft(block, cache, target, draws).tolist()
        truth = ref.tokens[n + 1 : n + size]
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, truth)) if d != t), len(truth))
        start = ref.prompt_len + n  # the features of [last token, accepted drafts] become context
        drafter.append_context(ref.features[:, start : start + accepted + 1], cache)
        lengths.append(accepted + 1)
        n, produced = n + accepted + 1, produced + accepted + 1
    return lengths


def replay_tau(
    drafter: Drafter, model: Any, refs: Sequence[Reference], *, max_tokens: int, block_size: int
) -> dict[str, dict]:
    """Greedy tau of `drafter` on `refs`, per prompt kind and "all", as `evaluate` reports it
    (with `prompts` and `tokens`; no speed: a replay does not decode)."""
    per: dict[str, list[list[int]]] = {}
    target = make_target(model, drafter.config.target_layer_ids)  # one adapter for every replay
    for ref in refs:
        lengths = replay_lengths(drafter, target, ref, max_tokens, block_size)
        for key in (ref.kind, "all"):
            per.setdefault(key, []).append(lengths)
    out = {}
    for key, runs in per.items():
        lengths = [n for run in runs for n in run]
        out[key] = {**summarize(lengths, block_size), "prompts": len(runs), "tokens": sum(lengths)}
    return out
