"""Helpers for the `dflash convert` / `dflash export` tests: z-lab-layout source
directories, a real-layout offline Hugging Face cache, and CLI assertions."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Optional

import dflash_mlx  # noqa: F401  (OpenBLAS preload before any mlx import)
import numpy as np
import pytest

import zlab_reference as zr
import zlab_run as zrun  # noqa: F401  (imported from here by the converter tests)

from conftest import DFLASH2, SMOLLM2  # DFLASH2: the test drafters' DFlash2 fields

# Fits the built-in default target, SmolLM2-135M-Instruct (30 layers, hidden 576, vocab 49152).
HIDDEN = SMOLLM2["hidden_size"]
N_TARGET = SMOLLM2["num_target_layers"]
VOCAB = SMOLLM2["vocab_size"]
IDS = [1, 15, 27]
MASK = 49151


def drafter_config(num_layers: int = 2, hidden: int = HIDDEN, ids=IDS, **extra) -> dict:
    """A small z-lab-layout config.json dict (9 heads of 64, 3 KV heads, MLP 512)."""
    return zr.zlab_config(
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        intermediate_size=512,
        vocab_size=extra.pop("vocab_size", VOCAB),
        block_size=8,
        num_target_layers=extra.pop("num_target_layers", N_TARGET),
        target_layer_ids=ids,
        mask_token_id=MASK,
        rope_theta=100000.0,
        **extra,
    )


def drafter2_config(num_layers: int = 2, **extra) -> dict:
    """:func:`drafter_config` as a DFlash2 drafter (``DFlash2DraftModel``)."""
    sub = {**DFLASH2, **extra.pop("dflash_config", {})}
    return drafter_config(num_layers, architectures=["DFlash2DraftModel"], dflash_config=sub, **extra)


def zlab_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a z-lab drafter checkpoint (v1, or DFlash2 in its
    released layout), written out from the layout (not from our drafter), so tests check
    the converter against it."""
    h, hd = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    inter = config["intermediate_size"]
    ids = (config.get("dflash_config") or {}).get("target_layer_ids") or IDS
    shapes = {"fc.weight": (h, len(ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    d2 = config.get("dflash_config") or {}
    if "DFlash2DraftModel" in config.get("architectures", []):
        k, groups, rank = d2["conv_kernel_size"], h // d2["conv_group_size"], d2["selector_rank"]
        for i in range(config["num_hidden_layers"]):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, k, h)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * groups, h)
        for book in ("predecessor_codebook", "successor_codebook"):
            shapes[f"candidate_selector.{book}"] = (config["vocab_size"], rank)
        shapes["candidate_selector.hidden_projection.weight"] = (rank, h)
    return shapes


def write_numpy_checkpoint(
    out: Path,
    config: dict,
    *,
    seed: int = 0,
    drop: Iterable[str] = (),
    extra: Optional[dict] = None,
    shapes: Optional[dict] = None,
) -> Path:
    """A z-lab-layout safetensors directory with random float16 weights, without torch."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in {**zlab_shapes(config), **(shapes or {})}.items():
        if name in drop:
            continue
        scale = 0.02 if len(shape) == 2 else 0.1
        base = 0.0 if len(shape) == 2 else 1.0
        tensors[name] = (base + scale * rng.standard_normal(shape)).astype(np.float16)
    tensors.update(extra or {})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def add_to_hub_cache(
    cache: Path, repo_id: str, files_dir: Path, tags: Iterable[str] = ("main",), commit: Optional[str] = None
) -> str:
    """Put `files_dir` into a Hugging Face hub cache exactly as `huggingface_hub` lays it
    out (blobs + relative symlinks in snapshots/<commit> + refs/<tag>). Returns the commit."""
    storage = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    commit = commit or hashlib.sha1(f"{repo_id}:{files_dir}".encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(files_dir).iterdir()):
        data = f.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / f.name
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    for tag in tags:
        (storage / "refs" / tag).write_text(commit)
    return commit


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, with huggingface_hub switched to it and to offline mode
    (constants are read at import, so they are patched as well as the environment)."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cli(*args):
    """Run `dflash ARGS` in-process; returns click's Result (stdout / stderr apart)."""
    from typer.testing import CliRunner

    from app.cli.main import app

    return CliRunner().invoke(app, [str(a) for a in args])


def leftovers(out: Path) -> list[str]:
    """Temporary or backup directories the converter may have left next to `out`."""
    return sorted(p.name for p in Path(out).parent.glob(f".{Path(out).name}.*"))


def assert_fails(result, out: Path, *needles: str, code: int = 1) -> str:
    """Non-zero exit, exactly one `error:` line (the last one) holding every needle,
    no output directory and no temporary directory left."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith(("error:", "interrupted"))]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    assert not Path(out).exists(), f"{out} left behind"
    assert leftovers(out) == []
    return errors[0]


def assert_ok(result) -> None:
    assert result.exit_code == 0, (result.output, result.exception)


def block_inputs(
    seed: int = 0, n_ctx: int = 11, block: int = 8, n_ids: int = len(IDS), hidden: int = HIDDEN, vocab: int = 1000
):
    """Random context features (1, n_ctx, n_ids * hidden), block embeddings (1, B, hidden)
    and an lm_head weight (vocab, hidden)."""
    rng = np.random.default_rng(seed)
    ctx = rng.standard_normal((1, n_ctx, n_ids * hidden)).astype(np.float32)
    emb = rng.standard_normal((1, block, hidden)).astype(np.float32)
    head = (0.05 * rng.standard_normal((vocab, hidden))).astype(np.float32)
    return ctx, emb, head


def mlx_logits(drafter, ctx, emb, head, float32: bool = True) -> np.ndarray:
    """Our drafter's logits for a block after the context (context at 0..n-1, block after)."""
    import mlx.core as mx

    if float32:
        drafter.set_dtype(mx.float32)
    cache = drafter.make_cache()
    drafter.append_context(mx.array(ctx), cache)
    hidden = drafter(mx.array(emb), cache)
    return np.array((hidden @ mx.array(head).T).astype(mx.float32))
