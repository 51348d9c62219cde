"""The drafter registry: which family a config.json is, and the drafter directory written
all at once (`save_drafter`) and read back (`load_drafter_dir`) to the same weights."""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from conftest import smollm2_drafter_config
from dflash_mlx.drafter import DrafterConfig
from dflash_mlx.drafter2 import Drafter2, Drafter2Config
from dflash_mlx.drafters import FAMILIES, build_drafter, config_class, load_drafter_dir, save_drafter


def test_the_family_comes_from_architectures_else_from_its_fields():
    assert set(FAMILIES) == {"DFlashDraftModel", "DFlash2DraftModel"}
    assert config_class({"architectures": ["DFlash2DraftModel"]}) is Drafter2Config
    assert config_class({"architectures": ["DFlashDraftModel"], "selector_rank": 4}) is DrafterConfig
    assert config_class({"dflash_config": {"conv_kernel_size": 2}}) is Drafter2Config
    assert config_class({"selector_top_k": 8}) is Drafter2Config
    assert config_class({"hidden_size": 64}) is DrafterConfig


@pytest.mark.parametrize("dflash2", [False, True], ids=["v1", "dflash2"])
def test_save_then_load_gives_the_same_drafter(tmp_path, dflash2):
    mx.random.seed(0)
    drafter = build_drafter(smollm2_drafter_config(dflash2=dflash2))
    path = save_drafter(drafter, tmp_path / "drafter")
    again = load_drafter_dir(path)
    assert isinstance(again, Drafter2) == dflash2 and type(again.config) is type(drafter.config)
    want, got = dict(tree_flatten(drafter.parameters())), dict(tree_flatten(again.parameters()))
    assert want.keys() == got.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(np.array(value), np.array(got[name]), err_msg=name)


def test_save_is_all_or_nothing(tmp_path):
    drafter = build_drafter(smollm2_drafter_config())
    path = save_drafter(drafter, tmp_path / "drafter")
    with pytest.raises(FileExistsError):
        save_drafter(drafter, path)
    save_drafter(drafter, path, overwrite=True)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no staging directory left
