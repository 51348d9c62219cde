"""`dflash convert` / `dflash export` on bad inputs: each fails with one clear line naming
the problem, a non-zero exit, and no output or temporary directory left behind.
The sources here are written with numpy + safetensors (no torch needed)."""

from __future__ import annotations

import json
import sys

import dflash_mlx  # noqa: F401  (OpenBLAS preload before any mlx import)
import numpy as np
import pytest

from convert_helpers import (
    HIDDEN,
    IDS,
    assert_fails,
    assert_ok,
    cli,
    drafter_config,
    leftovers,
    write_numpy_checkpoint,
    zlab_shapes,
    zr,
)


@pytest.fixture
def config() -> dict:
    return drafter_config(num_layers=1)


def test_valid_source_converts(src, out):
    """The baseline every other test here breaks in one way."""
    assert_ok(cli("convert", src, out))
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_expected_keys_come_from_the_drafter(config):
    from converters.checkpoint import expected_tensors
    from dflash_mlx.config import parse_config

    cfg, _ = parse_config(config)
    got = {k: shape for k, (shape, _) in expected_tensors(cfg).items()}
    assert got == zlab_shapes(config)  # 11 per layer + fc, hidden_norm, norm


def test_missing_source_directory(tmp_path, out):
    assert_fails(cli("convert", tmp_path / "nope", out), out, "nope", "no such directory")


def test_missing_weights_file(src, out):
    (src / "model.safetensors").unlink()
    assert_fails(cli("convert", src, out), out, "no drafter weights")


def test_missing_config(src, out):
    (src / "config.json").unlink()
    assert_fails(cli("convert", src, out), out, "no config.json")


def test_missing_shard(tmp_path, src, out):
    index = {
        "metadata": {},
        "weight_map": {
            "fc.weight": "model-00001-of-00002.safetensors",
            "norm.weight": "model-00002-of-00002.safetensors",
        },
    }
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_fails(cli("convert", src, out), out, "model-00002-of-00002.safetensors", "missing")


def test_truncated_safetensors(src, out):
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_fails(cli("convert", src, out), out, "model.safetensors", "truncated")


def test_not_a_safetensors_file(src, out):
    (src / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert_fails(cli("convert", src, out), out, "model.safetensors", "not a safetensors file")


def test_missing_key(tmp_path, config, out):
    src = write_numpy_checkpoint(tmp_path / "src", config, drop=["layers.0.mlp.up_proj.weight"])
    assert_fails(cli("convert", src, out), out, "layers.0.mlp.up_proj.weight", "lacks")


def test_extra_key(tmp_path, config, out):
    extra = {"layers.0.self_attn.rotary_emb.inv_freq": np.ones(32, np.float16)}
    src = write_numpy_checkpoint(tmp_path / "src", config, extra=extra)
    assert_fails(cli("convert", src, out), out, "layers.0.self_attn.rotary_emb.inv_freq", "unexpected")


def test_extra_layer(tmp_path, config, out):
    more = drafter_config(num_layers=2)
    src = write_numpy_checkpoint(tmp_path / "src", more)
    (src / "config.json").write_text(json.dumps(config))  # config says 1 layer, weights have 2
    assert_fails(cli("convert", src, out), out, "unexpected tensor layers.1.", "1-layer")


def test_wrong_shape(tmp_path, config, out):
    shapes = {"layers.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN + 64)}
    src = write_numpy_checkpoint(tmp_path / "src", config, shapes=shapes)
    assert_fails(
        cli("convert", src, out),
        out,
        "layers.0.self_attn.q_proj.weight",
        f"({HIDDEN}, {HIDDEN + 64})",
        f"({HIDDEN}, {HIDDEN})",
    )


def test_integer_tensor(tmp_path, config, out):
    src = write_numpy_checkpoint(tmp_path / "src", config, extra={"norm.weight": np.ones(HIDDEN, np.int32)})
    assert_fails(cli("convert", src, out), out, "norm.weight", "int32")


def test_config_without_target_layer_ids(tmp_path, out):
    src = write_numpy_checkpoint(tmp_path / "src", drafter_config(num_layers=1, ids=None))
    assert_fails(cli("convert", src, out), out, "target_layer_ids", "--target-layer-ids")


def test_config_fields(tmp_path, src, out, config):
    for change, needle in [
        ({"num_target_layers": 20}, "target_layer_ids [27] out of range"),
        ({"dflash_config": {"mask_token_id": 10**6, "target_layer_ids": IDS}}, "mask_token_id"),
        ({"architectures": ["DFlash2DraftModel"]}, "lacks dflash_config.conv_kernel_size"),
        (
            {"dflash_config": {**config["dflash_config"], "output_multiplier": "2"}},
            "output_multiplier must be a positive number",
        ),
        ({"dflash_config": {**config["dflash_config"], "final_logit_softcapping": -1.0}}, "final_logit_softcapping"),
        ({"rope_scaling": {"rope_type": "unheard-of", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "truncate": False}}, "truncate"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ]:
        (src / "config.json").write_text(json.dumps({**config, **change}))
        assert_fails(cli("convert", src, out), out, needle)
    (src / "config.json").write_text("{not json")
    assert_fails(cli("convert", src, out), out, "config.json", "not valid JSON")


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"num_target_layers": 28}, "num_target_layers 28"),
        ({"vocab_size": 50000}, "vocab_size 50000"),
        ({"hidden": 64}, "hidden_size 64"),
    ],
)
def test_target_does_not_fit(tmp_path, out, default_model_dir, change, needle):
    config = drafter_config(num_layers=1, **change)
    src = write_numpy_checkpoint(tmp_path / "src", config)
    assert_fails(cli("convert", src, out, "--target", default_model_dir), out, "does not fit target", needle)


def test_existing_output_without_force(src, out):
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    result = cli("convert", src, out)
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error:")
    assert "already exists" in result.stderr and "--force" in result.stderr
    assert (out / "mine.txt").read_text() == "keep me" and leftovers(out) == []
    result = cli("export", src, out)
    assert result.exit_code == 1 and "--force" in result.stderr
    assert (out / "mine.txt").read_text() == "keep me"


@pytest.mark.parametrize("exc,code", [(KeyboardInterrupt, 130), (OSError, 1)])
@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_midway(src, out, monkeypatch, exc, code, existing):
    """The weights writer dies after writing part of its file (Ctrl-C or a full disk):
    the partial output goes, and an existing output replaced with --force stays intact."""
    import mlx.core as mx

    def dying_writer(path, arrays, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\x00" * 1000)
        raise exc("No space left on device" if exc is OSError else "")

    if existing:
        out.mkdir()
        (out / "old.txt").write_text("previous conversion")
    monkeypatch.setattr(mx, "save_safetensors", dying_writer)
    result = cli("convert", src, out, *(["--force"] if existing else []))
    assert result.exit_code == code, result.output
    assert leftovers(out) == []
    if existing:
        assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    else:
        assert_fails(result, out, *(["No space left"] if exc is OSError else ["interrupted"]), code=code)


def test_bin_without_torch(src, out, monkeypatch):
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    assert_fails(cli("convert", src, out), out, "needs torch", "mlx-dflash[torch]")


@pytest.mark.skipif(not zr.ZLAB_AVAILABLE, reason="torch not installed")
def test_corrupt_bin(src, out):
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip")
    assert_fails(cli("convert", src, out), out, "pytorch_model.bin", "not a readable PyTorch checkpoint")


def test_bad_options(src, out):
    assert_fails(cli("convert", src, out, "--dtype", "int8"), out, "--dtype")
    assert_fails(cli("convert", src, out, "-q", "--q-bits", "7"), out, "--q-bits")
    assert_fails(cli("convert", src, out, "--target-layer-ids", "a,b"), out, "--target-layer-ids")
    result = cli("convert", src, src, "--force")  # would replace its own input
    assert result.exit_code == 1 and "replace the input" in result.stderr
    assert (src / "model.safetensors").is_file()


def test_export_errors(tmp_path, src, out):
    assert_fails(cli("export", tmp_path / "missing", out), out, "missing", "no such directory")
    (src / "model.safetensors").write_bytes(b"")
    assert_fails(cli("export", src, out), out, "model.safetensors", "truncated")


@pytest.mark.parametrize("flag,value", [("--q-bits", "8"), ("--q-group-size", "32")])
def test_a_quantization_flag_without_quantize(src, out, flag, value):
    """--q-bits / --q-group-size without -q would be ignored: refused, naming the flag."""
    assert_fails(cli("convert", src, out, flag, value), out, flag, "-q")
