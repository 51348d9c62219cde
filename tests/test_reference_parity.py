"""Conformance with z-lab's reference implementation (PyPI ``dflash==0.1.0``).

1. Drafter forward: on identical random weights, our MLX ``Drafter`` and z-lab's PyTorch
   ``DFlashDraftModel`` (driven with z-lab's own cache handling, see
   ``zlab_run.TorchDraftSession``) give the same final-norm hidden states and the
   same logits, to ``TOL`` (max abs diff), over a context that GROWS step by step
   (different numbers of new context tokens per step, the block at later and later
   positions), for several configs: 1 layer with MHA, 3 layers with GQA and a head_dim
   that is not hidden / heads, ``sliding_attention`` layers (causal, and bidirectional
   with ``is_causal: false``), and ``is_causal: true`` on full-attention layers.
   Plus the real default target: its own features as context and its tied lm_head.
2. Decoding: our ``stream_generate`` and z-lab's MLX ``dflash.model_mlx.stream_generate``
   produce the same tokens (greedy, real SmolLM2 target, drafters saved in z-lab's
   layout and loaded by both loaders), and the same accepted length in every cycle.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS preload before the first mlx import)

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load_draft
from dflash_mlx.drafters import build_drafter
from dflash_mlx.targets import make_target

from conftest import SMOLLM2
from parity_cases import CONFIGS, MASK, STEPS, VOCAB, ours_generate, step_inputs
from smollm2_drafters import chat
from zlab_run import zlab_generate

import zlab_reference as zr
import zlab_run as zrun

pytestmark = [
    pytest.mark.skipif(not zr.ZLAB_AVAILABLE, reason="torch + dflash==0.1.0 not installed"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

TOL = 1e-4  # max abs difference allowed between our float32 outputs and z-lab's


def _config(spec: dict) -> dict:
    return zr.zlab_config(vocab_size=VOCAB, mask_token_id=MASK, **spec)


def _ours_from_torch(torch_model, config: dict, **overrides):
    """Our drafter built from z-lab's state dict, key by key."""
    weights = {k: mx.array(v) for k, v in zr.state_dict_numpy(torch_model).items()}
    return build_drafter({**config, **overrides}, weights)


def _run_ours(drafter, steps, lm_head):
    """Our drafter over a growing context: append the new context, then draft the block."""
    cache = drafter.make_cache()
    head = mx.array(lm_head)
    hidden, logits, starts = [], [], []
    for features, emb in steps:
        drafter.append_context(mx.array(features), cache)
        starts.append(cache[0].offset)
        h = drafter(mx.array(emb), cache)
        hidden.append(np.array(h))
        logits.append(np.array(h @ head.T))
    return hidden, logits, starts


def _max_diff(a, b) -> float:
    assert a.shape == b.shape
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_drafter_matches_zlab_torch_over_growing_context(name):
    spec = CONFIGS[name]
    config = _config(spec)
    torch_model = zr.make_torch_drafter(config, seed=11)
    ours = _ours_from_torch(torch_model, config)
    steps, lm_head = step_inputs(np.random.default_rng(5), spec)

    ref_hidden = zrun.torch_draft_logits_growing(torch_model, steps)
    ref_logits = zrun.torch_draft_logits_growing(torch_model, steps, lm_head=lm_head)
    hidden, logits, starts = _run_ours(ours, steps, lm_head)

    # The block sits right after the context: positions 9, 10, 14, 16, 22.
    assert starts == list(np.cumsum([n for n, _ in STEPS]))
    for i, (_, e) in enumerate(steps):
        assert hidden[i].shape == (1, e.shape[1], spec["hidden_size"])
        assert _max_diff(hidden[i], ref_hidden[i]) < TOL, f"{name}: step {i} hidden"
        assert _max_diff(logits[i], ref_logits[i]) < TOL, f"{name}: step {i} logits"

    # The masking under test really matters for these inputs (no vacuous pass).
    layer_types = config.get("layer_types") or []
    if "sliding_attention" in layer_types or config.get("is_causal"):
        plain = _ours_from_torch(
            torch_model,
            config,
            is_causal=None,
            sliding_window=None,
            layer_types=["full_attention"] * spec["num_layers"],
        )
        plain_hidden, _, _ = _run_ours(plain, steps, lm_head)
        assert _max_diff(plain_hidden[-1], ref_hidden[-1]) > 100 * TOL


def test_drafter_matches_zlab_torch_on_the_real_target(default_model):
    """Real context (the default target's own layer outputs, through our Target adapter),
    real block embeddings and the target's tied lm_head (vocab 49152)."""
    model, tokenizer = default_model
    config = _smol_config()
    torch_model = zr.make_torch_drafter(config, seed=3)
    ours = _ours_from_torch(torch_model, config)
    target = make_target(model, config["dflash_config"]["target_layer_ids"])

    text = "Once upon a time, in a small village by the sea, there lived an old fisherman."
    tokens = tokenizer.encode(text)
    from mlx_lm.models.cache import make_prompt_cache

    _, features = target.forward(mx.array(tokens)[None], make_prompt_cache(model))
    features = np.array(features)
    lm_head = np.array(model.model.embed_tokens.weight)
    mask_id = config["dflash_config"]["mask_token_id"]

    # Context arrives as prompt (7 tokens), then 1, 4 and 3 committed tokens; the block
    # starts with the token after the context.
    cuts = [7, 8, 12, 15]
    steps = []
    for lo, hi in zip([0] + cuts, cuts):
        block = mx.array([[tokens[hi]] + [mask_id] * (16 - 1)])
        steps.append((features[:, lo:hi], np.array(target.embed(block))))
    ref = zrun.torch_draft_logits_growing(torch_model, steps, lm_head=lm_head)

    cache = ours.make_cache()
    for (f, e), want in zip(steps, ref):
        ours.append_context(mx.array(f), cache)
        got = np.array(target.lm_head(ours(mx.array(e), cache)))
        assert got.shape == want.shape == (1, 16, 49152)
        assert _max_diff(got, want) < TOL


# ---------------------------------------------------------------------------
# Decoding: our stream_generate vs z-lab's MLX stream_generate
# ---------------------------------------------------------------------------

COMMA = 28  # "," in SmolLM2's vocabulary
SMOL_IDS = [2, 14, 27]  # the same for every drafter: z-lab hooks the target only once


def _smol_config(mask_token_id: int = 4) -> dict:
    return zr.zlab_config(
        **SMOLLM2,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=1536,
        block_size=16,
        target_layer_ids=SMOL_IDS,
        mask_token_id=mask_token_id,
        rope_theta=100_000.0,
    )


@pytest.fixture(scope="module")
def smol_drafters(tmp_path_factory):
    """Two drafters for the default target, saved in z-lab's layout (float32):
    "random": plain random weights, accepts next to nothing.
    "comma": mask token "," and attention / MLP outputs scaled down, so its block barely
    moves from the mask embedding and it proposes "," everywhere; on a comma-separated
    answer that gives accepted drafts in about half of the cycles."""
    out = {}
    random_config = _smol_config()
    out["random"] = zr.save_zlab_checkpoint(
        zr.make_torch_drafter(random_config, seed=21), random_config, tmp_path_factory.mktemp("random")
    )
    comma_config = _smol_config(mask_token_id=COMMA)
    comma = zr.make_comma_drafter(comma_config, seed=22)
    out["comma"] = zr.save_zlab_checkpoint(comma, comma_config, tmp_path_factory.mktemp("comma"))
    return out


# The random drafter's answer stops at EOS within a few cycles of 16; the comma drafter's
# runs to max_tokens, its blocks accepted in part and shrunk at the end.
CASES = [
    ("random", "What is the capital of France? Answer in one sentence.", 16),
    ("comma", "List the numbers from 1 to 20, one per line.", 8),
]


@pytest.mark.parametrize("kind,text,block_size", CASES)
def test_greedy_tokens_equal_zlab_mlx(default_model, zlab_target, smol_drafters, kind, text, block_size):
    model, tokenizer = default_model
    path = smol_drafters[kind]
    ours = load_draft(str(path), model=model)
    theirs = zrun.zlab_mlx_load_draft(path)
    prompt = chat(tokenizer, text)

    max_tokens = 48  # z-lab counts the prefill token too, as we do
    want, their_cycles = zlab_generate(zlab_target, theirs, tokenizer, prompt, max_tokens, block_size)
    got, our_cycles = ours_generate(model, ours, tokenizer, prompt, max_tokens, block_size)
    assert got == want
    assert len(want) == max_tokens or want[-1] in tokenizer.eos_token_ids

    # Same drafts, hence the same accepted length in every cycle. z-lab shrinks the last
    # block to the tokens still wanted and cuts its output there, so that cycle is
    # compared only up to what it emitted.
    assert our_cycles[: len(their_cycles) - 1] == their_cycles[:-1]
    assert our_cycles[len(their_cycles) - 1] >= their_cycles[-1]
    if kind == "comma":
        assert max(their_cycles) >= 2 and sum(c >= 2 for c in their_cycles) >= 5
