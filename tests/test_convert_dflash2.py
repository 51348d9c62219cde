"""`dflash convert` / `dflash export` / `load_draft` with DFlash2 drafters: the checkpoint
layout (convolutions, selector; codebooks as plain tensors, or with `.weight` as torch
state dicts name them), one-line errors for missing or inconsistent config fields and
tensors, and the round trip convert -> export -> z-lab's strict loaders."""

from __future__ import annotations

import json

import dflash_mlx  # noqa: F401  (OpenBLAS preload before any mlx import)
import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.drafter2 import Drafter2
from dflash_mlx.sampling import SamplingParams

from convert_helpers import (
    HIDDEN,
    assert_fails,
    assert_ok,
    block_inputs,
    cli,
    drafter2_config,
    drafter_config,
    mlx_logits,
    write_numpy_checkpoint,
    zlab_shapes,
    zr,
    zrun,
)

GREEDY = SamplingParams().draws(0)  # greedy choices: positions do not matter
CODEBOOK = "candidate_selector.predecessor_codebook"


@pytest.fixture
def config() -> dict:
    return drafter2_config(num_layers=1)


def test_expected_keys_follow_the_released_layout(config):
    from converters.checkpoint import expected_tensors
    from dflash_mlx.config import parse_config

    cfg, _ = parse_config(config)
    got = {k: shape for k, (shape, _) in expected_tensors(cfg).items()}
    assert got == zlab_shapes(config)  # v1's 14, 4 per layer for the convolutions, 3 for the selector
    assert len(got) == 14 + 4 + 3


def test_convert_and_load(src, out, config):
    assert_ok(cli("convert", src, out))
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"]
    assert {k: saved["dflash_config"][k] for k in ("conv_kernel_size", "selector_top_k")} == {
        "conv_kernel_size": 2,
        "selector_top_k": 8,
    }
    draft = dflash_mlx.load_draft(out)
    assert isinstance(draft, Drafter2) and draft.config.conv_group_size == 64
    assert draft.candidate_selector.predecessor_codebook.shape == (config["vocab_size"], 16)
    v1 = dflash_mlx.load_draft(write_numpy_checkpoint(out.parent / "v1", drafter_config(num_layers=1)))
    assert type(v1).__name__ == "Drafter"


def test_torch_state_dict_names_load(tmp_path, config, out):
    """A torch state dict names the codebooks `*.weight` (nn.Embedding): same tensors."""
    shapes = zlab_shapes(config)
    renamed = {k + ".weight" if k.endswith("_codebook") else k: v for k, v in shapes.items()}
    src = write_numpy_checkpoint(tmp_path / "src", config, shapes=renamed, drop=[k for k in shapes if k not in renamed])
    assert CODEBOOK + ".weight" in renamed and CODEBOOK not in renamed
    assert_ok(cli("convert", src, out))
    draft = dflash_mlx.load_draft(src)  # the loader reads them too
    assert isinstance(draft, Drafter2)
    both = write_numpy_checkpoint(tmp_path / "both", config, shapes={CODEBOOK + ".weight": shapes[CODEBOOK]})
    assert_fails(cli("convert", both, tmp_path / "o2"), tmp_path / "o2", CODEBOOK, "both")


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"dflash_config": {"selector_top_k": None}}, "lacks dflash_config.selector_top_k"),
        ({"dflash_config": {"conv_group_size": 100}}, f"conv_group_size 100 does not divide hidden_size {HIDDEN}"),
        ({"dflash_config": {"selector_rank": 0}}, "selector_rank must be a positive integer"),
        ({"dflash_config": {"selector_top_k": 10**6}}, "selector_top_k 1000000 exceeds vocab_size"),
        ({"architectures": ["DFlashDraftModel"]}, "sets conv_kernel_size, a DFlash2 field"),
    ],
)
def test_config_errors(src, out, config, change, needle):
    sub = {k: v for k, v in {**config["dflash_config"], **change.get("dflash_config", {})}.items() if v is not None}
    (src / "config.json").write_text(json.dumps({**config, **change, "dflash_config": sub}))
    assert_fails(cli("convert", src, out), out, needle)
    with pytest.raises(ValueError, match=needle.split(" ")[0]):
        dflash_mlx.load_draft(src)


def test_tensor_errors(tmp_path, config, out):
    missing = write_numpy_checkpoint(tmp_path / "a", config, drop=["layers.0.mlp_conv.base_kernel"])
    assert_fails(cli("convert", missing, out), out, "lacks tensor layers.0.mlp_conv.base_kernel")
    wrong = write_numpy_checkpoint(
        tmp_path / "b", config, shapes={"layers.0.attention_conv.kernel_projection.weight": (18, HIDDEN)}
    )
    assert_fails(
        cli("convert", wrong, out),
        out,
        "layers.0.attention_conv.kernel_projection.weight",
        f"(18, {HIDDEN})",
        f"(36, {HIDDEN})",
    )


@pytest.mark.skipif(not zr.ZLAB_AVAILABLE, reason="torch + dflash==0.1.0 not installed")
def test_round_trip_convert_export_zlab_strict(tmp_path):
    """z-lab's DFlash2 checkpoint -> dflash convert (bf16) -> dflash export -> z-lab's torch
    `from_pretrained` (strict) and MLX `load_draft`: the same tensors (bf16-rounded), and
    the same hidden states and draft path as our converted drafter."""
    import torch

    config = drafter2_config(num_layers=1)
    torch_drafter = zr.make_torch_drafter(config, seed=5)
    src = zr.save_zlab_checkpoint(torch_drafter, config, tmp_path / "src")
    out, exported = tmp_path / "mlx", tmp_path / "zlab"
    assert_ok(cli("convert", src, out, "--dtype", "bfloat16"))
    assert_ok(cli("export", out, exported))
    saved = json.loads((exported / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"] and saved["dflash_config"]["selector_rank"] == 16

    back = zr.load_torch_drafter(exported, dtype="float32", strict=True)  # raises on any key issue
    rounded = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in torch_drafter.state_dict().items()}
    assert sorted(back.state_dict()) == sorted(rounded)
    for k, v in back.state_dict().items():
        assert torch.equal(v, rounded[k]), k
    assert set(zr.read_checkpoint_tensors(exported)) == set(zlab_shapes(config))
    assert isinstance(zrun.zlab_mlx_load_draft(exported).candidate_selector.predecessor_codebook.weight, mx.array)

    ctx, emb, head = block_inputs(seed=2)
    want = zrun.torch_draft_logits(back, ctx, emb)
    want_logits = zrun.torch_draft_logits(back, ctx, emb, lm_head=head)
    ours = dflash_mlx.load_draft(out)
    ours.set_dtype(mx.float32)
    got = mlx_logits(ours, ctx, emb, np.eye(HIDDEN, dtype=np.float32))  # the hidden states
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    path = ours.candidate_selector.select(mx.array(got[0, 1:]), mx.array(want_logits[0, 1:]), mx.array(3), GREEDY)
    assert path.tolist() == zrun.torch_select(back, want, want_logits, 3)
