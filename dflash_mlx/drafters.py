"""The drafter families (DFlash v1, DFlash2) and the drafter directory: read, build, write.

`drafter.py` is the v1 model and `drafter2.py` builds DFlash2 on it; neither knows the
other's config. This registry is the one place that tells them apart in a config.json
(`config_class`), builds the right model (`build_drafter`), loads a directory
(`load_drafter_dir`) and writes one (`write_drafter_files` into a staging directory,
`save_drafter` all at once through `atomic.atomic_directory`), or the mean of several
(`average_drafters`: checkpoints of one run averaged, a cheap gain in acceptance). A new
family is one entry in `FAMILIES`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .atomic import atomic_directory
from .draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab
from .drafter import Drafter, DrafterConfig
from .drafter2 import Drafter2Config

__all__ = [
    "FAMILIES",
    "average_drafters",
    "build_drafter",
    "config_class",
    "config_from_dict",
    "drafter_files",
    "load_drafter_dir",
    "read_config",
    "save_drafter",
    "write_drafter_files",
]

#: Config classes by z-lab architecture name; the first is the fallback for configs that
#: name none and set no family's own fields.
FAMILIES: dict[str, type[DrafterConfig]] = {cls.architecture: cls for cls in (DrafterConfig, Drafter2Config)}


def config_class(config: dict) -> type[DrafterConfig]:
    """The family a config.json dict describes: the one its `architectures` names, else
    the one whose own fields it sets (under `dflash_config` or at the top level)."""
    named = config.get("architectures")
    if named:
        return next((cls for name, cls in FAMILIES.items() if name in named), DrafterConfig)
    sub = config.get("dflash_config") or {}
    for cls in FAMILIES.values():
        if any(k in sub or k in config for k in cls.family_fields):
            return cls
    return DrafterConfig


def config_from_dict(config: dict) -> DrafterConfig:
    """The config of the drafter family a config.json dict describes."""
    return config_class(config).from_dict(config)


def read_config(path: str | os.PathLike) -> dict:
    """Read a checkpoint directory's config.json, with a one-line error if absent or bad."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None


def build_drafter(config: dict | DrafterConfig, weights: Optional[dict[str, mx.array]] = None) -> Drafter:
    """Build a drafter from a config and (optionally) a z-lab-layout weight dict.
    Checkpoint copies of the target's embed_tokens / lm_head are dropped."""
    cfg = config if isinstance(config, DrafterConfig) else config_from_dict(config)
    drafter = cfg.make_drafter()
    quant = cfg.extra.get("quantization") if isinstance(config, DrafterConfig) else config.get("quantization")
    if quant:
        nn.quantize(drafter, group_size=quant["group_size"], bits=quant["bits"])
    if weights is not None:
        drafter.load_weights(list(drafter.sanitize(weights).items()), strict=True)
    mx.eval(drafter.parameters())
    return drafter


def _weight_files(path: Path) -> dict[str, mx.array]:
    """All the weights in a directory's .safetensors files (z-lab's shards too), by name."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def load_drafter_dir(path: str | os.PathLike) -> Drafter:
    """Load an MLX (or z-lab safetensors) drafter directory, with the draft vocabulary
    beside its weights if there is one."""
    path = Path(path)
    drafter = build_drafter(read_config(path), _weight_files(path))
    if (path / DRAFT_VOCAB_FILE).is_file():
        drafter.use_draft_vocab(load_draft_vocab(path, drafter.config.vocab_size))
    return drafter


def write_drafter_files(directory: Path, arrays: dict[str, mx.array], config: dict, fmt: str = "mlx") -> None:
    """Write model.safetensors (`fmt`: "mlx", or "pt" for z-lab's loaders) and config.json
    into `directory`, a staging directory of `atomic_directory`."""
    mx.save_safetensors(str(directory / "model.safetensors"), arrays, metadata={"format": fmt})
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def drafter_files(drafter: Drafter) -> tuple[dict[str, mx.array], dict]:
    """A drafter's weights (z-lab key names) and its config.json dict."""
    return dict(tree_flatten(drafter.parameters())), drafter.config.to_dict()


def save_drafter(drafter: Drafter, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write a drafter directory all at once (nothing half-written); an existing `path`
    is replaced only with `overwrite`. Returns the path."""
    with atomic_directory(path, overwrite=overwrite) as tmp:
        write_drafter_files(tmp, *drafter_files(drafter))
    return Path(path)


def average_drafters(paths: Sequence[str | os.PathLike]) -> tuple[dict[str, mx.array], dict]:
    """The mean of several drafters' weights (checkpoints of one training run), tensor by
    tensor in float32 and stored in the widest dtype among them, and their config.json
    dict. Refuses drafters whose configs or tensor names differ, and quantized ones (a
    mean of packed integers is no weight). Late checkpoints of one run sit around one
    minimum; their mean lies nearer it than any one of them."""
    if len(paths) < 2:
        raise ValueError(f"averaging needs at least two drafters, got {len(paths)}")
    config = read_config(paths[0])
    for path in paths[1:]:
        if read_config(path) != config:
            raise ValueError(f"{path}: its config.json differs from {paths[0]}'s; only one run's checkpoints average")
    if config.get("quantization"):
        raise ValueError(f"{paths[0]} is quantized: average the float checkpoints, then quantize")
    total: dict[str, mx.array] = {}
    dtypes: set = set()
    for path in map(Path, paths):
        weights = _weight_files(path)
        if total and weights.keys() != total.keys():
            raise ValueError(f"{path}: its tensors differ from {paths[0]}'s")
        for name, value in weights.items():
            dtypes.add(value.dtype)
            total[name] = total.get(name, 0) + value.astype(mx.float32)
        mx.eval(total)  # one drafter's weights in memory at a time
    dtype = max(dtypes, key=lambda d: d.size)  # float32 over float16 / bfloat16
    mean = {name: (value / len(paths)).astype(dtype) for name, value in total.items()}
    mx.eval(mean)
    return mean, config
