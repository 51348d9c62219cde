"""Test helper: z-lab's reference DFlash implementation (PyPI ``dflash==0.1.0``).

This module wraps z-lab's own code, used only through ``import`` (nothing of it
is copied here), so that our MLX drafter can be checked against the reference
in conformance tests. It needs ``torch`` (CPU) and ``dflash==0.1.0``; use
:data:`ZLAB_AVAILABLE` / :func:`skip_unless_zlab` so the suite still runs without
them. torch and dflash are imported lazily, inside the functions.

Facts about z-lab's API (read from the installed 0.1.0 sources)
=========================================================


PyTorch side, ``dflash.model``
------------------------------
* ``DFlashDraftModel(config)`` subclasses ``Qwen3PreTrainedModel`` with
  ``config_class = Qwen3Config``; the extra fields simply ride on the config:
  ``dflash_config`` (dict), ``block_size``, ``num_target_layers``. Every DFlash
  field is looked up as ``config.dflash_config[name]`` first and as a top-level
  attribute second (so ``block_size`` may sit at either place; default 16).
  ``target_layer_ids`` defaults to ``round(1 + i * (n_target - 4) / (n_draft - 1))``
  (``[n_target // 2]`` for one layer); ``mask_token_id`` has no default (None).
  Loading is plain HF: ``DFlashDraftModel.from_pretrained(dir, dtype=...)``
  (their benchmark passes ``attn_implementation="sdpa"``); safetensors, sharded
  safetensors with index and ``pytorch_model.bin`` all load.
* With transformers 5.x a top-level ``rope_theta`` in config.json becomes
  ``config.rope_parameters = {"rope_theta": ..., "rope_type": "default"}``.
  ``layer_types`` defaults to all ``full_attention`` (``use_sliding_window``
  false). ``attention_bias`` is honoured (the MLX port hard-codes no bias).
* ``state_dict()`` holds exactly ``11 * num_layers + 3`` tensors with the key
  names our checkpoints use (``fc.weight``, ``hidden_norm.weight``,
  ``norm.weight``, ``layers.{i}.…``); the rotary ``inv_freq`` buffers are not
  persistent.
* ``forward(position_ids, attention_mask=None, noise_embedding=None,
  target_hidden=None, past_key_values=None, use_cache=False)`` returns a plain
  tensor: ``norm(h)`` for ALL block positions, shape (1, B, hidden). No logits:
  ``compute_logits(hidden, output_head)`` = ``output_head(hidden) *
  output_multiplier`` and an optional tanh softcap (``final_logit_softcapping``).
  - ``noise_embedding`` (1, B, hidden): the TARGET's embedding rows of
    ``[last committed token, mask x (B-1)]`` (``F.embedding`` on the target's
    input-embedding weight, times ``input_embedding_scale``, default 1).
  - ``target_hidden`` (1, n_new, len(ids) * hidden): the raw concatenation of
    HF ``hidden_states[i + 1]`` for i in ``target_layer_ids``, NEW context only.
    It goes through ``hidden_norm(fc(x))`` (fc first, then the RMSNorm), once,
    and the same tensor feeds every layer; it never passes through a layer's
    ``input_layernorm`` and has no MLP path.
  - ``position_ids`` (1, n_new + B): the new context's absolute positions
    followed by the block's. RoPE keys get all of them, queries the last B
    (``apply_rotary_pos_emb`` slices ``cos[..., -q_len:, :]``).
* Attention per layer: q from the block only (``q_norm`` then RoPE); keys =
  ``k_norm(k_proj(concat(ctx, block)))`` then RoPE, values ``v_proj`` of the same
  (no norm). The cache update appends [new ctx K/V, block K/V] (post-norm,
  post-RoPE). Full-attention layers get no mask and the module's
  ``is_causal = False`` reaches SDPA, so the block is bidirectional and sees all
  cached context. ``sliding_attention`` layers are causal unless ``is_causal``.
* Without a cache the drafter output depends only on RELATIVE positions (RoPE):
  shifting context and block together changes nothing; a gap between them does.

z-lab's torch generation loop and their MLX side: ``zlab_run.py``.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ZLAB_VERSION = "0.1.0"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


#: True when torch and z-lab's ``dflash`` package (with ``dflash.model``) are importable.
ZLAB_AVAILABLE = _has_module("torch") and _has_module("dflash") and _has_module("dflash.model")


def skip_unless_zlab() -> None:
    """Skip the calling test (or module) when the z-lab reference is not installed."""
    import pytest

    pytest.importorskip("torch")
    pytest.importorskip("dflash.model")


def zlab_torch_module():
    """z-lab's PyTorch module, `dflash.model` (imported on first use: torch is optional)."""
    from dflash import model as zlab_model

    return zlab_model


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


def zlab_config(
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    vocab_size: int,
    block_size: int | None,
    num_target_layers: int,
    target_layer_ids: Sequence[int] | None,
    mask_token_id: int,
    rope_theta: float = 1_000_000.0,
    rms_norm_eps: float = 1e-6,
    **extra: Any,
) -> dict:
    """A config.json dict laid out like z-lab's released drafters.

    ``block_size`` goes top level (None leaves it out: both loaders then use
    ``dflash_config.block_size`` or 16). ``target_layer_ids=None`` leaves the ids
    out (the torch loader derives defaults, z-lab's MLX loader then fails).
    ``extra`` adds or overrides top-level keys; an ``extra["dflash_config"]`` dict
    is merged into ``dflash_config``.
    """
    dflash_config: dict[str, Any] = {"mask_token_id": int(mask_token_id)}
    if target_layer_ids is not None:
        dflash_config["target_layer_ids"] = [int(i) for i in target_layer_ids]
    dflash_config.update(extra.pop("dflash_config", None) or {})

    config: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "hidden_size": int(hidden_size),
        "head_dim": int(head_dim),
        "initializer_range": 0.02,
        "intermediate_size": int(intermediate_size),
        "layer_types": ["full_attention"] * int(num_layers),
        "max_position_embeddings": 40960,
        "max_window_layers": int(num_layers),
        "num_attention_heads": int(num_heads),
        "num_hidden_layers": int(num_layers),
        "num_key_value_heads": int(num_kv_heads),
        "num_target_layers": int(num_target_layers),
        "rms_norm_eps": float(rms_norm_eps),
        "rope_scaling": None,
        "rope_theta": float(rope_theta),
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": int(vocab_size),
        "dflash_config": dflash_config,
    }
    if block_size is not None:
        config["block_size"] = int(block_size)
    config.update(extra)
    return config


def zlab2_config(
    conv_kernel_size: int = 2, conv_group_size: int = 16, selector_rank: int = 8, selector_top_k: int = 4, **v1
) -> dict:
    """A DFlash2 config.json dict (``DFlash2DraftModel``): :func:`zlab_config`'s arguments
    plus the DFlash2 fields, which z-lab's configs keep in ``dflash_config``."""
    extra = dict(
        conv_kernel_size=conv_kernel_size,
        conv_group_size=conv_group_size,
        selector_rank=selector_rank,
        selector_top_k=selector_top_k,
    )
    v1["dflash_config"] = {**extra, **(v1.get("dflash_config") or {})}
    return zlab_config(architectures=["DFlash2DraftModel"], auto_map={"AutoModel": "dflash.DFlash2DraftModel"}, **v1)


def _model_class(config: dict):
    zm = zlab_torch_module()
    return zm.DFlash2DraftModel if "DFlash2DraftModel" in config.get("architectures", []) else zm.DFlashDraftModel


def torch_config(config: dict):
    """The ``Qwen3Config`` z-lab's torch model is built from (as ``from_pretrained`` would)."""
    return _model_class(config).config_class.from_dict(dict(config))


# ---------------------------------------------------------------------------
# Model construction, save and load
# ---------------------------------------------------------------------------


def make_torch_drafter(
    config: dict,
    seed: int,
    weight_std: float = 0.02,
    norm_std: float = 0.1,
):
    """z-lab's PyTorch ``DFlashDraftModel`` (or ``DFlash2DraftModel``, as the config's
    architectures say) in float32, eval mode, seeded random weights.

    Matrices ~ normal(0, weight_std); vectors (all RMSNorm weights, and biases if
    ``attention_bias``) ~ 1 + norm_std * normal for norms, weight_std * normal for
    biases. DFlash2's parameters get scales that make them matter (:func:`_scale_dflash2`).
    The global torch RNG is left untouched.
    """
    import torch

    cfg = torch_config(config)
    with torch.random.fork_rng(devices=[]):
        model = _model_class(config)(cfg)
    model = model.to(dtype=torch.float32).eval()

    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + norm_std * noise)
            else:
                param.copy_(weight_std * noise)
            _scale_dflash2(name, param, noise, cfg.hidden_size)
    return model


def make_comma_drafter(config: dict, seed: int):
    """:func:`make_torch_drafter` with attention and MLP outputs scaled down 20x: its
    block barely moves from the mask embedding, so with mask token "," it proposes ","
    everywhere (accepted drafts on comma-separated answers)."""
    import torch

    model = make_torch_drafter(config, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(0.05)
    return model


def _scale_dflash2(name: str, param, noise, hidden_size: int) -> None:
    """Random DFlash2 weights whose effects are not negligible: convolution base kernels
    near the identity (1 at offset 0) with spread 0.5, per-token kernels of about 0.1,
    unit-normal codebooks and a hidden projection that makes the selector's interaction
    term about as large as the spread of the top logits."""
    if name.endswith("base_kernel"):
        param.copy_(0.5 * noise)
        param[:, 0] += 1.0
    elif name.endswith("kernel_projection.weight"):
        param.copy_(0.1 / hidden_size**0.5 * noise)
    elif name.endswith("codebook.weight"):
        param.copy_(noise)
    elif name.endswith("hidden_projection.weight"):
        param.copy_(0.5 / hidden_size**0.5 * noise)


def _torch_dtype(dtype):
    import torch

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
    return getattr(torch, aliases.get(name, name))


def save_zlab_checkpoint(
    torch_model,
    config: dict,
    out_dir,
    fmt: str = "safetensors",
    dtype=None,
    num_shards: int = 2,
    extra_tensors: dict | None = None,
) -> Path:
    """Write a z-lab layout drafter directory and return its path.

    fmt: ``"safetensors"`` (``model.safetensors``), ``"sharded"``
    (``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``) or
    ``"bin"`` (``pytorch_model.bin``). dtype: torch dtype or name (default
    float32; released drafters are bfloat16); config.json's ``torch_dtype`` is set
    to match. ``extra_tensors`` (name -> array/tensor) are saved too, e.g.
    ``embed_tokens.weight`` as some later uploads carry.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tdtype = _torch_dtype(dtype)

    tensors = {
        released_key(k): v.detach().to("cpu", tdtype).contiguous().clone() for k, v in torch_model.state_dict().items()
    }
    for k, v in (extra_tensors or {}).items():
        tensors[k] = torch.as_tensor(np.asarray(v)).to(tdtype).contiguous()

    cfg = dict(config)
    cfg["torch_dtype"] = str(tdtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    elif fmt == "sharded":
        from safetensors.torch import save_file

        names = sorted(tensors)
        n = max(1, min(int(num_shards), len(names)))
        groups = [names[i::n] for i in range(n)]
        weight_map: dict[str, str] = {}
        total = 0
        for idx, group in enumerate(groups, start=1):
            fname = f"model-{idx:05d}-of-{n:05d}.safetensors"
            part = {k: tensors[k] for k in group}
            save_file(part, str(out / fname), metadata={"format": "pt"})
            for k in group:
                weight_map[k] = fname
                total += part[k].numel() * part[k].element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    elif fmt == "bin":
        torch.save(tensors, str(out / "pytorch_model.bin"))
    else:
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    return out


def read_checkpoint_tensors(path) -> dict[str, np.ndarray]:
    """All tensors of a z-lab layout directory (any of the 3 formats) as float32 numpy."""
    import torch

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    tensors: dict[str, Any] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            tensors.update(load_file(str(f)))
    elif (path / "pytorch_model.bin").exists():
        tensors = torch.load(str(path / "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no checkpoint weights in {path}")
    return {k: v.to(torch.float32).numpy() for k, v in tensors.items()}


def released_key(name: str) -> str:
    """The checkpoint name of a state-dict key: z-lab's DFlash2 uploads store the
    selector's codebooks as plain tensors (their loaders add ``.weight`` back)."""
    return name.removesuffix(".weight") if name.endswith("_codebook.weight") else name


def state_dict_numpy(torch_model) -> dict[str, np.ndarray]:
    """The model's state dict as float32 numpy arrays, keyed exactly as the checkpoint."""
    import torch

    return {k: v.detach().to("cpu", torch.float32).numpy().copy() for k, v in torch_model.state_dict().items()}


def load_torch_drafter(path, dtype=None, strict: bool = True):
    """Load a drafter directory with z-lab's loader (``DFlash[2]DraftModel.from_pretrained``).

    With ``strict`` any missing, unexpected or mismatched key raises ``ValueError``.
    """
    config = json.loads((Path(path) / "config.json").read_text())
    model, info = _model_class(config).from_pretrained(
        str(path),
        dtype=_torch_dtype(dtype),
        attn_implementation="sdpa",
        output_loading_info=True,
    )
    if strict:
        problems = {k: v for k, v in info.items() if v}
        if problems:
            raise ValueError(f"non-strict load of {path}: {problems}")
    return model.eval()
