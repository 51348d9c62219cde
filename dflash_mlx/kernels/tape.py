"""A gated-delta layer's verify forward that records its recurrence inputs (the tape).

Undoing a verify on a hybrid target by re-running the mixer module (rollback.py) reads
its input projections again. With the inputs of the recurrence kept from the verify
itself, a rollback needs no projection: the conv window is a slice of the recorded conv
input, and the state is the gated delta rule replayed from the state before the verify
(`gated_delta_replay`, one Metal kernel on a Mac). The recording cannot come from the
module (patching it is off limits), so for the mixers we know (mlx-lm's qwen3_5
`GatedDeltaNet`, which qwen3_5_moe reuses, and qwen3_next's) `decoder_layer` repeats
the decoder layer's forward op for op, calling mlx-lm's own functions for the
normalisation and the recurrence, and keeps k, v, g, beta and the conv input. This is the
kernel path only (`Target.use_kernels`); with kernels off the layer runs as a black box.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import compute_g, gated_delta_update, normalize_qk

from .decoder import linear
from .replay import gated_delta_replay

#: The mixer classes whose forward `decoder_layer` repeats, by module and name.
MIXERS = {("mlx_lm.models.qwen3_5", "GatedDeltaNet"), ("mlx_lm.models.qwen3_next", "Qwen3NextGatedDeltaNet")}


@dataclass
class Tape:
    """One verify's recurrence inputs in one gated-delta layer (L tokens)."""

    conv_input: mx.array  # (1, K - 1 + L, conv_dim): the conv window before the verify, then the L new rows
    k: mx.array  # (1, L, Hk, Dk), after conv and normalisation
    v: mx.array  # (1, L, Hv, Dv)
    g: mx.array  # (1, L, Hv) float32 decays
    beta: mx.array  # (1, L, Hv) write strengths

    def rewind(self, cache: ArraysCache, drop: int) -> None:
        """Set `cache`, holding the state from before the verify, to the state after the
        verify's first L - drop tokens: the conv window slid that far, the state replayed."""
        length = self.k.shape[1]
        keep, window = length - drop, self.conv_input.shape[1] - length
        state = cache[1]
        if state is None:  # the verify was the layer's first input
            state = mx.zeros((1, self.v.shape[2], self.v.shape[3], self.k.shape[3]), mx.float32)
        cache[0] = mx.contiguous(self.conv_input[:, keep : keep + window])
        cache[1] = gated_delta_replay(state, self.k[:, :keep], self.v[:, :keep], self.g[:, :keep], self.beta[:, :keep])


def supports(layer: nn.Module) -> bool:
    """Whether `decoder_layer` repeats this layer's forward (a gated-delta layer we know)."""
    mixer = layer.get("linear_attn") if getattr(layer, "is_linear", False) else None
    return mixer is not None and (type(mixer).__module__, type(mixer).__name__) in MIXERS


def takes(layer: nn.Module, mask: Any, cache: Any) -> bool:
    """Whether this call can be recorded: a known layer, one unpadded sequence, no sharding."""
    plain = isinstance(cache, ArraysCache) and cache.lengths is None and cache.left_padding is None
    return supports(layer) and mask is None and plain and getattr(layer.linear_attn, "sharding_group", None) is None


def _projections(mixer: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(conv input rows (B, L, conv_dim), z (B, L, Hv, Dv), b, a (B, L, Hv)), as the mixer splits them."""
    B, L, _ = x.shape
    if "in_proj_qkvz" in mixer:  # qwen3_next: per-key-head interleaved layout
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(
            linear(mixer.in_proj_qkvz, x), linear(mixer.in_proj_ba, x)
        )
        return mx.concatenate([t.reshape(B, L, -1) for t in (q, k, v)], axis=-1), z, b, a
    z = linear(mixer.in_proj_z, x).reshape(B, L, mixer.num_v_heads, mixer.head_v_dim)
    return linear(mixer.in_proj_qkv, x), z, linear(mixer.in_proj_b, x), linear(mixer.in_proj_a, x)


def _mixer(mixer: nn.Module, x: mx.array, cache: ArraysCache) -> tuple[mx.array, Tape]:
    """mixer(x, None, cache) for a mixer `supports` accepts, and its tape."""
    B, L, _ = x.shape
    qkv, z, b, a = _projections(mixer, x)
    window = mixer.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, window, mixer.conv_dim), x.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)  # (B, K - 1 + L, conv_dim)
    cache[0] = mx.contiguous(conv_input[:, -window:])
    conv_out = nn.silu(mixer.conv1d(conv_input))
    key, value = mixer.key_dim, mixer.head_v_dim
    q, k, v = mx.split(conv_out, [key, 2 * key], axis=-1)
    q = q.reshape(B, L, mixer.num_k_heads, mixer.head_k_dim)
    k = k.reshape(B, L, mixer.num_k_heads, mixer.head_k_dim)
    v = v.reshape(B, L, mixer.num_v_heads, value)
    q, k = normalize_qk(q, k, inv_scale=mixer.head_k_dim**-0.5, eps=1e-6)
    out, cache[1] = gated_delta_update(
        q, k, v, a, b, mixer.A_log, mixer.dt_bias, cache[1], None, use_kernel=not mixer.training
    )
    cache.advance(L)
    out = linear(mixer.out_proj, mixer.norm(out, z).reshape(B, L, -1))
    # g and beta as gated_delta_update derives them (lazy: computed only if a rollback reads them)
    return out, Tape(conv_input, k, v, compute_g(mixer.A_log, a, mixer.dt_bias), mx.sigmoid(b))


def decoder_layer(layer: nn.Module, x: mx.array, cache: ArraysCache) -> tuple[mx.array, Tape]:
    """layer(x, None, cache) for a layer `takes` accepts, and its mixer's tape."""
    r, tape = _mixer(layer.linear_attn, layer.input_layernorm(x), cache)
    h = x + r
    return h + layer.mlp(layer.post_attention_layernorm(h)), tape


def any_supported(layers: list[nn.Module]) -> bool:
    """Whether some layer of a target can record a tape."""
    return any(supports(layer) for layer in layers)
