"""Draft trees (DDTree, Ringel and Romano, arXiv 2604.12989): several guesses per position,
verified in one target forward.

A DFlash drafter gives a distribution for every block position in one forward, but a
chain verifies only each position's argmax, so one wrong guess ends the cycle. A tree
keeps the next most likely tokens too. The drafter predicts each position on its own,
so a path's draft probability is the product of its tokens' per-position probabilities;
a path's prefixes are at least as likely as the path, so the n most likely paths form a
tree, and a heap finds them best-first from each position's top candidates (`build_tree`).

The target sees root + nodes in one forward: each node attends to the prefix and to its
own ancestors (`Tree.ancestor_mask`), at RoPE position prefix + depth
(`Tree.positions`). The walk (`walk`) then follows the target's own rule: at the current
node take the target's token (argmax, or `sampling.Draws`' choice: a sample whose noise is
keyed by the position it fills, prefix + depth + 1); move to the child holding it, else
commit it as the next root. Each node's draw depends on nothing but its own logits and
its position, so the committed tokens are exactly what the target alone would have
chosen with the same seed: no rejection residuals are needed.

Layout: node 0 is the root (the last committed token, depth 0); nodes 1..n follow in
best-first order, so every parent comes before its children (parents[i] < i).

The decoding loop grows its trees on the device (`grow_tree` -> `DeviceTree`: a beam per
depth, then the best of all depths, walked there too), so that a tree cycle reads the host
once, after the walk. `build_tree` and `walk` are the same tree and walk on the host, the
definition the device's are tested against (and what offline replays use).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from .sampling import log_softmax
from .topk import top_k_columns


@dataclass(frozen=True)
class Tree:
    """A draft tree in best-first layout: node 0 the root, parents[i] < i for i >= 1."""

    tokens: list[int]  # (n + 1,) token of each node
    parents: list[int]  # (n + 1,) parent index; -1 for the root
    depths: list[int]  # (n + 1,) 0 for the root
    scores: list[float]  # (n + 1,) draft log-probability of the path to each node (0 at the root)

    @property
    def size(self) -> int:
        """Draft nodes below the root."""
        return len(self.tokens) - 1

    def children(self) -> list[dict[int, int]]:
        """children()[i][token] = the child of node i that holds `token`."""
        kids: list[dict[int, int]] = [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]][self.tokens[i]] = i
        return kids

    def ancestors(self) -> np.ndarray:
        """(n + 1, n + 1) bool: [i, j] when node j is node i or one of its ancestors."""
        m = len(self.tokens)
        out = np.zeros((m, m), dtype=bool)
        for i in range(m):
            if i:
                out[i] = out[self.parents[i]]  # parents come first: that row is done
            out[i, i] = True
        return out

    def ancestor_mask(self, prefix: int) -> mx.array:
        """(n + 1, prefix + n + 1) bool: every node sees the `prefix` cached tokens and its
        own ancestors (itself included) among root + nodes."""
        m = len(self.tokens)
        return mx.array(np.concatenate([np.ones((m, prefix), dtype=bool), self.ancestors()], axis=1))

    def positions(self, prefix: int) -> mx.array:
        """(n + 1,) int32 RoPE position of each node: prefix + depth."""
        return mx.array(self.depths, dtype=mx.int32) + prefix

    def path(self, node: int) -> list[int]:
        """The nodes from the root's first child down to `node` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def top_candidates(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Each row's k most likely tokens, most likely first: (log-probabilities (D, k),
    token ids (D, k)) of draft logits (D, V). Tokens at -inf (outside a draft
    vocabulary) come last and are never put in a tree."""
    k = min(k, logits.shape[-1])
    logprobs = log_softmax(logits)
    ids = top_k_columns(logprobs, k)
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return mx.take_along_axis(values, order, axis=-1), mx.take_along_axis(ids, order, axis=-1)


def build_tree(
    root: int,
    logprobs: np.ndarray,
    ids: np.ndarray,
    budget: int,
    max_depth: int,
    guess: Sequence[int] = (),
    guess_logprob: float = math.log(0.5),
) -> Tree:
    """The `budget` most likely draft paths as a tree below `root`, best first.

    logprobs, ids (D, K): each depth's candidates, most likely first (`top_candidates`);
    depth d + 1 of the tree uses row d, down to min(max_depth, D). A node's
    first child (rank 0 at the next depth) and its next sibling (the next rank at its
    depth) are the only nodes that can come next after it, so the heap holds at most
    two entries per node taken, and nodes come out in non-increasing score (a child
    or a later sibling is never more likely). Ties go to the entry pushed first.

    `guess`: one more path below the root (prompt lookup's, `lookup.py`), down to
    min(max_depth, len(guess)) (below the candidates' rows too), each token scored
    `guess_logprob`, so that it competes with the candidates: it goes deep where
    the drafter is unsure and yields where the drafter is confident. A node's score is its
    parent's plus the better of its two readings (its candidate log-probability; the
    guess's, on the guess path), so a token both hold is one node, and candidates go on
    below guessed nodes too."""
    rows = min(max_depth, logprobs.shape[0])  # the candidates' depth; the guess may go deeper
    tokens, parents, depths, scores = [root], [-1], [0], [0.0]
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    count = itertools.count()  # tie-break: the entry pushed first
    # (-score, order, depth row, rank (-1: the guess), parent, parent score)
    heap: list[tuple[float, int, int, int, int, float]] = []

    def push(row: int, rank: int, parent: int, base: float) -> None:
        if rank < 0 and row < min(max_depth, len(guess)):
            heapq.heappush(heap, (-(base + guess_logprob), next(count), row, rank, parent, base))
        elif 0 <= rank < ids.shape[1] and row < rows and np.isfinite(logprobs[row, rank]):
            heapq.heappush(heap, (-(base + float(logprobs[row, rank])), next(count), row, rank, parent, base))

    push(0, 0, 0, 0.0)
    push(0, -1, 0, 0.0)
    while heap and len(tokens) <= budget:
        neg, _, row, rank, parent, base = heapq.heappop(heap)
        token = int(guess[row] if rank < 0 else ids[row, rank])
        node = node_of.get((parent, token))
        if node is None:  # else: a node the guess and a candidate share, placed by the better
            node = node_of[parent, token] = len(tokens)
            tokens.append(token)
            parents.append(parent)
            depths.append(row + 1)
            scores.append(-neg)
            push(row + 1, 0, node, -neg)  # its first child
        if rank < 0:
            push(row + 1, -1, node, scores[node])  # the guess goes on, from its node's best score
        else:
            push(row, rank + 1, parent, base)  # a candidate's next sibling
    return Tree(tokens, parents, depths, scores)


def walk(tree: Tree, choices: list[int]) -> tuple[list[int], int]:
    """Follow the target's choices down the tree. choices[i]: the target's token after
    node i. Returns (the accepted nodes below the root, in order; the target's token
    after the last of them: the next root)."""
    kids = tree.children()
    node, path = 0, []
    while True:
        token = choices[node]
        child = kids[node].get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child


@dataclass(frozen=True)
class DeviceTree:
    """A draft tree held on the device (`grow_tree`): root + `n` node slots in best-first
    order (parents before children), lazy arrays all. A slot whose score is -inf (fewer
    candidates than the budget, e.g. a draft vocabulary's edge) is dead: verified like the
    others, never walked into."""

    tokens: mx.array  # (n + 1,) int32
    parents: mx.array  # (n + 1,) int32; 0 for the root (its own parent)
    depths: mx.array  # (n + 1,) int32; 0 for the root
    live: mx.array  # (n + 1,) bool
    depth: int  # the deepest a node may be (a host bound)

    @property
    def size(self) -> int:
        """Node slots below the root."""
        return self.tokens.shape[0] - 1

    def ancestor_mask(self, prefix: int) -> mx.array:
        """(n + 1, prefix + n + 1) bool: every node sees the `prefix` cached tokens and its
        own ancestors (itself included) among root + nodes."""
        m = self.tokens.shape[0]
        slots = mx.arange(m)
        mask, node = slots[:, None] == slots[None], slots
        for _ in range(self.depth):  # climb one generation at a time
            node = self.parents[node]
            mask = mask | (slots[None] == node[:, None])
        return mx.concatenate([mx.ones((m, prefix), dtype=mx.bool_), mask], axis=1)

    def positions(self, prefix: int) -> mx.array:
        """(n + 1,) int32 RoPE position of each node: prefix + depth."""
        return self.depths + prefix

    def walk(self, choices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Follow the target's choices (n + 1,) (choices[i]: its token after node i) down
        the tree: (the accepted nodes (depth,), -1 past the last; how many; the target's
        token after the last: the next root), lazily."""
        m = self.tokens.shape[0]
        child = (self.parents[None] == mx.arange(m)[:, None]) & (self.tokens[None] == choices[:, None])
        child = child & self.live[None] & (mx.arange(m)[None] > 0)  # (m, m): node j holds i's choice
        step = mx.where(child.any(axis=1), mx.argmax(child, axis=1).astype(mx.int32), -1)  # (m,)
        node, going, path = mx.array(0), mx.array(True), []
        for _ in range(self.depth):
            ahead = step[node]
            going = going & (ahead >= 0)
            node = mx.where(going, ahead, node)
            path.append(mx.where(going, node, -1))
        path = mx.stack(path) if path else mx.zeros((0,), dtype=mx.int32)
        return path, (path >= 0).sum(), choices[node]


def _ranks(scores: mx.array, depths: Optional[mx.array] = None) -> mx.array:
    """Each entry's place (0: first) by score, higher first; ties to the shallower (`depths`),
    then to the earlier entry: the order `build_tree`'s heap takes them in. Distinct."""
    n = scores.shape[0]
    index = mx.arange(n)
    depths = depths if depths is not None else mx.zeros((n,), dtype=mx.int32)
    earlier = (depths[None] < depths[:, None]) | ((depths[None] == depths[:, None]) & (index[None] < index[:, None]))
    ahead = (scores[None] > scores[:, None]) | ((scores[None] == scores[:, None]) & earlier)  # [i, j]: j before i
    return ahead.sum(axis=1)


def grow_tree(
    root: int,
    logprobs: mx.array,
    ids: mx.array,
    budget: int,
    max_depth: int,
    guess: Sequence[int] = (),
    guess_logprob: float = math.log(0.5),
) -> DeviceTree:
    """`build_tree`'s tree, grown on the device without a read: the `budget` most likely
    paths below `root` (best first, ties to the shallower), from logprobs, ids (D, K)
    (`top_candidates`) down to min(max_depth, D), with `guess` one more path scored
    `guess_logprob` a token (a token both hold: one node, the better reading).

    Depth by depth, the best `budget` children of the last depth's best `budget` nodes are
    kept (a node among the tree's best has at most budget - 1 better ones at its depth, so
    the beam loses none of them), then the best `budget` of all depths are the tree: a
    child never scores above its parent, and ties go to the shallower, so every node's
    parent is in it, before it."""
    rows = min(max_depth, logprobs.shape[0])
    depth = max(rows, min(max_depth, len(guess)))
    # the last depth's kept nodes: score, token, global index, whether it is the guess's node
    scores, tokens, index, on_guess = mx.array([0.0]), mx.array([root], dtype=mx.int32), mx.array([0]), mx.array([True])
    all_scores, all_tokens, all_parents, all_depths, count = [scores], [tokens], [mx.array([0])], [mx.array([0])], 1
    for d in range(depth):
        options_s, options_t, options_p, options_g = [], [], [], []
        guessed = guess[d] if d < len(guess) else None
        if d < rows:  # the candidates of depth d + 1 below every kept node
            lp, tok = logprobs[d].astype(mx.float32), ids[d].astype(mx.int32)  # (K,)
            s = scores[:, None] + lp[None]  # (p, K)
            if guessed is not None:  # the guess's own node takes the token both hold
                s = mx.where(on_guess[:, None] & (tok[None] == guessed), -mx.inf, s)
            options_s.append(s.reshape(-1))
            options_t.append(mx.broadcast_to(tok[None], s.shape).reshape(-1))
            options_p.append(mx.broadcast_to(index[:, None], s.shape).reshape(-1))
            options_g.append(mx.zeros((s.size,), dtype=mx.bool_))
        if guessed is not None:  # the guess's next node, below the guess's node if kept
            reading = mx.array(guess_logprob)
            if d < rows:
                reading = mx.maximum(reading, mx.max(mx.where(tok == guessed, lp, -mx.inf)))
            parent_score = mx.max(mx.where(on_guess, scores, -mx.inf))
            options_s.append((parent_score + reading)[None])
            options_t.append(mx.array([guessed], dtype=mx.int32))
            options_p.append(mx.max(mx.where(on_guess, index, -1))[None])
            options_g.append(mx.array([True]))
        s, t, p, g = (mx.concatenate(o) for o in (options_s, options_t, options_p, options_g))
        kept = min(budget, s.shape[0])
        order = mx.argsort(_ranks(s))[:kept]  # the ranks are distinct: any sort gives this order
        scores, tokens, parents, on_guess = s[order], t[order], p[order], g[order]
        index = mx.arange(count, count + kept)
        count += kept
        all_scores.append(scores)
        all_tokens.append(tokens)
        all_parents.append(parents)
        all_depths.append(mx.full((kept,), d + 1))
    return _best_of(all_scores, all_tokens, all_parents, all_depths, budget, depth)


def _best_of(scores, tokens, parents, depths, budget: int, depth: int) -> DeviceTree:
    """The root and the best `budget` nodes of every depth's kept ones (lists of (n_d,)
    arrays, depth 0 the root alone), renumbered in best-first order."""
    s, t, p, d = (mx.concatenate(x) for x in (scores, tokens, parents, depths))
    n = min(budget, s.shape[0] - 1)
    rank = _ranks(s, d)  # the root (score 0, depth 0) is first
    order = mx.argsort(rank)[: n + 1]  # (n + 1,): global indices, best first
    place = mx.zeros((s.shape[0],), dtype=mx.int32)
    place = place.at[order].add(mx.arange(n + 1, dtype=mx.int32))  # global index -> slot (kept ones)
    return DeviceTree(
        tokens=t[order].astype(mx.int32),
        parents=place[p[order]],
        depths=d[order].astype(mx.int32),
        live=s[order] > -mx.inf,
        depth=depth,
    )
