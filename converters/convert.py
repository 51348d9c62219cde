"""What `dflash convert` and `dflash export` do (the commands themselves live in app/cli.py).

convert: a z-lab-layout drafter (Hub repo or local directory; safetensors, sharded
safetensors or a PyTorch state dict) -> a ready MLX drafter directory::

    OUTPUT_DIR/config.json         z-lab's config layout (+ "quantization" when -q)
    OUTPUT_DIR/model.safetensors   MLX weights, z-lab key names, in --dtype
    OUTPUT_DIR/README.md           model card: source, revision, dtype, the command

Everything is validated before anything is written (config fields, every tensor's
presence, name, shape and dtype, and with --target the drafter/target pair); the output
is built in a hidden temporary directory next to OUTPUT_DIR and renamed into place at the
end, so a failed or interrupted run leaves nothing behind. An existing OUTPUT_DIR is only
replaced with --force.

`convert --target-model` converts a target LLM instead, by handing it to
`mlx_lm.convert` (same atomic output handling).

export: an MLX drafter directory -> z-lab's layout (config.json with
``architectures: ["DFlashDraftModel"]``, bfloat16 ``model.safetensors``, same keys),
which SGLang, vLLM and z-lab's PyTorch ``DFlashDraftModel.from_pretrained`` load.
Quantized drafters are dequantized first.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import dflash_mlx  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash_mlx.atomic import atomic_directory
from dflash_mlx.config import parse_config
from dflash_mlx.drafter import Drafter, DrafterConfig, check_fit, read_config
from dflash_mlx.errors import one_line
from dflash_mlx.hub import ResolvedSource, resolve_source

from .card import build_convert_command, model_card, size_text
from .checkpoint import FLOAT_DTYPES, Checkpoint, open_checkpoint, validate_tensors

__all__ = [
    "convert_drafter",
    "export_drafter",
    "convert_target_model",
    "check_output",
    "check_target",
]

Log = Callable[[str], None]
Q_BITS = (2, 3, 4, 5, 6, 8)
Q_GROUP_SIZES = (32, 64, 128)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def check_output(output_dir: Path, force: bool, sources: Sequence[Path] = ()) -> None:
    """Fail early (before any download) if OUTPUT_DIR exists without --force, or would
    replace one of the inputs (OUTPUT_DIR equal to an input, or an input inside it)."""
    out = Path(output_dir).expanduser()
    if out.exists() and not force:
        raise FileExistsError(f"{output_dir} already exists (pass --force to replace it)")
    o = out.resolve()
    for s in sources:
        s = Path(s).resolve()
        if o == s or s.is_relative_to(o):
            raise ValueError(f"OUTPUT_DIR {output_dir} would replace the input {s}: choose another directory")


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _check_dtype(dtype: Optional[str], option: str = "--dtype") -> None:
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"{option} must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")


def _check_quant(q_bits: int, q_group_size: int) -> None:
    if q_bits not in Q_BITS:
        raise ValueError(f"--q-bits must be one of {', '.join(map(str, Q_BITS))}, got {q_bits}")
    if q_group_size not in Q_GROUP_SIZES:
        raise ValueError(f"--q-group-size must be one of {', '.join(map(str, Q_GROUP_SIZES))}, got {q_group_size}")


def _check_request(
    source: str,
    out: Path,
    force: bool,
    dtype: Optional[str],
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
) -> None:
    """The option and output checks every command makes before it reads anything."""
    _check_dtype(dtype)
    if quantize:
        _check_quant(q_bits, q_group_size)
    local = Path(source).expanduser()
    check_output(out, force, [local] if local.exists() else [])


def _output_config(cfg, raw: dict, dtype: str) -> dict:
    """z-lab's config layout for `cfg`, keeping the source's other dflash_config fields,
    with the dtype fields set to what the weights now are."""
    out = cfg.to_dict()
    for key in ("quantization", "quantization_config"):
        out.pop(key, None)
    out["dflash_config"] = {**(raw.get("dflash_config") or {}), **out["dflash_config"]}
    out["torch_dtype"] = dtype
    if "dtype" in out:
        out["dtype"] = dtype
    return out


def _load_target_dims(target: str):
    """(num_layers, hidden_size, vocab_size, embedding rows) of a target, loaded lazily
    (no weights are read). "default" is the built-in default target."""
    from dflash_mlx.loading import load
    from dflash_mlx.target import Target

    try:
        model, _ = load(None if target == "default" else target, lazy=True)
    except Exception as e:  # mlx-lm / hub errors of many kinds: keep one line
        raise ValueError(f"cannot load target {target} ({one_line(e)})") from None
    t = Target(model)
    rows = t.body.embed_tokens.weight.shape[0]
    return t.num_layers, t.hidden_size, t.vocab_size, rows


def check_target(cfg: DrafterConfig, target: str) -> None:
    """Raise a one-line ValueError naming the field if the drafter cannot serve `target`."""
    num_layers, hidden, vocab, rows = _load_target_dims(target)
    try:
        check_fit(cfg, num_layers=num_layers, hidden_size=hidden, vocab_size=vocab)
        if cfg.mask_token_id >= rows:
            raise ValueError(
                f"drafter mask_token_id {cfg.mask_token_id} is outside the target's embedding ({rows} rows)"
            )
    except ValueError as e:
        raise ValueError(f"drafter does not fit target {target}: {e}") from None


def _check_quantizable(drafter: Drafter, group_size: int) -> None:
    for name, module in drafter.named_modules():
        if isinstance(module, nn.Linear) and module.weight.shape[-1] % group_size:
            raise ValueError(
                f"cannot quantize {name} with --q-group-size {group_size}: its input "
                f"size {module.weight.shape[-1]} is not a multiple of it"
            )


# ---------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------


@dataclass
class _Source:
    """A drafter checkpoint that passed every check: where it is, its config, its tensors."""

    src: ResolvedSource
    cfg: DrafterConfig
    raw: dict  # config.json as read (target_layer_ids filled in)
    ckpt: Checkpoint
    dropped: list[str]  # embed_tokens / lm_head copies that are not converted

    @property
    def quantization(self) -> Optional[dict]:
        return self.raw.get("quantization")

    def weights(self) -> dict:
        return self.ckpt.load([k for k in self.ckpt.tensors if k not in self.dropped])


def _open_source(
    source: str,
    out: Path,
    force: bool,
    *,
    revision: Optional[str] = None,
    target_layer_ids: Optional[Sequence[int]] = None,
    require_layer_ids: bool = True,
) -> _Source:
    """Resolve SOURCE and validate its config and every tensor, before anything is written."""
    src = resolve_source(source, revision)
    check_output(out, force, [src.path])
    cfg, raw = parse_config(read_config(src.path), target_layer_ids, require_layer_ids=require_layer_ids)
    ckpt = open_checkpoint(src.path)
    dropped = validate_tensors(ckpt.tensors, cfg, raw.get("quantization"))
    return _Source(src, cfg, raw, ckpt, dropped)


def _write_drafter(out: Path, force: bool, arrays: dict, config: dict, fmt: str, card: Optional[str] = None) -> None:
    with atomic_directory(out, overwrite=force) as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), arrays, metadata={"format": fmt})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if card is not None:
            (tmp / "README.md").write_text(card)


def _mlx_arrays(source: _Source, dtype: str, quant: Optional[dict]) -> dict:
    """The drafter's parameters in `dtype` (floating tensors only), quantized as `quant` asks."""
    mx_dtype = getattr(mx, dtype)
    weights = {k: v.astype(mx_dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in source.weights().items()}
    drafter = Drafter(source.cfg)
    if source.quantization:
        nn.quantize(drafter, group_size=source.quantization["group_size"], bits=source.quantization["bits"])
    drafter.load_weights(list(weights.items()), strict=True)
    del weights
    if quant and not source.quantization:
        _check_quantizable(drafter, quant["group_size"])
        nn.quantize(drafter, group_size=quant["group_size"], bits=quant["bits"])
    arrays = dict(tree_flatten(drafter.parameters()))
    mx.eval(arrays)
    return arrays


def convert_drafter(
    source: str,
    output_dir: str | Path,
    *,
    revision: Optional[str] = None,
    dtype: Optional[str] = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    target: Optional[str] = None,
    target_layer_ids: Optional[Sequence[int]] = None,
    force: bool = False,
    command: Optional[str] = None,
    log: Log = _stderr,
) -> Path:
    """Convert a z-lab-layout drafter (Hub repo id or directory) into an MLX drafter
    directory. See the module docstring; returns the output path."""
    out = Path(output_dir).expanduser()
    _check_request(source, out, force, dtype, quantize, q_bits, q_group_size)
    s = _open_source(source, out, force, revision=revision, target_layer_ids=target_layer_ids)
    if s.quantization and quantize:
        raise ValueError("the source drafter is already quantized; convert without -q")
    src_dtype = s.ckpt.dtype() or "unknown"
    dtype = dtype or (src_dtype if src_dtype in FLOAT_DTYPES else "float32")
    log(
        f"{s.src.describe()}: {s.ckpt.kind}, {len(s.ckpt.tensors)} tensors ({src_dtype}), "
        f"{s.cfg.num_hidden_layers}-layer drafter, hidden {s.cfg.hidden_size}: valid"
    )
    if s.dropped:
        log(f"dropping {', '.join(s.dropped)} (the drafter uses the target's)")
    if target:
        check_target(s.cfg, target)
        log(f"fits target {target}")

    quant = s.quantization or ({"group_size": q_group_size, "bits": q_bits} if quantize else None)
    arrays = _mlx_arrays(s, dtype, quant)
    config = _output_config(s.cfg, s.raw, dtype)
    if quant:
        config["quantization"] = dict(quant)
    weights_text = dtype + (f", {quant['bits']}-bit quantized (group size {quant['group_size']})" if quant else "")
    if command is None:
        command = build_convert_command(
            source,
            str(output_dir),
            revision=revision,
            dtype=dtype,
            quantize=quantize,
            q_bits=q_bits,
            q_group_size=q_group_size,
            target=target,
            target_layer_ids=target_layer_ids,
        )
    card = model_card(
        out=out, src=s.src, fmt=s.ckpt.kind, src_dtype=src_dtype, weights=weights_text, cfg=s.cfg, command=command
    )
    _write_drafter(out, force, arrays, config, "mlx", card)
    log(f"wrote {out} ({weights_text}, {size_text(sum(a.nbytes for a in arrays.values()))})")
    return out


def convert_target_model(
    source: str,
    output_dir: str | Path,
    *,
    revision: Optional[str] = None,
    dtype: Optional[str] = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    force: bool = False,
    log: Log = _stderr,
) -> Path:
    """Convert a target LLM with `mlx_lm.convert` (nothing re-implemented), written atomically."""
    out = Path(output_dir).expanduser()
    _check_request(source, out, force, dtype, quantize, q_bits, q_group_size)
    import mlx_lm  # its public `mlx_lm.convert` function

    with atomic_directory(out, overwrite=force) as tmp:
        staged = tmp / "model"
        mlx_lm.convert(
            hf_path=source,
            mlx_path=str(staged),
            quantize=quantize,
            q_group_size=q_group_size if quantize else None,
            q_bits=q_bits if quantize else None,
            dtype=dtype,
            revision=revision,
        )
        if not staged.is_dir():
            raise RuntimeError(f"mlx_lm.convert wrote nothing for {source}")
        for item in staged.iterdir():
            os.replace(item, tmp / item.name)
        staged.rmdir()
    log(f"wrote {out} (converted by mlx_lm.convert)")
    return out


# ---------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------


def export_drafter(
    draft: str,
    output_dir: str | Path,
    *,
    dtype: str = "bfloat16",
    revision: Optional[str] = None,
    force: bool = False,
    log: Log = _stderr,
) -> Path:
    """Write an MLX drafter (directory or Hub repo) in z-lab's layout: config.json with
    ``architectures: ["DFlashDraftModel"]`` and ``model.safetensors`` in `dtype` with the
    same keys. Quantized weights are dequantized."""
    out = Path(output_dir).expanduser()
    _check_request(draft, out, force, dtype)
    s = _open_source(draft, out, force, revision=revision, require_layer_ids=False)
    weights = s.weights()
    quant = s.quantization
    if quant:
        for key in [k for k in weights if k.endswith(".scales")]:
            base = key[: -len(".scales")]
            weights[base + ".weight"] = mx.dequantize(
                weights[base + ".weight"],
                weights.pop(key),
                weights.pop(base + ".biases", None),
                group_size=quant["group_size"],
                bits=quant["bits"],
            )
        log(f"dequantized {quant['bits']}-bit weights")
    arrays = {k: v.astype(getattr(mx, dtype)) for k, v in sorted(weights.items())}
    mx.eval(arrays)
    _write_drafter(out, force, arrays, _output_config(s.cfg, s.raw, dtype), "pt")
    log(f"wrote {out}: z-lab layout, {len(arrays)} tensors ({dtype})")
    return out
