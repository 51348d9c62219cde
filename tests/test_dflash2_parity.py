"""DFlash2 conformance with z-lab's reference (PyPI ``dflash==0.1.0``).

1. Drafter forward and selection: on identical random weights, our MLX ``Drafter2`` and
   z-lab's PyTorch ``DFlash2DraftModel`` (driven with z-lab's own cache handling) give
   the same final-norm hidden states and logits to 1e-5 (max abs diff) and the same
   greedy draft path, over a context that grows step by step, for configs with and
   without sliding-window layers. The convolutions and the selector both change the
   result for these inputs (no vacuous pass), and the path differs from the argmax.
2. Decoding: our ``stream_generate`` and z-lab's MLX ``dflash.model_mlx.stream_generate``
   produce the same tokens and the same accepted length in every cycle (greedy, real
   SmolLM2 target, a random DFlash2 drafter saved in z-lab's released layout).
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS preload before the first mlx import)

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import load_draft
from dflash_mlx.drafters import build_drafter
from dflash_mlx.drafter2 import Drafter2
from dflash_mlx.sampling import SamplingParams

from conftest import SMOLLM2
from parity_cases import CONFIGS as V1_CONFIGS
from parity_cases import MASK, VOCAB, ours_generate, step_inputs
from smollm2_drafters import chat
from zlab_run import zlab_generate

import zlab_reference as zr
import zlab_run as zrun

GREEDY = SamplingParams().draws(0)  # greedy choices: positions do not matter

pytestmark = [
    pytest.mark.skipif(not zr.ZLAB_AVAILABLE, reason="torch + dflash==0.1.0 not installed"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

TOL = 1e-5

CONFIGS = {
    "2 layers, kernel 2, group 16, top 4": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        block_size=8,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        rope_theta=10_000.0,
    ),
    "kernel 3, group 8, top 12, rank 16": dict(
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        intermediate_size=128,
        block_size=16,
        num_target_layers=8,
        target_layer_ids=[3],
        rope_theta=1_000_000.0,
        conv_kernel_size=3,
        conv_group_size=8,
        selector_top_k=12,
        selector_rank=16,
    ),
    # v1's sliding-window cases (the convolutions and selector come with the DFlash2 defaults)
    **{name: V1_CONFIGS[name] for name in ("sliding window 6, causal", "sliding window 5 < block, bidirectional")},
}


def _ours(torch_model, config: dict) -> Drafter2:
    """Our drafter from z-lab's state dict (torch names: codebooks with `.weight`)."""
    weights = {k: mx.array(v) for k, v in zr.state_dict_numpy(torch_model).items()}
    drafter = build_drafter(config, weights)
    assert isinstance(drafter, Drafter2)
    return drafter


def _run_ours(drafter: Drafter2, steps, lm_head):
    """Hidden states, logits and the greedy path of each step over a growing context."""
    cache, head = drafter.make_cache(), mx.array(lm_head)
    out = []
    for features, emb, anchor in steps:
        drafter.append_context(mx.array(features), cache)
        h = drafter(mx.array(emb), cache)
        logits = h @ head.T
        path = drafter.candidate_selector.select(h[0, 1:], logits[0, 1:], mx.array(anchor), GREEDY)
        out.append((np.array(h), np.array(logits), path.tolist()))
    return out


def _max_diff(a, b) -> float:
    assert a.shape == b.shape
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_drafter2_matches_zlab_torch_over_growing_context(name):
    spec = dict(CONFIGS[name])
    config = zr.zlab2_config(vocab_size=VOCAB, mask_token_id=MASK, **spec)
    torch_model = zr.make_torch_drafter(config, seed=7)
    rng = np.random.default_rng(9)
    pairs, lm_head = step_inputs(rng, spec)
    anchors = [int(rng.integers(0, MASK)) for _ in pairs]
    steps = [(f, e, a) for (f, e), a in zip(pairs, anchors)]

    ref_hidden = zrun.torch_draft_logits_growing(torch_model, pairs)
    ref_logits = zrun.torch_draft_logits_growing(torch_model, pairs, lm_head=lm_head)
    ours = _run_ours(_ours(torch_model, config), steps, lm_head)
    changed_by_selector = 0
    for i, ((h, logits, path), want_h, want_l, anchor) in enumerate(zip(ours, ref_hidden, ref_logits, anchors)):
        assert _max_diff(h, want_h) < TOL, f"{name}: step {i} hidden"
        assert _max_diff(logits, want_l) < TOL, f"{name}: step {i} logits"
        assert path == zrun.torch_select(torch_model, want_h, want_l, anchor), f"{name}: step {i} path"
        changed_by_selector += path != np.argmax(want_l[0, 1:], axis=-1).tolist()
    assert changed_by_selector >= 2  # the interaction term really picks other candidates

    # The convolutions matter for these inputs: identity kernels give other states.
    plain = _ours(torch_model, config)
    for layer in plain.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0].add(1.0)
            conv.kernel_projection.weight = mx.zeros_like(conv.kernel_projection.weight)
    assert _max_diff(_run_ours(plain, steps, lm_head)[-1][0], ref_hidden[-1]) > 100 * TOL


# ---------------------------------------------------------------------------
# Decoding: our stream_generate vs z-lab's MLX stream_generate (DFlash2 branch)
# ---------------------------------------------------------------------------

COMMA = 28  # "," in SmolLM2's vocabulary
SMOL_IDS = [2, 14, 27]  # as in test_reference_parity: z-lab hooks a target only once


def _smol2_config(mask_token_id: int) -> dict:
    return zr.zlab2_config(
        **SMOLLM2,
        num_layers=1,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=256,
        block_size=8,
        target_layer_ids=SMOL_IDS,
        mask_token_id=mask_token_id,
        rope_theta=100_000.0,
        conv_group_size=64,
        selector_rank=16,
        selector_top_k=8,
    )


@pytest.fixture(scope="module")
def smol2_drafters(tmp_path_factory):
    """DFlash2 drafters for the default target in z-lab's released layout (float32):
    "random", and "comma" (mask token ",", attention / MLP outputs scaled down: it
    proposes "," nearly everywhere, so a comma-separated answer accepts drafts)."""
    random_config = _smol2_config(4)
    out = {
        "random": zr.save_zlab_checkpoint(
            zr.make_torch_drafter(random_config, seed=31), random_config, tmp_path_factory.mktemp("random2")
        )
    }
    comma_config = _smol2_config(COMMA)
    comma = zr.make_comma_drafter(comma_config, seed=32)
    out["comma"] = zr.save_zlab_checkpoint(comma, comma_config, tmp_path_factory.mktemp("comma2"))
    return out


@pytest.mark.parametrize(
    "kind,text,block_size",
    [
        ("random", "What is the capital of France? Answer in one sentence.", 8),
        ("comma", "List the numbers from 1 to 20, one per line.", 8),
    ],
)
def test_greedy_tokens_equal_zlab_mlx_dflash2(default_model, zlab_target, smol2_drafters, kind, text, block_size):
    model, tokenizer = default_model
    path = smol2_drafters[kind]
    ours = load_draft(str(path), model=model)
    theirs = zrun.zlab_mlx_load_draft(path)
    assert isinstance(ours, Drafter2) and type(theirs).__name__ == "DFlash2DraftModel"
    prompt = chat(tokenizer, text)
    max_tokens = 40
    want, their_cycles = zlab_generate(zlab_target, theirs, tokenizer, prompt, max_tokens, block_size)
    got, our_cycles = ours_generate(model, ours, tokenizer, prompt, max_tokens, block_size)
    assert got == want
    assert our_cycles[: len(their_cycles) - 1] == their_cycles[:-1]
    assert our_cycles[len(their_cycles) - 1] >= their_cycles[-1]
    if kind == "comma":
        assert sum(c >= 2 for c in their_cycles) >= 3, their_cycles


def test_first_draft_equals_zlab_mlx_on_the_real_target(default_model, smol2_drafters):
    """The draft path itself, which the loop comparison sees only through accepted
    lengths: our Drafter2 and z-lab's MLX DFlash2DraftModel on the real target's features
    of a prompt, then of 3 more tokens; the selector moves the path off the argmax."""
    from mlx_lm.models.cache import make_prompt_cache

    from dflash_mlx.targets import make_target

    model, tokenizer = default_model
    path = smol2_drafters["random"]
    ours, theirs = load_draft(str(path), model=model), zrun.zlab_mlx_load_draft(path).bind(model)
    target = make_target(model, SMOL_IDS)
    tokens = chat(tokenizer, "Write a haiku about the sea.")
    _, features = target.forward(mx.array(tokens)[None], make_prompt_cache(model))
    our_cache, their_cache = ours.make_cache(), theirs.make_cache()
    off_argmax = 0
    for lo, hi in ((0, len(tokens) - 4), (len(tokens) - 4, len(tokens) - 1)):
        block = mx.array([[tokens[hi]] + [4] * 7])  # the token after the context, then masks
        ours.append_context(features[:, lo:hi], our_cache)
        got = ours.draft(block, our_cache, target, GREEDY).tolist()
        want, _, _ = theirs.propose(block, features[:, lo:hi], their_cache, 0.0, logits_start=1)
        assert got == want[0].tolist()
        off_argmax += got != mx.argmax(ours.propose(block, our_cache, target), axis=-1).tolist()
    assert off_argmax >= 1
