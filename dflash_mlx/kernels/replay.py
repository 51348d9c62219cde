"""`gated_delta_replay`: a gated-delta layer's recurrent state after a few recorded tokens.

After a rejected draft a hybrid target's recurrent state must be the one after the
accepted tokens only. With the tokens' recurrence inputs recorded during the verify (the
tape, kernels/tape.py), that state is the gated delta rule replayed from the state before
the verify: no projection, conv or readout runs again. On a Metal GPU one kernel
(gated_delta_replay.metal) does it for every head and row at once, keeping each state row
in registers across the tokens; elsewhere, and as the reference in tests, the exact
fallback is the same recurrence in MLX ops, in the order mlx-lm's `gated_delta_ops` uses.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .choice import kernel_wins, replay_key
from .launch import KernelSource, Launch, metal_ready, run_metal

MAX_TOKENS = 16  # tokens per launch (staged in threadgroup memory); longer tapes take several
MAX_KEY_DIM = 256  # MAX_TOKENS * Dk floats of threadgroup memory: 16 KiB at most
ROWS_PER_THREADGROUP = 4  # state rows (simdgroups) sharing one staging of k, g, beta

GATED_DELTA_REPLAY = KernelSource.from_file("gated_delta_replay", ("state_in", "k", "v", "g", "beta"), ("state_out",))


def check_args(state: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array) -> None:
    """Raise ValueError naming the first argument whose shape does not fit the others."""
    if k.ndim != 4 or v.ndim != 4 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k (B, T, Hk, Dk) and v (B, T, Hv, Dv) must share B and T, got {k.shape} and {v.shape}")
    (batch, tokens, hk, dk), (hv, dv) = k.shape, v.shape[2:]
    if hv % hk:
        raise ValueError(f"v's heads ({hv}) must be a multiple of k's ({hk})")
    if tuple(state.shape) != (batch, hv, dv, dk):
        raise ValueError(f"state must have shape {(batch, hv, dv, dk)}, got {state.shape}")
    for name, a in (("g", g), ("beta", beta)):
        if tuple(a.shape) != (batch, tokens, hv):
            raise ValueError(f"{name} must have shape {(batch, tokens, hv)} (scalar gates), got {a.shape}")


def kernel_takes(k: mx.array) -> bool:
    """Whether the Metal kernel handles this key size (its threadgroup memory is bounded)."""
    return k.shape[-1] <= MAX_KEY_DIM


def gated_delta_replay_launch(state: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array) -> Launch:
    """The `mx.fast.metal_kernel` call for at most MAX_TOKENS tokens."""
    batch, _, hk, dk = k.shape
    hv, dv = v.shape[2:]
    return Launch(
        inputs=[state, k, v, g, beta],
        template=[("StT", state.dtype), ("Dk", dk), ("Dv", dv), ("Hk", hk), ("Hv", hv), ("MAX_T", MAX_TOKENS)],
        grid=(32, dv, batch * hv),
        threadgroup=(32, ROWS_PER_THREADGROUP, 1),
        output_shapes=[tuple(state.shape)],
        output_dtypes=[state.dtype],
    )


def gated_delta_replay_reference(state: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array) -> mx.array:
    """The exact pure-MLX result: the recurrence token by token (decay, read S k, write)."""
    if v.shape[2] > k.shape[2]:  # grouped heads: value head h reads key head h // (Hv / Hk)
        k = mx.repeat(k, v.shape[2] // k.shape[2], axis=2)
    for t in range(k.shape[1]):
        kt = k[:, t, :, None, :]  # (B, Hv, 1, Dk)
        state = state * g[:, t, :, None, None]  # (B, Hv, Dv, Dk)
        kv = (state * kt).sum(axis=-1)  # (B, Hv, Dv)
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        state = state + kt * delta[..., None]
    return state


def gated_delta_replay(
    state: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    use_kernel: Optional[bool] = None,
) -> mx.array:
    """The recurrent state (B, Hv, Dv, Dk) after replaying the gated delta rule from `state`
    over k (B, T, Hk, Dk) and v (B, T, Hv, Dv) (after conv and norm, as the layer feeds its
    recurrence), with decays g and write strengths beta (B, T, Hv). The Metal kernel runs
    when `use_kernel` (default: on a Metal GPU, for key sizes it takes, where it was checked and won
    for this shape and T, choice.py); otherwise the MLX-ops reference does.
    T = 0 returns `state`."""
    check_args(state, k, v, g, beta)
    if use_kernel is None:
        hk, dk, (hv, dv) = k.shape[2], k.shape[3], v.shape[2:]
        key = replay_key(hk, hv, dv, dk, k.dtype, k.shape[1])
        use_kernel = metal_ready() and kernel_takes(k) and kernel_wins(key)
    if not use_kernel:
        return gated_delta_replay_reference(state, k, v, g, beta)
    if not kernel_takes(k):
        raise ValueError(f"the kernel takes key sizes up to {MAX_KEY_DIM}, got {k.shape[-1]}")
    for t0 in range(0, k.shape[1], MAX_TOKENS):
        part = slice(t0, t0 + MAX_TOKENS)
        (state,) = run_metal(
            GATED_DELTA_REPLAY, gated_delta_replay_launch(state, k[:, part], v[:, part], g[:, part], beta[:, part])
        )
    return state
