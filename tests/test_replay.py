"""Replayed greedy tau (`train/replay.py`) equals real decoding's, cycle by cycle.

The shipped drafter on held-out prompts of three kinds with the real SmolLM2 target
(float32): the committed length of every cycle from the replay must equal what
`stream_generate` with a fixed block records, also where blocks shrink at `max_tokens`
and where an answer stops at EOS.
"""

from __future__ import annotations

import json

import pytest

from dflash_mlx.defaults import shipped_asset
from dflash_mlx.loading import DEFAULT_DRAFT_DIR, load_draft
from dflash_mlx.messages import apply_chat_template, read_prompt_file
from dflash_mlx.options import DecodeOptions
from dflash_mlx.speculative import stream_generate
from dflash_mlx.targets import make_target
from dflash_mlx.train.replay import greedy_answers, references, replay_lengths, replay_tau


@pytest.fixture(scope="module")
def pair(default_model):
    model, tokenizer = default_model
    return model, tokenizer, load_draft(str(DEFAULT_DRAFT_DIR), model=model)


def decoded_lengths(model, tokenizer, drafter, prompt, max_tokens, block):
    ids = apply_chat_template(tokenizer, prompt["messages"])
    options = DecodeOptions(block_size=block, lookup=0)  # what replay measures: the drafter's own chains
    last = list(stream_generate(model, tokenizer, ids, drafter, options, max_tokens=max_tokens))[-1]
    return last.stats.accepted_lengths, last.finish_reason


def test_replay_matches_decoding(pair, tmp_path):
    model, tokenizer, drafter = pair
    held = read_prompt_file(shipped_asset("prompts") / "heldout.jsonl")
    prompts = [next(p for p in held if p["set"] == kind) for kind in ("math", "code", "chat")]
    prompts.append({"set": "short", "messages": [{"role": "user", "content": "Say just the word yes."}]})
    max_tokens, answers = 20, tmp_path / "answers.json"
    refs = references(
        model, tokenizer, prompts, drafter.config.target_layer_ids, max_tokens=max_tokens, block_size=8, answers=answers
    )
    target = make_target(model, drafter.config.target_layer_ids)
    finishes = set()
    for block in (8, 3):
        for prompt, ref in zip(prompts, refs):
            expected, finish = decoded_lengths(model, tokenizer, drafter, prompt, max_tokens, block)
            finishes.add(finish)
            assert replay_lengths(drafter, target, ref, max_tokens, block) == expected, (prompt["set"], block)
    assert finishes == {"stop", "length"}  # both ends of an answer are covered
    res = replay_tau(drafter, model, refs, max_tokens=max_tokens, block_size=8)
    assert set(res) == {"math", "code", "chat", "short", "all"}
    assert (
        sum(res["all"]["histogram"]) == res["all"]["cycles"] == sum(r["cycles"] for k, r in res.items() if k != "all")
    )

    # the answers are kept: read back for the same prompts (no model needed), remade for others
    ids = [apply_chat_template(tokenizer, p["messages"]) for p in prompts]
    assert greedy_answers(None, ids, max_tokens + 8, answers) == json.loads(answers.read_text())["answers"]
    assert greedy_answers(model, ids[:1], 3, answers) == [refs[0].tokens[:3]]


def test_eval_replay_reports_what_decoding_does(default_model_dir, tmp_path):
    """`dflash eval --replay` gives `dflash eval --temp 0`'s greedy tau and histograms per kind,
    and keeps the target's answers where --answers says."""
    from typer.testing import CliRunner

    from app.cli.main import app

    held = (shipped_asset("prompts") / "heldout.jsonl").read_text().splitlines()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join([held[0], held[-1]]) + "\n")  # a chat and a stdlib prompt
    common = ["eval", "--model", str(default_model_dir), "-p", str(prompts), "-m", "24", "--block-size", "4"]
    reports = []
    for extra in (["--temp", "0"], ["--replay", "--answers", str(tmp_path / "answers.json")]):
        out = tmp_path / f"eval{len(reports)}.json"
        result = CliRunner().invoke(app, [*common, *extra, "--json", str(out)])
        assert result.exit_code == 0, result.output
        reports.append(json.loads(out.read_text())["0"])
    decoded, replayed = reports
    assert set(decoded) == set(replayed) == {"chat", "stdlib", "all"}
    for kind in decoded:
        assert replayed[kind]["histogram"] == decoded[kind]["histogram"], kind
        assert replayed[kind]["tau"] == decoded[kind]["tau"] and replayed[kind]["prompts"] == decoded[kind]["prompts"]
    assert (tmp_path / "answers.json").is_file()
