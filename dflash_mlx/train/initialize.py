"""How a new drafter starts: its config from the target, and its first weights.

Two starts:
- ``warm`` (default): the drafter's decoder layers are copies of the target layers that
  follow the deepest feature layer, `fc` passes that deepest feature through, and the
  norms are the ones the target applies there. On the first step the drafter's context
  keys/values are those of the copied target layer, and its head sees the target's final
  norm: it starts as a shallow continuation of the target instead of noise.
- ``cold``: random layers, with a data-dependent `fc` init (below), for targets whose
  layers do not fit the drafter's shapes.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..drafter import Drafter, DrafterConfig
from ..target import Target


def default_mask_token_id(tokenizer: Any) -> int:
    """A special token that the target never writes: the highest-id special token that is
    not BOS / EOS / PAD and does not appear in the chat template."""
    specials = set(getattr(tokenizer, "all_special_ids", []) or [])
    avoid = {getattr(tokenizer, n, None) for n in ("bos_token_id", "eos_token_id", "pad_token_id")}
    avoid |= set(getattr(tokenizer, "eos_token_ids", []) or [])
    template = getattr(tokenizer, "chat_template", None) or ""
    candidates = []
    for i in sorted(specials):
        if i in avoid:
            continue
        text = tokenizer.convert_ids_to_tokens(i) if hasattr(tokenizer, "convert_ids_to_tokens") else ""
        if text and text in template:
            continue
        candidates.append(i)
    if not candidates:
        raise ValueError("no unused special token in this tokenizer: pass --mask-token-id")
    return candidates[-1]


def training_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """`count` feature layers spread from layer 1 to the second-to-last: the deepest feature
    feeds a warm start's copy of the last layer, and drafters of any depth share one
    feature cache."""
    top = max(1, num_target_layers - 2)
    return sorted({int(round(x)) for x in np.linspace(1, top, count)})


def make_config(target: Target, *, num_layers: int = 5, target_layer_ids: Optional[Sequence[int]] = None,
                block_size: int = 16, mask_token_id: int, intermediate_size: Optional[int] = None,
                num_heads: Optional[int] = None, num_kv_heads: Optional[int] = None) -> DrafterConfig:
    """A drafter config for `target`: hidden size, head dims, RoPE and vocabulary follow the
    target; depth, feature layers and block size are the paper's defaults unless given."""
    args = target.args  # the text model's (multimodal wrappers nest it)
    heads = num_heads or args.num_attention_heads
    ids = list(target_layer_ids) if target_layer_ids else training_layer_ids(target.num_layers)
    return DrafterConfig(
        hidden_size=args.hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=num_kv_heads or getattr(args, "num_key_value_heads", None) or heads,
        intermediate_size=intermediate_size or args.intermediate_size, vocab_size=args.vocab_size,
        num_target_layers=target.num_layers, target_layer_ids=ids, mask_token_id=int(mask_token_id),
        block_size=block_size, head_dim=getattr(args, "head_dim", None) or args.hidden_size // heads,
        rms_norm_eps=getattr(args, "rms_norm_eps", 1e-6), rope_theta=getattr(args, "rope_theta", 10000.0),
        rope_scaling=_rope_scaling(args),
        max_position_embeddings=getattr(args, "max_position_embeddings", None) or 40960,
    )


def _rope_scaling(args) -> Optional[dict]:
    """The target's rope scaling for the drafter, unless it is the default kind (Qwen3.5's
    `rope_parameters` also carry a partial rotary factor and M-RoPE sections that a
    drafter's full rotary embedding does not use)."""
    scaling = getattr(args, "rope_scaling", None)
    kind = (scaling or {}).get("type", (scaling or {}).get("rope_type", "default"))
    return scaling if kind != "default" else None


_LAYER_PARTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")


def warm_start_sources(drafter: Drafter) -> list[int]:
    """The target layers a warm start copies into drafter layers 0.. (those right after the
    deepest feature layer, the last one repeated if the target runs out)."""
    cfg = drafter.config
    first = max(cfg.target_layer_ids) + 1
    return [min(first + j, cfg.num_target_layers - 1) for j in range(cfg.num_hidden_layers)]


def warm_start(drafter: Drafter, target: Target) -> None:
    """Copy target layers into the drafter (see the module docstring). Raises ValueError
    when a shape differs (a drafter narrower than its target): use a cold start then."""
    cfg = drafter.config
    weights: list[tuple[str, mx.array]] = []
    for j, src in enumerate(warm_start_sources(drafter)):
        layer = target.layers[src]
        for part in _LAYER_PARTS:
            obj = layer
            for name in part.split("."):
                obj = getattr(obj, name)
            mine = drafter.layers[j]
            for name in part.split("."):
                mine = getattr(mine, name)
            if getattr(obj, "weight", None) is None or obj.weight.shape != mine.weight.shape or hasattr(obj, "scales"):
                raise ValueError(f"target layer {src} {part} does not fit the drafter: use a cold start")
            weights.append((f"layers.{j}.{part}.weight", obj.weight))
    k, hidden = len(cfg.target_layer_ids), cfg.hidden_size
    deepest = cfg.target_layer_ids.index(max(cfg.target_layer_ids))
    fc = np.zeros((hidden, k * hidden), dtype=np.float32)
    fc[:, deepest * hidden: (deepest + 1) * hidden] = np.eye(hidden, dtype=np.float32)
    weights += [("fc.weight", mx.array(fc)),
                ("hidden_norm.weight", target.layers[warm_start_sources(drafter)[0]].input_layernorm.weight),
                ("norm.weight", target.body.norm.weight)]
    drafter.load_weights(weights, strict=False)
    mx.eval(drafter.parameters())


def rms_fc_init(drafter: Drafter, features: np.ndarray) -> None:
    """Cold-start `fc` init from sample features (n, k * hidden), positions >= 1 only.

    A few feature dims carry huge, nearly constant values (and position 0 is an attention
    sink), which would swamp fc + hidden_norm at the start. Scaling each input column by
    1 / that feature's RMS lets the context vectors differ from token to token from step
    one; projecting out the features' common (mean) direction keeps every context vector,
    and so every attention output, from being nearly the same."""
    rows = features.astype(np.float64)
    rms = np.sqrt((rows**2).mean(axis=0)) + 1e-3
    scale = rms / rms.mean()
    u = (rows / scale).mean(axis=0)
    u = u / max(np.linalg.norm(u), 1e-9)
    w = np.array(drafter.fc.weight, dtype=np.float64) / scale[None]
    drafter.fc.weight = mx.array((w - np.outer(w @ u, u)).astype(np.float32))
    mx.eval(drafter.parameters())
