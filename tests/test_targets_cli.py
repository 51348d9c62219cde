"""`dflash generate` and `dflash bench` on tiny random models saved as mlx-lm directories,
as a user would run them (`--model <dir>`): the same text as mlx-lm's own greedy
generation, and the bench's token check passes (z-lab's loop included on `qwen3_5`)."""

from __future__ import annotations

import json

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest
from typer.testing import CliRunner

from app.cli.main import app
from dflash_mlx.drafter import Drafter
from dflash_mlx.drafters import save_drafter
from dflash_mlx.targets import make_target
from tiny_targets import save_tiny_target, tiny_drafter_config

VOCAB = 49152  # the default model's tokenizer


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss", "gemma4"])
def test_generate_cli(default_model_dir, tmp_path, family):
    path = save_tiny_target(family, tmp_path / family, default_model_dir, VOCAB)
    model, tokenizer = mlx_lm.load(str(path))
    n = make_target(model).num_layers
    mx.random.seed(1)
    save_drafter(
        Drafter(tiny_drafter_config(n, 8, VOCAB)),
        tmp_path / "draft",
    )
    result = CliRunner().invoke(
        app,
        [
            "generate",
            "--model",
            str(path),
            "--draft",
            str(tmp_path / "draft"),
            "-p",
            "Tell me a story",
            "-m",
            "24",
            "--block-size",
            "4",
        ],
    )
    assert result.exit_code == 0, result.output
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story"}], add_generation_prompt=True)
    want = mlx_lm.generate(model, tokenizer, prompt, max_tokens=24)
    assert result.stdout == want + "\n"  # the stats go to stderr
    assert "Acceptance: tau" in result.stderr


def test_bench_cli_hybrid(default_model_dir, tmp_path):
    path = save_tiny_target("qwen3_5", tmp_path / "qwen3_5", default_model_dir, VOCAB)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hi.\nCount to five.\n")
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "speed",
            "--model",
            str(path),
            "--draft",
            "random",
            "--prompts",
            str(prompts),
            "-m",
            "12",
            "--fixed",
            "4",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert {"dflash-mlx (ours)", "dflash-mlx B=4", "z-lab MLX (reference)"} <= set(rows)
    assert all(r["same_tokens_as_mlx_lm"] for r in rows.values())
