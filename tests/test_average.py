"""`dflash average`: the mean of one run's checkpoints, tensor by tensor, in the widest
dtype among them; drafters that are not one run's checkpoints are refused before
anything is written."""

from __future__ import annotations

import json
from dataclasses import replace

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from convert_helpers import assert_fails, cli
from mlx.utils import tree_flatten

from dflash_mlx.drafter import Drafter
from dflash_mlx.drafters import drafter_files, load_drafter_dir, save_drafter, write_drafter_files
from tiny_targets import tiny_drafter_config

CONFIG = tiny_drafter_config(num_target_layers=4, block_size=4)


def _checkpoint(path, seed: int, dtype=mx.float32, **fields):
    """A random drafter saved at `path` in `dtype`; returns its weights as NumPy float64."""
    mx.random.seed(seed)
    drafter = Drafter(replace(CONFIG, **fields))
    drafter.set_dtype(dtype)
    save_drafter(drafter, path)
    return {k: np.array(v.astype(mx.float32), dtype=np.float64) for k, v in tree_flatten(drafter.parameters())}


def test_the_mean_of_three_checkpoints_is_their_average_in_the_widest_dtype(tmp_path):
    dirs = [tmp_path / f"step-{i}" for i in range(3)]
    weights = [
        _checkpoint(d, seed=i, dtype=dtype)
        for i, (d, dtype) in enumerate(zip(dirs, (mx.float16, mx.float32, mx.bfloat16)))
    ]
    (dirs[0] / "draft_vocab.json").write_text("shared")  # one drafter's vocabulary is not the run's
    result = cli("average", *dirs, "--out", tmp_path / "mean")
    assert result.exit_code == 0, result.output
    assert "averaged 3 drafters (no draft vocabulary)" in result.output
    mean = load_drafter_dir(tmp_path / "mean")
    for name, value in tree_flatten(mean.parameters()):
        assert value.dtype == mx.float32
        expected = sum(w[name] for w in weights) / 3
        np.testing.assert_allclose(np.array(value), expected, rtol=1e-6, atol=1e-7)
    assert json.loads((tmp_path / "mean" / "config.json").read_text()) == drafter_files(mean)[1]


def test_a_draft_vocabulary_every_checkpoint_shares_comes_along(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    for i, d in enumerate(dirs):
        _checkpoint(d, seed=i)
        (d / "draft_vocab.json").write_text('{"ids": [0, 1, 2]}')
    assert cli("average", *dirs, "-o", tmp_path / "mean").exit_code == 0
    assert (tmp_path / "mean" / "draft_vocab.json").read_text() == '{"ids": [0, 1, 2]}'


@pytest.mark.parametrize(
    "case, needles",
    [
        ("one", ("at least two drafters", "got 1")),
        ("other-config", ("config.json differs",)),
        ("quantized", ("quantized",)),
        ("missing", ("DRAFTER", "not a directory")),
        ("out-is-input", ("--out", "one of the drafters")),
        ("out-exists", ("--out", "already exists", "--force")),
    ],
)
def test_what_is_not_one_runs_checkpoints_is_refused_before_anything_is_written(tmp_path, case, needles):
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "mean"
    _checkpoint(a, seed=0)
    _checkpoint(b, seed=1, intermediate_size=32 if case == "other-config" else CONFIG.intermediate_size)
    args = {"one": [a], "missing": [a, tmp_path / "nowhere"]}.get(case, [a, b])
    if case == "quantized":
        for d in (a, b):
            weights, config = drafter_files(load_drafter_dir(d))
            write_drafter_files(d, weights, {**config, "quantization": {"group_size": 32, "bits": 4}})
    if case == "out-is-input":
        out = b
    if case == "out-exists":
        out.mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())
    assert_fails(
        cli("average", *args, "--out", out),
        out if case not in ("out-is-input", "out-exists") else tmp_path / "x",
        *needles,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == before
