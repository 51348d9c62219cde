"""Does the long run learn its data or the target? Greedy tau by replay (B = 8, 64 tokens)
of three drafters on single-turn greedy self-instruct answers from four parts of the
committed training set, which the run features in order (a chunk an epoch), so that each
part was trained on many times, once or never by each drafter's step: the run at step 7,040
and at its end (its resume point's weight average), both read from git, and the shipped
drafter. The answers are the target's own (the data's completions): no decoding needed.

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


from dflash_mlx.drafter import Drafter
from dflash_mlx.drafters import load_drafter_dir
from dflash_mlx.loading import load
from dflash_mlx.targets import make_target
from dflash_mlx.train.replay import Reference, reference, replay_tau

from benchmarks.stale import head_commit

ROOT = Path(__file__).resolve().parent.parent
POINT = "assets/train/long-run"
SHIPPED = ROOT / "assets" / "smollm2-135m-dflash-b8"
DATA = ROOT / "assets" / "train" / "smollm2-train.jsonl.gz"
OUT = Path(__file__).resolve().parent / "seen-unseen.json"
#: the commits of the resume point measured (the run at step 7,040 and at its end); None: the shipped drafter
DRAFTERS = ("0150860", None, "b16e1ac")
#: (label, first, end): the parts of the data compared, with what each drafter had trained on
PARTS = (
    ("1,024-2,047: trained on 7-8 times by step 7,040, more after", 1024, 2048),
    ("4,608-5,119: once by step 7,040, more after", 4608, 5120),
    ("5,120-8,930: never by step 7,040, several times by the end", 5120, 8931),
    ("8,931-9,575: never by any", 8931, 9576),
)
PROMPTS, TOKENS, BLOCK = 80, 64, 8
#: what the table measures (benchmarks/stale.py): replay, the shipped drafter and the data
MEASURED = [
    "dflash_mlx/",
    "!dflash_mlx/train/",
    "dflash_mlx/train/replay.py",
    "dflash_mlx/train/evaluate.py",
    "benchmarks/seen_unseen.py",
    "assets/smollm2-135m-dflash-b8/",
    "assets/train/smollm2-train.jsonl.gz",
]


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


def committed(commit: str, name: str) -> bytes:
    """A file of the resume point as committed at `commit`."""
    return subprocess.run(["git", "show", f"{commit}:{POINT}/{name}"], capture_output=True, check=True, cwd=ROOT).stdout


def column(commit: str | None) -> str:
    """A drafter's column: the run's step and core-hours at `commit`, or the shipped drafter."""
    if commit is None:
        return "shipped (round 5: 7.2 core-hours)"
    state = json.loads(committed(commit, "state.json"))
    return f"step {state['step']:,} ({state['core_seconds'] / 3600:.2f} core-hours)"


def drafter_at(commit: str | None) -> Drafter:
    """The drafter's weights alone (no optimizer moments, no draft vocabulary): the resume
    point's weight average where it has one (the weights its evaluations measure), else its
    weights; without a commit, the shipped drafter."""
    with tempfile.TemporaryDirectory() as tmp:
        if commit is None:
            files = {name: (SHIPPED / name).read_bytes() for name in ("config.json", "model.safetensors")}
        else:
            names = subprocess.run(
                ["git", "ls-tree", "--name-only", commit, f"{POINT}/"], capture_output=True, text=True, cwd=ROOT
            )
            weights = (
                "average.safetensors" if f"{POINT}/average.safetensors" in names.stdout.split() else "model.safetensors"
            )
            files = {"config.json": committed(commit, "config.json"), "model.safetensors": committed(commit, weights)}
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return load_drafter_dir(tmp)


def main() -> None:
    model, tokenizer = load()
    drafters = [(column(commit), drafter_at(commit)) for commit in DRAFTERS]
    target = make_target(model, drafters[0][1].config.target_layer_ids)
    with gzip.open(DATA, "rt") as fh:
        records = [json.loads(line) for line in fh]
    rows = []
    for label, first, end in PARTS:
        refs = sample(records, first, end, set(tokenizer.eos_token_ids), target)
        rows.append([label, len(refs)])
        for name, drafter in drafters:
            tau = replay_tau(drafter, model, refs, max_tokens=TOKENS, block_size=BLOCK)["all"]["tau"]
            rows[-1].append(round(tau, 2))
            print(f"{label} | {name}: tau {tau:.2f} ({len(refs)} answers)", flush=True)
    table = {
        "commands": ["python -m benchmarks.seen_unseen"],
        "when": (
            f"the long run's resume point at commits {DRAFTERS[0]} and {DRAFTERS[2]} (its weight average), "
            f"and the shipped drafter without its draft vocabulary; float32 target, greedy tau by replay along the "
            f"data's own answers ({TOKENS} tokens, B = {BLOCK}), 2-core x86 Linux."
        ),
        "measured": {"commit": head_commit(ROOT), "files": MEASURED},
        "columns": [
            {"name": "training sequences (single-turn greedy self-instruct ones)", "align": "l", "format": ""},
            {"name": "answers", "align": "r", "format": "d"},
        ]
        + [{"name": name, "align": "r", "format": ".2f"} for name, _ in drafters],
        "rows": rows,
    }
    OUT.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
