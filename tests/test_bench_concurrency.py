"""`dflash bench concurrency`: `dflash serve` and `mlx_lm.server` started as real processes
on the default model, N clients at once on each; a bad `--levels` fails in one line
before any server starts.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from app.cli.main import app


def test_bad_levels_fail_in_one_line():
    result = CliRunner().invoke(app, ["bench", "concurrency", "--levels", "0,2"])
    assert result.exit_code != 0 and "--levels" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_both_servers_under_concurrent_clients(default_model_dir, tmp_path):
    out, plot = tmp_path / "c.json", tmp_path / "c.png"
    args = ["bench", "concurrency", "--levels", "1,2", "-m", "8", "--prompts", "chat", "--json", str(out)]
    result = CliRunner().invoke(app, [*args, "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["results"]
    assert [(r["server"], r["clients"]) for r in rows] == [("dflash", 1), ("dflash", 2), ("mlx_lm", 1), ("mlx_lm", 2)]
    assert all(r["tokens"] > 0 and r["tokens_per_second"] > 0 and r["p95_latency"] >= r["p50_latency"] for r in rows)
    ours = [r for r in rows if r["server"] == "dflash"]
    assert all(r["solo_texts"] == r["clients"] for r in ours)  # ours: every text its solo text
    assert "| dflash | 2 |" in result.output and plot.stat().st_size > 0
