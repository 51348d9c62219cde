"""The draft vocabulary: the drafter proposes only a subset of tokens; decoding stays
lossless (greedy token-identical, sampling exact), and bad files get one-line errors."""

from __future__ import annotations

import json
from collections import Counter

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import stream_generate as plain_stream_generate
from two_token_sampling import ORACLE_SAMPLES, OracleDrafter, PlainDistribution, _sample_pairs, _wrap_rest

from dflash_mlx import load_draft, stream_generate
from dflash_mlx.draft_vocab import DRAFT_VOCAB_FILE, build_draft_vocab, check_draft_vocab, save_draft_vocab
from dflash_mlx.loading import DEFAULT_DRAFT_DIR

from chi_square import assert_fits

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Tom has 12 apples and gives 5 to Ann. How many are left?",
]


def _greedy(model, tokenizer, text, drafter=None, **kw):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    if drafter is None:
        return [r.token for r in plain_stream_generate(model, tokenizer, prompt, max_tokens=48)]
    return [r for r in stream_generate(model, tokenizer, prompt, drafter, max_tokens=48, **kw)]


@pytest.fixture(scope="module")
def references(default_model) -> dict[str, list[int]]:
    """Each prompt's plain mlx-lm greedy tokens (48), decoded once for the module."""
    model, tokenizer = default_model
    return {text: _greedy(model, tokenizer, text) for text in PROMPTS}


def test_builder_keeps_the_most_frequent_tokens_and_the_required_ones():
    counts = Counter({5: 50, 9: 30, 2: 15, 7: 4, 11: 1})
    ids, cov = build_draft_vocab(counts, size=2, required=[0])
    assert ids.tolist() == [0, 5] and cov == pytest.approx(0.5)  # EOS takes a slot
    ids, cov = build_draft_vocab(counts, coverage=0.9, required=[0])
    assert ids.tolist() == [0, 2, 5, 9] and cov == pytest.approx(0.95)
    ids, cov = build_draft_vocab(counts, coverage=1.0)
    assert ids.tolist() == [2, 5, 7, 9, 11] and cov == 1.0
    ids, cov = build_draft_vocab(counts, size=8, required=[0], vocab_size=20)  # 6 counted, 2 lowest unseen
    assert ids.tolist() == [0, 1, 2, 3, 5, 7, 9, 11] and cov == 1.0
    assert build_draft_vocab(counts, size=30, vocab_size=12)[0].tolist() == list(range(12))
    with pytest.raises(ValueError, match="exactly one of"):
        build_draft_vocab(counts)
    with pytest.raises(ValueError, match="--coverage"):
        build_draft_vocab(counts, coverage=1.5)


@pytest.mark.parametrize(
    "ids, match",
    [
        ([3, 1, 2], "unsorted"),
        ([1, 2, 2, 3], "repeated"),
        ([1, 2, 70000], "outside the vocabulary"),
        ([-1, 2], "outside the vocabulary"),
        ([1, 3], "EOS id 2 is missing"),
        ([], "non-empty"),
    ],
)
def test_bad_vocab_files_get_one_line_errors(tmp_path, ids, match):
    with pytest.raises(ValueError, match=match):
        check_draft_vocab(ids, 49152, [2])
    f = tmp_path / DRAFT_VOCAB_FILE
    f.write_text(json.dumps({"ids": ids, "eos_token_ids": [2]}))
    with pytest.raises(ValueError, match=match) as e:
        load_draft(str(DEFAULT_DRAFT_DIR), draft_vocab=str(f))
    assert "\n" not in str(e.value)


def test_greedy_is_token_identical_with_subsets(default_model, references, tmp_path):
    """A subset without many tokens the target writes (every third id), on every prompt,
    and one with only the EOS (every cycle's drafts fail: one prompt's 48 tokens try it
    often enough): drafts fail where the subset lacks the target's token; output is
    unchanged."""
    model, tokenizer = default_model
    eos = sorted(tokenizer.eos_token_ids)
    sparse = np.union1d(np.arange(0, 49152, 3), eos)
    for ids, texts in ((sparse, PROMPTS), (np.array(eos), PROMPTS[:1])):
        save_draft_vocab(ids, tmp_path / "v.json", eos, coverage=0.0)
        drafter = load_draft(str(DEFAULT_DRAFT_DIR), model=model, draft_vocab=str(tmp_path / "v.json"))
        assert drafter.draft_vocab.tolist() == ids.tolist()
        for text in texts:
            ours = _greedy(model, tokenizer, text, drafter, block_size=8, lookup=0)  # the drafter's drafts only
            assert [r.token for r in ours] == references[text]
            drafted = [r.token for r in ours if r.from_draft]
            assert set(drafted) <= set(ids.tolist())  # nothing outside the subset was proposed
    none = load_draft(str(DEFAULT_DRAFT_DIR), model=model, draft_vocab="none")
    assert none.draft_vocab is None


def test_eval_reports_the_share_of_target_tokens_in_the_subset(default_model, references, tmp_path):
    from dflash_mlx.train.evaluate import evaluate

    model, tokenizer = default_model
    eos = sorted(tokenizer.eos_token_ids)
    ids = np.union1d(np.arange(0, 49152, 2), eos)
    save_draft_vocab(ids, tmp_path / "v.json", eos, coverage=0.0)
    drafter = load_draft(str(DEFAULT_DRAFT_DIR), model=model, draft_vocab=str(tmp_path / "v.json"))
    prompt = {"messages": [{"role": "user", "content": PROMPTS[0]}], "source": "chat"}
    result = evaluate(model, tokenizer, drafter, [prompt], max_tokens=48, temps=(0.0,))["0"]["all"]
    written = references[PROMPTS[0]]
    assert result["tokens"] == len(written)
    assert result["vocab_coverage"] == round(sum(t in set(ids.tolist()) for t in written) / len(written), 4)
    assert (
        "vocab_coverage"
        not in evaluate(
            model,
            tokenizer,
            load_draft(str(DEFAULT_DRAFT_DIR), model=model, draft_vocab="none"),
            [prompt],
            max_tokens=8,
            temps=(0.0,),
        )["0"]["all"]
    )


def test_sampling_is_exact_with_a_subset(sampling_setup):
    """The oracle drafter (q = the target's own distribution, sharpened) restricted to the
    even token ids: q is the softmax over the subset, and (t1, t2) still follow plain
    sampling exactly."""
    model, _, prompt, _, _ = sampling_setup
    drafter = OracleDrafter(model, prompt, alpha=2.0, block_size=2)
    drafter.use_draft_vocab(mx.array(np.arange(0, 49152, 2, dtype=np.int32)))
    n = ORACLE_SAMPLES
    pairs, from_draft = _sample_pairs(sampling_setup, drafter, n, seed=21, temp=1.0)
    plain = PlainDistribution(sampling_setup, temp=1.0)
    cells = plain.joint_cells(n)
    assert_fits(_wrap_rest(pairs, cells), cells, "oracle drafter over even ids, T=1")
    accepted = [t2 for (_, t2), a in zip(pairs, from_draft) if a]
    assert accepted and all(t % 2 == 0 for t in accepted)  # drafts came from the subset only
    assert any(t2 % 2 for _, t2 in pairs)  # odd tokens still come: the target chooses them


def test_convert_and_export_carry_the_vocabulary(tmp_path):
    from converters.convert import export_drafter

    src = tmp_path / "src"
    src.mkdir()
    for name in ("config.json", "model.safetensors"):
        (src / name).write_bytes((DEFAULT_DRAFT_DIR / name).read_bytes())
    save_draft_vocab(np.array([0, 1, 2, 7]), src, [2], coverage=0.5)
    out = export_drafter(str(src), tmp_path / "zlab", dtype="float32", log=lambda s: None)
    assert (out / DRAFT_VOCAB_FILE).read_text() == (src / DRAFT_VOCAB_FILE).read_text()
    assert load_draft(str(out)).draft_vocab.tolist() == [0, 1, 2, 7]
