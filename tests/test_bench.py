"""`dflash bench`: one run, three methods side by side, outputs compared token for token."""

import json

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
from dflash_mlx import DecodeOptions
from typer.testing import CliRunner

from app.cli.bench.speed import markdown_table, run_bench
from app.cli.bench.context import QUESTIONS
from app.cli.main import app


def test_bench_random_drafter_against_mlx_lm_and_zlab(default_model_dir):
    report = run_bench(str(default_model_dir), "random", ["Name a colour."], max_tokens=12)
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["mlx-lm", "dflash-mlx (ours)", "z-lab MLX (reference)"]
    assert all(r["same_tokens_as_mlx_lm"] for r in rows.values())
    assert rows["dflash-mlx (ours)"]["tau"] == 1.0  # an untrained drafter accepts nothing
    assert rows["mlx-lm"]["speedup"] == 1.0 and rows["mlx-lm"]["tokens"] > 0
    table = markdown_table(report)
    assert table.count("\n| ") == 4 and "z-lab MLX (reference)" in table


def test_bench_reports_each_kind(default_model_dir):
    """Prompts of two kinds: the rows of each kind add up to the whole, and the table says so."""
    report = run_bench(
        str(default_model_dir),
        "random",
        ["Name a colour.", "2+2?", "Say hi."],
        max_tokens=6,
        reference=False,
        kinds=["chat", "math", "chat"],
    )
    by_kind = report["by_kind"]
    assert list(by_kind) == ["chat", "math"] and [k["prompts"] for k in by_kind.values()] == [2, 1]
    for i, row in enumerate(report["results"]):
        assert sum(k["results"][i]["tokens"] for k in by_kind.values()) == row["tokens"]
        assert all(k["results"][i]["same_tokens_as_mlx_lm"] for k in by_kind.values())
    table = markdown_table(report)
    assert "| kind | prompts | mlx-lm tok/s | dflash-mlx (ours) |" in table and "| **all** | 3 |" in table
    assert (
        "by_kind" in report and not run_bench(str(default_model_dir), "random", ["Hi."], 4, reference=False)["by_kind"]
    )


def test_bench_cli_writes_json(default_model_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hi.\n")
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "speed",
            "--model",
            str(default_model_dir),
            "--draft",
            "random",
            "--prompts",
            str(prompts),
            "-m",
            "6",
            "--no-reference",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [r["method"] for r in report["results"]] == [
        "mlx-lm",
        "dflash-mlx (ours)",
        "dflash-mlx B=4",
        "dflash-mlx B=8",
        "dflash-mlx B=16",
    ]
    assert sum(report["results"][1]["block_sizes"]) == report["results"][1]["tokens"]  # adaptive: one cycle a token
    assert "| dflash-mlx (ours) |" in result.output


def test_bench_compares_draft_vocabularies(default_model_dir, tmp_path):
    vocab = tmp_path / "v.json"
    vocab.write_text(json.dumps({"ids": list(range(300)), "eos_token_ids": [2]}))
    report = run_bench(
        str(default_model_dir), "random", ["Name a colour."], max_tokens=8, reference=False, draft_vocab=f"none,{vocab}"
    )
    rows = {r["method"]: r for r in report["results"]}
    assert list(rows) == ["mlx-lm", "dflash-mlx (ours)", "dflash-mlx vocab 300"]
    assert all(r["same_tokens_as_mlx_lm"] for r in rows.values())
    assert report["draft_vocab"] == "full"
    assert rows["mlx-lm"]["draft_ms"] is None
    assert rows["dflash-mlx (ours)"]["draft_ms"] > 0 and rows["dflash-mlx vocab 300"]["draft_ms"] > 0
    assert "| draft ms |" in markdown_table(report)


def test_bench_compares_two_drafters_side_by_side(default_model_dir, tmp_path):
    """`--draft A --draft B`: B decodes beside A in the same run (rows interleaved per
    prompt), each with its own draft vocabulary; both give mlx-lm's tokens."""
    from dflash_mlx import shipped_drafter_dir

    out = tmp_path / "bench.json"
    args = ["bench", "speed", "--model", str(default_model_dir), "--draft", "random", "--draft"]
    args += [str(shipped_drafter_dir()), "-m", "12", "--fixed", "", "--no-reference", "--json", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["results"]}
    other = f"dflash-mlx draft {shipped_drafter_dir()}"
    assert list(rows) == ["mlx-lm", "dflash-mlx (ours)", other]
    assert report["other_drafts"] == [str(shipped_drafter_dir())]
    assert all(r["same_tokens_as_mlx_lm"] for r in rows.values())
    assert rows["dflash-mlx (ours)"]["tau"] == 1.0 < rows[other]["tau"]  # the trained drafter accepts some
    assert rows[other]["draft_ms"] > 0 and f"| {other} |" in result.output


def test_bench_alone_runs_speed_with_its_defaults(monkeypatch):
    """`dflash bench` with no subcommand is `dflash bench speed` with every default (`make bench`)."""
    from app.cli.bench import speed

    seen = {}

    def fake_run_bench(model, draft, texts, max_tokens, options, reference, **rest):
        seen.update(model=model, texts=texts, max_tokens=max_tokens, options=options, reference=reference, **rest)
        raise KeyboardInterrupt  # stop there: the routing and the defaults are what is checked

    monkeypatch.setattr(speed, "run_bench", fake_run_bench)
    for args in (["bench"], ["bench", "speed"]):
        seen.clear()
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 130, (args, result.output)
        assert seen["model"] is None and seen["texts"] is None and seen["max_tokens"] == 128
        assert seen["options"] == DecodeOptions() and seen["reference"] and seen["fixed_sizes"] is None


def test_bench_kernels_table(default_model_dir, tmp_path, monkeypatch):
    """`dflash bench kernels`: a row per M; off a Mac it says plainly the kernel did not run."""
    from app.cli.bench import kernels as bench_kernels

    out, full = tmp_path / "kernels.json", bench_kernels.run_kernel_bench
    monkeypatch.setattr(bench_kernels, "run_kernel_bench", lambda model, progress: full(model, progress, (1, 4), 1))
    result = CliRunner().invoke(app, ["bench", "kernels", "--model", str(default_model_dir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [r["m"] for r in report["rows"]] == [1, 4] and report["projections_per_layer"] == 7
    assert report["kernel_path_used"] and "quantized here to 4 bits" in report["quantization"]
    if not report["metal"]:
        assert "the kernel cannot run" in result.output and all(r["kernel_us"] is None for r in report["rows"])
    assert all(r["verify_ms_own"] > 0 and r["verify_ms_kernel_path"] > 0 for r in report["rows"])
    assert "Gated-delta rollback" in result.output
    if not report["metal"]:
        assert report["replay"] is None and "not measured: no Metal GPU here" in result.output


def test_bench_replay_timing_runs(monkeypatch):
    """The Mac-only rollback timing, run here with the replay's fallback standing in for the kernel."""
    import dflash_mlx.kernels
    from app.cli.bench.kernels import REPLAY_KEEP, _replay_lines, replay_times
    from tiny_targets import tiny_target

    if not dflash_mlx.kernels.metal_ready():
        assert "no Metal GPU" in replay_times(tiny_target("qwen3_5"), 1)[1]
    monkeypatch.setattr(dflash_mlx.kernels, "metal_ready", lambda: True)
    rows, note = replay_times(tiny_target("qwen3_5"), 1)
    assert [r["tokens"] for r in rows] == list(REPLAY_KEEP) and note == ""
    assert all(r["module_ms"] > 0 and r["kernel_ms"] > 0 for r in rows)
    assert "| 15 |" in "\n".join(_replay_lines({"replay": rows}))
    assert "no gated-delta layers" in replay_times(tiny_target("qwen3_moe"), 1)[1]


def test_bench_context_lengths(default_model_dir, tmp_path):
    """`dflash bench context`: one row per length of real documentation before the question
    (the questions from --prompts), ours token-identical to mlx-lm at each, prompts as long as
    asked, the report's JSON and its plot written."""
    from app.cli.bench.context import context_table, documentation

    questions, out, png = tmp_path / "questions.txt", tmp_path / "context.json", tmp_path / "context.png"
    questions.write_text("\n".join(QUESTIONS[:2]) + "\n")
    args = ["--model", default_model_dir, "--lengths", "32,160", "--prompts", questions, "-m", 8]
    result = CliRunner().invoke(app, ["bench", "context", *map(str, args), "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    rows = report["results"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and all(r["prompts"] == 2 for r in rows)
    assert [r["context"] for r in rows] == [32, 160] and all(r["same_tokens_as_mlx_lm"] for r in rows)
    assert rows[1]["prompt_tokens"] - rows[0]["prompt_tokens"] >= 120 and all(r["draft_ms"] > 0 for r in rows)
    assert context_table(report).count("\n| ") == 3
    import mlx_lm

    _, tokenizer = mlx_lm.load(str(default_model_dir))
    assert abs(len(tokenizer.encode(documentation(tokenizer, 500), add_special_tokens=False)) - 500) <= 10


def test_bench_host_counts_reads_and_idle_time_per_kind_of_cycle(default_model_dir):
    """`dflash bench host`: a row per kind of cycle, each reading the host about once a
    cycle (the prefill's reads a few more a generation)."""
    from app.cli.bench.host import host_table, run_host_bench

    report = run_host_bench(str(default_model_dir), None, ["Name a colour."], max_tokens=12)
    rows = {r["kind"]: r for r in report["results"]}
    assert list(rows) == ["plain", "chain 8", "tree 16", "defaults"]
    assert all(1 <= r["reads_per_cycle"] < 1.5 for r in rows.values()), rows
    assert all(r["idle_ms_per_cycle"] >= 0 and r["cycles"] > 0 for r in rows.values())
    assert "| tree 16 |" in host_table(report)
