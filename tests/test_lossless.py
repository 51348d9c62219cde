"""Greedy DFlash output must equal the target's own greedy output, token for token.

Real target (SmolLM2-135M-Instruct, float32), real tokenizer, reference = `mlx_lm`'s own
`stream_generate`. Drafters: a random one (almost nothing accepted) and a scripted
adversary that knows the right answer and injects errors at chosen block positions.
Block sizes: fixed, adaptive (the real policy), and scripted sequences of sizes that mix
plain steps (b = 1) with drafted blocks.
"""

import itertools
import random

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest

from dflash_mlx import PromptCache
from dflash_mlx.policy import BlockSizePolicy, Width
from dflash_mlx.tree_policy import TreePolicy
from fixed_policies import ScriptedPolicy, rows_cost
from references import ours
from smollm2_drafters import BLOCK, PROMPTS, ScriptedDrafter, ScriptedDrafter2, chat, drafter_config
from dflash_mlx.drafter import Drafter
from dflash_mlx.drafter2 import Drafter2

MAX_TOKENS = 72
FAMILIES = pytest.mark.parametrize("scripted", [ScriptedDrafter, ScriptedDrafter2], ids=["v1", "dflash2"])


@pytest.fixture(scope="module")
def references(default_model):
    """mlx-lm's greedy answers to the prompts (one of them ends at EOS): each test's block
    sizes and error patterns come round many times within them."""
    model, tokenizer = default_model
    out = {}
    for text in PROMPTS:
        prompt = chat(tokenizer, text)
        out[text] = (prompt, [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)])
    return out


class RowCostPolicy(TreePolicy):
    """The loop's default policy, charged a fixed cost per verified row (`rows_cost`, the policy
    tests' CPU-shaped curve) instead of the wall time: its choices then follow what the drafts
    had accepted, not the machine's load."""

    def update_width(self, width: Width, accepted: int, seconds: float, chain=None) -> None:
        super().update_width(width, accepted, rows_cost(width), chain)


@pytest.mark.parametrize("block_size", [16, None])
def test_random_drafter_is_lossless(default_model, references, block_size):
    model, tokenizer = default_model
    mx.random.seed(1)
    drafter = Drafter(drafter_config(block_size=16))
    mx.eval(drafter.parameters())
    policy = RowCostPolicy(16) if block_size is None else None  # carried across the prompts, as a chat does
    # A verify of 16 rows per token, 15 rolled back: two answers do that over a hundred times.
    # The policy needs all four to settle.
    count = 2 if block_size else 4
    for text, (prompt, ref) in list(references.items())[:count]:
        got, responses = ours(
            model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS, block_size=block_size, policy=policy
        )
        assert got == ref, text
        assert responses[-1].finish_reason == ("stop" if ref[-1] == 2 else "length")
        sizes = responses[-1].stats.block_sizes
        if block_size:  # fixed: never a plain step; blocks shrink only at max_tokens
            assert min(sizes) >= 2 and sizes.count(16) > len(sizes) // 2
    if block_size is None:  # nothing is accepted: the policy settles on plain steps (rare probes remain)
        assert sizes[-20:].count(1) >= 17, sizes


@pytest.mark.parametrize("block_size", [BLOCK, None])
def test_random_dflash2_drafter_is_lossless(default_model, references, block_size):
    """A random DFlash2 drafter (convolutions and selector at random weights), fixed and
    adaptive block sizes."""
    model, tokenizer = default_model
    mx.random.seed(4)
    drafter = Drafter2(drafter_config(dflash2=True))
    mx.eval(drafter.parameters())
    prompt, ref = references[PROMPTS[0]]
    got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS, block_size=block_size)
    assert got == ref
    sizes = responses[-1].stats.block_sizes
    assert min(sizes) >= 2 if block_size else max(sizes) >= 2  # adaptive: it did draft


# Each cycle picks an error pattern: first position wrong, last wrong, all right, one
# wrong in the middle, everything wrong.
PATTERNS = [
    lambda k, n: k == 1,
    lambda k, n: k == n - 1,
    lambda k, n: False,
    lambda k, n: k == n // 2,
    lambda k, n: True,
]


@FAMILIES
def test_adversarial_drafter_is_lossless(default_model, references, scripted):
    model, tokenizer = default_model
    seen = set()
    for i, (text, (prompt, ref)) in enumerate(references.items()):
        truth = prompt + ref
        drafter = scripted(truth, lambda c, k, i=i: PATTERNS[(c + i) % len(PATTERNS)](k, BLOCK))
        got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS, block_size=BLOCK)
        assert got == ref, text
        seen.update(responses[-1].stats.accepted_lengths)
        # from_draft marks exactly the accepted drafted tokens.
        assert sum(r.from_draft for r in responses) == responses[-1].stats.accepted_drafted_tokens
    # The patterns reached every kind of outcome: none accepted, some, all (B-1 + bonus).
    assert {1, BLOCK // 2, BLOCK - 1, BLOCK} <= seen


@FAMILIES
def test_adversarial_drafter_with_mixed_block_sizes_is_lossless(default_model, references, scripted):
    """Plain steps and drafted blocks of every size, in a scripted order, with errors at
    chosen positions: the plain steps' features must reach the drafter's context
    (the scripted drafter reads its position from it)."""
    model, tokenizer = default_model
    rng = random.Random(0)
    seen = set()
    for i, (text, (prompt, ref)) in enumerate(references.items()):
        sizes = [rng.choice([1, 1, 2, 3, 5, BLOCK]) for _ in range(40)]
        drafter = scripted(prompt + ref, lambda c, k, i=i: PATTERNS[(c + i) % 3](k, BLOCK))
        got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS, policy=ScriptedPolicy(sizes))
        assert got == ref, text
        stats = responses[-1].stats
        assert stats.adaptive and sum(r.from_draft for r in responses) == stats.accepted_drafted_tokens
        seen.update(zip(stats.block_sizes, stats.accepted_lengths))
    assert {(1, 1), (2, 2), (3, 3), (5, 5), (BLOCK, BLOCK), (BLOCK, 1), (5, 1)} <= seen


class WidthRecorder(Drafter):
    """A random drafter that notes the width of every block it is asked to draft."""

    def draft(self, block, cache, target, sampling):
        self.widths = getattr(self, "widths", []) + [block.shape[1]]
        return super().draft(block, cache, target, sampling)


@pytest.mark.parametrize("block_size", [4, None])
def test_adaptive_cycles_draft_the_full_block(default_model, references, block_size):
    """Adaptive cycles verify the first drafts of the drafter's whole block (drafted as it
    was trained); a fixed block size drafts exactly that many, as z-lab's loop does."""
    model, tokenizer = default_model
    mx.random.seed(2)
    drafter = WidthRecorder(drafter_config(block_size=16))
    mx.eval(drafter.parameters())
    prompt, ref = next(iter(references.values()))
    policy = None if block_size else ScriptedPolicy([3, 1, 5, 2], max_size=16)
    kw = dict(max_tokens=MAX_TOKENS, block_size=block_size, policy=policy)
    got, responses = ours(model, tokenizer, prompt, drafter, **kw)
    assert got == ref
    assert set(drafter.widths) == {block_size or 16}, drafter.widths
    assert set(responses[-1].stats.block_sizes) == ({4} if block_size else {1, 2, 3, 5})


class CpuCostPolicy(BlockSizePolicy):
    """The real policy, charged a fixed cost per size (shaped like a real drafter on this
    CPU) instead of the measured wall time: the scripted drafter costs nothing, and a
    shared machine's timings would make the choices a matter of luck."""

    def update(self, size: int, accepted: int, seconds: float) -> None:
        super().update(size, accepted, 1.0 if size == 1 else 1.6 + 0.055 * size)


def test_adaptive_policy_follows_the_drafter(default_model, references):
    """The policy in the loop, with a drafter that is always wrong for the first 20
    tokens, then always right: lossless throughout; plain steps first, big blocks once
    they pay."""
    model, tokenizer = default_model
    prompt, ref = references[PROMPTS[1]]
    drafter = ScriptedDrafter(prompt + ref, lambda c, k: drafter.position < len(prompt) + 20, block_size=16)
    got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS, policy=CpuCostPolicy(16))
    assert got == ref
    stats = responses[-1].stats
    starts = list(itertools.accumulate(stats.accepted_lengths, initial=1))  # tokens before each cycle
    early = [b for b, n in zip(stats.block_sizes, starts) if n < 20]
    late = [b for b, n in zip(stats.block_sizes, starts) if n >= 20]
    assert early.count(1) >= len(early) * 3 // 4 and max(late) >= 8, stats.block_sizes
    assert sum(r.from_draft for r in responses) == stats.accepted_drafted_tokens >= 20


def test_eos_inside_an_accepted_block(default_model, references):
    model, tokenizer = default_model
    stopped = [(p, r) for p, r in references.values() if r[-1] in tokenizer.eos_token_ids]
    assert stopped, "at least one reference answer must end with EOS within MAX_TOKENS"
    for prompt, ref in stopped:
        # Blocks commit ref[1 + B*c : 1 + B*(c+1)]; pick B so that EOS is not a bonus token.
        block = 16 if (len(ref) - 1) % 16 else 15
        drafter = ScriptedDrafter(prompt + ref + [7] * 32, lambda c, k: False, block_size=block)
        got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS + 40, block_size=block)
        assert got == ref
        assert responses[-1].finish_reason == "stop"
        assert responses[-1].from_draft  # EOS arrived as an accepted draft, mid-block


@pytest.mark.parametrize("block_size", [16, None])
@pytest.mark.parametrize("max_tokens", [1, 2, 13, 37])
def test_max_tokens_inside_a_block(default_model, references, max_tokens, block_size):
    model, tokenizer = default_model
    prompt, ref = references[PROMPTS[1]]
    drafter = ScriptedDrafter(prompt + ref, lambda c, k: False, block_size=16)
    got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=max_tokens, block_size=block_size)
    assert got == ref[:max_tokens]
    assert responses[-1].finish_reason == "length"
    assert [r.finish_reason for r in responses[:-1]] == [None] * (max_tokens - 1)
    assert "".join(r.text for r in responses) == tokenizer.decode(ref[:max_tokens])


def test_stop_string(default_model, references):
    model, tokenizer = default_model
    prompt, ref = references[PROMPTS[0]]
    full = tokenizer.decode([t for t in ref if t not in tokenizer.eos_token_ids])
    stop = full[10:14]
    drafter = ScriptedDrafter(prompt + ref, lambda c, k: k == 3, block_size=16)
    _, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS, stop=[stop], block_size=16)
    assert "".join(r.text for r in responses) == full[: full.index(stop)]
    assert responses[-1].finish_reason == "stop"


def assert_cache_agrees(cache, drafter) -> None:
    """The target cache, the drafter's context and `cache.tokens` hold the same tokens."""
    assert cache.target[0].offset == len(cache.tokens)
    if drafter is not None:
        assert cache.draft_length == len(cache.tokens)


@pytest.mark.parametrize("with_drafter", [True, False])
def test_pipelined_plain_steps_end_exactly(default_model, references, with_drafter):
    """Plain steps are queued before the previous token is read. EOS, max_tokens and stop
    strings that land inside such a run end it exactly; the cache holds what was fed
    (a step queued behind EOS or a stop string included, nothing past max_tokens), and
    the next turn through the same cache stays lossless. Without a drafter this is the
    baseline path (the target alone), token-identical to mlx-lm on every prompt."""
    model, tokenizer = default_model
    sizes = [1, 1, 1, 1, 1, 1, 3]  # long runs of plain steps, and a drafted block now and then
    for text, (prompt, ref) in references.items():
        drafter = ScriptedDrafter(prompt + ref, lambda c, k: k == 2) if with_drafter else None
        cache = PromptCache(model, drafter)
        kw = dict(prompt_cache=cache, policy=ScriptedPolicy(sizes))
        got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS, **kw)
        assert got == ref, text
        assert_cache_agrees(cache, drafter)
        for m in (m for m in (1, 2, 5, 13) if m <= len(ref)):
            got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=m, **kw)
            assert got == ref[:m]
            assert responses[-1].finish_reason == ("stop" if ref[m - 1] in tokenizer.eos_token_ids else "length")
            assert len(cache.tokens) == len(prompt) + m - 1  # nothing queued past max_tokens
            assert_cache_agrees(cache, drafter)
    prompt, ref = references[PROMPTS[0]]
    full = tokenizer.decode([t for t in ref if t not in tokenizer.eos_token_ids])
    stop = full[10:14]
    drafter = ScriptedDrafter(prompt + ref, lambda c, k: True) if with_drafter else None
    cache = PromptCache(model, drafter)
    _, responses = ours(
        model,
        tokenizer,
        prompt,
        drafter,
        max_tokens=MAX_TOKENS,
        stop=[stop],
        prompt_cache=cache,
        policy=ScriptedPolicy([1]),
    )
    assert "".join(r.text for r in responses) == full[: full.index(stop)]
    assert responses[-1].finish_reason == "stop" and len(cache.tokens) == len(prompt) + len(responses)
    assert_cache_agrees(cache, drafter)
    later = prompt + ref[: len(responses) + 3]  # the next turn extends what the cache holds
    got, responses = ours(
        model, tokenizer, later, drafter, max_tokens=16, prompt_cache=cache, policy=ScriptedPolicy([1, 1, 2])
    )
    assert got == [r.token for r in mlx_lm.stream_generate(model, tokenizer, later, max_tokens=16)]
    assert responses[-1].stats.prompt_cached == len(later) - 3
