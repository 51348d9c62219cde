"""Prompt lookup (`dflash_mlx/lookup.py`) and its path in draft trees (`build_tree(guess=)`):

* `lookup` returns what followed the latest earlier occurrence of the longest suffix, as a
  brute-force scan finds it, within its window, and nothing where no suffix recurs;
* a guess path competes with the drafter's candidates best first, scored per token, and
  shares the nodes where they agree;
* the guesses' score comes from their record: the tokens the target's choices reached,
  right or wrong, in counts that decay per cycle;
* in the loop it is only ever a guess: greedy output stays mlx-lm's with the lookup on or
  off (at a fixed tree and with the adaptive policy), and on a repetitive answer it commits
  more tokens a cycle than the drafter alone does (test_tree.py checks sampling through trees);
* the guess goes on below the drafter's block: on the real pair a cycle commits more tokens
  than a block holds;
* a chain cycle (all there is on hybrid gated-delta and sliding-window targets) verifies the
  guess in place of the drafter's drafts when the two records say it keeps more: greedy
  output stays mlx-lm's, a seed gives the target's own sampled text, and a weak drafter
  commits more per cycle with it.
"""

from __future__ import annotations

import math

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import numpy as np
import pytest

from dflash_mlx.defaults import shipped_drafter_dir
from dflash_mlx.drafters import load_drafter_dir
from dflash_mlx.acceptance import Acceptance, GuessRecord, Records
from dflash_mlx.lookup import lookup
from dflash_mlx.messages import apply_chat_template
from dflash_mlx.targets import make_target
from dflash_mlx.tree import build_tree
from references import dflash_tokens, greedy_reference
from tiny_drafters import random_candidates, random_drafter
from tiny_targets import tiny_target


def brute_lookup(ctx: list[int], k: int, max_ngram: int) -> list[int]:
    for n in range(min(max_ngram, len(ctx) - 1), 0, -1):
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i : i + n] == ctx[-n:]:
                return ctx[i + n : i + n + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_lookup_finds_the_latest_longest_match(seed):
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 6, size=int(rng.integers(2, 80))).tolist()  # few symbols: many matches
    for max_ngram in (1, 2, 4):
        assert lookup(ctx, 5, max_ngram, window=0) == brute_lookup(ctx, 5, max_ngram)


def test_lookup_examples_and_window():
    assert lookup([1, 2, 3, 9, 9, 1, 2, 3], 3) == [9, 9, 1]  # suffix 1 2 3 seen at 0: what followed
    assert lookup([1, 2, 3, 7, 2, 3], 2) == [7, 2]  # longest suffix "2 3" (not "3" alone)
    assert lookup([5, 1, 5, 2, 5], 1) == [2]  # the latest occurrence
    assert lookup([1, 2, 3, 4], 3) == [] and lookup([7], 3) == []
    assert lookup([1, 8, 0, 0, 0, 0, 1], 2, window=4) == []  # the old "1" is out of the window
    assert lookup([1, 8, 0, 0, 0, 0, 1], 2, window=0) == [8, 0]


@pytest.mark.parametrize("budget,max_depth", [(8, 4), (6, 2), (12, 3)])
@pytest.mark.parametrize("guess_logprob", [-0.1, -1.0, -30.0])
def test_the_guess_competes_with_the_candidates_best_first(budget, max_depth, guess_logprob):
    lp, ids = random_candidates(4, 4, seed=budget)
    guess = [int(ids[0, 0]), int(ids[1, 2]), 7, 7]  # shares depth 1 with the drafter's best, then parts
    tree = build_tree(11, lp, ids, budget, max_depth, guess, guess_logprob)
    assert tree.size == budget
    nodes = range(1, tree.size + 1)
    assert all(tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1 for i in nodes)
    siblings = [(tree.parents[i], tree.tokens[i]) for i in nodes]
    assert len(set(siblings)) == len(siblings)  # shared tokens are one node
    assert all(a >= b for a, b in zip(tree.scores[1:], tree.scores[2:]))  # best first
    # the tree holds the best `budget` of all paths, a path scored as its parent plus the
    # better reading of its last token: a candidate's log-probability, or the guess's
    paths: dict[tuple[int, ...], float] = {(): 0.0}
    for d in range(max_depth):
        for path, base in [(p, s) for p, s in paths.items() if len(p) == d]:
            for token in set(ids[d].tolist()) | {guess[d]}:
                read = [float(lp[d, r]) for r in range(ids.shape[1]) if ids[d, r] == token]
                if list(path) + [token] == guess[: d + 1]:
                    read.append(guess_logprob)
                if read:
                    paths[path + (token,)] = base + max(read)
    del paths[()]
    np.testing.assert_allclose(tree.scores[1:], sorted(paths.values(), reverse=True)[:budget], rtol=1e-6)
    in_tree = {tuple(tree.tokens[j] for j in tree.path(i)) for i in nodes}
    if guess_logprob > -1:  # a likely guess: its whole path is in
        assert tuple(guess[: min(len(guess), max_depth)]) in in_tree
    if guess_logprob < -20:  # an unlikely one: only where the drafter has it too
        assert all(path in in_tree for path in sorted(paths, key=paths.get, reverse=True)[:budget])
        assert (guess[0], guess[1], 7) not in in_tree


@pytest.mark.parametrize("max_depth", [3, 6])
def test_the_guess_goes_on_below_the_drafters_rows(max_depth):
    lp, ids = random_candidates(2, 3, seed=1)  # the drafter's block: candidates for 2 depths
    guess = [200, 201, 202, 203, 204, 205, 206]  # tokens no candidate holds
    tree = build_tree(11, lp, ids, 12, max_depth, guess, -0.01)
    deepest = max(range(tree.size + 1), key=tree.depths.__getitem__)
    assert tree.depths[deepest] == max_depth  # the guess's own cap, not the candidates'
    assert [tree.tokens[i] for i in tree.path(deepest)] == guess[:max_depth]
    below = [tree.tokens[i] for i in range(1, tree.size + 1) if tree.depths[i] > 2]
    assert below == guess[2:max_depth]  # below the candidates' rows: the guess alone


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_lookup_is_lossless_and_pays_on_repeats(name):
    model = tiny_target(name, scale=2.0)
    drafter = random_drafter(make_target(model), 0)
    prompt = [3, 17, 29, 41, 5, 60] * 4  # the answer repeats itself here and there: the lookup guesses right
    want = greedy_reference(model, prompt, 48)
    (on, with_lookup), (off, without) = (
        dflash_tokens(model, prompt, drafter, 48, tree_budget=6, lookup=k) for k in (4, 0)
    )
    assert on == want and off == want
    assert with_lookup.mean_acceptance > without.mean_acceptance, (with_lookup.mean_acceptance, without.mean_acceptance)
    for k in (1, 4):  # the adaptive policy, trees and chains
        assert dflash_tokens(model, prompt, drafter, 48, lookup=k)[0] == want


def test_the_guess_record_counts_tried_tokens_and_forgets_slowly():
    record = GuessRecord(decay=0.5)
    assert record.probability == 0.5  # before any guess
    record.observe([4, 5, 6], [4, 5, 9, 2])  # two right, the third tried and wrong
    assert (record.hits, record.tries) == (2, 3)
    record.observe([7, 8], [1])  # wrong at once: the second is never reached
    assert (record.hits, record.tries) == (1, 2.5)
    record.observe([], [3, 3])  # no guess: nothing to count, nothing forgotten
    assert (record.hits, record.tries) == (1, 2.5)
    record.observe([3, 3, 3], [3])  # the committed tokens reach only the first
    assert (record.hits, record.tries) == (1.5, 2.25)
    assert record.probability == pytest.approx(2.5 / 4.25)
    assert record.logprob == pytest.approx(math.log(2.5 / 4.25))
    for _ in range(200):  # a long run of right guesses: the probability nears 1 - (1 - decay) / 2
        record.observe([1, 2], [1, 2, 3])
    assert record.probability > 0.6 and math.isclose(record.hits, record.tries)


def test_a_guess_below_the_block_commits_more_than_a_block(default_model):
    """The real pair in float32: where the answer copies its context (after its short reply the
    135M model opens a new turn of the chat template the prompt holds), a tree cycle commits
    more tokens than the drafter's block has rows, which only the guess can reach; the
    output stays mlx-lm's, there and with the adaptive policy (whose chains, at most a block,
    may take the guess instead)."""
    model, tokenizer = default_model
    drafter = load_drafter_dir(shipped_drafter_dir())
    text = (
        "Repeat this sentence exactly, twice: "
        "The old lighthouse keeper counted forty-two ships passing the northern rocks before dawn."
    )
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": text}])
    want = greedy_reference(model, prompt, 64)
    tokens, stats = dflash_tokens(model, prompt, drafter, 64, tree_budget=16)
    assert tokens == want
    assert max(stats.accepted_lengths) > drafter.config.block_size, stats.accepted_lengths
    assert dflash_tokens(model, prompt, drafter, 64)[0] == want


def test_a_chain_takes_the_guess_only_where_its_record_promises_more():
    """The lookup's record against the drafter's (the one acceptance model the policies read)."""
    fresh, sure, unsure = GuessRecord(), GuessRecord(hits=19.0, tries=20.0), GuessRecord(hits=1.0, tries=20.0)
    assert fresh.expected(3) == pytest.approx(0.875) and sure.expected(0) == 0
    even, missing = Acceptance(8), Acceptance(8)
    for _ in range(20):
        missing.learn(8, 0)  # draft 1 always rejected
    assert even.expected(4) - 1 == pytest.approx(0.875)  # before any chain: even odds at each draft
    assert Records(even, fresh).chain_guess([4, 5, 6], 3) == []  # even odds: the drafter keeps its chain
    assert Records(even, sure).chain_guess([4, 5, 6, 7, 8], 3) == [4, 5, 6]  # at most the chain's drafts
    assert Records(even, unsure).chain_guess([4, 5, 6], 3) == []
    assert Records(missing, sure).chain_guess([4], 7) == [4]  # one likely token beats seven unlikely ones
    assert Records(even, sure).chain_guess([4], 7) == []  # ... not seven coin flips (0.91 < 0.99)
    assert Records(missing, sure).chain_guess([], 3) == []


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "gpt_oss"])
def test_chains_take_the_guess_losslessly(name):
    model = tiny_target(name, scale=2.0)
    drafter = random_drafter(make_target(model), 0)  # random: it rarely guesses right
    prompt = [3, 17, 29, 41, 5, 60] * 4
    want = greedy_reference(model, prompt, 48)
    (on, with_lookup), (off, without) = (
        dflash_tokens(model, prompt, drafter, 48, block_size=6, lookup=k) for k in (4, 0)
    )
    assert on == want and off == want
    assert with_lookup.lookup_chains > 0 and without.lookup_chains == 0
    assert dflash_tokens(model, prompt, drafter, 48)[0] == want  # the adaptive policy
    sampled = dict(temp=1.0, seed=3)  # keyed draws: the seed's text is the target's own, whatever is verified
    alone = dflash_tokens(model, prompt, None, 48, **sampled)[0]
    assert dflash_tokens(model, prompt, drafter, 48, block_size=6, **sampled)[0] == alone
    assert dflash_tokens(model, prompt, drafter, 48, **sampled)[0] == alone


@pytest.mark.parametrize("name", ["gpt_oss", "gemma4_text"])
def test_guessed_chains_commit_more_where_the_answer_repeats(name):
    """Sliding-window targets (chains only) whose tiny answers repeat themselves."""
    model = tiny_target(name, scale=2.0)
    drafter = random_drafter(make_target(model), 0)
    prompt = [7, 8, 9, 10] * 6
    runs = [dflash_tokens(model, prompt, drafter, 48, block_size=6, lookup=k)[1] for k in (4, 0)]
    assert runs[0].mean_acceptance > 1.5 * runs[1].mean_acceptance, [r.mean_acceptance for r in runs]
