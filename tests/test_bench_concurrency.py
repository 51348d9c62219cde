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


def test_a_burst_fires_n_requests_at_once_and_the_next_n_once_they_are_answered(monkeypatch):
    """`--burst`: the clients' requests start together, group by group (a slow answer holds
    the next group back); without it each client goes on at its own pace."""
    import threading
    import time

    from app.cli.bench import concurrency

    spans, lock = {}, threading.Lock()

    def fake_ask(port, prompt, max_tokens):
        start = time.perf_counter()
        time.sleep(0.02 if int(prompt) % 2 else 0.08)  # odd prompts answer fast
        with lock:
            spans[int(prompt)] = (start, time.perf_counter())
        return concurrency.Answer(prompt, 1, 0.0, 0.0)

    monkeypatch.setattr(concurrency, "ask", fake_ask)
    prompts = [str(i) for i in range(5)]
    for burst in (True, False):
        spans.clear()
        answers, _ = concurrency.run_level(0, prompts, 2, 8, burst=burst)
        assert [a.text for a in answers] == prompts
        next_group_waits = spans[3][0] >= max(spans[0][1], spans[1][1])  # prompt 3 after prompts 0 and 1
        assert next_group_waits == burst, (burst, spans)
