"""How a new drafter starts: its config from the target, and its first weights.

Two starts:
- ``warm`` (default): the drafter's decoder layers are copies of the target layers that
  follow the deepest feature layer, `fc` passes that deepest feature through, and the
  norms are the ones the target applies there. On the first step the drafter's context
  keys/values are those of the copied target layer, and its head sees the target's final
  norm: it starts as a shallow continuation of the target instead of noise.
- ``cold``: random layers, with a data-dependent `fc` init (below), for targets whose
  layers do not fit the drafter's shapes.

A DFlash2 drafter's additions start neutral under either start (`neutral_dflash2`): its
convolutions are the identity and its selector adds nothing, so it computes what a v1
drafter with the same weights computes, and `init_from` turns a trained v1 drafter into
a DFlash2 drafter that drafts exactly the same tokens at step 0.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..config import check_config
from ..drafter import Drafter, DrafterConfig, check_fit
from ..drafter2 import DFLASH2_FIELDS, Drafter2, Drafter2Config
from ..drafters import load_drafter_dir
from ..target import Target
from ..targets import make_target

if TYPE_CHECKING:
    from .checkpoint import TrainArgs


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


def as_arch(cfg: DrafterConfig, dflash2: Optional[dict] = None) -> DrafterConfig:
    """`cfg`'s v1 fields as a v1 config (`dflash2` None) or as a DFlash2 config with the
    `DFLASH2_FIELDS` values in `dflash2`."""
    values = {f.name: getattr(cfg, f.name) for f in fields(DrafterConfig)}
    return Drafter2Config(**values, **dflash2) if dflash2 else DrafterConfig(**values)


def make_config(
    target: Target,
    *,
    num_layers: int = 5,
    target_layer_ids: Optional[Sequence[int]] = None,
    block_size: int = 16,
    mask_token_id: int,
    intermediate_size: Optional[int] = None,
    num_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    dflash2: Optional[dict] = None,
) -> DrafterConfig:
    """A drafter config for `target`: hidden size, head dims, RoPE and vocabulary follow the
    target; depth, feature layers and block size are the paper's defaults unless given.
    `dflash2`: the DFlash2 fields of a DFlash2 drafter (None: a v1 drafter)."""
    args = target.args  # the text model's (multimodal wrappers nest it)
    heads = num_heads or args.num_attention_heads
    ids = list(target_layer_ids) if target_layer_ids else training_layer_ids(target.num_layers)
    return as_arch(
        DrafterConfig(
            hidden_size=args.hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=num_kv_heads or getattr(args, "num_key_value_heads", None) or heads,
            intermediate_size=intermediate_size or args.intermediate_size,
            vocab_size=args.vocab_size,
            num_target_layers=target.num_layers,
            target_layer_ids=ids,
            mask_token_id=int(mask_token_id),
            block_size=block_size,
            head_dim=getattr(args, "head_dim", None) or args.hidden_size // heads,
            rms_norm_eps=getattr(args, "rms_norm_eps", 1e-6),
            rope_theta=getattr(args, "rope_theta", 10000.0),
            rope_scaling=_rope_scaling(args),
            max_position_embeddings=getattr(args, "max_position_embeddings", None) or 40960,
        ),
        dflash2,
    )


def _rope_scaling(args) -> Optional[dict]:
    """The target's rope scaling for the drafter, unless it is the default kind (Qwen3.5's
    `rope_parameters` also carry a partial rotary factor and M-RoPE sections that a
    drafter's full rotary embedding does not use)."""
    scaling = getattr(args, "rope_scaling", None)
    kind = (scaling or {}).get("type", (scaling or {}).get("rope_type", "default"))
    return scaling if kind != "default" else None


_LAYER_PARTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)


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
    fc[:, deepest * hidden : (deepest + 1) * hidden] = np.eye(hidden, dtype=np.float32)
    weights += [
        ("fc.weight", mx.array(fc)),
        ("hidden_norm.weight", target.layers[warm_start_sources(drafter)[0]].input_layernorm.weight),
        ("norm.weight", target.body.norm.weight),
    ]
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


def neutral_dflash2(drafter: Drafter) -> None:
    """Make a DFlash2 drafter's additions neutral: every convolution is the identity and
    the selector's projection is zero, so its edges are 0 and its path is each position's
    argmax. Both still receive gradients. A v1 drafter is left as it is."""
    if not isinstance(drafter, Drafter2):
        return
    for layer in drafter.layers:
        layer.attention_conv.make_identity()
        layer.mlp_conv.make_identity()
    projection = drafter.candidate_selector.hidden_projection
    projection.weight = mx.zeros_like(projection.weight)


def init_from(path: str, block_size: int, dflash2: Optional[dict] = None) -> Drafter:
    """A new drafter (DFlash2 with the fields in `dflash2`, else v1) that starts as the
    trained drafter at `path`: all of its weights, and DFlash2 additions that start neutral
    when it has none, so that it drafts exactly as that drafter does. A DFlash2 source keeps
    its own DFlash2 fields; `block_size` is the one to train at."""
    source = load_drafter_dir(path)
    if "quantization" in source.config.extra:
        raise ValueError(f"--init-from: {path} is quantized; start from a float drafter")
    if isinstance(source.config, Drafter2Config):
        if not dflash2:
            raise ValueError(f"--init-from: {path} is a DFlash2 drafter; train it with --arch dflash2")
        dflash2 = {k: getattr(source.config, k) for k in DFLASH2_FIELDS}
    cfg = replace(as_arch(source.config, dflash2), block_size=block_size)
    check_config(cfg)
    drafter = cfg.make_drafter()
    neutral_dflash2(drafter)
    drafter.load_weights(tree_flatten(source.parameters()), strict=False)
    mx.eval(drafter.parameters())
    return drafter


def new_drafter(args: TrainArgs, model: Any, tokenizer: Any) -> Drafter:
    """The drafter a fresh run of `args` starts from (its first weights: `Trainer._initialize`),
    checked against the target `model`."""
    target = make_target(model)
    if args.init_from:
        drafter = init_from(args.init_from, args.block_size, args.dflash2_fields())
    else:
        mask_id = args.mask_token_id if args.mask_token_id is not None else default_mask_token_id(tokenizer)
        cfg = make_config(
            target,
            num_layers=args.num_layers,
            target_layer_ids=args.target_layer_ids,
            block_size=args.block_size,
            mask_token_id=mask_id,
            intermediate_size=args.intermediate_size,
            dflash2=args.dflash2_fields(),
        )
        check_config(cfg)
        mx.random.seed(args.seed)
        drafter = cfg.make_drafter()
        neutral_dflash2(drafter)
        mx.eval(drafter.parameters())
    check_fit(
        drafter.config, num_layers=target.num_layers, hidden_size=target.hidden_size, vocab_size=target.vocab_size
    )
    return drafter
