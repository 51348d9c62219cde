"""Draft trees (`dflash_mlx/tree.py`) piece by piece, on tiny random mlx-lm targets (float32):

* construction: the budget, the depth cap, best-first order, and the same nodes as a
  brute-force ranking of every path; tokens outside a draft vocabulary never enter;
* the ancestor mask and per-node positions: a tree verify gives every node the logits
  (and the captured features) of a plain forward of its root-to-node path, to 1e-5, on
  every family that gets trees (and a quantized target on the kernel path);
* compaction: after a walk to any node, the KV cache (plain or quantized) equals a fresh
  prefill of the committed tokens, and the next step sees the same thing;
* the walk: exact for sampling (chi-square at T = 1 with top-p, draws keyed by position);
* which targets get trees: the plain decoders; hybrid and sliding-window ones do not.
"""

from __future__ import annotations

import itertools
import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlx_lm.models.cache import make_prompt_cache as make_target_cache

from dflash_mlx.rollback import keep_rows
from dflash_mlx.sampling import SamplingParams, filter_logprobs, log_softmax
from dflash_mlx.target import Target
from dflash_mlx.targets import make_target
from dflash_mlx.tree import DeviceTree, Tree, build_tree, grow_tree, top_candidates, walk
from chi_square import assert_fits
from tiny_drafters import random_candidates
from tiny_targets import VOCAB, tiny_target

TREE_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"]
PROMPT = [3, 17, 29, 41, 5, 60, 77, 8, 99]


def all_paths(lp: np.ndarray, max_depth: int) -> list[float]:
    """The score of every path (ranks r1..rd, d <= max_depth), by brute force."""
    return [
        sum(lp[d, r] for d, r in enumerate(ranks))
        for d in range(1, max_depth + 1)
        for ranks in itertools.product(range(lp.shape[1]), repeat=d)
    ]


@pytest.mark.parametrize("budget,max_depth", [(1, 4), (3, 1), (7, 2), (20, 4), (1000, 3)])
def test_build_tree_takes_the_most_likely_paths_best_first(budget, max_depth):
    lp, ids = random_candidates(4, 4, seed=budget + max_depth)
    tree = build_tree(11, lp, ids, budget, max_depth)
    paths = sorted(all_paths(lp, max_depth), reverse=True)
    assert tree.size == min(budget, len(paths)) and tree.tokens[0] == 11 and tree.parents[0] == -1
    assert max(tree.depths) <= max_depth
    nodes = range(1, tree.size + 1)
    assert all(tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in nodes)
    assert all(a >= b for a, b in zip(tree.scores[1:], tree.scores[2:]))  # best first
    np.testing.assert_allclose(tree.scores[1:], paths[: tree.size], rtol=1e-6)  # the top paths
    for i in range(1, tree.size + 1):  # each node: its parent's path plus one candidate of its depth
        d = tree.depths[i] - 1
        rank = list(ids[d]).index(tree.tokens[i])
        assert abs(tree.scores[i] - tree.scores[tree.parents[i]] - lp[d, rank]) < 1e-6
    siblings = [(tree.parents[i], tree.tokens[i]) for i in range(1, tree.size + 1)]
    assert len(set(siblings)) == len(siblings)  # no token twice below one parent


def test_tokens_outside_the_draft_vocabulary_never_enter():
    allowed = mx.array([5, 9, 200])
    logits = mx.full((3, VOCAB), -mx.inf)
    logits[:, allowed] = mx.array([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0], [2.0, 2.0, 2.0]])
    lp, ids = top_candidates(logits, 8)
    assert ids.shape == (3, 8) and np.all(np.diff(np.array(lp)[:, :3], axis=1) <= 0) and np.isinf(lp[:, 3:]).all()
    assert set(np.array(ids)[:, :3].ravel()) == {5, 9, 200}
    assert np.array(ids)[0, :3].tolist() == [9, 5, 200]
    tree = build_tree(1, np.array(lp), np.array(ids), 100, 3)
    assert tree.size == 3 + 9 + 27 and set(tree.tokens[1:]) == {5, 9, 200}


def hand_tree() -> Tree:
    """root -> a(1) -> c(3); root -> b(2) -> d(4) -> e(5)."""
    return Tree(
        tokens=[50, 1, 2, 3, 4, 5],
        parents=[-1, 0, 0, 1, 2, 4],
        depths=[0, 1, 1, 2, 2, 3],
        scores=[0.0, -0.1, -0.2, -0.3, -0.4, -0.5],
    )


def test_mask_positions_and_walk_of_a_hand_tree():
    tree = hand_tree()
    mask = np.array(tree.ancestor_mask(3))
    assert mask.shape == (6, 9) and mask[:, :3].all()
    want = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 4, 5]]
    assert [np.flatnonzero(row[3:]).tolist() for row in mask] == want
    assert np.array(tree.positions(3)).tolist() == [3, 4, 4, 5, 5, 6]
    assert tree.path(5) == [2, 4, 5] and tree.path(0) == []
    # choices[i]: the target's token after node i
    assert walk(tree, [2, 0, 4, 0, 5, 77]) == ([2, 4, 5], 77)  # down to the leaf, then its own token
    assert walk(tree, [1, 9, 0, 0, 0, 0]) == ([1], 9)
    assert walk(tree, [8, 3, 4, 0, 0, 0]) == ([], 8)


def _paths(tokens: list, parents: list, live: list) -> set:
    """Every live node's root-to-node tokens."""
    out = set()
    for i in range(1, len(tokens)):
        node, path = i, []
        while live[i] and node > 0:
            path.append(tokens[node])
            node = parents[node]
        out |= {tuple(reversed(path))} if live[i] else set()
    return out


@pytest.mark.parametrize("seed", range(24))
def test_grow_tree_grows_build_trees_tree_on_the_device(seed):
    """The loop's tree (`grow_tree`, no read) holds exactly the paths of `build_tree`'s,
    prompt lookup's guess among them (also where it shares tokens with the candidates),
    parents before children."""
    rng = np.random.default_rng(seed)
    lp, ids = random_candidates(int(rng.integers(1, 6)), int(rng.integers(1, 6)), seed)
    budget, depth = int(rng.integers(1, 20)), int(rng.integers(1, 7))
    guess = [] if seed % 3 == 0 else rng.integers(0, 50, size=int(rng.integers(1, 8))).tolist()
    if seed % 3 == 2:
        guess = [int(ids[i % ids.shape[0], 0]) for i in range(len(guess))]
    g = float(rng.uniform(-3, -0.01))
    want = build_tree(11, lp, ids, budget, depth, guess, g)
    got = grow_tree(11, mx.array(lp.tolist()), mx.array(ids.tolist()), budget, depth, guess, g)
    tokens, parents, live = got.tokens.tolist(), got.parents.tolist(), got.live.tolist()
    assert _paths(tokens, parents, live) == _paths(want.tokens, want.parents, [True] * len(want.tokens))
    assert sum(live[1:]) == want.size and tokens[0] == 11
    assert all(parents[i] < i for i in range(1, len(tokens)) if live[i])


def test_the_device_mask_and_walk_of_a_hand_tree():
    t = hand_tree()
    tree = DeviceTree(mx.array(t.tokens), mx.array([0] + t.parents[1:]), mx.array(t.depths), mx.ones(6, mx.bool_), 3)
    assert np.array_equal(np.array(tree.ancestor_mask(3)), np.array(t.ancestor_mask(3)))
    for choices in ([2, 0, 4, 0, 5, 77], [1, 9, 0, 0, 0, 0], [8, 3, 4, 0, 0, 0]):
        path, accepted, bonus = tree.walk(mx.array(choices))
        assert (path.tolist()[: accepted.item()], bonus.item()) == walk(t, choices)


def prefilled(model, target: Target, cache=None):
    cache = cache if cache is not None else make_target_cache(model)
    target.forward(mx.array(PROMPT)[None], cache, capture=False)
    return cache


def a_tree(seed: int = 0, budget: int = 12) -> Tree:
    lp, ids = random_candidates(5, 4, seed)
    return build_tree(7, lp, ids, budget, 5)


def verify(target: Target, cache, tree: Tree) -> tuple[mx.array, mx.array]:
    """The tree's logits (n + 1, V) and features (n + 1, k * hidden) (None without capture layers)."""
    start = cache[0].offset
    hidden, features = target.tree_forward(
        mx.array(tree.tokens)[None], cache, tree.positions(start), tree.ancestor_mask(start)
    )
    return target.lm_head(hidden)[0], None if features is None else features[0]


def quantized_qwen3():
    model = tiny_target("qwen3", scale=2.0)
    nn.quantize(model, group_size=64, bits=4)
    return model


@pytest.mark.parametrize("family", TREE_FAMILIES + ["qwen3_q4_kernels"])
def test_tree_verify_equals_a_plain_forward_of_each_path(family):
    """Node i's logits and features equal those of the last token of a plain forward
    (the model's own call, a fresh cache) over prompt + root + the path to node i."""
    model = quantized_qwen3() if family == "qwen3_q4_kernels" else tiny_target(family, scale=2.0)
    target = make_target(model, [0, 1])
    target.use_kernels(family.endswith("kernels"))
    assert target.kernels == family.endswith("kernels")
    tree = a_tree()
    logits, features = verify(target, prefilled(model, target), tree)
    assert logits.shape == (tree.size + 1, VOCAB) and features.shape[0] == tree.size + 1
    for i in range(tree.size + 1):
        tokens = mx.array(PROMPT + [tree.tokens[j] for j in [0] + tree.path(i)])[None]
        want = model(tokens, make_target_cache(model))[0, -1]
        np.testing.assert_allclose(np.array(logits[i]), np.array(want), atol=1e-5, rtol=1e-5)
        hidden, want_features = make_target(model, [0, 1]).forward(tokens, make_target_cache(model))
        np.testing.assert_allclose(np.array(features[i]), np.array(want_features[0, -1]), atol=1e-5, rtol=1e-5)


def cache_rows(c) -> list[np.ndarray]:
    """A KV cache's live rows (each packed array of a quantized one)."""
    packed = (*c.keys, *c.values) if isinstance(c, QuantizedKVCache) else (c.keys, c.values)
    return [np.array(a[..., : c.offset, :]) for a in packed]


@pytest.mark.parametrize("family", TREE_FAMILIES)
def test_compaction_leaves_what_a_fresh_prefill_of_the_path_leaves(family):
    model = tiny_target(family)
    target = make_target(model)
    tree = a_tree(seed=1)
    for node in range(tree.size + 1):  # a walk that accepted the path to `node`
        cache = prefilled(model, target)
        verify(target, cache, tree)
        rows = [0] + tree.path(node)
        keep_rows(cache, len(PROMPT), rows)
        fresh = make_target_cache(model)
        target.forward(mx.array(PROMPT + [tree.tokens[j] for j in rows])[None], fresh, capture=False)
        for got, want in zip(cache, fresh):
            assert got.offset == want.offset == len(PROMPT) + len(rows)
            for a, b in zip(cache_rows(got), cache_rows(want)):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
        for step in ([9], [4, 6, 8]):  # and the next forwards see the same thing
            a = target.lm_head(target.forward(mx.array(step)[None], cache, capture=False)[0])
            b = target.lm_head(target.forward(mx.array(step)[None], fresh, capture=False)[0])
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["plain", "quantized"])
def test_keep_rows_gathers_exactly(kind):
    """Rows written in tree order, compacted: exactly the cache that was given the kept rows alone."""
    make = (lambda: QuantizedKVCache(group_size=32, bits=4)) if kind == "quantized" else KVCache
    rng = np.random.default_rng(0)
    prefix = mx.array(rng.normal(size=(1, 2, 5, 64)).astype(np.float32))
    rows = mx.array(rng.normal(size=(1, 2, 9, 64)).astype(np.float32))
    for keep in ([0], [0, 1, 2], [0, 2, 5, 8], [0, 3, 4]):
        got, want = make(), make()
        for c in (got, want):
            c.update_and_fetch(prefix, prefix * 2)
        got.update_and_fetch(rows, rows * 2)
        keep_rows([got], 5, keep)
        kept = rows[:, :, mx.array(keep)]
        want.update_and_fetch(kept, kept * 2)
        assert got.offset == want.offset == 5 + len(keep)
        for a, b in zip(cache_rows(got), cache_rows(want)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "family,trees",
    [
        ("llama", True),
        ("mistral", True),
        ("qwen2", True),
        ("qwen3", True),
        ("qwen3_moe", True),
        ("qwen3_5", False),
        ("qwen3_next", False),
        ("gpt_oss", False),
        ("gemma4_text", False),
        ("llama_swa", False),
    ],
)
def test_which_targets_get_trees(family, trees):
    model = tiny_target(family)
    assert make_target(model).supports_trees(make_target_cache(model)) == trees


def test_walk_with_keyed_draws_commits_the_target_distribution():
    """A small vocabulary, a target whose next-token distribution depends on the whole
    path, a fixed tree over its likely tokens, the target's choices drawn as the loop draws
    them (`SamplingParams.draws`, each node's row at the position of its depth): the first
    two committed tokens follow p(t1) p(t2 | t1) of the filtered target (chi-square),
    whatever the tree holds."""
    V, temp, top_p = 6, 1.0, 0.9
    table = np.random.default_rng(3).normal(size=(V + 1, V + 1, V)).astype(np.float32) * 1.5

    def logits_after(path: list[int]) -> np.ndarray:  # the target's logits after root + path
        return table[(path + [V, V])[0], (path + [V, V])[1] if len(path) > 1 else V]

    def probs(path):
        return np.array(mx.softmax(filter_logprobs(log_softmax(mx.array(logits_after(path))), top_p) / temp))

    # below each node its target's most likely tokens: 3 at depth 1, 2 at depth 2, 1 at depth 3
    tokens, parents, depths = [9], [-1], [0]
    for parent in itertools.count():
        if parent == len(tokens) or depths[parent] == 3:
            break
        path = [tokens[j] for j in Tree(tokens, parents, depths, [0.0] * len(tokens)).path(parent)]
        for token in np.argsort(-probs(path))[: 3 - depths[parent]]:
            tokens, parents, depths = tokens + [int(token)], parents + [parent], depths + [depths[parent] + 1]
    tree = Tree(tokens, parents, depths, [0.0] * len(tokens))
    node_logits = mx.array(
        np.stack([logits_after([tree.tokens[j] for j in tree.path(i)]) for i in range(len(tree.tokens))])
    )
    samples, deep = [], 0
    for seed in range(3000):
        draws = SamplingParams(temp=temp, top_p=top_p, seed=seed).draws(21)  # the root's position: 21
        path, bonus = walk(tree, draws.choose(node_logits, tree.depths).tolist())
        committed = [tree.tokens[i] for i in path] + [bonus]
        deep += len(path) >= 2
        if len(committed) == 1:  # the second token comes from the next cycle, after t1
            committed.append(int(draws.choose(mx.array(logits_after(committed))[None], [1]).item()))
        samples.append(tuple(committed[:2]))
    exact = {(a, b): probs([])[a] * probs([a])[b] for a in range(V) for b in range(V)}
    assert_fits(samples, exact, "first two tokens of a tree walk", impossible=lambda s: exact[s] == 0)
    assert 100 < deep < 2900  # walks of every length ran
