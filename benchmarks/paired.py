"""Before-and-after tables of issue 57 (one engine that keeps a GPU busy), from the raw
reports the bench commands wrote into `benchmarks/issue57/`: the host bench's blocking reads
and idle milliseconds per cycle, the speed bench's and the concurrency bench's ratios.

    python -m benchmarks.paired && python -m benchmarks.render --write

Each table names the commits its two sides ran (`"when"`) and the files it measures
(`"measured"`, the after side's commit: `benchmarks/stale.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RAW = HERE / "issue57"
ENGINE = ["dflash_mlx/", "!dflash_mlx/train/", "app/cli/bench/", "assets/smollm2-135m-dflash-b8/", "assets/prompts/"]


def _raw(name: str) -> dict:
    return json.loads((RAW / f"{name}.json").read_text())


def host_table() -> dict:
    """Per kind of cycle: blocking reads and host idle ms per cycle, before and after."""
    before, after = (_raw(f"host-{side}")["results"] for side in ("before", "after"))
    rows = []
    for b, a in zip(before, after):
        assert b["kind"] == a["kind"]
        rows.append(
            [
                b["kind"],
                b["reads_per_cycle"],
                a["reads_per_cycle"],
                b["idle_ms_per_cycle"],
                a["idle_ms_per_cycle"],
                b["cycle_ms"],
                a["cycle_ms"],
                b["tokens_per_cycle"],
                a["tokens_per_cycle"],
            ]
        )
    names = ["reads/cycle", "host idle ms/cycle", "cycle ms", "tokens/cycle"]
    columns = [{"name": "cycles", "align": "l"}]
    for name in names:
        spec = ".2f" if name != "cycle ms" else ".1f"
        columns += [{"name": f"{name} before", "align": "r", "format": spec}]
        columns += [{"name": f"{name} after", "align": "r", "format": spec}]
    return {"columns": columns, "rows": rows}


def _ours_and_plain(report: dict) -> tuple[dict, dict]:
    by_name = {r["method"]: r for r in report["results"]}
    return by_name["dflash-mlx (ours)"], by_name["mlx-lm"]


def speed_table(runs: list[tuple[str, str]]) -> dict:
    """One row per (label, raw report name) of `dflash bench speed`: ours against plain mlx-lm."""
    rows = []
    for label, name in runs:
        ours, plain = _ours_and_plain(_raw(name))
        same = "yes" if ours["same_tokens_as_mlx_lm"] else "NO"
        rows.append([label, plain["tokens_per_second"], ours["tokens_per_second"], ours["speedup"], ours["tau"], same])
    columns = [
        {"name": "run", "align": "l"},
        {"name": "mlx-lm tok/s", "align": "r", "format": ".1f"},
        {"name": "ours tok/s", "align": "r", "format": ".1f"},
        {"name": "speed-up", "align": "r", "format": ".2f"},
        {"name": "tau", "align": "r", "format": ".2f"},
        {"name": "same tokens", "align": "l"},
    ]
    return {"columns": columns, "rows": rows}


def burst_table(pairs: tuple[str, ...] = ("", "-2")) -> dict:
    """Per pair of runs and level: dflash serve against mlx_lm.server in bursts, before and after."""
    rows = []
    for pair in pairs:
        before, after = (_raw(f"burst-{side}{pair}")["rows"] for side in ("before", "after"))
        rows += _burst_rows(before, after, f"pair {pairs.index(pair) + 1}")
    columns = [{"name": "runs", "align": "l"}, {"name": "clients at once", "align": "r"}]
    for name, spec in (("mlx_lm.server tok/s", ".1f"), ("dflash serve tok/s", ".1f"), ("ratio", ".2f")):
        columns += [{"name": f"{name} {side}", "align": "r", "format": spec} for side in ("before", "after")]
    columns += [{"name": f"same as solo {side}", "align": "l"} for side in ("before", "after")]
    return {"columns": columns, "rows": rows}


def _burst_rows(before: list, after: list, label: str) -> list[list]:
    """One row per level of a pair of burst runs."""
    rows = []
    for b, a in zip(before, after):
        ratio = [r["dflash serve"]["tok_s"] / r["mlx_lm.server"]["tok_s"] for r in (b, a)]
        same = [f"{r['dflash serve']['same_as_solo']}/{r['dflash serve']['answers']}" for r in (b, a)]
        rows.append([label, b["clients"], b["mlx_lm.server"]["tok_s"], a["mlx_lm.server"]["tok_s"]])
        rows[-1] += [b["dflash serve"]["tok_s"], a["dflash serve"]["tok_s"], *ratio, *same]
    return rows


def main() -> None:
    """Write each table's JSON, keeping its commands, "when" and "measured" if it has them."""
    tables = {
        "engine-host": host_table(),
        "engine-speed": speed_table(
            [
                ("40 held-out, before", "speed-before"),
                ("40 held-out, after", "speed-after"),
                ("random drafter, one bench run, before", "random-bench-before"),
                ("random drafter, one-shot calls, before", "random-oneshot-before"),
                ("random drafter, one-shot calls, after", "random-oneshot-after"),
            ]
        ),
        "engine-burst": burst_table(),
    }
    for name, table in tables.items():
        path = HERE / f"{name}.json"
        kept = json.loads(path.read_text()) if path.is_file() else {}
        keys = ("commands", "when", "measured")
        out = {key: kept[key] for key in keys if key in kept}
        server = ["app/server/", "app/model_thread.py"] if name == "engine-burst" else []
        out.setdefault("measured", {"commit": "", "files": ENGINE + server})
        path.write_text(json.dumps({**out, **table}, indent=1) + "\n")


if __name__ == "__main__":
    main()
