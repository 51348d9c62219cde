"""Draft trees in the decoding loop, on tiny random mlx-lm targets (float32):

* greedy output token-identical to mlx-lm's own greedy decoding with trees on (fixed
  budgets and the adaptive policy) on every family that gets trees, with a random
  drafter and with scripted drafters that put the right token at chosen ranks (so that
  walks go down second and third branches, to every depth);
* a tree policy's probe of the chain verifies the drafter's drafts, never prompt lookup's
  guess in their place, so the probe is reported to the policy;
* `tree_budget=0` is the chain exactly (same tokens, same cycles), and a sequence's turn
  with it leaves a policy that weighs trees again at the next `tree_budget=None`;
* hybrid gated-delta and sliding-window targets fall back to the chain, with no error;
* sampling at T = 1 with top-p through tree cycles: the first three tokens follow the
  target's own joint distribution (chi-square), with an oracle drafter whose trees hold
  the target's likely tokens;
* DFlash2 trees: candidates from the drafter's logits, the chain shown is the selector's.
"""

from __future__ import annotations

from dataclasses import fields

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache as make_target_cache

from dflash_mlx.policy import Width
from dflash_mlx.tree_policy import TreePolicy
from dflash_mlx.cycles import chain_shown
from dflash_mlx.drafter import Drafter, DrafterConfig
from dflash_mlx.drafter2 import Drafter2, Drafter2Config
from dflash_mlx.pair import Pair
from dflash_mlx.sampling import SamplingParams, filter_logprobs, log_softmax
from dflash_mlx.speculative import GenerationStats, generate_step
from dflash_mlx.target import Target
from dflash_mlx.targets import make_target
from chi_square import assert_fits
from references import dflash_tokens, greedy_reference
from tiny_drafters import BLOCK, drafter_config, prompt_of, random_drafter
from tiny_targets import VOCAB, tiny_target
from fixed_policies import rows_cost

TREE_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]


class RankedDrafter(Drafter):
    """Puts the true next token at rank `rank(cycle, k)` of block position k (0: first;
    None: nowhere near), below decoys: a chain accepts only rank-0 tokens, a tree also
    the others it holds."""

    def __init__(self, target: Target, truth: list[int], rank):
        super().__init__(drafter_config(target))
        self.truth, self.rank, self.cycle = truth, rank, 0

    def propose(self, block, cache, target):
        start, rows = cache[0].offset, []
        for k in range(1, block.shape[1]):
            true = self.truth[start + k] if start + k < len(self.truth) else 0
            r = self.rank(self.cycle, k)
            row = np.full(VOCAB, -8.0, dtype=np.float32)
            for j in range(3):  # decoys above the true token, then below it
                row[(true + 1 + j) % VOCAB] = 3.0 - j if r is not None and j < r else -1.0 - j
            if r is not None:
                row[true] = 3.0 - r
            rows.append(row)
        self.cycle += 1
        return mx.array(np.stack(rows))


RANKS = [
    lambda c, k: 0,
    lambda c, k: 1,
    lambda c, k: (c + k) % 3,
    lambda c, k: None if k == 3 else k % 2,
    lambda c, k: [0, 2, 1, 0, 1][(c * 7 + k) % 5],
]


@pytest.fixture(scope="module", params=TREE_FAMILIES)
def family(request):
    model = tiny_target(request.param, scale=2.0)
    return request.param, model, make_target(model)


def _kind(budget):
    """A fixed tree budget, or (None) the adaptive policy that weighs trees."""
    return {"tree_budget": budget} if budget is not None else {"policy": TreePolicy(BLOCK)}


@pytest.mark.parametrize("budget", [4, 16, None])
def test_greedy_with_trees_is_mlx_lm_greedy(family, budget):
    name, model, target = family
    accepted = set()
    for i, (length, n) in enumerate([(5, 28), (13, 24)]):
        prompt = prompt_of(length, i)
        ref = greedy_reference(model, prompt, n)
        got, stats = dflash_tokens(model, prompt, random_drafter(target, i), n, **_kind(budget))
        assert got == ref, (name, budget, "random")
        for rank in RANKS:
            drafter = RankedDrafter(target, prompt + ref + [0] * BLOCK, rank)
            got, stats = dflash_tokens(model, prompt, drafter, n, **_kind(budget))
            assert got == ref, (name, budget, length)
            if budget is not None:
                assert all(stats.trees) and max(stats.block_sizes) == budget + 1
            accepted.update(a for a, t in zip(stats.accepted_lengths, stats.trees) if t)
    assert accepted >= ({1, 2, BLOCK} if budget == 16 else {1, 2}), accepted


def test_the_default_policy_weighs_trees(family):
    """`tree_budget=None` with an adaptive block size: a `TreePolicy` (on every device: on a
    CPU it is measured as fast as the chain policy, BENCHMARKS.md), mlx-lm's greedy tokens;
    `make_policy` makes the same, or the chain policy with `trees=False`."""
    from dflash_mlx import speculative
    from dflash_mlx.policy import BlockSizePolicy

    name, model, target = family
    prompt = prompt_of(9, 4)
    ref = greedy_reference(model, prompt, 24)
    drafter = RankedDrafter(target, prompt + ref + [0] * BLOCK, RANKS[2])
    sequence = speculative.make_prompt_cache(model, drafter)
    assert dflash_tokens(model, prompt, drafter, 24, prompt_cache=sequence)[0] == ref, name
    assert type(Pair.of(model, drafter).policy) is TreePolicy is type(speculative.make_policy(model, drafter))
    assert type(speculative.make_policy(model, drafter, trees=False)) is BlockSizePolicy


class AlwaysTree(TreePolicy):
    """A tree of 8 nodes every cycle; keeps what the loop reports of each."""

    def __init__(self):
        super().__init__(BLOCK)
        self.reports: list[tuple[Width, int, tuple[int, int]]] = []

    def choose_width(self, limit=None) -> Width:
        return Width(9, True)

    def update_width(self, width, accepted, seconds, chain=None) -> None:
        self.reports.append((width, accepted, chain))


@pytest.mark.parametrize(
    "rank, chain",
    [
        (lambda c, k: 0, (BLOCK, BLOCK - 1)),  # the chain's drafts all right: all seen accepted
        (lambda c, k: 0 if k < 3 else 1, (4, 2)),  # its third draft is a decoy: a miss seen there
    ],
)
def test_a_tree_cycle_shows_the_chains_outcome(rank, chain):
    """Each tree cycle tells the policy what the chain's own drafts would have had accepted
    on the same tokens (the adaptive policy's chain estimates learn from it)."""
    model = tiny_target("llama", scale=2.0)
    target, prompt = make_target(model), prompt_of(6, 5)
    ref = greedy_reference(model, prompt, 40)
    policy = AlwaysTree()
    drafter = RankedDrafter(target, prompt + ref + [0] * BLOCK, rank)
    assert dflash_tokens(model, prompt, drafter, 40, policy=policy, lookup=0)[0] == ref  # the drafter's tree alone
    full = [(a, shown) for w, a, shown in policy.reports[:4]]  # far from max_tokens: full depth
    assert full and all(w.tree for w, _, _ in policy.reports)
    assert all(shown == chain and a >= chain[1] for a, shown in full), full


class ChainProbes(TreePolicy):
    """Probes the chain under a tree every cycle (what a `TreePolicy` does now and then
    while it chooses a tree), with drafts never expected to pass (so that prompt lookup's
    guess promises more); keeps the widths the loop reports."""

    def __init__(self):
        super().__init__(BLOCK, prior=0.0)
        self.reported: list[Width] = []

    def choose_width(self, limit=None) -> Width:
        chain = Width(min(BLOCK, limit or BLOCK))
        self.tree_probe = (chain, Width(9, True), 1.0)
        return chain

    def update_width(self, width, accepted, seconds, chain=None) -> None:
        self.reported.append(width)
        super().update_width(width, accepted, seconds, chain)


def test_a_probe_of_the_chain_is_not_replaced_by_prompt_lookup():
    model = tiny_target("llama", scale=2.0)
    prompt = prompt_of(5, 6) * 4  # prompt lookup finds what followed each repeat
    ref = greedy_reference(model, prompt, 16)
    policy = ChainProbes()
    got, stats = dflash_tokens(model, prompt, random_drafter(make_target(model)), 16, policy=policy)
    assert got == ref and stats.block_sizes
    assert stats.lookup_chains == 0 and len(policy.reported) == len(stats.block_sizes)


def test_tree_budget_zero_is_the_chain(family):
    name, model, target = family
    prompt = prompt_of(7, 3)
    ref = greedy_reference(model, prompt, 30)
    runs = [
        dflash_tokens(
            model, prompt, RankedDrafter(target, prompt + ref + [0] * BLOCK, RANKS[2]), 30, block_size=BLOCK, **kw
        )
        for kw in ({}, {"tree_budget": 0})
    ]
    assert runs[0][0] == runs[1][0] == ref
    assert runs[0][1].block_sizes == runs[1][1].block_sizes and not any(runs[1][1].trees)
    # a fixed block runs chains anyway: where a tree would be verified, tree_budget=0 verifies its chain
    drafter = RankedDrafter(target, prompt + ref + [0] * BLOCK, RANKS[2])
    got, stats = dflash_tokens(model, prompt, drafter, 30, policy=AlwaysTree(), tree_budget=0)
    assert got == ref and stats.block_sizes and not any(stats.trees)


class RowCostTreePolicy(TreePolicy):
    """The default policy charged a fixed cost per verified row (`rows_cost`) instead of the
    wall time, so that its choices on a tiny model follow the drafts, not the machine's load."""

    def update_width(self, width, accepted, seconds, chain=None) -> None:
        super().update_width(width, accepted, rows_cost(width), chain)


def test_trees_come_back_after_a_turn_without_them():
    """A chat's `/tree 0`, then `/tree auto`: the policy carried across the turns weighs
    trees again (and the turn without trees verifies the chain policy's chains, never a
    tree's)."""
    from dflash_mlx import speculative

    model = tiny_target("llama", scale=2.0)
    prompt = prompt_of(9, 4)
    ref = greedy_reference(model, prompt, 24)
    drafter = RankedDrafter(make_target(model), prompt + ref + [0] * BLOCK, RANKS[2])
    sequence, policy = speculative.make_prompt_cache(model, drafter), RowCostTreePolicy(BLOCK)
    for budget in (0, None, 0, None):
        got, stats = dflash_tokens(model, prompt, drafter, 24, prompt_cache=sequence, tree_budget=budget, policy=policy)
        assert got == ref and stats.block_sizes
        assert any(stats.trees) == (budget is None), budget
        assert budget is None or max(stats.block_sizes) <= BLOCK


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next", "gpt_oss", "llama_swa"])
def test_hybrid_and_sliding_targets_keep_the_chain(name):
    model = tiny_target(name, scale=2.0)
    target = make_target(model)
    prompt = prompt_of(11, 5)
    ref = greedy_reference(model, prompt, 20)
    for budget in (8, None):
        got, stats = dflash_tokens(
            model, prompt, RankedDrafter(target, prompt + ref + [0] * BLOCK, RANKS[2]), 20, **_kind(budget)
        )
        assert got == ref and not any(stats.trees) and stats.tree_budget is None


class OracleDrafter(Drafter):
    """Drafts from the target itself: position k gets the target's logits after the
    context, the root and the target's greedy tokens 1..k-1 (so a tree's first level holds
    the likely samples, and deeper levels the greedy path's). `memo` (tokens -> the target's
    logits after them) is shared by the runs of a test: the target is fixed, so a context
    seen before gets the same logits without a forward."""

    def __init__(self, model, target: Target, context: list[int], memo: dict):
        super().__init__(drafter_config(target))
        self.model, self.context, self.memo = model, context, memo

    def propose(self, block, cache, target):
        tokens, rows = self.context[: cache[0].offset] + [block[0, 0].item()], []
        for _ in range(block.shape[1] - 1):
            key = tuple(tokens)
            if key not in self.memo:
                self.memo[key] = self.model(mx.array(tokens)[None], make_target_cache(self.model))[0, -1]  # (V,)
            rows.append(self.memo[key])
            tokens.append(int(mx.argmax(rows[-1]).item()))
        return mx.stack(rows)


@pytest.mark.slow  # about half a minute: 1,200 generations
def test_sampling_through_trees_follows_the_target():
    """First three tokens at T = 1, top-p 0.9, every cycle a tree of 6 nodes: exactly
    plain sampling's p(t1) p(t2 | t1) p(t3 | t1 t2) (chi-square on the likely outcomes)."""
    model = tiny_target("qwen3", scale=2.0)
    target = make_target(model)
    prompt, temp, top_p, runs = prompt_of(6, 9), 1.0, 0.9, 1200

    def dist(tokens: list[int]) -> np.ndarray:
        logits = model(mx.array(prompt + tokens)[None], make_target_cache(model))[0, -1]
        return np.array(mx.softmax(filter_logprobs(log_softmax(logits), top_p) / temp, axis=-1))  # filters, then temp

    samples, through, memo = [], 0, {}
    for seed in range(runs):
        mx.random.seed(seed)
        context = list(prompt)
        drafter = OracleDrafter(model, target, context, memo)
        tokens, stats = [], GenerationStats()
        for committed, _, _ in generate_step(
            prompt, model, drafter, tree_budget=6, temp=temp, top_p=top_p, stats=stats
        ):
            tokens += committed
            context += committed
            if len(tokens) >= 3:
                break
        through += any(a >= 2 for a in stats.accepted_lengths)
        samples.append(tuple(tokens[:3]))
    first = dist([])
    exact = {}
    for a in np.flatnonzero(first > 0.02):
        second = dist([int(a)])
        for b in np.flatnonzero(second > 0.02):
            third = dist([int(a), int(b)])
            for c in np.flatnonzero(third > 0.02):
                exact[(int(a), int(b), int(c))] = first[a] * second[b] * third[c]
    assert_fits(samples, exact, "first three tokens through tree cycles")
    assert through > runs // 4  # walks accepted drafts in many runs


def dflash2_drafter(target: Target, seed: int = 0) -> Drafter2:
    """A random DFlash2 drafter that fits a tiny target (its selector ranks 8 candidates)."""
    base = drafter_config(target)
    mx.random.seed(seed)
    config = Drafter2Config(
        **{f.name: getattr(base, f.name) for f in fields(DrafterConfig)},
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=8,
    )
    drafter = Drafter2(config)
    mx.eval(drafter.parameters())
    return drafter


def test_dflash2_trees_use_the_selectors_candidates_and_path():
    """A DFlash2 tree's candidates are the top tokens of the drafter's logits (the set its
    selector ranks), and the chain a tree cycle shows the policy is the selector's own path
    (what a chain cycle verifies), not each position's argmax; output stays mlx-lm's."""
    model = tiny_target("llama", scale=2.0)
    drafter, prompt = dflash2_drafter(make_target(model)), prompt_of(6, 5)
    target = make_target(model, drafter.config.target_layer_ids)
    ref = greedy_reference(model, prompt, 12)
    policy = AlwaysTree()
    assert dflash_tokens(model, prompt, drafter, 12, policy=policy, lookup=0)[0] == ref
    # the first tree cycle, by hand: the drafter's context is the prompt's features
    cache = drafter.make_cache()
    drafter.append_context(target.forward(mx.array(prompt)[None], make_target_cache(model))[1], cache)
    block = mx.array([[ref[0]] + [drafter.config.mask_token_id] * (BLOCK - 1)])
    draws = SamplingParams().draws(len(prompt) + 1)
    logits, chain = drafter.candidates(block, cache, target, draws)
    assert chain.tolist() == drafter.draft(block, cache, target, draws).tolist()
    assert chain.tolist() != mx.argmax(logits, axis=-1).tolist()  # the selector's path, not the argmax
    top = mx.argpartition(-logits, 7, axis=-1)[:, :8].tolist()
    assert all(t in row for t, row in zip(chain.tolist(), top))  # its path runs through the candidates
    width, accepted, shown = policy.reports[0]
    assert shown == chain_shown(chain.tolist(), ref[1 : accepted + 2])
