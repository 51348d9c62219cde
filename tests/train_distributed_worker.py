"""One rank of a data-parallel drafter training run (started by `mlx.launch -n 2`).

A tiny random llama target writes its own greedy answers; every rank trains the same
drafter on its share of each batch, with gradients averaged over ranks by
`nn.average_gradients` (an `mx.distributed.all_sum`), and keeps the weights' moving
average (`--ema`). Each rank prints one JSON line: its rank, the world size, checksums of
its final weights and of their average, and its loss history. Equal checksums on all
ranks show the ranks stayed in lockstep.

Usage: PATH=.venv/bin:$PATH mlx.launch -n 2 --backend ring python tests/train_distributed_worker.py OUT_DIR [TIME_LIMIT]

With TIME_LIMIT (seconds) the run trains until then, its schedule following the wall
clock: the ranks must follow one clock to stay in lockstep and stop together.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
import dflash_mlx.drafters as drafters
import dflash_mlx.loading as loading
from dflash_mlx.train.loop import TrainArgs, train
from tiny_training import TinyTok, tiny_target  # this script's folder, tests/, is on sys.path


def main(out_dir: str, time_limit: Optional[float] = None) -> None:
    group = mx.distributed.init()
    out = Path(out_dir)
    model = tiny_target(vocab=48, seed=0)  # the same target on every rank
    data = out / f"train-rank{group.rank()}.jsonl"
    rng = np.random.default_rng(0)
    with open(data, "w") as fh:
        for i in range(16):
            prompt = rng.integers(0, 40, size=6).tolist()
            answer = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=32)]
            fh.write(json.dumps({"id": str(i), "source": "t", "prompt_ids": prompt, "completion_ids": answer}) + "\n")
    loading.load = lambda path=None, **kw: (model, TinyTok())
    result = train(
        TrainArgs(
            data=str(data),
            out=str(out / "drafter"),
            num_layers=1,
            target_layer_ids=[1, 3],
            block_size=8,
            batch_size=4,
            num_anchors=8,
            epochs=2,
            time_limit=time_limit,
            lr=3e-3,
            progress=False,
            log_every=1,
            checkpoint_every=1000,
            seed=0,
            ema=0.99,
        ),
        log=lambda s: None,
    )
    drafter = drafters.load_drafter_dir(out / "drafter") if group.rank() == 0 else None
    print(
        json.dumps(
            {
                "rank": group.rank(),
                "world": group.size(),
                "checksum": _checksum(v for _, v in tree_flatten(result["drafter"].parameters())),
                "average_checksum": _checksum(result["average"].weights.values()),
                "steps": result["step"],
                "losses": [h["loss"] for h in result["history"]],
                "saved": drafter is not None,
            }
        ),
        flush=True,
    )


def _checksum(arrays) -> float:
    return float(np.abs(np.concatenate([np.array(v).ravel() for v in arrays])).sum())


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else None)
