"""Greedy DFlash output must equal the target's own greedy output, token for token.

Real target (SmolLM2-135M-Instruct, float32), real tokenizer, reference = `mlx_lm`'s own
`stream_generate`. Drafters: a random one (almost nothing accepted) and a scripted
adversary that knows the right answer and injects errors at chosen block positions.
"""

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest

from dflash_mlx import make_prompt_cache, stream_generate
from dflash_mlx.drafter import Drafter, DrafterConfig

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 10.",
    "Translate 'good morning' into Spanish and French.",
    "What is 17 times 23? Show your work.",
    "Write a haiku about the sea.",
    "Give me a short tip for learning to play the guitar.",
]
MAX_TOKENS = 72
BLOCK = 8


def drafter_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=576, num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3,
                head_dim=64, intermediate_size=1536, vocab_size=49152, num_target_layers=30,
                target_layer_ids=[2, 15, 28], mask_token_id=4, block_size=BLOCK, rope_theta=1e5)
    base.update(kw)
    return DrafterConfig(**base)


class ScriptedDrafter(Drafter):
    """Proposes the target's true continuation, corrupted by `corrupt(cycle, k)`.

    It reads the block's position from its context cache, like a real drafter, and
    returns one-hot logits, so it exercises every acceptance length."""

    def __init__(self, truth: list[int], corrupt, block_size: int = BLOCK):
        super().__init__(drafter_config(block_size=block_size))
        self.truth, self.corrupt, self.cycle = truth, corrupt, 0

    def propose(self, block, cache, target):
        start = cache[0].offset  # position of block[0]
        size = block.shape[1]
        tokens = []
        for k in range(1, size):
            true = self.truth[start + k] if start + k < len(self.truth) else 0
            tokens.append((true + 1) % 49152 if self.corrupt(self.cycle, k) else true)
        self.cycle += 1
        return mx.where(mx.arange(49152)[None] == mx.array(tokens)[:, None], 10.0, -10.0)


def chat(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


@pytest.fixture(scope="module")
def references(default_model):
    model, tokenizer = default_model
    out = {}
    for text in PROMPTS:
        prompt = chat(tokenizer, text)
        out[text] = (prompt, [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=MAX_TOKENS)])
    return out


def ours(model, tokenizer, prompt, drafter, **kw):
    responses = list(stream_generate(model, tokenizer, prompt, drafter, **kw))
    return [r.token for r in responses], responses


def test_baseline_path_equals_mlx_lm(default_model, references):
    model, tokenizer = default_model
    for prompt, ref in list(references.values())[:3]:
        assert ours(model, tokenizer, prompt, None, max_tokens=MAX_TOKENS)[0] == ref


def test_random_drafter_is_lossless(default_model, references):
    model, tokenizer = default_model
    mx.random.seed(1)
    drafter = Drafter(drafter_config(block_size=16))
    mx.eval(drafter.parameters())
    for text, (prompt, ref) in references.items():
        got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS)
        assert got == ref, text
        assert responses[-1].finish_reason == ("stop" if ref[-1] == 2 else "length")


# Each cycle picks an error pattern: first position wrong, last wrong, all right, one
# wrong in the middle, everything wrong.
PATTERNS = [
    lambda k, n: k == 1,
    lambda k, n: k == n - 1,
    lambda k, n: False,
    lambda k, n: k == n // 2,
    lambda k, n: True,
]


def test_adversarial_drafter_is_lossless(default_model, references):
    model, tokenizer = default_model
    seen = set()
    for i, (text, (prompt, ref)) in enumerate(references.items()):
        truth = prompt + ref
        drafter = ScriptedDrafter(truth, lambda c, k, i=i: PATTERNS[(c + i) % len(PATTERNS)](k, BLOCK))
        got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS)
        assert got == ref, text
        seen.update(responses[-1].stats.accepted_lengths)
        # from_draft marks exactly the accepted drafted tokens.
        assert sum(r.from_draft for r in responses) == responses[-1].stats.accepted_drafted_tokens
    # The patterns reached every kind of outcome: none accepted, some, all (B-1 + bonus).
    assert {1, BLOCK // 2, BLOCK - 1, BLOCK} <= seen


def test_eos_inside_an_accepted_block(default_model, references):
    model, tokenizer = default_model
    stopped = [(p, r) for p, r in references.values() if r[-1] in tokenizer.eos_token_ids]
    assert stopped, "at least one reference answer must end with EOS within MAX_TOKENS"
    for prompt, ref in stopped:
        # Blocks commit ref[1 + B*c : 1 + B*(c+1)]; pick B so that EOS is not a bonus token.
        block = 16 if (len(ref) - 1) % 16 else 15
        drafter = ScriptedDrafter(prompt + ref + [7] * 32, lambda c, k: False, block_size=block)
        got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS + 40)
        assert got == ref
        assert responses[-1].finish_reason == "stop"
        assert responses[-1].from_draft  # EOS arrived as an accepted draft, mid-block


@pytest.mark.parametrize("max_tokens", [1, 2, 13, 37])
def test_max_tokens_inside_a_block(default_model, references, max_tokens):
    model, tokenizer = default_model
    prompt, ref = references[PROMPTS[1]]
    drafter = ScriptedDrafter(prompt + ref, lambda c, k: False, block_size=16)
    got, responses = ours(model, tokenizer, prompt, drafter, max_tokens=max_tokens)
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
    _, responses = ours(model, tokenizer, prompt, drafter, max_tokens=MAX_TOKENS, stop=[stop])
    assert "".join(r.text for r in responses) == full[: full.index(stop)]
    assert responses[-1].finish_reason == "stop"


def test_multi_turn_cache_reuse_is_lossless(default_model):
    """A second turn through a reused PromptCache equals a fresh generation, and only
    the new part of the prompt is prefilled."""
    model, tokenizer = default_model
    mx.random.seed(2)
    drafter = Drafter(drafter_config())
    mx.eval(drafter.parameters())
    cache = make_prompt_cache(model, drafter)
    messages = [{"role": "user", "content": PROMPTS[2]}]
    first = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    reply = "".join(r.text for r in stream_generate(model, tokenizer, first, drafter, max_tokens=24, prompt_cache=cache))
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": PROMPTS[3]}]
    second = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    progress = []
    reused, responses = ours(model, tokenizer, second, drafter, max_tokens=32, prompt_cache=cache,
                     prompt_progress_callback=lambda done, total: progress.append((done, total)))
    fresh = [r.token for r in mlx_lm.stream_generate(model, tokenizer, second, max_tokens=32)]
    assert reused == fresh
    assert progress == [(len(second), len(second))]
    assert responses[-1].stats.prompt_cached > len(first)  # the first turn's reply is reused too
    assert cache.tokens[: len(first)] == first
    # Toggling to target-only and back stays lossless on the same cache.
    third = second + [tokenizer.encode(" ok")[0]]
    assert ours(model, tokenizer, third, None, max_tokens=8, prompt_cache=cache)[0] == \
        [r.token for r in mlx_lm.stream_generate(model, tokenizer, third, max_tokens=8)]
    assert ours(model, tokenizer, third, drafter, max_tokens=8, prompt_cache=cache)[0] == \
        [r.token for r in mlx_lm.stream_generate(model, tokenizer, third, max_tokens=8)]
