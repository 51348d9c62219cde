"""Does the long run learn its data or the target? Greedy tau by replay (B = 8, 64 tokens)
of the run's drafter as committed at step 7,040 (read from git) on single-turn greedy
self-instruct answers from three parts of the committed training set: sequences it had
trained on 7-8 times, once, and never (the run features the set in order, a chunk an
epoch). The answers are the target's own (the data's completions): no decoding needed.

    python -m benchmarks.seen_unseen && python -m benchmarks.render --write
"""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import tempfile
from pathlib import Path

import dflash_mlx  # noqa: F401  (OpenBLAS preload before the first mlx import)


from dflash_mlx.drafters import load_drafter_dir
from dflash_mlx.loading import load
from dflash_mlx.targets import make_target
from dflash_mlx.train.replay import Reference, reference, replay_tau

ROOT = Path(__file__).resolve().parent.parent
POINT = "assets/train/long-run"
AT = "0150860"  # the commit of the step-7,040 resume point, which PARTS describe
DATA = ROOT / "assets" / "train" / "smollm2-train.jsonl.gz"
OUT = Path(__file__).resolve().parent / "seen-unseen.json"
#: (label, first, end) of the parts compared, and what the run had trained on at step 7,040
PARTS = (
    ("1,024-2,047: featured in epochs 2-3, trained on 7-8 times", 1024, 2048),
    ("4,608-5,119: featured in epoch 9, trained on once", 4608, 5120),
    ("5,120-9,575: featured later or not yet, never trained on", 5120, 9576),
)
PROMPTS, TOKENS, BLOCK = 80, 64, 8


def sample(records: list[dict], first: int, end: int, eos: set[int], target) -> list[Reference]:
    """`PROMPTS` single-turn greedy self-instruct records of records[first:end] (a fixed
    shuffle), as replay references along their completions."""
    pool = [
        r for r in records[first:end] if r["source"] == "selfinstruct" and not r.get("turns") and r.get("temp", 0) == 0
    ]
    pool = [r for r in pool if len(r["completion_ids"]) >= 16]
    random.Random(1).shuffle(pool)
    return [
        reference(target, "chat", r["prompt_ids"], r["completion_ids"][: TOKENS + BLOCK], eos, TOKENS)
        for r in pool[:PROMPTS]
    ]


def committed(name: str) -> bytes:
    """A file of the resume point as committed at `AT`."""
    return subprocess.run(["git", "show", f"{AT}:{POINT}/{name}"], capture_output=True, check=True, cwd=ROOT).stdout


def main() -> None:
    state = json.loads(committed("state.json"))
    with tempfile.TemporaryDirectory() as tmp:  # the weights alone, not the optimizer's moments
        for name in ("config.json", "model.safetensors"):
            (Path(tmp) / name).write_bytes(committed(name))
        drafter = load_drafter_dir(tmp)
    model, tokenizer = load()
    target = make_target(model, drafter.config.target_layer_ids)
    with gzip.open(DATA, "rt") as fh:
        records = [json.loads(line) for line in fh]
    rows = []
    for label, first, end in PARTS:
        refs = sample(records, first, end, set(tokenizer.eos_token_ids), target)
        tau = replay_tau(drafter, model, refs, max_tokens=TOKENS, block_size=BLOCK)["all"]["tau"]
        rows.append([label, len(refs), round(tau, 2)])
        print(f"{label}: tau {tau:.2f} ({len(refs)} answers)", flush=True)
    table = {
        "commands": ["python -m benchmarks.seen_unseen"],
        "when": (
            f"the long run's drafter at step {state['step']:,} ({state['core_seconds'] / 3600:.2f} core-hours; "
            f"its resume point at commit {AT}), float32 target, greedy tau by replay along the data's own "
            f"answers ({TOKENS} tokens, B = {BLOCK}), 2-core x86 Linux."
        ),
        "columns": [
            {"name": "training sequences (single-turn greedy self-instruct ones)", "align": "l", "format": ""},
            {"name": "answers", "align": "r", "format": "d"},
            {"name": "tau", "align": "r", "format": ".2f"},
        ],
        "rows": rows,
    }
    OUT.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
