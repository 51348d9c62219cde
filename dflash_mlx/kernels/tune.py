"""The kernel-or-MLX timing pairs (choice.py) for one target's own shapes.

For every affine projection `verify_qmm` takes (the layers' and the output head) at the
verify sizes the loop runs (decoder.MIN_ROWS..MAX_ROWS rows), and for every gated-delta
layer the tape path knows at each count of kept tokens a rollback replays (1..15), one
step runs the custom kernel and one MLX's own op on random inputs of that shape.
`tune` checks and times them once per chip, MLX version and model (cached) and adopts the
choice: a kernel runs only where its output matched MLX's op and it was faster.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from . import decoder, tape
from .choice import Step, Timer, evaluated, load_or_time, median_seconds, qmm_key, replay_key
from .launch import metal_ready
from .qmm import verify_qmm, verify_qmm_reference
from .replay import MAX_KEY_DIM, MAX_TOKENS, gated_delta_replay, gated_delta_replay_reference

VERIFY_ROWS = range(decoder.MIN_ROWS, decoder.MAX_ROWS + 1)
REPLAY_TOKENS = range(1, MAX_TOKENS)  # a rollback keeps fewer tokens than the verify had


def qmm_pairs(modules: list[nn.Module], rows: range = VERIFY_ROWS) -> list[tuple[Step, Step]]:
    """(kernel, mx.quantized_matmul) steps for each distinct projection shape and row count."""
    shapes = {}
    for p in modules:
        if decoder.kernel_takes(p):
            n, k = p.weight.shape[0], p.scales.shape[1] * p.group_size
            shapes[(n, k, p.bits, p.group_size, p.scales.dtype)] = p
    pairs = []
    for (n, k, bits, gs, dtype), p in shapes.items():
        for m in rows:
            x = mx.random.normal((m, k), key=mx.random.key(m))  # its own key: the user's global RNG is untouched
            args = (x.astype(dtype), p.weight, p.scales, p.biases, gs, bits)
            key = qmm_key(n, k, bits, gs, dtype, m)
            custom = Step(key, True, lambda a=args: evaluated(verify_qmm(*a, use_kernel=True)))
            pairs.append((custom, Step(key, False, lambda a=args: evaluated(verify_qmm_reference(*a)))))
    return pairs


def replay_pairs(layers: list[nn.Module], tokens: range = REPLAY_TOKENS) -> list[tuple[Step, Step]]:
    """(replay kernel, MLX-ops replay) steps for each distinct gated-delta shape and token count."""
    shapes = {}
    for layer in layers:
        if tape.supports(layer):
            mixer = layer.linear_attn
            dtype = mixer.conv1d.weight.dtype
            shapes[(mixer.num_k_heads, mixer.num_v_heads, mixer.head_v_dim, mixer.head_k_dim, dtype)] = None
    pairs = []
    for hk, hv, dv, dk, dtype in shapes:
        if dk > MAX_KEY_DIM:  # the kernel does not take it: nothing to choose
            continue
        for t in tokens:
            keys = mx.random.split(mx.random.key(t), 5)  # its own keys: the user's global RNG is untouched
            state = mx.random.normal((1, hv, dv, dk), key=keys[0])  # (B, Hv, Dv, Dk) float32, as the cache keeps it
            k = mx.random.normal((1, t, hk, dk), key=keys[1]).astype(dtype)
            v = mx.random.normal((1, t, hv, dv), key=keys[2]).astype(dtype)
            g = mx.random.uniform(shape=(1, t, hv), key=keys[3])
            beta = mx.random.uniform(shape=(1, t, hv), key=keys[4]).astype(dtype)
            args, key = (state, k, v, g, beta), replay_key(hk, hv, dv, dk, dtype, t)
            custom = Step(key, True, lambda a=args: evaluated(gated_delta_replay(*a, use_kernel=True)))
            pairs.append((custom, Step(key, False, lambda a=args: evaluated(gated_delta_replay_reference(*a)))))
    return pairs


def tune(layers: list[nn.Module], head: Optional[nn.Module] = None, timer: Timer = median_seconds) -> dict[str, dict]:
    """On a Metal GPU, the kernel-or-MLX checks and timings of this target's shapes (cached
    per chip, MLX version and model) and their choice adopted; elsewhere {} (MLX's ops run)."""
    if not metal_ready():
        return {}
    modules = [p for layer in layers for p in decoder.projections(layer)] + ([head] if head is not None else [])
    modules += [m for layer in layers if tape.supports(layer) for m in layer.linear_attn.children().values()]
    return load_or_time(qmm_pairs(modules) + replay_pairs(layers), timer)
