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
* ``dflash_generate(model, target, input_ids, max_new_tokens, stop_token_ids,
  temperature=0.0, top_p=1.0, top_k=0, block_size=None, return_stats=False)``
  returns output ids (1, prompt + generated), or with ``return_stats=True`` a
  namespace with timings that calls ``torch.cuda.synchronize`` (so CPU needs
  ``return_stats=False``). Loop, as it drives the drafter:
  - prefill the target with ``output_hidden_states``; context = features of the
    whole prompt; ``start`` = prompt length; the block is
    ``output_ids[start:start+B]`` (buffer prefilled with ``mask_token_id``).
  - the draft cache is ``DynamicCache(config=model.config)`` with
    ``activate_past_recording()``; each step calls the drafter with
    ``position_ids[:, start - n_new : start + B]`` and then CROPS the cache back
    to ``start`` (``crop(-(len - start))``): the block's K/V are appended, used
    and immediately removed, so the cache holds context K/V of positions
    ``0 .. start-1`` only. Draft tokens come from ``out[:, 1 - B:]`` (position 0's
    output is discarded; position k predicts the token AT start + k).
  - after verify, the new context is the features of ``block[:produced]``
    (first token + accepted drafts; ``produced`` may be cut at a stop token,
    which is included, or at max length), and ``start += produced``.
  - the last block shrinks to ``min(B, max_length - start)``.
  - with transformers 5.x ``crop(0)`` is a no-op (negative = remove that many).
  - transformers 5.24 emits a FutureWarning (``past_key_values`` -> ``cache``,
    removal in 5.40); dflash 0.1.0's ``[local]`` extra pins transformers 5.15.0.
* Without a cache the drafter output depends only on RELATIVE positions (RoPE):
  shifting context and block together changes nothing; a gap between them does.

MLX side, ``dflash.model_mlx`` (imports and runs on Linux with mlx[cpu])
-----------------------------------------------------------------------
* ``load(model_id)`` is ``mlx_lm.load``. ``load_draft(draft_id)`` always calls
  ``huggingface_hub.snapshot_download`` (``*.safetensors``, ``*.json``), so a LOCAL
  directory raises ``HFValidationError``: use :func:`zlab_mlx_load_draft`, which
  swaps in an identity function for that one call. It reads config.json
  (required: hidden_size, num_hidden_layers, num_attention_heads,
  num_key_value_heads, head_dim, intermediate_size, vocab_size, rms_norm_eps,
  max_position_embeddings, num_target_layers, dflash_config.target_layer_ids and
  dflash_config.mask_token_id: no defaults there), loads EVERY ``*.safetensors``
  in the folder (the index is ignored, ``.bin`` unsupported) and calls
  ``load_weights`` strictly, so extra tensors such as ``embed_tokens.weight``
  make it fail.
* ``DFlashDraftModel(DFlashConfig)``; ``bind(target)`` takes the target's
  ``embed_tokens`` and ``lm_head`` (or ``embed_tokens.as_linear``);
  ``draft(block_ids, target_hidden, cache, logits_start=1)`` returns logits,
  ``draft.hidden_states(...)`` the normed hidden. Its cache (``KVCache`` per
  layer) stores ONLY the context K/V (block K/V never enter it); context keys are
  rotated at ``cache.offset``, block queries/keys at ``cache.offset + n_new``.
* ``stream_generate(model, draft, tokenizer, prompt, block_size=None,
  max_tokens=256, temperature=0.0, top_p=1.0, top_k=0, prefill_step_size=2048)``
  is a generator of z-lab's OWN ``GenerationResponse`` dataclass (not mlx-lm's):
  ``text, tokens: list[int], accepted: int | None, prompt_tokens, prompt_tps,
  generation_tokens, generation_tps, peak_memory, finish_reason``. First yield:
  the prefill token (``accepted=None``); then one yield per cycle with the new
  tokens (``accepted = len(tokens)`` = drafts accepted + 1); an EOS ends with
  ``finish_reason="stop"`` (EOS included); otherwise a last yield with
  ``tokens=[]``, ``finish_reason="length"``. ``max_tokens`` counts the first
  token. ``prompt`` may be a str, a token list or an mx.array.
* It MUTATES the target for good: ``model._hidden_states`` is added and
  ``model.model.layers[i]`` are replaced by hook wrappers (output of layer i).
  If ``_hidden_states`` already exists it returns early, so a second drafter
  with different ``target_layer_ids`` silently reuses the first one's hooks.
  Use a fresh target object per z-lab drafter. Hybrid (GatedDeltaNet) targets
  get ``GatedDeltaNet.__call__`` patched class-wide under a global lock.
* Nothing unusual is needed on Linux: ``wired_limit`` is a no-op off Metal and the
  gated-delta kernel falls back to ops on CPU.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from contextlib import contextmanager
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


def _zlab():
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


def zlab2_config(conv_kernel_size: int = 2, conv_group_size: int = 16, selector_rank: int = 8,
                 selector_top_k: int = 4, **v1) -> dict:
    """A DFlash2 config.json dict (``DFlash2DraftModel``): :func:`zlab_config`'s arguments
    plus the DFlash2 fields, which z-lab's configs keep in ``dflash_config``."""
    extra = dict(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                 selector_rank=selector_rank, selector_top_k=selector_top_k)
    v1["dflash_config"] = {**extra, **(v1.get("dflash_config") or {})}
    return zlab_config(architectures=["DFlash2DraftModel"],
                       auto_map={"AutoModel": "dflash.DFlash2DraftModel"}, **v1)


def _model_class(config: dict):
    zm = _zlab()
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

    tensors = {released_key(k): v.detach().to("cpu", tdtype).contiguous().clone()
               for k, v in torch_model.state_dict().items()}
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

    return {k: v.detach().to("cpu", torch.float32).numpy().copy()
            for k, v in torch_model.state_dict().items()}


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


@contextmanager
def _local_snapshot(module):
    original = module.snapshot_download

    def local(repo_id, **_kwargs):
        return str(repo_id)

    module.snapshot_download = local
    try:
        yield
    finally:
        module.snapshot_download = original


def zlab_mlx_load_draft(path):
    """z-lab's MLX ``load_draft`` on a local directory (their loader only takes Hub ids)."""
    from dflash import model_mlx

    with _local_snapshot(model_mlx):
        return model_mlx.load_draft(str(path))


# ---------------------------------------------------------------------------
# Forward passes
# ---------------------------------------------------------------------------

def _as_tensor(x, torch):
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu")
    else:
        t = torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32)))
    if t.ndim == 2:
        t = t[None]
    return t


def _model_dtype(model):
    return next(model.parameters()).dtype


def _run_block(model, target_hidden, block_embeddings, position_ids, cache, lm_head):
    import torch

    dtype = _model_dtype(model)
    ctx = _as_tensor(target_hidden, torch).to(dtype)
    emb = _as_tensor(block_embeddings, torch).to(dtype)
    pos = torch.as_tensor(np.asarray(position_ids, dtype=np.int64)).reshape(1, -1)
    if pos.shape[1] != ctx.shape[1] + emb.shape[1]:
        raise ValueError(
            f"position_ids must cover context + block: {pos.shape[1]} != "
            f"{ctx.shape[1]} + {emb.shape[1]}"
        )
    with torch.inference_mode():
        hidden = model(
            position_ids=pos,
            noise_embedding=emb,
            target_hidden=ctx,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        if lm_head is not None:
            weight = _as_tensor(lm_head, torch)[0].to(dtype)
            head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype)
            head.weight.copy_(weight)
            hidden = model.compute_logits(hidden, head)
    return hidden.to(torch.float32).numpy().copy()


def torch_draft_logits(
    torch_model,
    target_hidden,
    block_embeddings,
    start: int | None = None,
    position_ids=None,
    lm_head=None,
) -> np.ndarray:
    """One drafter forward with no cache, as z-lab's first draft step after prefill.

    target_hidden: (1, n_ctx, len(ids) * hidden), the RAW concatenation of target
    layer outputs (z-lab applies fc + hidden_norm itself). block_embeddings:
    (1, B, hidden), target embedding rows of [last token, MASK x (B-1)].
    Positions: ``start`` is the block's first position (default n_ctx); context
    then sits at start - n_ctx .. start - 1 and the block at start .. start + B - 1.
    Or give ``position_ids`` (n_ctx + B values) explicitly.
    Returns float32 numpy (1, B, hidden): ``norm(h)`` for ALL B positions (z-lab's
    loop drops position 0). With ``lm_head`` ((vocab, hidden) weight) it returns
    z-lab's ``compute_logits`` of that instead, (1, B, vocab).
    """
    n_ctx = np.asarray(target_hidden.shape)[-2]
    n_blk = np.asarray(block_embeddings.shape)[-2]
    if position_ids is None:
        s = int(n_ctx) if start is None else int(start)
        position_ids = np.arange(s - int(n_ctx), s + int(n_blk))
    return _run_block(torch_model, target_hidden, block_embeddings, position_ids, None, lm_head)


class TorchDraftSession:
    """z-lab's drafter over a GROWING context, with z-lab's own cache handling.

    Mirrors ``dflash_generate``: the cache is made by z-lab's ``_make_cache``
    (DynamicCache + past recording); each :meth:`step` passes only the NEW context
    features, positions ``start - n_new .. start + B - 1`` where
    ``start = cache length + n_new``, then crops the cache back to ``start`` with
    z-lab's ``_crop_to`` (the block K/V are dropped, the context K/V kept).
    """

    def __init__(self, torch_model, lm_head=None):
        zm = _zlab()
        self.model = torch_model
        self.lm_head = lm_head
        self.cache = zm._make_cache(torch_model.config)
        self._crop_to = zm._crop_to
        self.start = 0

    @property
    def cache_len(self) -> int:
        return int(self.cache.get_seq_length())

    def step(self, new_target_hidden, block_embeddings) -> np.ndarray:
        """Append ``new_target_hidden`` (1, n_new, len(ids) * hidden) and draft one block.

        Returns (1, B, hidden) final-norm hidden states for all block positions
        (or logits when the session has an ``lm_head``).
        """
        n_new = int(np.asarray(new_target_hidden.shape)[-2])
        n_blk = int(np.asarray(block_embeddings.shape)[-2])
        start = self.cache_len + n_new
        positions = np.arange(start - n_new, start + n_blk)
        out = _run_block(self.model, new_target_hidden, block_embeddings, positions,
                         self.cache, self.lm_head)
        self._crop_to(self.cache, start)
        self.start = start
        return out


def torch_draft_logits_growing(torch_model, steps, lm_head=None) -> list[np.ndarray]:
    """Run :class:`TorchDraftSession` over ``steps``: a list of
    (new_target_hidden, block_embeddings) pairs; step 0's context is the prompt's.
    Returns one (1, B_i, hidden) array per step.
    """
    session = TorchDraftSession(torch_model, lm_head=lm_head)
    return [session.step(ctx, emb) for ctx, emb in steps]


def run_dflash_generate(drafter, target, input_ids, max_new_tokens, stop_token_ids=None,
                        block_size=None):
    """z-lab's greedy ``dflash_generate`` on CPU (``return_stats=False``); returns a list of ids."""
    import torch

    zm = _zlab()
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64)).reshape(1, -1)
    out = zm.dflash_generate(drafter.eval(), target.eval(), ids, int(max_new_tokens),
                             stop_token_ids, temperature=0.0, block_size=block_size,
                             return_stats=False)
    return out[0].tolist()


def torch_select(torch_model, hidden, logits, anchor: int) -> list[int]:
    """z-lab's greedy DFlash2 draft path (``candidate_selector.select`` at temperature 0)
    for block positions 1.. of ``hidden`` (1, B, hidden) and ``logits`` (1, B, vocab),
    as :func:`torch_draft_logits` and :class:`TorchDraftSession` return them; ``anchor``
    is block token 0."""
    import torch

    with torch.inference_mode():
        path, _, _ = torch_model.candidate_selector.select(
            torch.from_numpy(np.ascontiguousarray(hidden[:, 1:])),
            torch.from_numpy(np.ascontiguousarray(logits[:, 1:])), torch.tensor([int(anchor)]), 0.0)
    return path[0].tolist()


def zlab_generate(model, drafter, tokenizer, prompt, max_tokens: int, block_size: int):
    """Greedy decoding with z-lab's MLX loop: (tokens, tokens committed per cycle)."""
    from dflash import model_mlx

    tokens, cycles = [], []
    for r in model_mlx.stream_generate(model, drafter, tokenizer, prompt, block_size=block_size,
                                       max_tokens=max_tokens, temperature=0.0):
        tokens += r.tokens
        if r.accepted is not None:
            cycles.append(r.accepted)
    return tokens, cycles
