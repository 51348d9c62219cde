"""The long run's table (BENCHMARKS.md, "The long run, carried across machines"), from the
log inside its committed resume point: every periodic held-out evaluation, with the fitted
line of `dflash curves`.

    python -m benchmarks.long_run && python -m benchmarks.render --write
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.stale import head_commit

ROOT = Path(__file__).resolve().parent.parent
POINT = ROOT / "assets" / "train" / "long-run"
OUT = Path(__file__).resolve().parent / "training-long-run-5.json"
KINDS = ("chat", "code", "math", "stdlib")


def evaluations(log: Path) -> list[list]:
    """One row per held-out evaluation in a run's train_log.jsonl: step, core-hours, tau, per
    kind, and the weights measured (the last step's, or the run's average under --ema)."""
    rows = []
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("heldout_tau") is not None:
            kinds = rec.get("heldout_kinds") or {}
            rows.append([rec["step"], round(rec["core_hours"], 2), round(rec["heldout_tau"], 2)])
            rows[-1] += [round(kinds[k], 2) if k in kinds else None for k in KINDS]
            rows[-1].append("average (--ema)" if rec.get("weights") == "ema" else "last step")
    return rows


def main() -> None:
    state = json.loads((POINT / "state.json").read_text())
    commit = head_commit(ROOT)
    columns = [{"name": "step", "align": "r", "format": ","}, {"name": "core-hours", "align": "r", "format": ".2f"}]
    columns += [{"name": name, "align": "r", "format": ".2f"} for name in ("all", *KINDS)]
    columns.append({"name": "weights", "align": "l"})
    table = {
        "commands": ["make resume-training", "dflash curves assets/train/long-run --target-tau 2.07"],
        "when": (
            f"the run in assets/train/long-run at step {state['step']:,} "
            f"({state['core_seconds'] / 3600:.2f} core-hours of training steps), 2-core x86 Linux, two OpenBLAS "
            "threads while the CPU lock is free, one while it is held, stopped for test suites and benchmarks; "
            "held-out greedy tau by replay (40 held-out prompts x 64 tokens, B = 8), rendered at commit "
            f"{commit} by `python -m benchmarks.long_run`."
        ),
        # the committed log is what the table measured: later training code does not alter it
        "measured": {"commit": commit, "files": ["assets/train/long-run/", "benchmarks/long_run.py"]},
        "columns": columns,
        "rows": evaluations(POINT / "train_log.jsonl"),
    }
    OUT.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{len(table['rows'])} evaluations -> {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
