"""Tiny random instances of every supported target family, built with mlx-lm's own
`Model(ModelArgs(...))`: a few layers, width 64, vocabulary 256, float32. Each has the
layer kinds its family mixes (gated-delta and full attention; sliding-window and full
attention with a window of 8, far shorter than the prompts; MoE blocks; gemma-4's
shared K/V and per-layer inputs)."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Optional

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

VOCAB = 256
HIDDEN = 64
WINDOW = 8

_LINEAR = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
)
_COMMON = dict(
    hidden_size=HIDDEN,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    mlp_only_layers=[],
)

ARGS = {
    "qwen3": dict(**_COMMON, num_hidden_layers=4, intermediate_size=128, rope_theta=10000.0),
    "qwen3_moe": dict(**_COMMON, **_MOE, num_hidden_layers=4, intermediate_size=128, rope_theta=10000.0),
    "qwen3_5": dict(
        text_config=dict(**_COMMON, **_LINEAR, model_type="qwen3_5", num_hidden_layers=4, intermediate_size=128)
    ),
    "qwen3_5_moe": dict(
        text_config=dict(
            **_COMMON,
            **_LINEAR,
            **_MOE,
            model_type="qwen3_5_moe",
            num_hidden_layers=4,
            intermediate_size=128,
            shared_expert_intermediate_size=32,
        )
    ),
    "qwen3_next": dict(
        **_COMMON,
        **_LINEAR,
        **_MOE,
        num_hidden_layers=4,
        intermediate_size=128,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        shared_expert_intermediate_size=32,
    ),
    "gpt_oss": dict(
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        num_hidden_layers=4,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        rope_theta=10000,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "gemma4_text": dict(
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB,
        num_hidden_layers=6,
        intermediate_size=64,
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=8,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        final_logit_softcapping=5.0,
        tie_word_embeddings=True,
    ),
}
ARGS["gemma4"] = dict(vocab_size=VOCAB, text_config=dict(ARGS["gemma4_text"], model_type="gemma4_text"))
ARGS["llama"] = dict(**_COMMON, num_hidden_layers=3, intermediate_size=128, attention_bias=True)
ARGS["mistral"] = dict(ARGS["llama"], attention_bias=False)
ARGS["qwen2"] = dict({k: v for k, v in _COMMON.items() if k != "head_dim"}, num_hidden_layers=3, intermediate_size=128)
# a llama with sliding-window layers (mlx-lm gives them a RotatingKVCache)
ARGS["llama_swa"] = dict(
    ARGS["llama"], sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
)
#: mlx-lm module and model type of the entries that are not named after theirs
MODULES = {"mistral": ("llama", "mistral"), "llama_swa": ("llama", "llama")}

FAMILIES = ["qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss", "gemma4_text", "gemma4"]


def tiny_config(family: str, vocab_size: Optional[int] = None, **fields) -> dict:
    """The config.json of a tiny `family` model: `ARGS[family]` and its model type; a
    `vocab_size` replaces the vocabulary (gemma's per-layer inputs then take the default
    size, mlx-lm's), `fields` replace or add top-level fields (a test's own sizes)."""
    args = json.loads(json.dumps(ARGS[family]))
    if vocab_size is not None:
        for config in (args, args.get("text_config")):
            if config is not None and "vocab_size" in config:
                config["vocab_size"] = vocab_size
                config.pop("vocab_size_per_layer_input", None)
    return dict(args, **fields, model_type=MODULES.get(family, (family, family))[1])


def tiny_target(family: str, seed: int = 0, scale: float = 1.0, **config):
    """A float32 random `family` model. `scale` multiplies every weight matrix (larger
    weights give sharper, more varied greedy continuations than the init's near-uniform
    ones); `config`: `tiny_config`'s keywords."""
    module = importlib.import_module(f"mlx_lm.models.{MODULES.get(family, (family,))[0]}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(tiny_config(family, **config)))
    if scale != 1.0:
        model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def save_tiny_target(family: str, path, tokenizer_dir, vocab_size: int, seed: int = 0, scale: float = 2.0) -> Path:
    """A tiny random `family` model (`tiny_target`) saved as an mlx-lm model directory
    (config.json, model.safetensors and the tokenizer files of `tokenizer_dir`), for
    `mlx_lm.load`, `dflash generate --model` and the rest. Returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_target(family, seed, scale, vocab_size=vocab_size)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(tiny_config(family, vocab_size), indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, path / name)
    return path


def tiny_drafter_config(num_target_layers: int, block_size: int, vocab_size: int = VOCAB, mask_token_id: int = 4):
    """A one-layer drafter that fits a tiny target (4 heads of 16, 2 KV heads, MLP 64),
    reading its first and last layers."""
    from dflash_mlx.drafter import DrafterConfig

    return DrafterConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=vocab_size,
        num_target_layers=num_target_layers,
        target_layer_ids=[0, num_target_layers - 1],
        mask_token_id=mask_token_id,
        block_size=block_size,
    )
