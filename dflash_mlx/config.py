"""Reading and checking a drafter's config.json: the one set of rules that `load_draft`,
`dflash convert` and `dflash export` all apply, and the parser for the layer ids a
command line names.

A config is checked as a whole before any weight is read, and every problem is reported
as one line that names the field.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

from mlx_lm.models.rope_utils import initialize_rope

from .drafter import DrafterConfig
from .drafter2 import DFLASH2_FIELDS, Drafter2Config
from .drafters import config_class, config_from_dict

__all__ = ["check_config", "parse_config", "parse_layer_ids"]

# dflash_config fields that scale the drafter's input and output (gemma-4 drafters), with
# whether 0 is allowed (a soft cap of 0 means none); `Drafter.embed_blocks` applies the input
# scale, `Drafter.head` the output multiplier and the soft cap.
_SCALE_FIELDS = {"input_embedding_scale": False, "output_multiplier": False, "final_logit_softcapping": True}


def _dflash_value(raw: dict, name: str) -> Any:
    """z-lab's lookup: `dflash_config[name]` first, then the top level."""
    sub = raw.get("dflash_config") or {}
    return sub[name] if name in sub else raw.get(name)


def parse_config(
    raw: dict,
    target_layer_ids: Optional[Sequence[int]] = None,
    require_layer_ids: bool = True,
    check_ranges: bool = True,
) -> tuple[DrafterConfig, dict]:
    """Parse and sanity-check a drafter config.json dict.

    Unlike the loader, a conversion does not guess `target_layer_ids` (z-lab's default
    spread is a fallback of their training code, not a property of the weights): a config
    without them is rejected unless `target_layer_ids` is given, which fills them in.
    `check_ranges=False` leaves the layer ids and the mask token to `drafter.check_fit`
    against a real target (the loader's choice: a drafter loads on its own).
    Returns the config and the raw dict (with the ids filled in).
    """
    if not isinstance(raw, dict):
        raise ValueError("config.json must hold a JSON object")
    raw = json.loads(json.dumps(raw))  # private deep copy
    arch = raw.get("architectures")
    if arch and not {"DFlashDraftModel", "DFlash2DraftModel"} & set(arch):
        raise ValueError(
            f"config.json architectures {arch} is not a DFlash drafter (expected DFlashDraftModel or DFlash2DraftModel)"
        )
    if config_class(raw) is not Drafter2Config:
        stray = [k for k in DFLASH2_FIELDS if _dflash_value(raw, k) is not None]
        if stray:
            raise ValueError(f"config.json sets {stray[0]}, a DFlash2 field, but architectures is {arch}")
    present = _dflash_value(raw, "target_layer_ids")
    if target_layer_ids is not None:
        ids = [int(i) for i in target_layer_ids]
        if present is not None and list(present) != ids:
            raise ValueError(
                f"config.json already sets target_layer_ids {list(present)}; --target-layer-ids {ids} disagrees"
            )
        raw.setdefault("dflash_config", {})["target_layer_ids"] = ids
    elif present is None and require_layer_ids:
        raise ValueError(
            "config.json has no target_layer_ids (dflash_config.target_layer_ids): "
            "pass --target-layer-ids with the target layers the drafter was trained on"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act {raw['hidden_act']!r} is not supported (silu only)")
    if raw.get("mlp_bias"):
        raise ValueError("config.json mlp_bias = true is not supported (the drafter's MLP has no bias)")
    for name, zero_ok in _SCALE_FIELDS.items():
        value = _dflash_value(raw, name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and (value > 0 or (zero_ok and value == 0))):
            raise ValueError(f"config.json {name} must be a positive number, got {value!r}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) if isinstance(rope, dict) else 1
    if partial != 1:
        raise ValueError(
            f"config.json partial_rotary_factor {partial} is not supported (the drafter rotates every dim)"
        )
    try:
        cfg = config_from_dict(raw)
    except (KeyError, TypeError) as e:
        raise ValueError(f"config.json is not a valid drafter config ({type(e).__name__}: {e})") from None
    check_config(cfg, check_ranges=check_ranges)
    return cfg, raw


def check_config(cfg: DrafterConfig, check_ranges: bool = True) -> None:
    """Raise a one-line ValueError naming the first field of `cfg` that cannot work. With
    `check_ranges`, the layer ids must lie in num_target_layers and the mask in the vocabulary."""
    for name in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "num_target_layers",
        "head_dim",
        "block_size",
    ):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"config.json {name} must be a positive integer, got {value!r}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"config.json num_attention_heads {cfg.num_attention_heads} is not a multiple "
            f"of num_key_value_heads {cfg.num_key_value_heads}"
        )
    if cfg.block_size < 2:
        raise ValueError(f"config.json block_size must be at least 2, got {cfg.block_size}")
    ids = cfg.target_layer_ids
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"config.json target_layer_ids must be a non-empty list of integers, got {ids!r}")
    if check_ranges:
        _check_ranges(cfg)
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ValueError(
            f"config.json layer_types has {len(cfg.layer_types)} entries for {cfg.num_hidden_layers} layers"
        )
    unknown = sorted(set(cfg.layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"config.json layer_types: unsupported {unknown}")
    _check_rope(cfg)
    if "sliding_attention" in cfg.layer_types and not (isinstance(cfg.sliding_window, int) and cfg.sliding_window > 0):
        raise ValueError(f"config.json has sliding_attention layers but sliding_window is {cfg.sliding_window!r}")
    if isinstance(cfg, Drafter2Config):
        _check_dflash2(cfg)


def _check_dflash2(cfg: Drafter2Config) -> None:
    for name in DFLASH2_FIELDS:
        value = getattr(cfg, name)
        if value is None:
            raise ValueError(f"config.json lacks dflash_config.{name}, which a DFlash2 drafter needs")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"config.json {name} must be a positive integer, got {value!r}")
    if cfg.hidden_size % cfg.conv_group_size:
        raise ValueError(
            f"config.json conv_group_size {cfg.conv_group_size} does not divide hidden_size {cfg.hidden_size}"
        )
    if cfg.selector_top_k > cfg.vocab_size:
        raise ValueError(f"config.json selector_top_k {cfg.selector_top_k} exceeds vocab_size {cfg.vocab_size}")


def _check_rope(cfg: DrafterConfig) -> None:
    """The drafter's rotary embedding is mlx-lm's `initialize_rope`: refuse a scaling type it lacks."""
    scaling = cfg.rope_scaling or {}
    if not isinstance(scaling, dict):
        raise ValueError(f"config.json rope_scaling must be an object, got {scaling!r}")
    if scaling.get("truncate", True) is not True:  # mlx-lm's YaRN always rounds the correction range
        raise ValueError("config.json rope_scaling truncate = false is not supported (mlx-lm's YaRN truncates)")
    try:
        initialize_rope(cfg.head_dim, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"config.json rope_scaling {scaling} is not usable ({type(e).__name__}: {e})") from None


def _check_ranges(cfg: DrafterConfig) -> None:
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < cfg.num_target_layers]
    if bad:
        raise ValueError(
            f"config.json target_layer_ids {bad} out of range for num_target_layers {cfg.num_target_layers}"
        )
    if not 0 <= cfg.mask_token_id < cfg.vocab_size:
        raise ValueError(f"config.json mask_token_id {cfg.mask_token_id} is outside vocab_size {cfg.vocab_size}")


def parse_layer_ids(text: Optional[str], option: str = "--target-layer-ids") -> Optional[list[int]]:
    """ "1,9,17,25,33" (spaces or brackets allowed) -> [1, 9, 17, 25, 33]; None -> None.
    Anything else is a one-line ValueError naming `option`."""
    if text is None:
        return None
    parts = [p for p in text.strip().strip("[]").replace(" ", ",").split(",") if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError(f"{option} is empty")
    return ids
