"""`dflash curves`: held-out tau against core-hours from training logs, fitted per doubling."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from app.cli.main import app
from dflash_mlx.train.curves import fit, hours_for, read_curve


def write_log(run, slope, start=1.0):
    """A train_log.jsonl whose evaluations lie on tau = start + slope * log2(4 * hours), with
    the step records between them (no held-out tau) that a real log has."""
    run.mkdir()
    lines = []
    for i, hours in enumerate((0.25, 0.5, 1.0, 2.0)):
        lines.append({"step": 10 * i + 5, "loss": 3.0, "core_hours": hours / 2})
        lines.append({"step": 10 * i + 10, "core_hours": hours, "heldout_tau": start + slope * math.log2(4 * hours)})
    (run / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_fit_and_table(tmp_path):
    write_log(tmp_path / "slow", 0.1)
    write_log(tmp_path / "fast", 0.3)
    curve = read_curve(tmp_path / "fast")
    assert [h for h, _ in curve] == [0.25, 0.5, 1.0, 2.0]
    a, b = fit(curve)
    assert b == pytest.approx(0.3) and a == pytest.approx(1.6)
    assert hours_for((a, b), 2.2) == pytest.approx(4.0) and hours_for((a, -0.1), 3) == math.inf

    png = tmp_path / "c.png"
    res = CliRunner().invoke(app, ["curves", str(tmp_path / "slow"), str(tmp_path / "fast"), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    rows = [line for line in res.output.splitlines() if line.startswith("| fast") or line.startswith("| slow")]
    assert rows[0].startswith("| fast") and "+0.300" in rows[0]  # steepest first
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_log_is_one_line(tmp_path):
    res = CliRunner().invoke(app, ["curves", str(tmp_path)])
    assert res.exit_code != 0 and "no train_log.jsonl" in res.output and "Traceback" not in res.output
