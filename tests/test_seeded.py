"""A seed gives the same text at any block size (issue 22): the random draws are keyed by
(seed, token position) alone (sampling.py), so neither the drafts nor the block sizes the
loop picks change what is committed.

* The real pair (SmolLM2-135M-Instruct and the shipped drafter with its draft vocabulary,
  float32) at T=0.8 with top-p: fixed blocks of 2 and 8, adaptive, a DFlash2 drafter and
  the target alone (`draft_model=None`) give token-identical output for one seed, and
  another seed gives other text.
* `dflash_mlx.generate` takes a `DecodeOptions` positionally after the drafter, as
  `stream_generate` does: the same text as its fields given as keywords, and nothing on
  stdout unless `verbose=True` (issue 44).
* Greedy decoding draws nothing from MLX's global generator (mlx-lm's does not either):
  code seeded with `mx.random.seed` sees the same random stream after a greedy generation
  (chains and trees) as without it; sampling without a seed draws its seed from it.
* The CLI: `dflash generate --temp 0.8 --seed 1` prints the same text with and without
  `--no-draft` and with `--profile` (and the stats go to stderr, so stdout can be diffed).
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS preload before the first mlx import)

import mlx.core as mx
import mlx_lm
from typer.testing import CliRunner

from app.cli.main import app
from dflash_mlx import DecodeOptions, generate, load_draft, stream_generate
from dflash_mlx.drafter2 import Drafter2
from dflash_mlx.loading import DEFAULT_DRAFT_DIR

from conftest import smollm2_drafter_config

PROMPT = [{"role": "user", "content": "Tell me a short story about a fox."}]
SAMPLING = dict(temp=0.8, top_p=0.9, max_tokens=24)


def _tokens(model, tokenizer, drafter, seed: int, **options) -> list[int]:
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    return [r.token for r in stream_generate(model, tokenizer, prompt, drafter, seed=seed, **SAMPLING, **options)]


def test_same_seed_same_text_at_any_block_size(default_model):
    model, tokenizer = default_model
    drafter = load_draft(str(DEFAULT_DRAFT_DIR), model=model)
    alone = _tokens(model, tokenizer, None, seed=3)
    runs = {b: _tokens(model, tokenizer, drafter, seed=3, block_size=b) for b in (2, 8, None)}
    dflash2 = Drafter2(smollm2_drafter_config(True, intermediate_size=256, target_layer_ids=[29], block_size=4))
    runs["dflash2"] = _tokens(model, tokenizer, dflash2, seed=3)
    for key, tokens in runs.items():
        assert tokens == alone, f"block size {key}: the text depends on the block size"
    assert _tokens(model, tokenizer, drafter, seed=4) != alone


def test_generate_takes_options_positionally_and_prints_nothing(default_model, capsys):
    model, tokenizer = default_model
    drafter = load_draft(str(DEFAULT_DRAFT_DIR), model=model)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    positional = generate(model, tokenizer, prompt, drafter, DecodeOptions(temp=0.9, seed=3), max_tokens=12)
    keywords = generate(model, tokenizer, prompt, drafter, temp=0.9, seed=3, max_tokens=12)
    greedy = generate(model, tokenizer, prompt, drafter, max_tokens=12)
    assert positional == keywords and positional != greedy
    assert capsys.readouterr().out == ""
    verbose = generate(model, tokenizer, prompt, drafter, DecodeOptions(temp=0.9, seed=3), max_tokens=12, verbose=True)
    out = capsys.readouterr().out
    assert verbose == positional and out.startswith(positional + "\n") and "Generation: 12 tokens" in out


def test_greedy_leaves_the_global_random_stream_alone(default_model):
    model, tokenizer = default_model
    drafter = load_draft(str(DEFAULT_DRAFT_DIR), model=model)
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)

    def stream_after(run) -> list[float]:
        mx.random.seed(11)
        run()
        return mx.random.uniform(shape=(4,)).tolist()

    untouched = stream_after(lambda: None)
    assert stream_after(lambda: mlx_lm.generate(model, tokenizer, prompt, max_tokens=4)) == untouched
    for options in (dict(block_size=4), dict(tree_budget=4), dict(draft_model=None)):
        kw = {"draft_model": drafter, "max_tokens": 6, **options}
        assert stream_after(lambda kw=kw: generate(model, tokenizer, prompt, **kw)) == untouched, options
    assert stream_after(lambda: generate(model, tokenizer, prompt, drafter, temp=0.8, max_tokens=2)) != untouched


def test_cli_seeded_text_equals_no_draft(default_model_dir):
    base = [
        "generate",
        "--prompt",
        "Name three colours.",
        "--model",
        str(default_model_dir),
        "--temp",
        "0.8",
        "--seed",
        "1",
        "--max-tokens",
        "16",
    ]
    drafted = CliRunner().invoke(app, base)
    alone = CliRunner().invoke(app, base + ["--no-draft"])
    assert drafted.exit_code == 0 and alone.exit_code == 0, (drafted.output, alone.output)
    assert drafted.stdout.strip() and drafted.stdout == alone.stdout
    # generate does not profile unless asked (a host sync per cycle); profiled, the text is the same
    profiled = CliRunner().invoke(app, base + ["--profile"])
    assert profiled.exit_code == 0 and profiled.stdout == drafted.stdout, profiled.output
    assert "Time: draft" in profiled.stderr and "Time: draft" not in drafted.stderr
