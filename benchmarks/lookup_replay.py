"""Tokens committed per cycle by draft trees with prompt lookup, replayed along the target's
greedy answers (the shipped drafter, the 40 held-out prompts x 64 tokens, B = 8): no timing, so
it may run beside other jobs (~10 minutes on one core). The guess path may stop at the block
(B - 1 tokens deep) or go as deep as the tree's budget, as the loop's does.

    python -m benchmarks.lookup_replay   # from the repository root; answers cached in data/
"""

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

import collections
from pathlib import Path

import mlx.core as mx
import numpy as np

from dflash_mlx import load, load_draft
from dflash_mlx.cache import PromptCache
from dflash_mlx.acceptance import GuessRecord
from dflash_mlx.lookup import lookup
from dflash_mlx.messages import apply_chat_template, read_prompt_file
from dflash_mlx.targets import make_target
from dflash_mlx.train.replay import references
from dflash_mlx.tree import build_tree, top_candidates

BLOCK, TOKENS = 8, 64
SETTINGS = [(4, True), (8, False), (8, True), (16, False), (16, True)]  # (tree nodes, past the block)


def replay(drafter, target, ref, prompt: list[int], budget: int, deep: bool) -> float:
    """Tokens per cycle along one reference answer: each cycle builds the tree the loop would
    (drafter candidates plus the lookup's guess) and walks it by the target's own tokens."""
    cache = PromptCache(target.model, drafter).draft
    drafter.append_context(ref.features[:, : ref.prompt_len], cache)  # (1, P, k * hidden)
    n, produced, cycles, record = 0, 1, 0, GuessRecord()
    while produced < ref.length:
        depth = max(1, min(budget if deep else BLOCK - 1, TOKENS - produced))
        block = mx.array([[ref.tokens[n]] + [drafter.config.mask_token_id] * (BLOCK - 1)])  # (1, B)
        logprobs, ids = top_candidates(drafter.propose(block, cache, target)[: min(depth, BLOCK - 1)], budget)
        guess = lookup(prompt + ref.tokens[: n + 1], min(depth, budget))
        tree = build_tree(ref.tokens[n], np.array(logprobs), np.array(ids), budget, depth, guess, record.logprob)
        kids, node, accepted = tree.children(), 0, 0
        for token in ref.tokens[n + 1 : n + 1 + depth]:  # the greedy walk follows the target's tokens
            if token not in kids[node]:
                break
            node, accepted = kids[node][token], accepted + 1
        record.observe(guess, ref.tokens[n + 1 : n + 2 + accepted])
        drafter.append_context(ref.features[:, ref.prompt_len + n : ref.prompt_len + n + accepted + 1], cache)
        n, produced, cycles = n + accepted + 1, produced + accepted + 1, cycles + 1
    return n / cycles


def main() -> None:
    model, tokenizer = load()
    drafter = load_draft(None, model=model)
    prompts = read_prompt_file("assets/prompts/heldout.jsonl")
    layers = drafter.config.target_layer_ids
    answers = Path("data/heldout_answers_64.json")
    answers.parent.mkdir(exist_ok=True)
    refs = references(model, tokenizer, prompts, layers, max_tokens=TOKENS, block_size=BLOCK, answers=answers)
    target = make_target(model, layers)
    for budget, deep in SETTINGS:
        per_kind = collections.defaultdict(list)
        for ref, p in zip(refs, prompts):
            rate = replay(drafter, target, ref, apply_chat_template(tokenizer, p["messages"]), budget, deep)
            for key in (ref.kind, "all"):
                per_kind[key].append(rate)
        means = {kind: round(sum(v) / len(v), 2) for kind, v in sorted(per_kind.items())}
        print(budget, "past the block" if deep else "within the block", means, flush=True)


if __name__ == "__main__":
    main()
