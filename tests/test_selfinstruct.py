"""Self-instruct chat data: cleaning, deduplication, held-out prompts kept out (the real
SmolLM2 writing a few short instructions), multi-turn conversations whose every answer is
trained on, and the per-kind table of `dflash eval`."""

from __future__ import annotations

import json

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import numpy as np
import pytest

from dflash_mlx.messages import apply_chat_template, read_prompt_file
from dflash_mlx.train.conversations import answer_conversations, conversation_record
from dflash_mlx.train.data import iter_records, load_sequences
from dflash_mlx.train.evaluate import format_table
from dflash_mlx.train.instructions import NearDuplicates, clean_instruction
from dflash_mlx.train.objective import make_batch
from dflash_mlx.train.selfinstruct import InstructionFilter, _resume_point, instruction_request, write_instructions


def test_requests_are_seeded_and_varied():
    reqs = [instruction_request(i, seed=3) for i in range(200)]
    assert reqs[:5] == [instruction_request(i, seed=3) for i in range(5)]  # deterministic
    assert instruction_request(0, seed=4) != reqs[0] or instruction_request(1, seed=4) != reqs[1]
    assert len({r["kind"] for r in reqs}) >= 8 and len({r["topic"] for r in reqs}) >= 60
    assert len({(r["messages"][0]["content"], r["prefill"]) for r in reqs}) >= 195
    assert all(r["prefill"].endswith('"' + r["opener"]) for r in reqs)


def test_cleaning_keeps_one_instruction():
    assert clean_instruction('What is a volcano?" she asked. More text') == "What is a volcano?"
    assert clean_instruction("1. How do tides work? 2. Why is the sea salty?") == "How do tides work?"
    assert (
        clean_instruction("Question: Can you explain how vaccines work to me?")
        == "Can you explain how vaccines work to me?"
    )
    assert (
        clean_instruction("Write a short story about a lighthouse. I'm not sure if I can help you with that.")
        == "Write a short story about a lighthouse."
    )
    assert (
        clean_instruction("Write a poem about rain. Make it sad. Add a title. Rhyme.")
        == "Write a poem about rain. Make it sad."
    )
    assert clean_instruction("Dear [Recipient's Name],\n\nI am writing to") is None  # cut mid-sentence
    assert clean_instruction("What?") is None  # too short
    assert clean_instruction("I'm sorry, as an AI I cannot do that.") is None  # an answer
    assert clean_instruction("Write " + "very " * 70 + "long.") is None  # too long
    assert clean_instruction("🍨🍨🍨🍨🍨🍨 what is 🍨🍨🍨🍨🍨 this?") is None  # not text


def test_dedupe_and_heldout_overlap():
    held = ["Explain the water cycle to a ten-year-old.", "Write a haiku about the moon."]
    f = InstructionFilter(held)
    assert f.reason("explain the water cycle to a ten year old!") == "heldout-exact"
    assert f.reason("Please explain the water cycle to a ten-year-old.") == "heldout-near"
    assert f.reason("Write a haiku about the moon tonight.") == "heldout-near"
    assert f.reason("Why do cats purr when they are happy?") is None
    f.keep("Why do cats purr when they are happy?")
    assert f.reason("Why do cats purr when they are happy ?") == "duplicate-exact"
    assert f.reason("why do cats purr when they are very happy?") == "duplicate-near"
    assert f.reason("How do I bake banana bread without eggs?") is None  # unrelated: kept
    assert f.reason("Write a haiku about the sea.") == "heldout-near"  # same template, short
    assert f.reason("Write a haiku about my grandmother's old garden.") is None  # two shared 3-grams of 9
    d = NearDuplicates(["a b c d e f"], threshold=0.5)
    assert d.match("a b c d e f g") == "near" and d.match("a b c x y z") is None


def test_writer_keeps_heldout_out_and_resumes(tmp_path, monkeypatch, default_model):
    """The real target writes a few instructions (greedy, so a second run writes the same):
    those put into the held-out file, verbatim or nearly, are not written again; a rerun
    continues from the requests it has not tried."""
    import dflash_mlx.loading as loading

    monkeypatch.setattr(loading, "load", lambda path=None, **kw: default_model)
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    common = dict(batch_size=3, temp=0.0, max_tokens=20, progress=False, log=lambda s: None)
    first = tmp_path / "a" / "instructions.jsonl"
    write_instructions(first, empty, 3, **common)
    kept = [r["messages"][0]["content"] for r in iter_records(first)]
    assert len(kept) == 3 and len(set(kept)) == 3
    assert all(clean_instruction(t) == t for t in kept)

    held = tmp_path / "heldout.jsonl"
    near = kept[1].rstrip(".?!") + " please?"
    held.write_text(
        json.dumps({"id": "h0", "messages": [{"role": "user", "content": kept[0].upper()}]})
        + "\n"
        + json.dumps({"id": "h1", "prompt": near})
        + "\n"
    )
    second = tmp_path / "b" / "instructions.jsonl"
    write_instructions(second, held, 3, **common)
    again = [r["messages"][0]["content"] for r in iter_records(second)]
    assert kept[0] not in again and kept[1] not in again and kept[2] in again
    logged = list(iter_records(second.parent / "instructions.log.jsonl"))
    assert {"heldout-exact", "heldout-near"} <= {r["reason"] for r in logged}
    assert {r["seed"] for r in logged} == {0}  # what a rerun with another seed leaves to it

    write_instructions(first, empty, 5, **common)  # resume: 3 -> 5
    ids = [r["id"] for r in iter_records(first)]
    assert (
        len(ids) == 5 and len(set(ids)) == 5 and [r["messages"][0]["content"] for r in iter_records(first)][:3] == kept
    )

    # the log lost (only the kept file is committed): the rerun asks none of the old requests again
    (first.parent / "instructions.log.jsonl").unlink()
    write_instructions(first, empty, 6, **common)
    last = max(int(i.rsplit("/", 1)[1]) for i in ids)
    asked = [r["request"] for r in iter_records(first.parent / "instructions.log.jsonl")]
    assert asked and min(asked) > last
    assert [r["id"] for r in iter_records(first)][:5] == ids and len(list(iter_records(first))) == 6


def test_a_rerun_with_another_seed_asks_its_own_requests(tmp_path):
    """Requests are numbered per seed ('si/<seed>/<request>'): those another seed tried,
    logged in the same file, are not this seed's (else a second seed skipped them all, and
    found none left once the first had spent its 8 n)."""
    log = tmp_path / "instructions.log.jsonl"
    log.write_text("".join(json.dumps({"request": i, "seed": 0, "kept": False}) + "\n" for i in range(5)))
    kept = [{"id": "si/0/4", "messages": [{"role": "user", "content": "What is a prime number?"}]}]
    assert _resume_point(kept, log, seed=1) == (0, set())
    assert _resume_point(kept, log, seed=0) == (5, set(range(5)))


def test_conversation_record_spans():
    ctx1, ans1 = [1, 2, 3], [10, 11, 2]
    ctx2 = ctx1 + ans1 + [7, 8]
    ans2 = [12, 13]
    rec = conversation_record({"id": "p", "source": "s"}, [(ctx1, ans1), (ctx2, ans2)], temp=0.8)
    assert rec["id"] == "p/turns2@t0.8" and rec["answer_spans"] == [[3, 6], [8, 10]]
    assert rec["prompt_ids"] + rec["completion_ids"] == ctx2 + ans2 and rec["prompt_ids"] == ctx1
    # an earlier answer re-encoded differently gets no span; the last one always has one
    rec = conversation_record({"id": "p", "source": "s"}, [(ctx1, [10, 99]), (ctx2, ans2)], temp=0.0)
    assert rec["answer_spans"] == [[8, 10]] and rec["prompt_ids"] == ctx2


def test_every_assistant_turn_is_trained_and_no_user_turn(tmp_path):
    toks = list(range(100, 140))
    spans = [(5, 15), (22, 30), (34, 40)]  # three answers; 15..22 and 30..34 are user turns
    f = tmp_path / "train.jsonl"
    f.write_text(
        json.dumps(
            {
                "id": "c",
                "source": "s",
                "prompt_ids": toks[:5],
                "completion_ids": toks[5:],
                "answer_spans": [list(s) for s in spans],
            }
        )
        + "\n"
        + json.dumps({"id": "one", "source": "s", "prompt_ids": [1, 2], "completion_ids": [3, 4, 5]})
        + "\n"
    )
    seqs = load_sequences(f)
    assert seqs[0][2] == spans and seqs[1][2] == [(2, 5)]
    rng = np.random.default_rng(0)
    hit = np.zeros(len(toks), bool)
    for _ in range(40):
        b, _, pos = make_batch([(toks, spans)], 4, 6, 99, rng)
        anchors, valid = np.array(b.anchors)[0], np.array(b.valid).reshape(-1, 4)
        assert all(any(s <= a <= e - 2 for s, e in spans) for a in anchors)
        labelled = pos[0][valid > 0]
        assert all(any(s < p < e for s, e in spans) for p in labelled)  # labels never leave their answer
        hit[labelled] = True
    assert all(hit[s + 1 : e].all() for s, e in spans)  # every answer token is learnt


def test_multi_turn_conversations_with_the_real_target(default_model):
    """Two turns, a few tokens each: the second context is the chat template over the whole
    conversation, and both answers' tokens sit at their spans."""
    model, tok = default_model
    prompts = [
        {"id": "p0", "source": "t", "messages": [{"role": "user", "content": "Name a fruit."}]},
        {"id": "p1", "source": "t", "messages": [{"role": "user", "content": "Say hello."}]},
    ]
    held = NearDuplicates(["Can you give me an example?"])
    recs = list(answer_conversations(model, tok, prompts, 2, 6, batch_size=2, heldout=held))
    assert [r["id"] for r in recs] == ["p0/turns2", "p1/turns2"]
    for p, r in zip(prompts, recs):
        full = r["prompt_ids"] + r["completion_ids"]
        (s1, e1), (s2, e2) = r["answer_spans"]
        first = tok.decode(full[s1:e1]).replace("<|im_end|>", "")
        assert full[:s1] == apply_chat_template(tok, p["messages"]) and e1 <= s2 and e2 == len(full)
        follow = tok.decode(full[e1:s2])
        user2 = follow.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert user2 and user2 != "Can you give me an example?"
        conv = p["messages"] + [{"role": "assistant", "content": first}, {"role": "user", "content": user2}]
        assert full[:s2] == apply_chat_template(tok, conv)


def test_eval_reports_by_kind(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(
        json.dumps({"prompt": "a", "set": "chat"})
        + "\n"
        + json.dumps({"prompt": "b", "source": "math"})
        + "\n"
        + json.dumps({"prompt": "c"})
        + "\n"
    )
    assert [p["source"] for p in read_prompt_file(f)] == ["chat", "math", "p"]
    r = {"tau": 1.5, "prompts": 2}
    table = format_table(
        {
            "0": {"chat": r, "math": {**r, "tau": 3.0}, "all": {**r, "tau": 2.25, "prompts": 4}},
            "1": {"chat": r, "all": r},
        }
    )
    lines = table.splitlines()
    assert lines[0] == "| kind | prompts | tau T=0 | tau T=1 |"
    assert lines[2:] == ["| chat | 2 | 1.50 | 1.50 |", "| math | 2 | 3.00 | - |", "| **all** | 4 | 2.25 | 1.50 |"]


def test_bad_turns_are_one_line_errors(default_model):
    model, tok = default_model
    with pytest.raises(ValueError, match="--turns"):
        list(answer_conversations(model, tok, [], 0, 4))
