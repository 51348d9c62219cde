"""What `dflash convert` and `dflash export` do (the commands themselves are the app's, in `app/`).

convert: a z-lab-layout drafter (Hub repo or local directory; safetensors, sharded
safetensors or a PyTorch state dict) -> a ready MLX drafter directory::

    OUTPUT_DIR/config.json         z-lab's config layout (+ "quantization" when -q)
    OUTPUT_DIR/model.safetensors   MLX weights, z-lab key names, in --dtype
    OUTPUT_DIR/README.md           model card: source, revision, dtype, the command
    OUTPUT_DIR/draft_vocab.json    the source's draft vocabulary, checked, where it has one

Everything is validated before anything is written (config fields, every tensor's
presence, name, shape and dtype, and with --target the drafter/target pair); the output
is built in a hidden temporary directory next to OUTPUT_DIR and renamed into place at the
end, so a failed or interrupted run leaves nothing behind. An existing OUTPUT_DIR is only
replaced with --force.

`convert --target-model` converts a target LLM instead, by handing it to
`mlx_lm.convert` (same atomic output handling).

export: an MLX drafter directory -> z-lab's layout (config.json with
``architectures: ["DFlashDraftModel"]`` or ``["DFlash2DraftModel"]``, bfloat16
``model.safetensors``, same keys, and the draft vocabulary if any), which SGLang, vLLM and
z-lab's PyTorch ``DFlash[2]DraftModel.from_pretrained`` load.
Quantized drafters are dequantized first.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

import dflash_mlx  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from dflash_mlx.atomic import atomic_directory
from dflash_mlx.config import parse_config
from dflash_mlx.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab
from dflash_mlx.drafter import Drafter, DrafterConfig, check_fit
from dflash_mlx.drafters import read_config, write_drafter_files
from dflash_mlx.errors import one_line
from dflash_mlx.hub import ResolvedSource, resolve_source

from .card import model_card, size_text
from .checkpoint import Checkpoint, open_checkpoint, validate_tensors
from .options import FLOAT_DTYPES, ConvertOptions, check_output

__all__ = [
    "convert_drafter",
    "export_drafter",
    "convert_target_model",
    "ConvertOptions",
    "check_target",
]

Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


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
    from dflash_mlx.targets import make_target

    try:
        model, _ = load(None if target == "default" else target, lazy=True)
    except Exception as e:  # mlx-lm / hub errors of many kinds: keep one line
        raise ValueError(f"cannot load target {target} ({one_line(e)})") from None
    t = make_target(model)
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
    options: ConvertOptions,
    *,
    target_layer_ids: Optional[Sequence[int]] = None,
    require_layer_ids: bool = True,
) -> _Source:
    """Resolve SOURCE and validate its config and every tensor, before anything is written."""
    src = resolve_source(source, options.revision)
    check_output(out, options.force, [src.path])
    cfg, raw = parse_config(read_config(src.path), target_layer_ids, require_layer_ids=require_layer_ids)
    ckpt = open_checkpoint(src.path)
    ckpt.use_names(cfg.make_drafter().key_aliases)
    dropped = validate_tensors(ckpt.tensors, cfg, raw.get("quantization"))
    return _Source(src, cfg, raw, ckpt, dropped)


def _draft_vocab_text(source: _Source) -> Optional[str]:
    """The source's draft_vocab.json, checked, to carry beside the written weights."""
    file = source.src.path / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    load_draft_vocab(file, source.cfg.vocab_size)
    return file.read_text()


def _write_drafter(
    out: Path,
    force: bool,
    arrays: dict,
    config: dict,
    fmt: str,
    card: Optional[str] = None,
    draft_vocab: Optional[str] = None,
) -> None:
    with atomic_directory(out, overwrite=force) as tmp:
        write_drafter_files(tmp, arrays, config, fmt)
        if card is not None:
            (tmp / "README.md").write_text(card)
        if draft_vocab is not None:
            (tmp / DRAFT_VOCAB_FILE).write_text(draft_vocab)


def _mlx_arrays(source: _Source, dtype: str, quant: Optional[dict]) -> dict:
    """The drafter's parameters in `dtype` (floating tensors only), quantized as `quant` asks."""
    mx_dtype = getattr(mx, dtype)
    weights = {k: v.astype(mx_dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in source.weights().items()}
    drafter = source.cfg.make_drafter()
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
    options: ConvertOptions = ConvertOptions(),
    *,
    target: Optional[str] = None,
    target_layer_ids: Optional[Sequence[int]] = None,
    command: Optional[str] = None,
    log: Log = _stderr,
) -> Path:
    """Convert a z-lab-layout drafter (Hub repo id or directory) into an MLX drafter
    directory. See the module docstring; returns the output path."""
    out = Path(output_dir).expanduser()
    options.check(source, out)
    s = _open_source(source, out, options, target_layer_ids=target_layer_ids)
    if s.quantization and options.quantize:
        raise ValueError("the source drafter is already quantized; convert without -q")
    src_dtype = s.ckpt.dtype() or "unknown"
    dtype = options.dtype or (src_dtype if src_dtype in FLOAT_DTYPES else "float32")
    log(
        f"{s.src.describe()}: {s.ckpt.kind}, {len(s.ckpt.tensors)} tensors ({src_dtype}), "
        f"{s.cfg.num_hidden_layers}-layer drafter, hidden {s.cfg.hidden_size}: valid"
    )
    if s.dropped:
        log(f"dropping {', '.join(s.dropped)} (the drafter uses the target's)")
    if target:
        check_target(s.cfg, target)
        log(f"fits target {target}")

    quant = s.quantization or options.quantization
    arrays = _mlx_arrays(s, dtype, quant)
    config = _output_config(s.cfg, s.raw, dtype)
    if quant:
        config["quantization"] = dict(quant)
    weights_text = dtype + (f", {quant['bits']}-bit quantized (group size {quant['group_size']})" if quant else "")
    if command is None:
        command = replace(options, dtype=dtype).command_line(
            source, str(output_dir), target=target, target_layer_ids=target_layer_ids
        )
    card = model_card(
        out=out, src=s.src, fmt=s.ckpt.kind, src_dtype=src_dtype, weights=weights_text, cfg=s.cfg, command=command
    )
    _write_drafter(out, options.force, arrays, config, "mlx", card, _draft_vocab_text(s))
    log(f"wrote {out} ({weights_text}, {size_text(sum(a.nbytes for a in arrays.values()))})")
    return out


def convert_target_model(
    source: str, output_dir: str | Path, options: ConvertOptions = ConvertOptions(), *, log: Log = _stderr
) -> Path:
    """Convert a target LLM with `mlx_lm.convert` (nothing re-implemented), written atomically."""
    out = Path(output_dir).expanduser()
    options.check(source, out)
    import mlx_lm  # its public `mlx_lm.convert` function

    with atomic_directory(out, overwrite=options.force) as tmp:
        staged = tmp / "model"
        q = options.quantization or {}
        mlx_lm.convert(
            hf_path=source,
            mlx_path=str(staged),
            quantize=options.quantize,
            q_group_size=q.get("group_size"),
            q_bits=q.get("bits"),
            dtype=options.dtype,
            revision=options.revision,
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
    ``architectures: ["DFlashDraftModel"]`` (or DFlash2's) and ``model.safetensors`` in `dtype` with the
    same keys. Quantized weights are dequantized."""
    out = Path(output_dir).expanduser()
    options = ConvertOptions(revision=revision, dtype=dtype, force=force)
    options.check(draft, out)
    s = _open_source(draft, out, options, require_layer_ids=False)
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
    _write_drafter(
        out, options.force, arrays, _output_config(s.cfg, s.raw, dtype), "pt", draft_vocab=_draft_vocab_text(s)
    )
    log(f"wrote {out}: z-lab layout, {len(arrays)} tensors ({dtype})")
    return out
