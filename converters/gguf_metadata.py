"""What a GGUF file says: its tensors and metadata, and the llama ``config.json`` they imply.

Part of the GGUF importer (`converters/gguf.py`); the tokenizer is rebuilt in
`gguf_tokenizer.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dflash_mlx  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

__all__ = ["GGUFImportError", "gguf_config", "need", "read_gguf"]


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported (wrong architecture, missing metadata, ...)."""


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


def need(meta: dict[str, Any], key: str) -> Any:
    """`meta[key]`, or a GGUFImportError naming the missing key."""
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

    hidden = int(need(meta, "llama.embedding_length"))
    heads = int(need(meta, "llama.attention.head_count"))
    kv_heads = int(meta.get("llama.attention.head_count_kv", heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFImportError(f"partial rotary embeddings ({rope_dim} of {head_dim}) are not supported")
    tokens = need(meta, "tokenizer.ggml.tokens")
    vocab = int(meta.get("llama.vocab_size", len(tokens)))
    tied = "output.weight" not in tensors

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(need(meta, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": int(need(meta, "llama.feed_forward_length")),
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
