"""A verify forward whose projections go through `verify_qmm`, with the model left untouched.

The kernel must see every quantized projection of a verify, yet the user's model may be
neither patched nor wrapped. So for the dense decoder layers we know (mlx-lm's llama /
mistral, qwen2 and qwen3 `TransformerBlock`: pre-norm attention with optional per-head
q/k norms, RoPE, the KV cache, SwiGLU MLP) this module reads the layer's own submodules
and repeats its forward op for op, calling each projection through `linear`: an affine
4/8-bit projection of 2..16 rows goes to `verify_qmm`, anything else to the module itself.
Where the kernel cannot run, `verify_qmm` is `mx.quantized_matmul`, exactly what the
module computes, so this path decodes token for token like the model's own (tested).

The same path verifies draft trees (`tree.py`), which the layer's own call cannot: each
row sits at its own RoPE position (prefix + depth, not prefix + row) and attends through
an ancestor mask. `decoder_layer(..., positions=...)` rotates each row at its position
with the model's own `rope` module and writes the rows into the KV cache in tree order;
without kernels the projections and the MLP are the modules' own calls, so qwen3_moe's
sparse MLP (and any MLP) runs as the model runs it.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import scaled_dot_product_attention

from .qmm import BITS, GROUP_SIZES, MAX_ROWS, verify_qmm

MIN_ROWS = 2  # one row is a plain decoding step: MLX's own qmv is tuned for it
#: The layer classes whose forward `decoder_layer` repeats (mistral loads as llama).
LAYER_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")
#: The layer classes a tree verify runs (their attention is the same; qwen3_moe's MLP is its own call).
TREE_MODULES = LAYER_MODULES + ("mlx_lm.models.qwen3_moe",)
PROJECTIONS = (
    ("self_attn", "q_proj"),
    ("self_attn", "k_proj"),
    ("self_attn", "v_proj"),
    ("self_attn", "o_proj"),
    ("mlp", "gate_proj"),
    ("mlp", "up_proj"),
    ("mlp", "down_proj"),
)


def kernel_takes(module: nn.Module) -> bool:
    """Whether `verify_qmm` computes this module's product (affine, 4 or 8 bits, group 32/64/128)."""
    return (
        isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        and getattr(module, "mode", "affine") == "affine"
        and module.bits in BITS
        and module.group_size in GROUP_SIZES
        and module.get("biases") is not None
    )


def _verify_rows(x: mx.array) -> bool:
    return MIN_ROWS <= x.size // x.shape[-1] <= MAX_ROWS


def linear(module: nn.Module, x: mx.array) -> mx.array:
    """module(x), through `verify_qmm` when it takes the module and x has 2..16 rows."""
    if not (isinstance(module, nn.QuantizedLinear) and kernel_takes(module) and _verify_rows(x)):
        return module(x)
    y = verify_qmm(x, module.weight, module.scales, module.biases, module.group_size, module.bits)
    return y + module.bias if "bias" in module else y


def as_linear(embedding: nn.Module, x: mx.array) -> mx.array:
    """embedding.as_linear(x) (a tied output head), through `verify_qmm` as `linear` does."""
    if not (isinstance(embedding, nn.QuantizedEmbedding) and kernel_takes(embedding) and _verify_rows(x)):
        return embedding.as_linear(x)
    return verify_qmm(x, embedding.weight, embedding.scales, embedding.biases, embedding.group_size, embedding.bits)


def projections(layer: nn.Module) -> list[nn.Module]:
    """The layer's attention and MLP projections that it has (by mlx-lm's names)."""
    return [layer[part][name] for part, name in PROJECTIONS if part in layer and name in layer[part]]


def supports(layers: list[nn.Module]) -> bool:
    """Whether every layer is one `decoder_layer` repeats and some projection is the kernel's."""
    known = all(type(layer).__module__ in LAYER_MODULES for layer in layers)
    return known and any(kernel_takes(p) for layer in layers for p in projections(layer))


def tree_supports(layers: list[nn.Module]) -> bool:
    """Whether `decoder_layer` can run every layer at per-row positions (a tree verify):
    a known layer whose rope takes an array of offsets (dynamic NTK sizes itself by one)."""
    return all(
        type(layer).__module__ in TREE_MODULES and type(layer.self_attn.rope).__name__ != "DynamicNTKScalingRoPE"
        for layer in layers
    )


def rope_at(rope: nn.Module, x: mx.array, positions: mx.array) -> mx.array:
    """The model's `rope` with row i of x (1, heads, L, head_dim) at positions[i] (L,):
    the rows become a batch, for which `mx.fast.rope` takes one offset each."""
    return rope(x.transpose(2, 1, 0, 3), offset=positions).transpose(2, 1, 0, 3)


def _call(module: nn.Module, x: mx.array) -> mx.array:
    return module(x)


def _attention(
    attn: nn.Module, x: mx.array, mask: Any, cache: Optional[Any], positions: Optional[mx.array] = None, project=linear
) -> mx.array:
    B, L, _ = x.shape
    queries = project(attn.q_proj, x).reshape(B, L, attn.n_heads, -1)  # (B, L, heads, head_dim)
    keys = project(attn.k_proj, x).reshape(B, L, attn.n_kv_heads, -1)
    values = project(attn.v_proj, x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    if "q_norm" in attn:  # qwen3
        queries, keys = attn.q_norm(queries), attn.k_norm(keys)
    queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)  # (B, heads, L, head_dim)
    if positions is not None:  # a tree: row i at positions[i]
        queries, keys = rope_at(attn.rope, queries, positions), rope_at(attn.rope, keys, positions)
        keys, values = cache.update_and_fetch(keys, values)
    elif cache is not None:
        queries = attn.rope(queries, offset=cache.offset)
        keys = attn.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
    else:
        queries, keys = attn.rope(queries), attn.rope(keys)
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
    return project(attn.o_proj, out.transpose(0, 2, 1, 3).reshape(B, L, -1))


def decoder_layer(
    layer: nn.Module,
    x: mx.array,
    mask: Any,
    cache: Optional[Any],
    positions: Optional[mx.array] = None,
    kernels: bool = True,
) -> mx.array:
    """layer(x, mask, cache) for a layer `supports` (or, with `positions`, `tree_supports`)
    accepts: with `kernels`, projections through `linear`; with `positions` (L,), row i
    of x (1, L, hidden) at RoPE position positions[i], attending as `mask` (L, cache + L) says."""
    project = linear if kernels else _call
    h = x + _attention(layer.self_attn, layer.input_layernorm(x), mask, cache, positions, project)
    mlp, y = layer.mlp, layer.post_attention_layernorm(h)
    if not (kernels and "gate_proj" in mlp):  # the model's own MLP (a MoE block included)
        return h + mlp(y)
    return h + linear(mlp.down_proj, swiglu(linear(mlp.gate_proj, y), linear(mlp.up_proj, y)))
