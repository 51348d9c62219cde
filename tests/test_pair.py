"""What is learned of a model pair lasts across calls: the adaptive policy is the pair's
(`Pair.policy`), so one-shot calls (no `prompt_cache`, as `dflash generate` and API users
make them) do not probe afresh a drafter the pair has already shown to be useless."""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)

from dflash_mlx.pair import Pair
from dflash_mlx.policy import MISSES_FREE
from dflash_mlx.targets import make_target
from references import dflash_tokens, greedy_reference
from tiny_drafters import BLOCK, ScriptedDrafter, prompt_of, random_drafter
from tiny_targets import tiny_target


def test_one_shot_calls_learn_in_the_pairs_policy():
    """Every call without a `prompt_cache` or `policy` teaches the pair's policy: its
    choices count every cycle of every call, its acceptance estimate has learned that no
    draft is ever accepted, and its probes that found nothing add up across calls, past
    the point where a new call no longer probes at its first cycle (`BlockSizePolicy.start`).
    On a real model this is what keeps a useless drafter's one-shot calls at plain speed
    (BENCHMARKS.md); on this tiny one cycle costs are too alike to assert the choices."""
    model = tiny_target("llama", seed=3)
    # every draft wrong: the drafter proposes the token after the true one
    drafter = ScriptedDrafter(make_target(model, (1,)), [], lambda cycle, k: True)
    pair = Pair.of(model, drafter)
    cycles = 0
    for i in range(6):
        prompt = prompt_of(6, 100 + i)
        reference = greedy_reference(model, prompt, 24)
        drafter.truth = prompt + reference + [0] * BLOCK
        tokens, stats = dflash_tokens(model, prompt, drafter, 24, tree_budget=0)
        assert tokens == reference
        cycles += len(stats.block_sizes)
    assert Pair.of(model, drafter).policy is pair.policy
    assert pair.policy.chosen >= cycles - 6  # each call's last cycle may be queued, not chosen
    assert pair.policy.acceptance(1) < 0.1  # from the prior, 0.5
    assert pair.policy.misses > MISSES_FREE


def test_the_pairs_of_both_kernel_switches_learn_in_one_policy():
    model = tiny_target("llama", seed=3)
    drafter = random_drafter(make_target(model, ()), seed=6)
    assert Pair.of(model, drafter, kernels=True).policy is Pair.of(model, drafter, kernels=False).policy
    assert Pair.of(model, None).policy is None
