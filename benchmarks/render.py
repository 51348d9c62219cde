"""Render BENCHMARKS.md's tables from the JSON files beside this script.

BENCHMARKS.md marks each rendered table with ``<!-- render: NAME -->`` ... ``<!-- /render -->``;
what lies between is exactly what ``benchmarks/NAME.json`` renders to: the commands that
produced it (an sh block), when and where they ran, then the table. So a number in a marked
block changes only with its JSON, and the JSON is what the commands wrote.

A JSON file is one of two kinds, both with ``"commands"`` (a list of command lines),
``"when"`` (date, machine state, commit) and ``"measured"`` (the commit and the files its numbers
measured, or why it is a historical record: ``benchmarks/stale.py``; not rendered):

- a benchmark report, as ``dflash bench speed --json FILE`` writes it (it has ``"results"``),
  rendered by the bench's own table (``markdown_table``): add the three keys to the file the
  command wrote;
- a plain table: ``"columns"``, each ``{"name", "align": "l" | "r", "format": spec}`` (the
  format spec is Python's, applied to numbers; strings are shown as they are), and
  ``"rows"``, lists of cells.

``python -m benchmarks.render --check`` exits 1 if BENCHMARKS.md differs from what the JSON
renders (naming the blocks) or a table is stale (naming it, its commit and the newest commit
that changed what it measures); ``--consistency`` checks the first alone (the tests: a commit to
the engine does not fail them), ``--stale`` prints every table's state, ``--write`` rewrites the
marked blocks.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from benchmarks.stale import measured, statuses

#: Where the benches' own tables live (the one place to change if a bench moves).
BENCH_TABLE_MODULE = "app.cli.bench.speed"
CONCURRENCY_TABLE_MODULE = "app.cli.bench.concurrency"

HERE = Path(__file__).resolve().parent
BENCHMARKS_MD = HERE.parent / "BENCHMARKS.md"
BLOCK = re.compile(r"(<!-- render: ([\w.-]+) -->\n)(.*?)(<!-- /render -->)", re.S)


def _cell(value: Any, spec: str) -> str:
    """One table cell: numbers through the column's format spec, anything else as it is."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and spec:
        return format(value, spec)
    return str(value)


def plain_table(data: dict) -> str:
    """A markdown table of `data["columns"]` and `data["rows"]`."""
    columns = data["columns"]
    for n, row in enumerate(data["rows"]):
        if len(row) != len(columns):
            raise ValueError(f"row {n} has {len(row)} cells for {len(columns)} columns")
    head = "| " + " | ".join(c["name"] for c in columns) + " |"
    rule = "|" + "|".join("---:" if c.get("align", "l") == "r" else "---" for c in columns) + "|"
    formats = [c.get("format", "") for c in columns]
    body = ["| " + " | ".join(_cell(v, f) for v, f in zip(row, formats)) + " |" for row in data["rows"]]
    return "\n".join([head, rule, *body])


def bench_table(report: dict) -> str:
    """A `dflash bench speed` or `dflash bench concurrency` `--json` report as the bench prints it."""
    import importlib

    if "mlx_lm_batch" in report:
        return importlib.import_module(CONCURRENCY_TABLE_MODULE).concurrency_table(report)
    return importlib.import_module(BENCH_TABLE_MODULE).markdown_table(report)


def render(name: str, data: dict) -> str:
    """The text of block NAME: its commands, when they ran, its table."""
    missing = [key for key in ("commands", "when") if key not in data]
    if missing:
        raise ValueError(f"benchmarks/{name}.json: no {missing[0]!r}")
    table = bench_table(data) if "results" in data or "mlx_lm_batch" in data else plain_table(data)
    commands = "\n".join(data["commands"])
    return f"```sh\n{commands}\n```\n\n{data['when']}\n\n{table}\n"


def rendered(text: str, directory: Path = HERE) -> tuple[str, list[str]]:
    """`text` with every marked block rendered afresh, and the names of the blocks that changed."""
    names = [m.group(2) for m in BLOCK.finditer(text)]
    files = {p.stem for p in directory.glob("*.json")}
    if files - set(names):
        raise ValueError(f"benchmarks/{sorted(files - set(names))[0]}.json has no <!-- render --> block")
    if len(set(names)) != len(names):
        raise ValueError("a <!-- render --> block appears twice")
    changed: list[str] = []

    def one(m: re.Match) -> str:
        path = directory / f"{m.group(2)}.json"
        if not path.is_file():
            raise ValueError(f"<!-- render: {m.group(2)} --> has no benchmarks/{m.group(2)}.json")
        data = json.loads(path.read_text())
        measured(m.group(2), data)  # not rendered, but every table has it
        new = render(m.group(2), data)
        if new != m.group(3):
            changed.append(m.group(2))
        return m.group(1) + new + m.group(4)

    return BLOCK.sub(one, text), changed


def main(argv: list[str] | None = None) -> int:
    """`--check` (exit 1 on a difference or a stale table), `--consistency` (on a difference),
    `--stale` (every table's state) or `--write`; `--file` and `--benchmarks` name others."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.render", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 if BENCHMARKS.md differs from the JSON or is stale")
    mode.add_argument("--consistency", action="store_true", help="exit 1 if BENCHMARKS.md differs from the JSON")
    mode.add_argument("--stale", action="store_true", help="print each table's staleness, one line each")
    mode.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's rendered blocks")
    parser.add_argument("--file", type=Path, default=BENCHMARKS_MD, help="the Markdown file (default: BENCHMARKS.md)")
    parser.add_argument("--benchmarks", type=Path, default=HERE, help="the JSON files' folder (default: benchmarks/)")
    args = parser.parse_args(argv)
    try:
        text = args.file.read_text()
        new, changed = rendered(text, args.benchmarks)
        found, skipped = statuses(args.benchmarks) if args.check or args.stale else ([], "")
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.stale:
        print("\n".join([s.line for s in found] or [skipped]))
        return 0
    if args.write:
        if new != text:
            args.file.write_text(new)
        print(f"rendered {len(changed)} changed block(s): {', '.join(changed) or 'none'}")
        return 0
    if changed:
        names = ", ".join(changed)
        print(f"{args.file.name} differs from benchmarks/*.json in: {names} (run --write)", file=sys.stderr)
    stale = [s.line for s in found if s.stale]
    for line in ([skipped] if skipped else []) + stale:
        print(line, file=sys.stderr)
    return 1 if changed or stale else 0


if __name__ == "__main__":
    sys.exit(main())
