"""Import a llama-architecture GGUF file as a plain MLX / Hugging Face model directory.

The result is what `mlx_lm.load(out_dir)` expects, with no special code:

- ``config.json``             (``model_type: llama``)
- ``model.safetensors``       (Hugging Face key names, weights dequantized to ``dtype``)
- ``tokenizer.json``          (byte-level BPE rebuilt from the GGUF vocabulary and merges)
- ``tokenizer_config.json``   (chat template, bos / eos / pad / unk tokens)
- ``generation_config.json``  (eos token id)
- ``dflash_import.json``      (where the directory came from; written last)

Two GGUF details need care:

- MLX's GGUF reader returns Q4_0 / Q4_1 / Q8_0 tensors as MLX affine-quantized triples
  ``X.weight`` (packed uint32) + ``X.scales`` + ``X.biases`` with group size 32; the bit
  width follows from the packed width. Other tensors come back as plain arrays.
- llama.cpp's converter reorders the rows of every Q and K projection, per head, so that
  rotary pairs sit next to each other (GPT-J style, ``2*j + i``) instead of in two halves
  (NeoX / Hugging Face style, ``i*half + j``). :func:`unpermute_rope_rows` undoes that.

The directory is built in a temporary folder next to ``out_dir`` and renamed into place
only when complete, so a failed import leaves no ``out_dir`` behind.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import dflash_mlx  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

from dflash_mlx.atomic import atomic_directory

from .gguf_metadata import GGUFImportError, gguf_config, read_gguf
from .gguf_tokenizer import build_tokenizer, tokenizer_config

__all__ = [
    "GGUFImportError",
    "REQUIRED_FILES",
    "MARKER_FILE",
    "import_gguf",
    "is_complete",
    "read_gguf",
    "gguf_config",
    "convert_weights",
    "build_tokenizer",
    "dequantize_tensor",
    "unpermute_rope_rows",
]

MARKER_FILE = "dflash_import.json"
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    MARKER_FILE,
)
GROUP_SIZE = 32
_IMPORT_FORMAT = 1  # bump when the layout of an imported directory changes

_DTYPES = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}

# GGUF tensor names -> Hugging Face llama names.
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)$")


# --------------------------------------------------------------------------- weights


def dequantize_tensor(tensors: dict[str, mx.array], name: str, dtype: mx.Dtype = mx.float32) -> mx.array:
    """Return GGUF tensor ``name`` (e.g. ``"blk.0.attn_q"``) as a dense ``dtype`` array of its
    logical shape ((out, in) for a projection: packed uint32 columns expanded).

    Quantized tensors are expanded with :func:`mlx.core.dequantize` (group size 32; the
    bit width is ``packed_width * 32 // columns``). Scales and biases are widened to
    float32 first so that nothing is lost to float16 rounding.
    """
    weight = tensors[f"{name}.weight"]
    scales = tensors.get(f"{name}.scales")
    if scales is None:
        return weight.astype(dtype)
    biases = tensors[f"{name}.biases"]
    columns = scales.shape[-1] * GROUP_SIZE
    bits = weight.shape[-1] * 32 // columns
    dense = mx.dequantize(
        weight,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=GROUP_SIZE,
        bits=bits,
    )
    return dense.astype(dtype)


def unpermute_rope_rows(weight: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's per-head rotary row reordering of a Q or K projection `weight`
    (n_heads * head_dim, in); the same shape comes back.

    In a GGUF file, row ``2*j + i`` of each head (``i`` in {0, 1}, ``j < head_dim/2``)
    holds what Hugging Face keeps at row ``i*head_dim/2 + j``: rotary pairs are
    interleaved instead of split into two halves. Reading the rows as
    ``(head, j, i)`` and swapping the last two axes gives back ``(head, i, j)``.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise GGUFImportError(f"{rows} rows cannot be split into {n_heads} rotary heads")
    half = rows // n_heads // 2
    rest = weight.shape[1:]
    out = weight.reshape(n_heads, half, 2, *rest).swapaxes(1, 2)
    return out.reshape(rows, *rest)


def _hf_name(gguf_base: str) -> str | None:
    if gguf_base in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_base]
    m = _LAYER_RE.match(gguf_base)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _tensor_bases(tensors: dict[str, mx.array]) -> list[str]:
    bases = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight")})
    unknown = [b for b in bases if _hf_name(b) is None]
    if unknown:
        raise GGUFImportError(f"unsupported GGUF tensors: {', '.join(unknown[:5])}")
    return bases


def convert_weights(
    tensors: dict[str, mx.array],
    config: dict[str, Any],
    dtype: mx.Dtype = mx.float32,
    on_tensor: Any = None,
) -> dict[str, mx.array]:
    """Map GGUF tensors to dense Hugging Face llama weights.

    ``on_tensor(name)`` is called after each tensor (for progress display).
    """
    out: dict[str, mx.array] = {}
    for base in _tensor_bases(tensors):
        hf = _hf_name(base)
        assert hf is not None
        w = dequantize_tensor(tensors, base, dtype)
        if base.endswith(".attn_q"):
            w = unpermute_rope_rows(w, config["num_attention_heads"])
        elif base.endswith(".attn_k"):
            w = unpermute_rope_rows(w, config["num_key_value_heads"])
        mx.eval(w)
        out[f"{hf}.weight"] = w
        if on_tensor is not None:
            on_tensor(base)
    layers = config["num_hidden_layers"]
    expected = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(layers) for n in _LAYER_NAMES.values()
    ]
    missing = [k for k in expected if k not in out]
    if missing:
        raise GGUFImportError(f"GGUF file lacks tensors: {', '.join(missing[:5])}")
    return out


# --------------------------------------------------------------------------- writing


def is_complete(model_dir: str | os.PathLike) -> bool:
    """True when ``model_dir`` holds a finished import (all files and the marker)."""
    d = Path(model_dir)
    return d.is_dir() and all((d / f).is_file() for f in REQUIRED_FILES)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Any]:
    """A rich progress bar (or a no-op) with ``advance(text)`` and ``note(text)``."""

    class _Null:
        def advance(self, text: str = "") -> None:
            pass

        def note(self, text: str) -> None:
            pass

    if not enabled:
        yield _Null()
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("[bold]importing GGUF[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=Console(stderr=True),
        transient=True,
    )

    class _Bar:
        def __init__(self) -> None:
            self.task = progress.add_task("reading", total=total)

        def advance(self, text: str = "") -> None:
            progress.update(self.task, advance=1, description=text)

        def note(self, text: str) -> None:
            progress.update(self.task, description=text)

    with progress:
        yield _Bar()


def _write_tokenizer(out: Path, meta: dict[str, Any], config: dict[str, Any]) -> None:
    """tokenizer.json, tokenizer_config.json and generation_config.json from the metadata."""
    tokenizer, special = build_tokenizer(meta)
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta, special, config["max_position_embeddings"]))
    generation: dict[str, Any] = {"eos_token_id": config.get("eos_token_id")}
    for k in ("bos_token_id", "pad_token_id"):
        if k in config:
            generation[k] = config[k]
    _write_json(out / "generation_config.json", generation)


def import_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a llama-architecture GGUF file into an MLX / Hugging Face model directory.

    Args:
        gguf_path: the ``.gguf`` file (Q4_0, Q4_1, Q8_0 or unquantized tensors).
        out_dir: directory to create; it must not exist unless ``overwrite`` is set.
        dtype: ``"float32"`` (default; the fast CPU path), ``"float16"`` or ``"bfloat16"``.
        overwrite: replace an existing ``out_dir`` (swapped in atomically at the end).
        progress: show a rich progress bar on stderr.

    Returns:
        The path of the new directory, loadable with ``mlx_lm.load(out_dir)``.

    Raises:
        FileExistsError: ``out_dir`` exists and ``overwrite`` is false.
        GGUFImportError: the file is not a supported llama GGUF.

    The directory is built in a temporary sibling folder and renamed into place only
    when complete; on any failure nothing is left at ``out_dir``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    src = Path(gguf_path).expanduser().resolve()
    out = Path(out_dir).expanduser().absolute()
    out.parent.mkdir(parents=True, exist_ok=True)  # the models folder stays, even on failure
    with atomic_directory(out, overwrite=overwrite) as tmp:
        tensors, meta = read_gguf(src)
        config = gguf_config(meta, tensors)
        with _progress(progress, len(_tensor_bases(tensors)) + 2) as bar:
            _write_json(tmp / "config.json", config)
            weights = convert_weights(tensors, config, _DTYPES[dtype], on_tensor=bar.advance)
            del tensors
            bar.note("writing model.safetensors")
            mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
            del weights
            bar.advance("model.safetensors")
            bar.note("tokenizer")
            _write_tokenizer(tmp, meta, config)
            bar.advance("tokenizer")
        marker = {
            "format": _IMPORT_FORMAT,
            "source": str(src),
            "source_bytes": src.stat().st_size,
            "dtype": dtype,
            "name": meta.get("general.name"),
        }
        _write_json(tmp / MARKER_FILE, marker)  # last: its presence means complete
    return out
