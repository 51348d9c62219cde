"""Parity with z-lab's MLX reference (`dflash==0.1.0`, `dflash.model_mlx`) on the new families:

* decoding a tiny random `qwen3_5` (hybrid gated-delta: z-lab rolls its linear layers
  back by replaying recorded recurrence inputs, we by re-running the layer): the same
  greedy tokens and the same accepted length in every cycle;
* the gemma-4 drafter fields (`input_embedding_scale`, `output_multiplier`,
  `final_logit_softcapping`) with sliding-window drafter layers and rope scaling: the
  same draft logits as z-lab's `DFlashDraftModel` on the same weights and context.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache as make_target_cache

from dflash_mlx import load_draft
from dflash_mlx.drafter import Drafter
from dflash_mlx.drafters import save_drafter
from dflash_mlx.speculative import stream_generate
from dflash_mlx.target import Target
from dflash_mlx.targets import make_target
from references import greedy_reference
from tiny_drafters import BLOCK, MASK, PATTERNS, ScriptedDrafter, drafter_config, prompt_of
from tiny_targets import HIDDEN, VOCAB, tiny_target
from zlab_run import zlab_generate

import zlab_run as zrun

pytest.importorskip("dflash.model_mlx")


def _save_random_drafter(target: Target, path, seed: int, **fields) -> None:
    mx.random.seed(seed)
    cfg = drafter_config(target, block_size=8)
    for name, value in fields.items():
        setattr(cfg, name, value)
    drafter = Drafter(cfg)
    mx.eval(drafter.parameters())
    save_drafter(drafter, path, overwrite=True)


@pytest.mark.parametrize("block_size", [4, 8])
def test_qwen3_5_greedy_equals_zlab_mlx(default_model, tmp_path, block_size):
    _, tokenizer = default_model  # only detokenizes; the tiny vocabulary's ids are valid in it
    model = tiny_target("qwen3_5", scale=2.0)
    theirs_model = tiny_target("qwen3_5", scale=2.0)  # z-lab's loop hooks the model it gets
    target = make_target(model)
    _save_random_drafter(target, tmp_path, seed=5)
    ours_drafter = load_draft(str(tmp_path), model=model)
    theirs_drafter = zrun.zlab_mlx_load_draft(tmp_path)
    accepted = []
    for seed, length in [(1, 6), (2, 21)]:
        prompt = prompt_of(length, seed)
        want, their_cycles = zlab_generate(theirs_model, theirs_drafter, tokenizer, prompt, 40, block_size)
        responses = list(stream_generate(model, tokenizer, prompt, ours_drafter, max_tokens=40, block_size=block_size))
        assert [r.token for r in responses] == want
        ours = responses[-1].stats.accepted_lengths
        # z-lab cuts its last block at max_tokens: that cycle is compared up to what it emitted.
        assert ours[: len(their_cycles) - 1] == their_cycles[:-1]
        assert ours[len(their_cycles) - 1] >= their_cycles[-1]
        accepted += ours
    assert min(accepted) == 1  # rollbacks ran


def _zlab_scripted_drafter(target: Target, truth: list[int], corrupt):
    """z-lab's MLX drafter class, proposing as `tiny_drafters.ScriptedDrafter` does: it
    tracks its block's position from the context it is handed (all of it the first time,
    the committed tokens after)."""
    from dflash import model_mlx

    class Scripted(model_mlx.DFlashDraftModel):
        position, cycle = 0, 0

        def __call__(self, inputs, target_hidden, cache, logits_start=0):
            self.position += target_hidden.shape[1]
            start = self.position  # of the block's first token: one past the context
            tokens = []
            for k in range(1, inputs.shape[1]):
                true = truth[start + k] if start + k < len(truth) else 0
                tokens.append((true + 1) % VOCAB if corrupt(self.cycle, k) else true)
            self.cycle += 1
            return mx.where(mx.arange(VOCAB)[None] == mx.array(tokens)[:, None], 10.0, -10.0)[None]

    cfg = drafter_config(target)
    config = model_mlx.DFlashConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        block_size=BLOCK,
        target_layer_ids=tuple(cfg.target_layer_ids),
        num_target_layers=cfg.num_target_layers,
        mask_token_id=MASK,
    )
    return Scripted(config)


def test_qwen3_5_scripted_drafters_equal_zlab_mlx(default_model):
    """Every error pattern of the scripted drafters, in both loops: rollbacks of every length."""
    _, tokenizer = default_model
    model = tiny_target("qwen3_5", scale=2.0)
    theirs_model = tiny_target("qwen3_5", scale=2.0)
    target = make_target(model)
    seen = set()
    for i, length in enumerate([5, 17]):
        prompt = prompt_of(length, 20 + i)
        truth = prompt + greedy_reference(model, prompt, 40) + [0] * BLOCK
        corrupt = lambda c, k, i=i: PATTERNS[(c + i) % len(PATTERNS)](k)  # noqa: E731
        want, their_cycles = zlab_generate(
            theirs_model, _zlab_scripted_drafter(target, truth, corrupt), tokenizer, prompt, 40, BLOCK
        )
        responses = list(
            stream_generate(
                model, tokenizer, prompt, ScriptedDrafter(target, truth, corrupt), max_tokens=40, block_size=BLOCK
            )
        )
        assert [r.token for r in responses] == want
        ours = responses[-1].stats.accepted_lengths
        assert ours[: len(their_cycles) - 1] == their_cycles[:-1]
        seen.update(their_cycles[:-1])
    assert {1, BLOCK // 2, BLOCK - 1, BLOCK} <= seen


def test_drafter_fields_equal_zlab_mlx(tmp_path):
    """Sliding-window drafter layers, linear rope scaling and the three gemma-4 fields.
    The window (10) is wider than the block: z-lab's MLX drafter windows only the context
    keys, its PyTorch one (which ours follows, see test_reference_parity.py) the block's too."""
    from dflash import model_mlx

    model = tiny_target("qwen3")
    target = make_target(model, [0, 3])
    fields = dict(
        input_embedding_scale=1.7,
        output_multiplier=0.8,
        final_logit_softcapping=3.0,
        layer_types=["sliding_attention"],
        sliding_window=10,
        rope_scaling={"type": "linear", "factor": 2.0},
    )
    _save_random_drafter(target, tmp_path, seed=6, **fields)
    ours = load_draft(str(tmp_path), model=model)
    assert ours.config.final_logit_softcapping == 3.0 and ours.config.input_embedding_scale == 1.7
    theirs = zrun.zlab_mlx_load_draft(tmp_path).bind(model)
    prompt = prompt_of(11, 3)
    _, features = target.forward(mx.array(prompt)[None], make_target_cache(model))
    block = mx.array([[prompt[-1]] + [MASK] * 7])
    cache = ours.make_cache()
    ours.append_context(features, cache)
    got = ours.propose(block, cache, target)
    want = theirs(block, features, model_mlx.make_prompt_cache(theirs), logits_start=1)[0]
    assert float(mx.abs(got).max()) <= 3.0  # capped
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
