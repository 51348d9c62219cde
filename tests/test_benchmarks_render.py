"""BENCHMARKS.md's rendered tables are what benchmarks/*.json render to (`python -m
benchmarks.render --check`), and the check catches a number changed by hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.render import main, plain_table

ROOT = Path(__file__).resolve().parent.parent


def test_benchmarks_md_matches_its_json():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.render", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_a_number_edited_by_hand_fails_the_check(tmp_path, capsys):
    text = (ROOT / "BENCHMARKS.md").read_text()
    data = json.loads((ROOT / "benchmarks" / "training-long-run.json").read_text())
    row = "| " + " | ".join(f"{v:,}" if i == 0 else f"{v:.2f}" for i, v in enumerate(data["rows"][-1])) + " |"
    assert row in text
    edited = tmp_path / "BENCHMARKS.md"
    edited.write_text(text.replace(row, row.replace(f"{data['rows'][-1][2]:.2f}", "9.99", 1)))
    assert main(["--check", "--file", str(edited)]) == 1
    assert "training-long-run" in capsys.readouterr().err
    assert main(["--write", "--file", str(edited)]) == 0
    assert edited.read_text() == text


def test_plain_table_formats_and_checks_its_rows():
    columns = [{"name": "step", "align": "r", "format": ","}, {"name": "tau", "align": "r", "format": ".2f"}]
    assert plain_table({"columns": columns, "rows": [[1108, 1.4], [2, None]]}).splitlines() == [
        "| step | tau |",
        "|---:|---:|",
        "| 1,108 | 1.40 |",
        "| 2 | - |",
    ]
    with pytest.raises(ValueError, match="row 0 has 1 cells for 2 columns"):
        plain_table({"columns": columns, "rows": [[1]]})
