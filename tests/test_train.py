"""Drafter training: the training forward equals inference, anchors and the block-wise mask,
loss weights, a tiny run that learns, and save / load round trips."""

from __future__ import annotations

import json
from dataclasses import replace
import math

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from dflash_mlx.drafter import Drafter
from dflash_mlx.drafters import load_drafter_dir, save_drafter
from dflash_mlx.targets import make_target
from dflash_mlx.train.features import target_pass
from dflash_mlx.train.objective import SequenceContext, block_forward, loss_weights, make_batch, sample_anchors
from tiny_training import TinyTok, random_training_data, tiny_drafter, tiny_target, tiny_train_args


def target_features(target, tokens, layer_ids):
    return target_pass(target, tokens, layer_ids, top_k=2)[0]


def inference_block(drafter, target, tokens, anchor):
    """The inference path: context = positions < anchor through append_context, then the block."""
    B = drafter.config.block_size
    feats = target_features(target, mx.array([tokens]), drafter.config.target_layer_ids)
    cache = drafter.make_cache()
    drafter.append_context(feats[:, :anchor], cache)
    block = mx.array([[tokens[anchor]] + [drafter.config.mask_token_id] * (B - 1)])
    return drafter(target.embed(block), cache)


def test_train_forward_matches_inference_for_every_block():
    model = tiny_target()
    drafter = tiny_drafter(model)
    target = make_target(model, drafter.config.target_layer_ids)
    B = drafter.config.block_size
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 60, size=40).tolist()
    anchors = [3, 4, 11, 20, 31]  # adjacent and overlapping blocks, one reaching past the end
    feats = target_features(target, mx.array([tokens]), drafter.config.target_layer_ids)
    block_tokens = mx.array([[tokens[a]] + [drafter.config.mask_token_id] * (B - 1) for a in anchors])
    h = block_forward(drafter, feats, target.embed(block_tokens), mx.array([anchors]))
    for j, a in enumerate(anchors):
        ref = inference_block(drafter, target, tokens, a)
        got = h[j : j + 1]
        assert mx.abs(got - ref).max().item() < 1e-5, (j, a)


def three_sequence_batch(seed: int):
    """A one-layer drafter, its tiny target, three random sequences of 22-37 tokens (prompt
    5) and their batch of 4 anchors each, with the target's features."""
    model = tiny_target()
    drafter = tiny_drafter(model, layers=1)
    target = make_target(model, drafter.config.target_layer_ids)
    rng = np.random.default_rng(seed)
    seqs = [(rng.integers(0, 60, size=n).tolist(), 5) for n in (30, 22, 37)]
    batch, kept, _ = make_batch(seqs, drafter.config.block_size, 4, drafter.config.mask_token_id, rng)
    assert kept == [0, 1, 2]
    batch.features = target_features(target, batch.tokens, drafter.config.target_layer_ids)  # (S, L, k*hidden)
    return drafter, target, seqs, batch


def test_train_forward_batched_sequences_match_single():
    drafter, target, seqs, batch = three_sequence_batch(1)
    h = block_forward(drafter, batch.features, target.embed(batch.block_tokens), batch.anchors)
    A = batch.anchors.shape[1]
    for s, (toks, _) in enumerate(seqs):
        for j, a in enumerate(np.array(batch.anchors[s]).tolist()):
            ref = inference_block(drafter, target, toks, a)
            assert mx.abs(h[s * A + j : s * A + j + 1] - ref).max().item() < 1e-5


def test_train_gradient_of_a_batch_is_the_sum_over_its_sequences():
    """Each block row's context is its own sequence's, in the backward pass too."""
    drafter, target, seqs, batch = three_sequence_batch(2)
    emb = target.embed(batch.block_tokens)  # (S*A, B, hidden)
    probe = mx.random.normal(emb.shape, key=mx.random.key(3))

    def grads(rows: slice, sequences: slice) -> dict:
        def loss(m):
            h = block_forward(m, batch.features[sequences], emb[rows], batch.anchors[sequences])
            return (h * probe[rows]).sum()

        return nn.value_and_grad(drafter, loss)(drafter)[1]

    A = batch.anchors.shape[1]
    alone = [grads(slice(s * A, (s + 1) * A), slice(s, s + 1)) for s in range(len(seqs))]
    summed = tree_map(lambda *g: sum(g), *alone)
    together = grads(slice(None), slice(None))
    for (name, g), (_, ref) in zip(tree_flatten(together), tree_flatten(summed)):
        assert mx.allclose(g, ref, atol=1e-4, rtol=1e-4).item(), name


def test_a_block_sees_its_sequences_context_before_its_anchor_and_its_whole_block():
    """SequenceContext.attend: block j of sequence s reads sequence s's values at positions
    strictly before its anchor and all of its own block's, and nothing else."""
    S, A, KV, G, B, L, D = 2, 3, 2, 2, 4, 12, 8
    anchors = mx.array([[2, 5, 9], [1, 6, 11]])
    keys = mx.random.split(mx.random.key(0), 5)
    q = mx.random.normal((S * A, KV * G, B, D), key=keys[0])
    k, v = (mx.random.normal((S * A, KV, B, D), key=key) for key in keys[1:3])
    ctx_k, ctx_v = (mx.random.normal((S, KV, L, D), key=key) for key in keys[3:5])

    def out(ctx_v: mx.array, v: mx.array) -> np.ndarray:
        visible = mx.arange(L) < anchors[..., None]
        return np.array(SequenceContext(ctx_k, ctx_v, visible).attend(q, k, v, D**-0.5))

    base = out(ctx_v, v)
    for row in range(S * A):  # what attention over the row's own copy of the context gives
        s, a = row // A, int(anchors[row // A, row % A])
        rk, rv = (
            mx.concatenate([ctx_k[s : s + 1, :, :a], k[row : row + 1]], 2),
            mx.concatenate([ctx_v[s : s + 1, :, :a], v[row : row + 1]], 2),
        )
        ref = mx.fast.scaled_dot_product_attention(q[row : row + 1], rk, rv, scale=D**-0.5)
        np.testing.assert_allclose(base[row], np.array(ref[0]), atol=1e-5)
    for s in range(S):
        for j, a in enumerate(np.array(anchors[s]).tolist()):
            row = s * A + j
            for pos in range(L):
                bumped = np.array(ctx_v)
                bumped[s, :, pos] += 1.0
                moved = np.abs(out(mx.array(bumped), v) - base).max(axis=(1, 2, 3))
                assert (moved[row] > 1e-4) == (pos < a), (s, j, pos)
                assert (moved[[r for r in range(S * A) if r // A != s]] == 0).all()  # other sequences
            own = np.array(v)
            own[row, :, B - 1] += 1.0  # the block's last position: every row of it reads it
            moved = np.abs(out(ctx_v, mx.array(own)) - base)
            assert (moved[row].max(axis=(0, 2)) > 1e-4).all() and np.delete(moved, row, axis=0).max() == 0


def test_sample_anchors_in_answer_and_labels_same_position():
    rng = np.random.default_rng(0)
    for _ in range(50):
        a, ends = sample_anchors([(7, 30)], 10, rng)
        assert len(a) == 10 and len(set(a.tolist())) == 10
        assert a.min() >= 7 and a.max() <= 28 and (np.diff(a) > 0).all() and (ends == 30).all()
    assert sample_anchors([(7, 10)], 10, rng)[0].tolist() == [7, 8]  # all that exist
    assert sample_anchors([(7, 9)], 10, rng)[0].tolist() == [7]
    assert len(sample_anchors([(7, 8)], 10, rng)[0]) == 0
    toks = list(range(100, 120))
    b, _, pos = make_batch([(toks, 5)], 4, 3, 99, rng)
    anchors = np.array(b.anchors)[0]
    block = np.array(b.block_tokens)
    labels = np.array(b.labels)
    valid = np.array(b.valid)
    assert (pos[0, :, 0] == anchors).all()
    for j, a in enumerate(anchors):
        assert block[j, 0] == toks[a] and (block[j, 1:] == 99).all()
        for k in range(1, 4):
            if a + k < len(toks):
                assert valid[j, k] == 1 and labels[j, k] == toks[a + k]
            else:
                assert valid[j, k] == 0
        assert valid[j, 0] == 0


def test_loss_weights():
    w = np.array(loss_weights(16))
    assert w[0] == 0 and abs(w.sum() - 1) < 1e-6
    raw = np.exp(-(np.arange(1, 16) - 1) / 7.0)
    np.testing.assert_allclose(w[1:], raw / raw.sum(), rtol=1e-6)
    assert (np.diff(w[1:]) < 0).all()
    w8 = np.array(loss_weights(8))
    np.testing.assert_allclose(w8[2] / w8[1], math.exp(-1 / 4), rtol=1e-6)


def test_tiny_training_run_learns_and_round_trips(tmp_path, monkeypatch):
    """A tiny target writes a predictable language; training lowers the loss and lifts
    the real speculative tau above the random drafter's."""
    import dflash_mlx.loading as loading
    from dflash_mlx.speculative import GenerationStats
    from dflash_mlx.speculative import generate_step as generate_dflash
    from dflash_mlx.train.loop import TrainArgs, train

    model = tiny_target(vocab=48, layers=4, hidden=32)

    # Self-distillation data: the tiny target's own greedy continuations.
    from mlx_lm.generate import generate_step

    rng = np.random.default_rng(0)
    data = tmp_path / "train.jsonl"
    prompts = []
    with open(data, "w") as fh:
        for i in range(24):
            prompt = rng.integers(0, 40, size=6).tolist()
            out = []
            for tok, _ in generate_step(mx.array(prompt), model, max_tokens=40):
                out.append(int(tok))
            prompts.append(prompt)
            fh.write(json.dumps({"id": str(i), "source": "t", "prompt_ids": prompt, "completion_ids": out}) + "\n")
    monkeypatch.setattr(loading, "load", lambda path=None, **kw: (model, TinyTok()))

    out = tmp_path / "drafter"
    args = TrainArgs(
        data=str(data),
        out=str(out),
        num_layers=1,
        target_layer_ids=[1, 3],
        block_size=8,
        batch_size=4,
        num_anchors=16,
        epochs=12,
        lr=3e-3,
        progress=False,
        log_every=6,
        checkpoint_every=1000,
    )
    result = train(args, log=lambda s: None)
    hist = result["history"]
    assert hist[-1]["loss"] < hist[0]["loss"] * 0.7

    trained = load_drafter_dir(out)
    random_drafter = Drafter(trained.config)
    mx.eval(random_drafter.parameters())

    def tau(d):
        taus = []
        for p in prompts[:6]:
            stats = GenerationStats()
            n = 0
            for committed, _, _ in generate_dflash(p, model, d, stats=stats, block_size=d.config.block_size):
                n += len(committed)
                if n >= 32:
                    break
            taus.append(stats.mean_acceptance)
        return float(np.mean(taus))

    t_trained, t_random = tau(trained), tau(random_drafter)
    assert t_trained > t_random + 0.5, (t_trained, t_random)

    # round trip: save / load gives the same function
    save_drafter(trained, tmp_path / "copy")
    again = load_drafter_dir(tmp_path / "copy")
    target = make_target(model, trained.config.target_layer_ids)
    toks = prompts[0] + [1, 2, 3, 4, 5]
    a, b = inference_block(trained, target, toks, 6), inference_block(again, target, toks, 6)
    assert mx.abs(a - b).max().item() == 0
    assert json.loads((tmp_path / "copy" / "config.json").read_text())["dflash_config"]["mask_token_id"] == 46


def test_checkpoint_and_resume(tmp_path, monkeypatch):
    from dflash_mlx.train.loop import train

    model = tiny_target(vocab=48)
    data = random_training_data(tmp_path, monkeypatch, model, max_token=40)
    out = tmp_path / "d"
    first = train(tiny_train_args(data, out, seed=0, max_steps=3), log=lambda s: None)
    assert first["step"] == 3
    assert (out / "checkpoint" / "state.json").is_file()
    load_drafter_dir(out / "checkpoint")  # the checkpoint is itself a drafter
    load_drafter_dir(out)
    second = train(tiny_train_args(data, out, seed=0, max_steps=5, resume=True), log=lambda s: None)
    assert second["step"] == 5
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 5 and state["seen"] == 10


def test_sampled_vocabulary_loss(tmp_path, monkeypatch):
    """--loss-vocab sampled: logits over the batch's labels and teacher tokens plus sampled others."""
    from dflash_mlx.train.loop import Trainer, TrainArgs, train

    model = tiny_target(vocab=48)
    data = random_training_data(tmp_path, monkeypatch, model, max_token=20)
    result = train(
        tiny_train_args(
            data,
            tmp_path / "d",
            seed=0,
            checkpoint_every=TrainArgs.checkpoint_every,
            max_steps=4,
            log_every=1,
            loss_vocab="sampled",
            negatives=8,
        ),
        log=lambda s: None,
    )
    assert result["step"] == 4 and all(np.isfinite(h["loss"]) for h in result["history"])
    # The same step with the full vocabulary: the sampled one holds its labels and teacher
    # tokens, and the sampled batch's labels and teacher ids index them exactly.
    batches = {}
    for kind in ("sampled", "full"):
        args = TrainArgs(
            data=str(data), out=str(tmp_path / kind), num_layers=1, target_layer_ids=[1, 3], block_size=4,
            batch_size=2, num_anchors=4, progress=False, max_steps=1, loss_vocab=kind, negatives=8,
        )  # fmt: skip
        batches[kind] = Trainer(args, log=lambda s: None).batch_for_step()
    (sampled, vocab), (full, none) = batches["sampled"], batches["full"]
    v = np.array(vocab)
    assert none is None and np.all(np.diff(v) > 0) and len(v) < model.args.vocab_size
    valid = np.array(full.valid) > 0
    assert np.array_equal(v[np.array(sampled.labels)][valid], np.array(full.labels)[valid])
    assert np.array_equal(v[np.array(sampled.teacher_ids)], np.array(full.teacher_ids))


def test_shipped_drafter_round_trips_through_export(tmp_path):
    """The trained demo drafter: load -> save -> load, and export (z-lab layout) -> load."""
    from mlx.utils import tree_flatten

    from dflash_mlx.loading import DEFAULT_DRAFT_DIR, load_draft

    if not (DEFAULT_DRAFT_DIR / "model.safetensors").is_file():
        pytest.skip("no shipped drafter")
    export_drafter = pytest.importorskip("converters.convert").export_drafter
    original = load_draft()
    save_drafter(original, tmp_path / "saved")
    out = export_drafter(str(DEFAULT_DRAFT_DIR), tmp_path / "zlab", dtype="float32", log=lambda s: None)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == 16
    want = dict(tree_flatten(original.parameters()))
    for other in (load_drafter_dir(tmp_path / "saved"), load_draft(str(out))):
        assert other.config.target_layer_ids == original.config.target_layer_ids
        assert other.config.block_size == original.config.block_size == 8
        got = dict(tree_flatten(other.parameters()))
        assert got.keys() == want.keys()
        assert all(mx.array_equal(got[k], want[k]).item() for k in want)


def test_periodic_heldout_tau_is_replayed_and_logged_per_kind(tmp_path, monkeypatch):
    """With a held-out file beside the data, training logs greedy tau (all and per kind) from
    replays along the target's greedy answers, which it makes once and keeps on disk."""
    from dflash_mlx.train.loop import TrainArgs, train

    model = tiny_target(vocab=48)
    data = random_training_data(tmp_path, monkeypatch, model, max_token=40)
    held = [
        {"set": kind, "messages": [{"role": "user", "content": text}]} for kind, text in [("a", "xyz"), ("b", "hi")]
    ]
    (tmp_path / "heldout.jsonl").write_text("".join(json.dumps(p) + "\n" for p in held))
    common = dict(data=str(data), out=str(tmp_path / "d"), num_layers=1, target_layer_ids=[1, 3], block_size=4)
    args = TrainArgs(
        **common, batch_size=2, num_anchors=4, max_steps=2, eval_minutes=1e-9, eval_tokens=6, progress=False
    )
    result = train(args, log=lambda s: None)
    evals = [r for r in result["history"] if "heldout_tau" in r]
    assert len(evals) == 2 and all(1.0 <= r["heldout_tau"] <= 4.0 for r in evals)
    assert set(evals[0]["heldout_kinds"]) == {"a", "b"}
    saved = json.loads((tmp_path / "heldout_answers_6.json").read_text())
    assert len(saved["answers"]) == 2 and all(len(a) == 6 + 4 for a in saved["answers"])
    # no periodic evaluation came due: the run still ends with one, for its curve's last point
    args = replace(args, out=str(tmp_path / "e"), max_steps=3, eval_minutes=1e6)
    history = train(args, log=lambda s: None)["history"]
    assert [r["step"] for r in history if "heldout_tau" in r] == [3]
