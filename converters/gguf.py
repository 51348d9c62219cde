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
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import dflash_mlx  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

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

# llama.cpp token types.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizers known to be "GPT-2 byte level, digits split one by one".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact"}
_PLAIN_GPT2_PRE = {"gpt2", "gpt-2", "default"}


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported (wrong architecture, missing metadata, ...)."""


# --------------------------------------------------------------------------- reading


def read_gguf(gguf_path: str | os.PathLike) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """Read a GGUF file with MLX; metadata scalars become Python values.

    Returns ``(tensors, metadata)``. Quantized tensors stay as MLX triples
    (``.weight``/``.scales``/``.biases``).
    """
    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        tensors, raw = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX raises a bare ValueError/RuntimeError
        raise GGUFImportError(f"could not read {path} as GGUF: {exc}") from exc
    meta: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, mx.array) and value.ndim == 0:
            meta[key] = value.item()
        else:
            meta[key] = value
    return tensors, meta


def _need(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFImportError(f"GGUF metadata has no {key!r}")
    return meta[key]


def gguf_config(meta: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    """Build a Hugging Face llama ``config.json`` dict from GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFImportError(f"only llama-architecture GGUF files are supported, got {arch!r}")
    if "rope_freqs.weight" in tensors:
        raise GGUFImportError("llama3-style rope frequency scaling (rope_freqs) is not supported")
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GGUFImportError(f"rope scaling {scaling!r} is not supported")

    hidden = int(_need(meta, "llama.embedding_length"))
    heads = int(_need(meta, "llama.attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFImportError(f"partial rotary embeddings ({rope_dim} of {head_dim}) are not supported")
    tokens = _need(meta, "tokenizer.ggml.tokens")
    vocab = int(meta.get("llama.vocab_size", len(tokens)))
    tied = "output.weight" not in tensors

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_need(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(_need(meta, "llama.feed_forward_length")),
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "vocab_size": vocab,
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    for key, name in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        if key in meta:
            config[name] = int(meta[key])
    return config


# --------------------------------------------------------------------------- weights


def dequantize_tensor(
    tensors: dict[str, mx.array], name: str, dtype: mx.Dtype = mx.float32
) -> mx.array:
    """Return GGUF tensor ``name`` (e.g. ``"blk.0.attn_q"``) as a dense ``dtype`` array.

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
    """Undo llama.cpp's per-head rotary row reordering of a Q or K projection.

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


# --------------------------------------------------------------------------- tokenizer


def _pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre is None or pre in _PLAIN_GPT2_PRE:
        return byte_level
    raise GGUFImportError(f"unsupported GGUF pre-tokenizer {pre!r}")


def build_tokenizer(meta: dict[str, Any]) -> tuple[Any, list[str]]:
    """Rebuild a byte-level BPE ``tokenizers.Tokenizer`` from GGUF metadata.

    Returns ``(tokenizer, special_tokens)``; control tokens (type 3) and user-defined
    tokens (type 4) become added tokens, the control ones marked special.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFImportError(f"only byte-level BPE ('gpt2') tokenizers are supported, got {model!r}")
    tokens = list(_need(meta, "tokenizer.ggml.tokens"))
    merges_raw = list(_need(meta, "tokenizer.ggml.merges"))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFImportError("GGUF vocabulary has duplicate tokens")
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise GGUFImportError(f"malformed BPE merge {m!r}")
        merges.append((left, right))

    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else list(types or [])

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    special: list[str] = []
    added: list[AddedToken] = []
    for i, t in enumerate(types):
        if t == _TOKEN_CONTROL:
            special.append(tokens[i])
            added.append(AddedToken(tokens[i], special=True, normalized=False))
        elif t == _TOKEN_USER_DEFINED:
            added.append(AddedToken(tokens[i], special=False, normalized=False))
    if added:
        tok.add_tokens(added)
    return tok, special


def _token(meta: dict[str, Any], key: str) -> str | None:
    if key not in meta:
        return None
    tokens = meta["tokenizer.ggml.tokens"]
    idx = int(meta[key])
    return tokens[idx] if 0 <= idx < len(tokens) else None


def _tokenizer_config(meta: dict[str, Any], special: list[str], max_len: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    for key, name in (
        ("tokenizer.ggml.bos_token_id", "bos_token"),
        ("tokenizer.ggml.eos_token_id", "eos_token"),
        ("tokenizer.ggml.padding_token_id", "pad_token"),
        ("tokenizer.ggml.unknown_token_id", "unk_token"),
    ):
        value = _token(meta, key)
        if value is not None:
            cfg[name] = value
    named = {cfg.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    extra = [s for s in special if s not in named]
    if extra:
        cfg["additional_special_tokens"] = extra
    template = meta.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return cfg


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


def _place(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` directory to ``out``."""
    if not overwrite:
        try:
            os.rename(tmp, out)
        except OSError as exc:
            if out.exists():  # someone else finished first
                raise FileExistsError(f"{out} already exists") from exc
            raise
        return
    trash = None
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, trash / out.name)
    os.rename(tmp, out)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


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
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        tensors, meta = read_gguf(src)
        config = gguf_config(meta, tensors)
        n_tensors = len(_tensor_bases(tensors))
        with _progress(progress, n_tensors + 2) as bar:
            _write_json(tmp / "config.json", config)
            weights = convert_weights(tensors, config, _DTYPES[dtype], on_tensor=bar.advance)
            del tensors
            bar.note("writing model.safetensors")
            mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
            del weights
            bar.advance("model.safetensors")

            bar.note("tokenizer")
            tokenizer, special = build_tokenizer(meta)
            tokenizer.save(str(tmp / "tokenizer.json"))
            _write_json(
                tmp / "tokenizer_config.json",
                _tokenizer_config(meta, special, config["max_position_embeddings"]),
            )
            gen: dict[str, Any] = {"eos_token_id": config.get("eos_token_id")}
            for k in ("bos_token_id", "pad_token_id"):
                if k in config:
                    gen[k] = config[k]
            _write_json(tmp / "generation_config.json", gen)
            bar.advance("tokenizer")

        _write_json(
            tmp / MARKER_FILE,
            {
                "format": _IMPORT_FORMAT,
                "source": str(src),
                "source_bytes": src.stat().st_size,
                "dtype": dtype,
                "name": meta.get("general.name"),
            },
        )
        _place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
