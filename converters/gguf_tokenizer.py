"""Rebuild a GGUF file's byte-level BPE tokenizer as a Hugging Face ``tokenizers`` one.

Part of the GGUF importer (`converters/gguf.py`): the vocabulary, merges and token types
in the metadata become ``tokenizer.json``; the special tokens and the chat template become
``tokenizer_config.json``.
"""

from __future__ import annotations

from typing import Any

import dflash_mlx  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx

from .gguf_metadata import GGUFImportError, need

__all__ = ["build_tokenizer", "tokenizer_config"]

# llama.cpp token types.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Pre-tokenizers known to be "GPT-2 byte level, digits split one by one".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact"}
_PLAIN_GPT2_PRE = {"gpt2", "gpt-2", "default"}


def _pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
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
    tokens = list(need(meta, "tokenizer.ggml.tokens"))
    merges_raw = list(need(meta, "tokenizer.ggml.merges"))
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


def tokenizer_config(meta: dict[str, Any], special: list[str], max_len: int) -> dict[str, Any]:
    """``tokenizer_config.json``: the special tokens, the chat template and the length limit."""
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
