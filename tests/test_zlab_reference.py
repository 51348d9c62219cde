"""Smoke tests for the z-lab reference wrapper (tests/zlab_reference.py)."""

import json

import numpy as np
import pytest

import dflash_mlx  # noqa: F401  (OpenBLAS preload before any mlx import)

import zlab_reference as zr
import zlab_run as zrun

pytestmark = pytest.mark.skipif(not zr.ZLAB_AVAILABLE, reason="torch + dflash==0.1.0 not installed")

HIDDEN = 64
IDS = [1, 3]


def _config(**extra):
    return zr.zlab_config(
        hidden_size=HIDDEN,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        vocab_size=128,
        block_size=8,
        num_target_layers=6,
        target_layer_ids=IDS,
        mask_token_id=127,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        **extra,
    )


@pytest.fixture(scope="module")
def drafter():
    return zr.make_torch_drafter(_config(), seed=0)


def _inputs(seed, n_ctx, block=8):
    rng = np.random.default_rng(seed)
    ctx = rng.standard_normal((1, n_ctx, len(IDS) * HIDDEN)).astype(np.float32)
    emb = rng.standard_normal((1, block, HIDDEN)).astype(np.float32)
    return ctx, emb


def test_config_layout():
    cfg = _config(dflash_config={"input_embedding_scale": 1.0})
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 6
    assert cfg["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": IDS, "input_embedding_scale": 1.0}
    model = zr.make_torch_drafter(_config(), seed=1)
    assert model.block_size == 8 and model.mask_token_id == 127
    assert list(model.target_layer_ids) == IDS


def test_drafter_weights_seeded_and_nontrivial(drafter):
    sd = zr.state_dict_numpy(drafter)
    assert len(sd) == 11 * 2 + 3
    assert sd["fc.weight"].shape == (HIDDEN, len(IDS) * HIDDEN)
    assert not np.allclose(sd["norm.weight"], 1.0)
    assert not np.allclose(sd["layers.0.self_attn.k_norm.weight"], 1.0)
    again = zr.state_dict_numpy(zr.make_torch_drafter(_config(), seed=0))
    other = zr.state_dict_numpy(zr.make_torch_drafter(_config(), seed=1))
    assert all(np.array_equal(sd[k], again[k]) for k in sd)
    assert not np.array_equal(sd["fc.weight"], other["fc.weight"])


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin"])
def test_save_and_strict_reload(drafter, tmp_path, fmt):
    out = zr.save_zlab_checkpoint(drafter, _config(), tmp_path / fmt, fmt=fmt)
    files = sorted(p.name for p in out.iterdir())
    if fmt == "safetensors":
        assert files == ["config.json", "model.safetensors"]
    elif fmt == "sharded":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) == 2 and shards <= set(files)
        assert set(index["weight_map"]) == set(drafter.state_dict())
    else:
        assert files == ["config.json", "pytorch_model.bin"]

    expected = zr.state_dict_numpy(drafter)
    on_disk = zr.read_checkpoint_tensors(out)
    assert on_disk.keys() == expected.keys()
    assert all(np.array_equal(on_disk[k], expected[k]) for k in expected)

    reloaded = zr.load_torch_drafter(out)  # z-lab's from_pretrained, strict
    got = zr.state_dict_numpy(reloaded)
    assert all(np.array_equal(got[k], expected[k]) for k in expected)

    ctx, emb = _inputs(0, 5)
    np.testing.assert_array_equal(
        zrun.torch_draft_logits(reloaded, ctx, emb), zrun.torch_draft_logits(drafter, ctx, emb)
    )


def test_bf16_checkpoint(drafter, tmp_path):
    out = zr.save_zlab_checkpoint(drafter, _config(), tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    w = zr.read_checkpoint_tensors(out)["fc.weight"]
    ref = zr.state_dict_numpy(drafter)["fc.weight"]
    assert not np.array_equal(w, ref) and np.allclose(w, ref, rtol=1e-2, atol=1e-4)


def test_draft_forward_deterministic(drafter):
    ctx, emb = _inputs(1, 7)
    a = zrun.torch_draft_logits(drafter, ctx, emb)
    b = zrun.torch_draft_logits(drafter, ctx, emb)
    assert a.shape == (1, 8, HIDDEN) and a.dtype == np.float32
    np.testing.assert_array_equal(a, b)
    # explicit positions equal the default layout (context right before the block)
    c = zrun.torch_draft_logits(drafter, ctx, emb, position_ids=np.arange(7 + 8))
    np.testing.assert_array_equal(a, c)
    # RoPE is relative: a uniform shift changes nothing, a gap does
    np.testing.assert_allclose(a, zrun.torch_draft_logits(drafter, ctx, emb, start=20), rtol=1e-4, atol=1e-4)
    gap = np.concatenate([np.arange(7), np.arange(10, 18)])
    assert not np.allclose(a, zrun.torch_draft_logits(drafter, ctx, emb, position_ids=gap))
    # the block sees all of the context
    assert not np.allclose(a, zrun.torch_draft_logits(drafter, ctx[:, 1:], emb))
    lm_head = np.random.default_rng(2).standard_normal((128, HIDDEN)).astype(np.float32)
    logits = zrun.torch_draft_logits(drafter, ctx, emb, lm_head=lm_head)
    np.testing.assert_allclose(logits, a @ lm_head.T, rtol=1e-4, atol=1e-4)


def test_growing_context_matches_full_context(drafter):
    ctx1, emb1 = _inputs(3, 6)
    ctx2, emb2 = _inputs(4, 3)
    ctx3, emb3 = _inputs(5, 1, block=5)
    session = zrun.TorchDraftSession(drafter)
    outs = []
    for ctx, emb in [(ctx1, emb1), (ctx2, emb2), (ctx3, emb3)]:
        outs.append(session.step(ctx, emb))
        assert session.cache_len == session.start  # block K/V cropped away
    assert session.start == 10
    full = np.concatenate([ctx1, ctx2, ctx3], axis=1)
    np.testing.assert_allclose(outs[2], zrun.torch_draft_logits(drafter, full, emb3), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[1], zrun.torch_draft_logits(drafter, full[:, :9], emb2), rtol=1e-5, atol=1e-5)
    again = zrun.torch_draft_logits_growing(drafter, [(ctx1, emb1), (ctx2, emb2), (ctx3, emb3)])
    for x, y in zip(outs, again):
        np.testing.assert_array_equal(x, y)


def test_zlab_mlx_drafter_agrees_with_torch(drafter, tmp_path):
    pytest.importorskip("dflash.model_mlx")
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    out = zr.save_zlab_checkpoint(drafter, _config(), tmp_path / "mlx", fmt="sharded")
    draft = zrun.zlab_mlx_load_draft(out)
    params = dict(tree_flatten(draft.parameters()))
    assert set(params) == set(drafter.state_dict())

    class _Embed:  # the drafter's input is already an embedding here
        def __call__(self, x):
            return x

    draft.embed_tokens, draft.embed_scale = _Embed(), 1.0
    cache = make_prompt_cache(draft)
    ctx1, emb1 = _inputs(6, 5)
    ctx2, emb2 = _inputs(7, 2)
    ref = zrun.torch_draft_logits_growing(drafter, [(ctx1, emb1), (ctx2, emb2)])
    for (ctx, emb), want in zip([(ctx1, emb1), (ctx2, emb2)], ref):
        got = draft.hidden_states(mx.array(emb), mx.array(ctx), cache)
        np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4)
    assert cache[0].offset == 7


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_dflash_generate_wrapper_is_lossless(drafter):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        target = Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=128,
                hidden_size=HIDDEN,
                intermediate_size=96,
                num_hidden_layers=6,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=512,
            )
        ).eval()
    prompt = [1, 2, 3, 4, 5]
    out = zrun.run_dflash_generate(drafter, target, prompt, 20)
    with torch.no_grad():
        plain = target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    assert out == plain[0].tolist()
