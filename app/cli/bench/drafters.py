"""The drafters a bench runs beside the one it is given: an untrained one (the loop's pure
overhead), and the time of one draft (a draft's share of a cycle)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def random_drafter(model, tokenizer, path: Path, seed: int = 0) -> Path:
    """A freshly initialised 2-layer drafter, saved to `path` so z-lab's loader can read it
    too: it accepts nothing, so its speed is the loop's pure overhead."""
    import mlx.core as mx

    from dflash_mlx import Drafter, save_drafter
    from dflash_mlx.targets import make_target
    from dflash_mlx.train import default_mask_token_id, make_config

    mx.random.seed(seed)
    config = make_config(
        make_target(model), num_layers=2, block_size=16, mask_token_id=default_mask_token_id(tokenizer)
    )
    return save_drafter(Drafter(config), path)


def draft_milliseconds(model: Any, drafter: Any, context: int = 256, repeats: int = 20) -> float:
    """Wall time of one draft at the drafter's block size, over `context` tokens of random
    context (the median of `repeats`, after a warm-up): the draft's share of a cycle."""
    import mlx.core as mx

    from dflash_mlx.targets import make_target

    target, B = make_target(model), drafter.config.block_size
    cache = drafter.make_cache()
    width = len(drafter.config.target_layer_ids) * target.hidden_size
    drafter.append_context(mx.random.normal((1, context, width), dtype=drafter.norm.weight.dtype), cache)
    block = mx.array([[0] + [drafter.config.mask_token_id] * (B - 1)])
    times = []
    for _ in range(repeats + 1):
        tic = time.perf_counter()
        mx.eval(drafter.propose(block, cache, target).argmax(-1))
        times.append(time.perf_counter() - tic)
    return round(1000 * sorted(times[1:])[repeats // 2], 2)
