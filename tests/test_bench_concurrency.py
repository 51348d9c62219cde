"""`dflash bench concurrency`: `dflash serve` and `mlx_lm.server` started as real processes
on the default model, N clients at once on each; bad levels or paths fail in one line
before any server starts."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from app.cli.main import app


@pytest.mark.parametrize(
    "args, message",
    [
        (["0,2"], "LEVELS must be integers >= 1"),
        (["1,x"], "LEVELS must be comma-separated integers"),
        (["1", "-m", "0"], "--max-tokens must be a positive integer"),
        (["1", "--json", "/nonexistent/dir/c.json"], "the directory /nonexistent/dir does not exist"),
    ],
)
def test_bad_arguments_fail_in_one_line_before_any_server(args, message):
    result = CliRunner().invoke(app, ["bench", "concurrency", *args])
    assert result.exit_code != 0 and message in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_both_servers_under_concurrent_clients(default_model_dir, tmp_path):
    out, plot = tmp_path / "c.json", tmp_path / "c.png"
    args = ["bench", "concurrency", "2", "--limit", "4", "-m", "8", "--prompts", "chat", "--json", str(out)]
    result = CliRunner().invoke(app, [*args, "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [row["clients"] for row in report["rows"]] == [1, 2]  # 1 always first: the solo answers
    for row in report["rows"]:
        for server in ("dflash serve", "mlx_lm.server"):
            r = row[server]
            assert r["tok_s"] > 0 and r["latency_p95"] >= r["latency_p50"] > 0 and r["answers"] == 4
        assert row["dflash serve"]["same_as_solo"] == 4  # ours: every text its solo text
    assert "| 2 |" in result.output and plot.stat().st_size > 0
