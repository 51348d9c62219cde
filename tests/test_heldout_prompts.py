"""The held-out prompt sets shipped in assets/prompts/ (issue 22: every number in README and
BENCHMARKS comes from a command that works on a clone): the 40 prompts the shipped drafter's
data kept out of training (`data/smollm2/heldout.jsonl` as `dflash data` first wrote it),
one file per kind plus all 40 together, each record with its kind in a `set` field."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

from dflash_mlx.messages import read_prompt_file
from dflash_mlx.train.data import split_prompts
from dflash_mlx.train.instructions import NearDuplicates
from dflash_mlx.train.sources import collect_prompts

PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "prompts"
KINDS = {"chat": "chat", "code": "humaneval", "math": "math", "stdlib": "stdlib"}


def test_committed_training_answers_leave_the_heldout_prompts_out():
    """The answers committed in assets/train (every record, sampled and multi-turn ones too:
    ids `<prompt>@t0.8`, `<prompt>/turns2`) answer no held-out prompt, and no self-instruct
    prompt they answer repeats a held-out prompt's text."""
    train_dir = PROMPTS.parent / "train"
    held = [json.loads(line) for line in (PROMPTS / "heldout.jsonl").read_text().splitlines()]
    with gzip.open(train_dir / "smollm2-train.jsonl.gz", "rt") as fh:
        answered = {json.loads(line)["id"].split("@")[0].split("/turns")[0] for line in fh}
    assert len(answered) > 1000 and not answered & {r["id"] for r in held}
    with gzip.open(train_dir / "smollm2-instructions.jsonl.gz", "rt") as fh:
        instructions = [json.loads(line) for line in fh]
    assert {r["id"] for r in instructions} & answered  # the self-instruct prompts are among those answered
    held_texts = {r["messages"][-1]["content"].strip().lower() for r in held}
    assert not [r["id"] for r in instructions if r["messages"][-1]["content"].strip().lower() in held_texts]


def test_shipped_heldout_sets_stay_out_of_training(tmp_path):
    """No held-out prompt (by id or by text) is among the prompts `dflash data` trains on
    with its default sources (its own split, `split_prompts`, over a data directory that
    holds the shipped heldout.jsonl), and each kind's file holds its 10 prompts."""
    shipped = [json.loads(line) for line in (PROMPTS / "heldout.jsonl").read_text().splitlines()]
    assert len(shipped) == 40 and len({r["id"] for r in shipped}) == 40
    shutil.copy(PROMPTS / "heldout.jsonl", tmp_path / "heldout.jsonl")
    prompts = collect_prompts(["chat", "math", "stdlib", "humaneval"], seed=0)
    train, held = split_prompts(tmp_path, prompts, 40, seed=0)
    assert [r["id"] for r in held] == [r["id"] for r in shipped]
    ids, texts = {p["id"] for p in train}, {p["messages"][-1]["content"] for p in train}
    assert len(train) > 1000 and not ids & {r["id"] for r in shipped}
    assert not [r["id"] for r in shipped if r["messages"][-1]["content"] in texts]
    for kind, source in KINDS.items():
        records = [json.loads(line) for line in (PROMPTS / f"heldout_{kind}.jsonl").read_text().splitlines()]
        assert len(records) == 10 and {r["set"] for r in records} == {kind}
        assert {r["source"] for r in records} == {source}
        assert len(read_prompt_file(PROMPTS / f"heldout_{kind}.jsonl")) == 10  # what bench and eval read


def test_round6_prompts_and_answers_leave_the_heldout_prompts_out(tmp_path):
    """Round 6's sources (`dflash data --source round6`, run over a data directory holding
    the shipped heldout.jsonl) keep the shipped set held out and train on none of its
    prompts, by id, by text or nearly (word 3-gram Jaccard >= 0.5); the round-6 answers
    committed in assets/train answer only prompts of those sources, at that split."""
    shipped = [json.loads(line) for line in (PROMPTS / "heldout.jsonl").read_text().splitlines()]
    shutil.copy(PROMPTS / "heldout.jsonl", tmp_path / "heldout.jsonl")
    prompts = collect_prompts(["round6"], seed=0)
    train, held = split_prompts(tmp_path, prompts, 40, seed=0)
    assert [r["id"] for r in held] == [r["id"] for r in shipped] and len(train) == len(prompts) > 3000
    texts = [p["messages"][-1]["content"] for p in train]
    assert not {r["id"] for r in shipped} & {p["id"] for p in train}
    assert not [r["id"] for r in shipped if r["messages"][-1]["content"] in texts]
    near = NearDuplicates(r["messages"][-1]["content"] for r in shipped)
    assert not [t for t in texts if near.match(t)]
    with gzip.open(PROMPTS.parent / "train" / "smollm2-round6.jsonl.gz", "rt") as fh:
        answered = {json.loads(line)["id"] for line in fh}
    assert len(answered) > 100 and answered <= {p["id"] for p in train}


def test_another_seed_or_source_keeps_the_heldout_texts_out(tmp_path):
    """`dflash data` run again over the directory with another --seed (its chat and math
    prompts are drawn anew: `chat/5` is another text) or a prompt file of its own trains on
    no held-out text: held-out prompts stay out by their text as well as by their id."""
    shipped = [json.loads(line) for line in (PROMPTS / "heldout.jsonl").read_text().splitlines()]
    shutil.copy(PROMPTS / "heldout.jsonl", tmp_path / "heldout.jsonl")
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"messages": shipped[0]["messages"]}) + "\n")
    prompts = collect_prompts(["chat", "math", "stdlib", "humaneval", str(own)], seed=1)
    train, _ = split_prompts(tmp_path, prompts, 40, seed=1)
    texts = {p["messages"][-1]["content"] for p in train}
    assert [r["id"] for r in shipped if r["messages"][-1]["content"] in texts] == []


def test_bench_and_eval_read_the_sets_by_name(tmp_path):
    """`--prompts math` (bench and eval alike) is the shipped held-out math file; `heldout` all
    40 with their kinds; a name that is neither a file nor a set is one line naming it."""
    from app.cli.bench.commands import read_prompts
    from dflash_mlx.messages import read_prompt_sources

    assert read_prompt_sources(["math"]) == read_prompt_file(PROMPTS / "heldout_math.jsonl")
    texts, kinds = read_prompts(["heldout"])
    assert len(texts) == 40 and sorted(set(kinds)) == sorted(KINDS)
    assert read_prompts(["code", "chat"])[1] == ["code"] * 10 + ["chat"] * 10
    with pytest.raises(ValueError, match="'mathz' is neither a file nor a held-out set"):
        read_prompt_sources(["mathz"])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no prompts in"):
        read_prompt_sources([str(empty)])


def test_the_heldout_set_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A first `dflash data` stopped while writing heldout.jsonl leaves none: a partial file
    would be read back by the next run as the whole held-out set, and the prompts missing
    from it would be trained on."""
    import dflash_mlx.train.data as data

    prompts = collect_prompts(["chat", "math"], seed=0)
    dumps, written = data.json.dumps, []

    def stopped_at_the_third(obj, *args, **kwargs):
        if len(written) == 2:
            raise KeyboardInterrupt
        written.append(obj)
        return dumps(obj, *args, **kwargs)

    monkeypatch.setattr(data.json, "dumps", stopped_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        split_prompts(tmp_path, prompts, 10, seed=0)
    monkeypatch.undo()
    assert not (tmp_path / "heldout.jsonl").exists()
    assert len(split_prompts(tmp_path, prompts, 10, seed=0)[1]) == 10
