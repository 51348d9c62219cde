"""`dflash convert` / `dflash export` against z-lab's own PyTorch DFlashDraftModel
(dflash==0.1.0 on torch CPU): checkpoints in all three formats, served from a local Hub
cache in the real huggingface_hub layout with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dflash_mlx  # noqa: F401  (OpenBLAS preload before any mlx import)
import mlx.core as mx
import numpy as np
import pytest

from convert_helpers import (
    HIDDEN,
    IDS,
    add_to_hub_cache,
    assert_fails,
    assert_ok,
    block_inputs,
    cli,
    drafter_config,
    leftovers,
    mlx_logits,
    offline_hub,
    write_numpy_checkpoint,
    zr,
    zrun,
)

from tiny_targets import VOCAB, save_tiny_target

__all__ = ["offline_hub"]  # the fixture, imported for pytest

needs_zlab = pytest.mark.skipif(not zr.ZLAB_AVAILABLE, reason="torch + dflash==0.1.0 not installed")


@pytest.fixture(scope="module")
def config() -> dict:
    return drafter_config(num_layers=2)


@pytest.fixture(scope="module")
def torch_drafter(config):
    zr.skip_unless_zlab()
    return zr.make_torch_drafter(config, seed=0)


@pytest.fixture(scope="module")
def inputs():
    return block_inputs(seed=1)


def _st_dtypes(path: Path) -> set[str]:
    from converters.checkpoint import read_safetensors_header

    return {t.dtype for t in read_safetensors_header(path).values()}


@needs_zlab
@pytest.mark.parametrize("fmt,dtype", [("safetensors", "float32"), ("sharded", "float32"), ("bin", "bfloat16")])
def test_convert_from_offline_hub_matches_zlab(fmt, dtype, config, torch_drafter, inputs, offline_hub, tmp_path):
    src = zr.save_zlab_checkpoint(
        torch_drafter,
        config,
        tmp_path / "src",
        fmt=fmt,
        dtype=dtype,
        extra_tensors={"embed_tokens.weight": np.zeros((16, HIDDEN))},
    )
    repo = f"z-lab/tiny-dflash-{fmt}"
    commit = add_to_hub_cache(offline_hub, repo, src)
    out = tmp_path / "out"
    result = cli("convert", repo, out)  # --dtype defaults to the checkpoint's
    assert_ok(result)
    assert "embed_tokens.weight" in result.stderr  # reported as dropped
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert leftovers(out) == []
    assert _st_dtypes(out / "model.safetensors") == {dtype}

    draft = dflash_mlx.load_draft(out)
    assert draft.config.target_layer_ids == IDS and draft.config.block_size == 8
    ctx, emb, head = inputs
    reference = torch_drafter
    if dtype == "bfloat16":  # the checkpoint holds the weights rounded to bf16
        import copy

        import torch

        reference = copy.deepcopy(torch_drafter)  # round the weights only (not rotary buffers)
        with torch.no_grad():
            for p in reference.parameters():
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    expected = zrun.torch_draft_logits(reference, ctx, emb, lm_head=head)
    got = mlx_logits(draft, ctx, emb, head)
    assert got.shape == expected.shape == (1, 8, 1000)
    assert np.abs(got - expected).max() < 1e-4 * max(1.0, np.abs(expected).max())

    card = (out / "README.md").read_text()
    for needle in (repo, commit, dtype, f"dflash convert {repo} {out}"):
        assert needle in card
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and saved["torch_dtype"] == dtype
    assert saved["dflash_config"]["target_layer_ids"] == IDS


def test_revision_and_offline_cache_miss(config, offline_hub, tmp_path):
    src = write_numpy_checkpoint(tmp_path / "src", config)
    commit = add_to_hub_cache(offline_hub, "z-lab/tagged", src, tags=("main", "v1"))
    out = tmp_path / "out"
    assert_ok(cli("convert", "z-lab/tagged", out, "--revision", "v1", "--dtype", "float16"))
    card = (out / "README.md").read_text()
    assert "v1 (commit " + commit in card and "--revision v1" in card
    assert_fails(
        cli("convert", "z-lab/tagged", tmp_path / "o2", "--revision", "v2"),
        tmp_path / "o2",
        "z-lab/tagged",
        "revision v2",
        "cache",
    )
    assert_fails(
        cli("convert", "z-lab/not-cached", tmp_path / "o3"),
        tmp_path / "o3",
        "z-lab/not-cached",
        "not in the Hugging Face cache",
    )


def test_hub_offline_subprocess(config, tmp_path):
    """The real environment variables, in a fresh process: HF_HUB_OFFLINE=1 + HF_HUB_CACHE."""
    cache = tmp_path / "hf-cache"
    src = write_numpy_checkpoint(tmp_path / "src", config)
    add_to_hub_cache(cache, "z-lab/subprocess-dflash", src)
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "convert",
            "z-lab/subprocess-dflash",
            str(out),
            "--dtype",
            "bfloat16",
            "-q",
            "--q-bits",
            "8",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    saved = json.loads((out / "config.json").read_text())
    assert saved["quantization"] == {"group_size": 64, "bits": 8}
    draft = dflash_mlx.load_draft(str(out))
    assert draft.layers[0].mlp.up_proj.bits == 8


@needs_zlab
def test_round_trip_convert_export_zlab_strict(config, torch_drafter, inputs, tmp_path):
    import torch

    src = zr.save_zlab_checkpoint(torch_drafter, config, tmp_path / "src", fmt="safetensors")
    out, exported = tmp_path / "mlx", tmp_path / "zlab"
    assert_ok(cli("convert", src, out, "--dtype", "bfloat16"))
    assert_ok(cli("export", out, exported))
    assert sorted(p.name for p in exported.iterdir()) == ["config.json", "model.safetensors"]
    assert _st_dtypes(exported / "model.safetensors") == {"bfloat16"}
    saved = json.loads((exported / "config.json").read_text())
    assert saved["architectures"] == ["DFlashDraftModel"] and "quantization" not in saved

    back = zr.load_torch_drafter(exported, dtype="float32", strict=True)  # raises on any key issue
    assert sorted(back.state_dict()) == sorted(torch_drafter.state_dict())
    rounded = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in torch_drafter.state_dict().items()}
    for k, v in back.state_dict().items():
        assert torch.equal(v, rounded[k]), k
    ctx, emb, head = inputs
    got = zrun.torch_draft_logits(back, ctx, emb, lm_head=head)
    ours = mlx_logits(dflash_mlx.load_draft(out), ctx, emb, head)
    assert np.abs(got - ours).max() < 1e-4 * max(1.0, np.abs(got).max())


@needs_zlab
def test_quantized_convert_and_export(config, torch_drafter, inputs, tmp_path):
    src = zr.save_zlab_checkpoint(torch_drafter, config, tmp_path / "src", fmt="sharded")
    out, exported = tmp_path / "q8", tmp_path / "zlab"
    assert_ok(cli("convert", src, out, "--dtype", "float32", "-q", "--q-bits", "8", "--q-group-size", "64"))
    assert "8-bit" in (out / "README.md").read_text()
    draft = dflash_mlx.load_draft(out)
    ctx, emb, head = inputs
    expected = zrun.torch_draft_logits(torch_drafter, ctx, emb, lm_head=head)
    ours = mlx_logits(draft, ctx, emb, head)
    scale = np.abs(expected).max()
    assert np.abs(ours - expected).max() < 0.05 * scale  # 8-bit weights: close, not exact

    assert_ok(cli("export", out, exported, "--dtype", "float32"))
    back = zr.load_torch_drafter(exported, dtype="float32", strict=True)
    got = zrun.torch_draft_logits(back, ctx, emb, lm_head=head)
    assert np.abs(got - ours).max() < 1e-4 * scale  # the export holds the dequantized weights


def test_target_check_passes_for_default_target(config, default_model_dir, tmp_path):
    src = write_numpy_checkpoint(tmp_path / "src", config)
    out = tmp_path / "out"
    result = cli("convert", src, out, "--target", default_model_dir)
    assert_ok(result)
    assert "fits target" in result.stderr
    from dflash_mlx import load_draft

    model, _ = dflash_mlx.load(str(default_model_dir), lazy=True)
    load_draft(out, model=model)  # the loader's own fit check agrees


def test_config_without_target_layer_ids_needs_the_option(tmp_path):
    config = drafter_config(num_layers=1, ids=None)
    src = write_numpy_checkpoint(tmp_path / "src", config)
    out = tmp_path / "out"
    assert_fails(cli("convert", src, out), out, "target_layer_ids", "--target-layer-ids")
    assert_fails(cli("convert", src, out, "--target-layer-ids", "1,2"), out, "fc.weight")
    assert_ok(cli("convert", src, out, "--target-layer-ids", ",".join(map(str, IDS))))
    saved = json.loads((out / "config.json").read_text())
    assert saved["dflash_config"]["target_layer_ids"] == IDS
    assert "--target-layer-ids 1,15,27" in (out / "README.md").read_text()


def test_force_replaces_existing_output(config, tmp_path):
    src = write_numpy_checkpoint(tmp_path / "src", config)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    result = cli("convert", src, out)
    assert result.exit_code == 1 and "--force" in result.stderr
    assert (out / "keep.txt").read_text() == "old" and leftovers(out) == []
    assert_ok(cli("convert", src, out, "--force"))
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert leftovers(out) == []


def test_target_model_converts_through_mlx_lm(tmp_path, default_model_dir):
    """`convert --target-model` is mlx-lm's own convert (a tiny llama saved here: offline),
    written atomically; a model type mlx-lm does not know fails in one line, leaving nothing."""
    import mlx.nn as nn
    import mlx_lm

    source = save_tiny_target("llama", tmp_path / "src", default_model_dir, VOCAB)
    out = tmp_path / "target"
    assert_ok(cli("convert", source, out, "--target-model", "--dtype", "bfloat16", "-q", "--q-bits", "4"))
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    assert quantization["bits"] == 4 and quantization["group_size"] == 64
    model, _ = mlx_lm.load(str(out))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.up_proj, nn.QuantizedLinear) and layer.input_layernorm.weight.dtype == mx.bfloat16
    assert leftovers(out) == []

    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps(dict(config, model_type="foo")))
    assert_fails(
        cli("convert", source, tmp_path / "t2", "--target-model"), tmp_path / "t2", "Model type foo not supported"
    )
