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
import shlex
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from dflash_mlx.atomic import atomic_directory
from dflash_mlx.config import parse_config
from dflash_mlx.drafter import read_config
from dflash_mlx.errors import one_line
from dflash_mlx.hub import SAFETENSORS_PATTERNS, resolve_source

__all__ = ["convert_drafter", "export_drafter", "convert_target_model", "check_output", "check_target",
           "build_convert_command"]

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
    from .checkpoint import FLOAT_DTYPES

    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"{option} must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")


def _check_quant(q_bits: int, q_group_size: int) -> None:
    if q_bits not in Q_BITS:
        raise ValueError(f"--q-bits must be one of {', '.join(map(str, Q_BITS))}, got {q_bits}")
    if q_group_size not in Q_GROUP_SIZES:
        raise ValueError(f"--q-group-size must be one of {', '.join(map(str, Q_GROUP_SIZES))}, "
                         f"got {q_group_size}")


def _check_request(source: str, out: Path, force: bool, dtype: Optional[str], quantize: bool = False,
                   q_bits: int = 4, q_group_size: int = 64) -> None:
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


def _save_weights(path: Path, arrays: dict, fmt: str) -> None:
    import mlx.core as mx

    mx.save_safetensors(str(path), arrays, metadata={"format": fmt})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _size(n_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n_bytes < 1024 or unit == "GB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
    return ""


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


def check_target(cfg, target: str) -> None:
    """Raise a one-line ValueError naming the field if the drafter cannot serve `target`."""
    from dflash_mlx.drafter import check_fit

    num_layers, hidden, vocab, rows = _load_target_dims(target)
    try:
        check_fit(cfg, num_layers=num_layers, hidden_size=hidden, vocab_size=vocab)
        if cfg.mask_token_id >= rows:
            raise ValueError(f"drafter mask_token_id {cfg.mask_token_id} is outside the target's "
                             f"embedding ({rows} rows)")
    except ValueError as e:
        raise ValueError(f"drafter does not fit target {target}: {e}") from None


def _check_quantizable(drafter, group_size: int) -> None:
    import mlx.nn as nn

    for name, module in drafter.named_modules():
        if isinstance(module, nn.Linear) and module.weight.shape[-1] % group_size:
            raise ValueError(f"cannot quantize {name} with --q-group-size {group_size}: its input "
                             f"size {module.weight.shape[-1]} is not a multiple of it")


_CARD = """\
---
library_name: mlx
tags:
- mlx
- dflash
- speculative-decoding
{base}---

# {title}

A DFlash block-diffusion drafter for speculative decoding with mlx-dflash
(`pip install mlx-dflash`), converted to MLX from z-lab's checkpoint layout.

| | |
|---|---|
| Source | {source} |
| Revision | {revision} |
| Source format | {fmt} ({src_dtype}) |
| Weights | {weights} |
| Drafter | {layers} layers, hidden {hidden}, block size {block} |
| Target features | layers {ids} of a {n_target}-layer target, mask token {mask} |

Made with:

```bash
{command}
```

Use it with its target:

```python
import dflash_mlx
from dflash_mlx import load, load_draft, generate

model, tokenizer = load("<target model>")
draft = load_draft("<this directory or repo>", model=model)
print(generate(model, tokenizer, "Hello", draft, max_tokens=128))
```

`dflash export <this directory> <out>` turns it back into z-lab's PyTorch layout
(for SGLang / vLLM).
"""


def _model_card(*, title, source, revision, fmt, src_dtype, weights, cfg, command) -> str:
    base = f"base_model: {source}\n" if "/" in source and not Path(source).exists() else ""
    return _CARD.format(
        base=base, title=title, source=source, revision=revision, fmt=fmt, src_dtype=src_dtype,
        weights=weights, layers=cfg.num_hidden_layers, hidden=cfg.hidden_size,
        block=cfg.block_size, ids=", ".join(map(str, cfg.target_layer_ids)),
        n_target=cfg.num_target_layers, mask=cfg.mask_token_id, command=command)


# ---------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------

def convert_drafter(source: str, output_dir: str | Path, *, revision: Optional[str] = None,
                    dtype: Optional[str] = None, quantize: bool = False, q_bits: int = 4,
                    q_group_size: int = 64, target: Optional[str] = None,
                    target_layer_ids: Optional[Sequence[int]] = None, force: bool = False,
                    command: Optional[str] = None, log: Log = _stderr) -> Path:
    """Convert a z-lab-layout drafter (Hub repo id or directory) into an MLX drafter
    directory. See the module docstring; returns the output path."""
    out = Path(output_dir).expanduser()
    _check_request(source, out, force, dtype, quantize, q_bits, q_group_size)

    src = resolve_source(source, revision)
    check_output(out, force, [src.path])

    # --- validate everything before writing anything --------------------------------
    from .checkpoint import open_checkpoint, validate_tensors

    raw = read_config(src.path)
    cfg, raw = parse_config(raw, target_layer_ids)
    source_quant = raw.get("quantization")
    if source_quant and quantize:
        raise ValueError("the source drafter is already quantized; convert without -q")
    ckpt = open_checkpoint(src.path)
    dropped = validate_tensors(ckpt.tensors, cfg, source_quant)
    src_dtype = ckpt.dtype() or "unknown"
    dtype = dtype or (src_dtype if src_dtype in ("float16", "bfloat16", "float32") else "float32")
    log(f"{src.describe()}: {ckpt.kind}, {len(ckpt.tensors)} tensors ({src_dtype}), "
        f"{cfg.num_hidden_layers}-layer drafter, hidden {cfg.hidden_size}: valid")
    if dropped:
        log(f"dropping {', '.join(dropped)} (the drafter uses the target's)")
    if target:
        check_target(cfg, target)
        log(f"fits target {target}")

    # --- convert ----------------------------------------------------------------------
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from dflash_mlx.drafter import Drafter

    mx_dtype = getattr(mx, dtype)
    weights = ckpt.load([k for k in ckpt.tensors if k not in dropped])
    weights = {k: v.astype(mx_dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in weights.items()}
    drafter = Drafter(cfg)
    if source_quant:
        nn.quantize(drafter, group_size=source_quant["group_size"], bits=source_quant["bits"])
    drafter.load_weights(list(weights.items()), strict=True)
    del weights
    quant = source_quant
    if quantize:
        _check_quantizable(drafter, q_group_size)
        nn.quantize(drafter, group_size=q_group_size, bits=q_bits)
        quant = {"group_size": q_group_size, "bits": q_bits}
    arrays = dict(tree_flatten(drafter.parameters()))
    mx.eval(arrays)
    n_bytes = sum(a.nbytes for a in arrays.values())

    config = _output_config(cfg, raw, dtype)
    if quant:
        config["quantization"] = dict(quant)
    weights_text = dtype + (f", {quant['bits']}-bit quantized (group size {quant['group_size']})"
                            if quant else "")
    if command is None:
        command = build_convert_command(source, str(output_dir), revision=revision, dtype=dtype,
                                        quantize=quantize, q_bits=q_bits,
                                        q_group_size=q_group_size, target=target,
                                        target_layer_ids=target_layer_ids)
    revision_text = "local directory" if not src.is_hub else (
        (src.revision or "main") + (f" (commit {src.commit})" if src.commit and src.commit != src.revision else ""))
    card = _model_card(title=f"{out.name} (MLX DFlash drafter)",
                       source=src.repo_id if src.is_hub else str(src.path.resolve()),
                       revision=revision_text, fmt=ckpt.kind, src_dtype=src_dtype,
                       weights=weights_text, cfg=cfg, command=command)

    with atomic_directory(out, overwrite=force) as tmp:
        _save_weights(tmp / "model.safetensors", arrays, "mlx")
        _write_json(tmp / "config.json", config)
        (tmp / "README.md").write_text(card)
    log(f"wrote {out} ({weights_text}, {_size(n_bytes)})")
    return out


def build_convert_command(source: str, output_dir: str, *, revision=None, dtype=None,
                          quantize=False, q_bits=4, q_group_size=64, target=None,
                          target_layer_ids=None, target_model=False) -> str:
    """The canonical `dflash convert` command line for these options (for the model card)."""
    args = ["dflash", "convert", source, output_dir]
    if target_model:
        args.append("--target-model")
    if revision:
        args += ["--revision", revision]
    if dtype:
        args += ["--dtype", dtype]
    if quantize:
        args += ["-q", "--q-bits", str(q_bits), "--q-group-size", str(q_group_size)]
    if target:
        args += ["--target", target]
    if target_layer_ids:
        args += ["--target-layer-ids", ",".join(map(str, target_layer_ids))]
    return shlex.join(args)


def convert_target_model(source: str, output_dir: str | Path, *, revision: Optional[str] = None,
                         dtype: Optional[str] = None, quantize: bool = False, q_bits: int = 4,
                         q_group_size: int = 64, force: bool = False, log: Log = _stderr) -> Path:
    """Convert a target LLM with `mlx_lm.convert` (nothing re-implemented), written atomically."""
    out = Path(output_dir).expanduser()
    _check_request(source, out, force, dtype, quantize, q_bits, q_group_size)
    import mlx_lm  # its public `mlx_lm.convert` function

    with atomic_directory(out, overwrite=force) as tmp:
        staged = tmp / "model"
        mlx_lm.convert(hf_path=source, mlx_path=str(staged), quantize=quantize,
                       q_group_size=q_group_size if quantize else None,
                       q_bits=q_bits if quantize else None, dtype=dtype, revision=revision)
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

def export_drafter(draft: str, output_dir: str | Path, *, dtype: str = "bfloat16",
                   revision: Optional[str] = None, force: bool = False, log: Log = _stderr) -> Path:
    """Write an MLX drafter (directory or Hub repo) in z-lab's layout: config.json with
    ``architectures: ["DFlashDraftModel"]`` and ``model.safetensors`` in `dtype` with the
    same keys. Quantized weights are dequantized."""
    out = Path(output_dir).expanduser()
    _check_request(draft, out, force, dtype)

    src = resolve_source(draft, revision, patterns=SAFETENSORS_PATTERNS)
    check_output(out, force, [src.path])

    from .checkpoint import open_checkpoint, validate_tensors

    raw = read_config(src.path)
    cfg, raw = parse_config(raw, require_layer_ids=False)
    quant = raw.get("quantization")
    ckpt = open_checkpoint(src.path)
    dropped = validate_tensors(ckpt.tensors, cfg, quant)

    import mlx.core as mx

    weights = ckpt.load([k for k in ckpt.tensors if k not in dropped])
    if quant:
        for key in [k for k in weights if k.endswith(".scales")]:
            base = key[: -len(".scales")]
            weights[base + ".weight"] = mx.dequantize(
                weights[base + ".weight"], weights.pop(key), weights.pop(base + ".biases", None),
                group_size=quant["group_size"], bits=quant["bits"])
        log(f"dequantized {quant['bits']}-bit weights")
    mx_dtype = getattr(mx, dtype)
    arrays = {k: v.astype(mx_dtype) for k, v in sorted(weights.items())}
    mx.eval(arrays)
    config = _output_config(cfg, raw, dtype)

    with atomic_directory(out, overwrite=force) as tmp:
        _save_weights(tmp / "model.safetensors", arrays, "pt")
        _write_json(tmp / "config.json", config)
    log(f"wrote {out}: z-lab layout, {len(arrays)} tensors ({dtype})")
    return out
