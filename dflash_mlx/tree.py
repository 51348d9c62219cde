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
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

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
