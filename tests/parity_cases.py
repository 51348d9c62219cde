"""What the parity tests with z-lab's reference (v1 `test_reference_parity.py`, DFlash2
`test_dflash2_parity.py`) feed both implementations: the vocabulary and mask token of
the synthetic drafters, the v1 drafter configs, a context that grows step by step
(`STEPS`, `step_inputs`), and our loop run as z-lab's runs (`ours_generate`)."""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS preload before the first mlx import)
import numpy as np

from dflash_mlx import stream_generate
from dflash_mlx.options import DecodeOptions

VOCAB = 192
MASK = VOCAB - 1

#: name -> zlab_config arguments, less the vocabulary and mask token (`VOCAB`, `MASK`)
CONFIGS = {
    "1 layer, MHA": dict(
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        intermediate_size=128,
        block_size=8,
        num_target_layers=8,
        target_layer_ids=[3],
        rope_theta=10_000.0,
    ),
    "3 layers, GQA, head_dim 32": dict(
        hidden_size=96,
        num_layers=3,
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=160,
        block_size=16,
        num_target_layers=10,
        target_layer_ids=[1, 4, 8],
        rope_theta=1_000_000.0,
    ),
    # transformers' Qwen3Config drops sliding_window unless use_sliding_window is set.
    "sliding window 6, causal": dict(
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        block_size=8,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        rope_theta=10_000.0,
        sliding_window=6,
        use_sliding_window=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "sliding window 5 < block, bidirectional": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=96,
        block_size=8,
        num_target_layers=6,
        target_layer_ids=[0, 5],
        rope_theta=10_000.0,
        sliding_window=5,
        use_sliding_window=True,
        is_causal=False,
        layer_types=["full_attention", "sliding_attention"],
    ),
    # z-lab (torch and MLX alike) applies a config's is_causal to EVERY layer.
    "is_causal true, full attention": dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        block_size=8,
        num_target_layers=6,
        target_layer_ids=[2, 4],
        rope_theta=10_000.0,
        is_causal=True,
    ),
}

# (new context tokens, block length) per step: the context grows 9 -> 10 -> 14 -> 16 -> 22,
# and the last block is shorter, as z-lab's loop makes it near max_tokens.
STEPS = [(9, None), (1, None), (4, None), (2, None), (6, 5)]


def step_inputs(rng, spec: dict):
    """Random features, token embeddings and an lm_head shared by both implementations."""
    hidden, n_ids = spec["hidden_size"], len(spec["target_layer_ids"])
    embed = (0.5 * rng.standard_normal((VOCAB, hidden))).astype(np.float32)
    lm_head = (rng.standard_normal((VOCAB, hidden)) / np.sqrt(hidden)).astype(np.float32)
    steps = []
    for n_new, size in STEPS:
        size = size or spec["block_size"]
        features = (2.0 * rng.standard_normal((1, n_new, n_ids * hidden))).astype(np.float32)
        block = [int(rng.integers(0, VOCAB - 1))] + [MASK] * (size - 1)
        steps.append((features, embed[block][None]))
    return steps, lm_head


def ours_generate(model, drafter, tokenizer, prompt, max_tokens, block_size):
    """Our tokens and accepted lengths, the drafter's chains alone (z-lab's loop has no prompt lookup)."""
    options = DecodeOptions(block_size=block_size, lookup=0)
    responses = list(stream_generate(model, tokenizer, prompt, drafter, options, max_tokens=max_tokens))
    return [r.token for r in responses], responses[-1].stats.accepted_lengths
