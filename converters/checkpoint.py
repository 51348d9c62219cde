"""Read drafter checkpoints (safetensors, sharded safetensors, PyTorch state dicts) and
validate them against their config before anything is converted.

A :class:`Checkpoint` lists every tensor's name, shape and dtype first (for safetensors
from the file headers alone, without reading the data), so that a bad checkpoint is
rejected before any work; :meth:`Checkpoint.load` then returns MLX arrays.
The expected tensors come from the MLX drafter itself (v1 or DFlash2, as the config
says; its parameter tree, built lazily, so nothing is allocated): whatever the drafter
needs is what a checkpoint must hold, under its names or the aliases it accepts
(:meth:`Checkpoint.use_names`).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import dflash_mlx  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash_mlx.drafter import DrafterConfig

__all__ = [
    "DROPPED_KEYS",
    "TensorInfo",
    "Checkpoint",
    "open_checkpoint",
    "read_safetensors_header",
    "expected_tensors",
    "validate_tensors",
    "TORCH_HINT",
]

#: Copies of the target's embedding / head that some uploads carry; the drafter borrows the target's.
DROPPED_KEYS = ("embed_tokens.weight", "lm_head.weight")
TORCH_HINT = (
    "reading PyTorch checkpoints (.bin / .pt) needs torch: pip install 'mlx-dflash[torch]' (or pip install torch)"
)

_ST_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
PYTORCH = "PyTorch state dict"
_FLOATING = {"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2"}
_STATE_DICT_KEYS = ("state_dict", "model_state_dict", "model", "module")
_STRIPPED_PREFIXES = ("module.", "_orig_mod.")


@dataclass
class TensorInfo:
    """A stored tensor's shape and dtype (read from a header, not loaded) and the file holding it."""

    shape: tuple[int, ...]
    dtype: str  # numpy-style name: "bfloat16", "float32", "uint32", ...
    file: Path

    @property
    def is_float(self) -> bool:
        """Whether it is floating-point (weights, as opposed to packed quantized ints)."""
        return self.dtype in _FLOATING


# ---------------------------------------------------------------------------
# Expected tensors and validation
# ---------------------------------------------------------------------------


def expected_tensors(
    cfg: DrafterConfig, quantization: Optional[dict] = None
) -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape, is_float) of every parameter the MLX drafter holds. The drafter is
    built lazily (its random init is never evaluated), so this costs nothing."""
    try:
        drafter = cfg.make_drafter()
    except (ValueError, KeyError, TypeError) as e:  # e.g. an unknown rope_scaling type
        raise ValueError(f"config.json: cannot build a drafter ({e})") from None
    if quantization:
        nn.quantize(drafter, group_size=quantization["group_size"], bits=quantization["bits"])
    return {k: (tuple(v.shape), mx.issubdtype(v.dtype, mx.floating)) for k, v in tree_flatten(drafter.parameters())}


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def validate_tensors(
    found: dict[str, TensorInfo], cfg: DrafterConfig, quantization: Optional[dict] = None
) -> list[str]:
    """Check a checkpoint's tensors against the config: every expected key present, no
    unknown key, every shape and dtype right. Raises ValueError naming the first bad key.
    Returns the names that will be dropped (embed_tokens / lm_head copies)."""
    expected = expected_tensors(cfg, quantization)
    dropped = [k for k in DROPPED_KEYS if k in found and k not in expected]
    names = [k for k in found if k not in dropped]
    missing = [k for k in expected if k not in found]
    if missing:
        more = f" ({len(missing)} expected tensors missing)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint lacks tensor {missing[0]}{more}")
    extra = sorted(k for k in names if k not in expected)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ValueError(
            f"unexpected tensor {extra[0]} in checkpoint{more}: not part of a "
            f"{cfg.num_hidden_layers}-layer DFlash drafter"
        )
    for name, (shape, is_float) in expected.items():
        info = found[name]
        if tuple(info.shape) != shape:
            hint = ""
            if name == "fc.weight":
                hint = f" ({len(cfg.target_layer_ids)} target_layer_ids x hidden_size {cfg.hidden_size} inputs)"
            raise ValueError(
                f"tensor {name} has shape {_shape(info.shape)} but config.json implies {_shape(shape)}{hint}"
            )
        if is_float and not info.is_float:
            raise ValueError(f"tensor {name} has dtype {info.dtype}; expected floating-point weights")
    return dropped


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, shapes and dtypes from a safetensors header, checking that the file
    is complete (a truncated download fails here, before any data is read)."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path.name} is truncated ({size} bytes): not a safetensors file")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > size - 8:
            raise ValueError(
                f"{path.name} is truncated or not a safetensors file (header of {n} bytes in a {size}-byte file)"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{path.name} is not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name} is not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    tensors: dict[str, TensorInfo] = {}
    end = 0
    for name, entry in header.items():
        try:
            dtype = _ST_DTYPES.get(entry["dtype"], str(entry["dtype"]).lower())
            shape = tuple(int(s) for s in entry["shape"])
            start, stop = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path.name} is not a safetensors file (bad entry for {name})") from None
        end = max(end, stop)
        tensors[name] = TensorInfo(shape, dtype, path)
    if 8 + n + end > size:
        raise ValueError(f"{path.name} is truncated: {size} bytes, its header describes {8 + n + end}")
    return tensors


def _import_torch():
    try:
        import torch
    except ImportError:
        raise RuntimeError(TORCH_HINT) from None
    return torch


def _torch_to_mx(t) -> mx.array:
    torch = _import_torch()
    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    if t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.to(torch.float32)  # float8 and other exotic types
    return mx.array(t.numpy())


def _state_dict_of(obj: Any, name: str) -> dict:
    torch = _import_torch()

    def is_state_dict(d):
        return isinstance(d, dict) and d and all(isinstance(v, torch.Tensor) for v in d.values())

    if is_state_dict(obj):
        sd = obj
    elif isinstance(obj, dict) and any(is_state_dict(obj.get(k)) for k in _STATE_DICT_KEYS):
        sd = next(obj[k] for k in _STATE_DICT_KEYS if is_state_dict(obj.get(k)))
    elif isinstance(obj, dict):
        bad = next((k for k, v in obj.items() if not isinstance(v, torch.Tensor)), None)
        raise ValueError(f"{name}: entry {bad!r} is not a tensor (expected a state dict)")
    else:
        raise ValueError(f"{name} holds a {type(obj).__name__}, not a state dict")
    for prefix in _STRIPPED_PREFIXES:
        if all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix) :]: v for k, v in sd.items()}
    return sd


def _torch_load(path: Path) -> dict:
    torch = _import_torch()
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # zip / pickle / EOF errors of a broken or foreign file
        text = str(e).strip().splitlines()
        raise ValueError(
            f"{path.name} is not a readable PyTorch checkpoint ({text[0] if text else type(e).__name__})"
        ) from None
    return _state_dict_of(obj, path.name)


def _torch_dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class Checkpoint:
    """A checkpoint directory's weights: what they are (from headers) and how to load them."""

    directory: Path
    kind: str  # "safetensors" | "sharded safetensors" | "PyTorch state dict"
    files: list[Path]
    tensors: dict[str, TensorInfo]  # by the drafter's names once `use_names` ran
    _torch_state: dict = field(default_factory=dict, repr=False)
    _stored: dict[str, str] = field(default_factory=dict, repr=False)  # drafter's name -> name in the files

    def use_names(self, aliases: dict[str, str]) -> None:
        """Call tensors stored under an alias (name in the files -> the drafter's name) by
        the drafter's name, e.g. a torch state dict's `candidate_selector.*_codebook.weight`."""
        for stored, name in aliases.items():
            if stored in self.tensors:
                if name in self.tensors:
                    raise ValueError(f"checkpoint holds both {stored} and {name}")
                self.tensors[name] = self.tensors.pop(stored)
                self._stored[name] = stored

    def dtype(self) -> Optional[str]:
        """The most common floating dtype among the tensors (None if none)."""
        counts = Counter(t.dtype for t in self.tensors.values() if t.is_float)
        return counts.most_common(1)[0][0] if counts else None

    def load(self, names: Optional[Iterable[str]] = None) -> dict[str, mx.array]:
        """The named tensors (default: all) as MLX arrays, in their stored dtype."""
        wanted = set(self.tensors if names is None else names)
        out: dict[str, mx.array] = {}
        stored = {k: self._stored.get(k, k) for k in wanted}
        if self.kind == PYTORCH:
            for k in wanted:
                out[k] = _torch_to_mx(self._torch_state[stored[k]])
            return out
        for f in self.files:
            keys = [k for k, t in self.tensors.items() if t.file == f and k in wanted]
            if not keys:
                continue
            try:
                arrays = mx.load(str(f))
            except Exception as e:
                text = str(e).strip().splitlines()
                raise ValueError(f"cannot read {f.name} ({text[0] if text else type(e).__name__})") from None
            out.update({k: arrays[stored[k]] for k in keys})
        return out


def _merge(tensors: dict[str, TensorInfo], more: dict[str, TensorInfo]) -> None:
    for k, v in more.items():
        if k in tensors:
            raise ValueError(f"tensor {k} appears in both {tensors[k].file.name} and {v.file.name}")
        tensors[k] = v


def _index_shards(directory: Path, index_name: str) -> list[Path]:
    index_path = directory / index_name
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{index_name} is not a valid index (no weight_map)") from None
    for s in shards:
        if not (directory / s).is_file():
            raise FileNotFoundError(f"shard {s} listed in {index_name} is missing")
    return [directory / s for s in shards]


def _check_index(directory: Path, index_name: str, tensors: dict[str, TensorInfo]) -> None:
    weight_map = json.loads((directory / index_name).read_text())["weight_map"]
    for k, shard in weight_map.items():
        if k not in tensors or tensors[k].file.name != shard:
            raise ValueError(f"{index_name} lists tensor {k} in {shard}, which does not hold it")


def open_checkpoint(directory: str | Path) -> Checkpoint:
    """Find and inspect a checkpoint's weights. Formats, in order of preference:
    sharded safetensors (``model.safetensors.index.json``), ``*.safetensors``,
    sharded ``pytorch_model.bin.index.json``, ``pytorch_model.bin``, a single ``*.bin`` /
    ``*.pt`` / ``*.pth``. PyTorch files need torch and are read in full here."""
    d = Path(directory)
    st_index = "model.safetensors.index.json"
    tensors: dict[str, TensorInfo] = {}
    if (d / st_index).is_file():
        files = _index_shards(d, st_index)
        for f in files:
            _merge(tensors, read_safetensors_header(f))
        _check_index(d, st_index, tensors)
        return Checkpoint(d, "sharded safetensors", files, tensors)
    files = sorted(d.glob("*.safetensors"))
    if files:
        for f in files:
            _merge(tensors, read_safetensors_header(f))
        return Checkpoint(d, "safetensors", files, tensors)

    bin_index = "pytorch_model.bin.index.json"
    if (d / bin_index).is_file():
        files = _index_shards(d, bin_index)
    elif (d / "pytorch_model.bin").is_file():
        files = [d / "pytorch_model.bin"]
    else:
        files = sorted(p for ext in ("*.bin", "*.pt", "*.pth") for p in d.glob(ext))
        if len(files) > 1:
            raise ValueError(
                f"{d} holds several PyTorch files ({', '.join(p.name for p in files)}) "
                "and no pytorch_model.bin.index.json: keep only the drafter's"
            )
    if not files:
        raise FileNotFoundError(
            f"no drafter weights in {d} (expected model.safetensors, "
            "model.safetensors.index.json, pytorch_model.bin or a .pt file)"
        )
    state: dict = {}
    for f in files:
        sd = _torch_load(f)
        for k, t in sd.items():
            _merge(tensors, {k: TensorInfo(tuple(t.shape), _torch_dtype_name(t), f)})
        state.update(sd)
    if bin_index in {p.name for p in d.iterdir()}:
        _check_index(d, bin_index, tensors)
    return Checkpoint(d, PYTORCH, files, tensors, state)
