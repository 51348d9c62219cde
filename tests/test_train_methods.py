"""The training methods that make compute count: warm start, distillation, the on-disk
feature cache, and exact resume."""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_training import TINY2, random_training_data, tiny_drafter, tiny_target, tiny_train_args

from dflash_mlx.targets import make_target
from dflash_mlx.train.features import FeatureStore, fill_store, target_pass
from dflash_mlx.train.initialize import warm_start, warm_start_sources
from dflash_mlx.train.loop import TrainArgs, train
from dflash_mlx.train.objective import distill_loss


def test_warm_start_copies_the_layers_after_the_deepest_feature():
    model = tiny_target(layers=6)
    drafter = tiny_drafter(model, layers=2, ids=(0, 3))
    target = make_target(model, drafter.config.target_layer_ids)
    warm_start(drafter, target)
    assert warm_start_sources(drafter) == [4, 5]
    mine = dict(tree_flatten(drafter.parameters()))
    for j, src in enumerate([4, 5]):
        theirs = dict(tree_flatten(model.model.layers[src].parameters()))
        for name, w in theirs.items():
            assert mx.array_equal(mine[f"layers.{j}.{name}"], w).item(), name
    # fc passes the deepest feature (layer 3, the second block) through unchanged
    fc = np.array(mine["fc.weight"])
    hidden = drafter.config.hidden_size
    np.testing.assert_array_equal(fc[:, hidden:], np.eye(hidden))
    assert not fc[:, :hidden].any()
    assert mx.array_equal(mine["hidden_norm.weight"], model.model.layers[4].input_layernorm.weight).item()
    assert mx.array_equal(mine["norm.weight"], model.model.norm.weight).item()
    # so the drafter's context keys of layer 0 are exactly the target layer 4's keys
    tokens = mx.array([[3, 7, 1, 9, 4]])
    feats = target_pass(target, tokens, drafter.config.target_layer_ids, top_k=2)[0]
    k, _ = drafter.layers[0].self_attn.context_kv(drafter.project_context(feats), 0)
    h3 = feats[..., hidden:]
    attn = model.model.layers[4].self_attn
    ref = attn.k_proj(model.model.layers[4].input_layernorm(h3))
    ref = attn.rope(ref.reshape(1, 5, attn.n_kv_heads, -1).transpose(0, 2, 1, 3))
    # the drafter adds a per-head k_norm (Qwen3) that a llama layer lacks: compare directions
    cos = (k * ref).sum(-1) / (mx.linalg.norm(k, axis=-1) * mx.linalg.norm(ref, axis=-1))
    assert cos.min().item() > 0.999


def test_distillation_equals_cross_entropy_for_a_one_hot_teacher():
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(6, 11)).astype(np.float32))
    labels = mx.array(rng.integers(0, 11, size=6).astype(np.int32))
    ids = mx.concatenate([labels[:, None], mx.array(rng.integers(0, 11, size=(6, 3)).astype(np.int32))], axis=1)
    one_hot = mx.array(np.array([[0.0, -1e4, -1e4, -1e4]] * 6, dtype=np.float32))
    ce = nn.losses.cross_entropy(logits, labels, reduction="none")
    np.testing.assert_allclose(np.array(distill_loss(logits, ids, one_hot)), np.array(ce), rtol=1e-5)


@pytest.mark.parametrize("loss_vocab", ["full", "sampled"])
def test_the_loss_is_mlxs_cross_entropy_and_the_distillation_weighted(tmp_path, monkeypatch, loss_vocab):
    """loss_fn's two terms share one logsumexp: the loss is still (1 - d) x mlx's own
    cross-entropy + d x the distillation loss computed apart, position-weighted."""
    from dflash_mlx.train.loop import Trainer
    from dflash_mlx.train.objective import block_forward, loss_fn

    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    args = tiny_train_args(data, tmp_path / "run", max_steps=1, loss_vocab=loss_vocab, negatives=8)
    trainer = Trainer(args, log=lambda s: None)
    batch, vocab = trainer.batch_for_step()
    drafter, target, w = trainer.drafter, trainer.target, trainer.weights
    h = block_forward(drafter, batch.features, target.embed(batch.block_tokens), batch.anchors)
    logits = h @ target.head_rows(vocab).T if vocab is not None else target.lm_head(h)
    N, B, V = logits.shape
    ce = nn.losses.cross_entropy(logits, batch.labels, reduction="none")
    kd = distill_loss(
        logits.reshape(N * B, V), batch.teacher_ids.reshape(N * B, -1), batch.teacher_logits.reshape(N * B, -1)
    )
    weights = w[None] * batch.valid
    for d in (0.0, 0.5):
        expected = (((1 - d) * ce + d * kd.reshape(N, B)) * weights).sum() / weights.sum()
        np.testing.assert_allclose(loss_fn(drafter, target, batch, w, d, vocab)[0].item(), expected.item(), rtol=1e-5)


def test_distillation_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 7))
    ids = mx.array(rng.integers(0, 7, size=(3, 4)).astype(np.int32))
    teacher = mx.array(rng.normal(size=(3, 4)).astype(np.float32))

    def f(v):
        return distill_loss(v, ids, teacher).sum()

    grad = np.array(mx.grad(f)(mx.array(x.astype(np.float32))))
    eps = 1e-3
    for i in range(3):
        for j in range(7):
            plus, minus = x.copy(), x.copy()
            plus[i, j] += eps
            minus[i, j] -= eps
            up, down = f(mx.array(plus.astype(np.float32))).item(), f(mx.array(minus.astype(np.float32))).item()
            fd = (up - down) / (2 * eps)
            assert abs(fd - grad[i, j]) < 2e-3, (i, j, fd, grad[i, j])


def test_cached_features_equal_recomputed_ones(tmp_path):
    model = tiny_target()
    target = make_target(model)
    ids = [1, 3]
    rng = np.random.default_rng(2)
    seqs = {f"s{i}": rng.integers(0, 60, size=int(n)).tolist() for i, n in enumerate([5, 17, 9, 30, 12])}
    store = FeatureStore(tmp_path / "f", ids, 2 * model.args.hidden_size, top_k=3)
    assert fill_store(store, target, seqs, ids, batch_tokens=40) == 5
    assert fill_store(store, target, seqs, ids) == 0  # nothing left to do
    reopened = FeatureStore(tmp_path / "f", ids, 2 * model.args.hidden_size, top_k=3)
    for key, toks in seqs.items():
        f, top_ids, top_logits = reopened.get(key)
        ref_f, ref_ids, ref_logits = target_pass(target, mx.array([toks]), ids, top_k=3)
        np.testing.assert_allclose(f.astype(np.float32), np.array(ref_f[0]), atol=2e-2, rtol=2e-3)
        logits = np.array(model(mx.array([toks]))[0])
        for t in range(len(toks)):  # the stored tokens are the target's top 3, with their logits
            assert set(top_ids[t].tolist()) == set(np.argsort(-logits[t])[:3].tolist())
            np.testing.assert_allclose(top_logits[t].astype(np.float32), logits[t, top_ids[t]], atol=2e-2, rtol=2e-3)
        assert set(np.array(ref_ids[0, 0]).tolist()) == set(top_ids[0].tolist())
        assert ref_logits.shape == (1, len(toks), 3)


def test_opening_a_store_to_read_leaves_a_writers_rows_in_flight(tmp_path):
    """Another run opening the store while a writer appends a sequence (its rows on disk,
    its index line not yet) leaves those rows: cutting them would shift the writer's next
    rows against the index it writes."""
    writer = FeatureStore(tmp_path / "f", [0], 4, top_k=2)
    writer.add("a", np.ones((3, 4)), np.zeros((3, 2)), np.zeros((3, 2)))
    features = tmp_path / "f" / "features.f16"
    with open(features, "ab") as fh:  # the writer's next sequence, half-way through `add`
        fh.write(np.ones((5, 4), dtype=np.float16).tobytes())
    size = features.stat().st_size
    reader = FeatureStore(tmp_path / "f", [0], 4, top_k=2)
    assert len(reader) == 1 and (reader.get("a")[0] == 1).all()
    assert features.stat().st_size == size


def test_a_torn_write_is_cut_before_the_next_append(tmp_path):
    store = FeatureStore(tmp_path / "f", [0], 4, top_k=2)
    store.add("a", np.ones((3, 4)), np.zeros((3, 2)), np.zeros((3, 2)))
    with open(tmp_path / "f" / "features.f16", "ab") as fh:  # rows of a sequence never indexed
        fh.write(np.ones((5, 4), dtype=np.float16).tobytes())
    again = FeatureStore(tmp_path / "f", [0], 4, top_k=2)
    assert len(again) == 1 and again.rows == 3
    again.add("b", np.full((2, 4), 2.0), np.zeros((2, 2)), np.zeros((2, 2)))
    assert (again.get("b")[0] == 2).all() and (again.get("a")[0] == 1).all()


def test_a_torn_index_line_is_cut_before_the_next_append(tmp_path):
    """A writer killed half-way through an index line: the next one's lines follow it on
    lines of their own, and every later opening finds them."""
    store = FeatureStore(tmp_path / "f", [0], 4, top_k=2)
    store.add("a", np.ones((3, 4)), np.zeros((3, 2)), np.zeros((3, 2)))
    with open(tmp_path / "f" / "index.jsonl", "a") as fh:
        fh.write('{"key": "b", "sta')
    again = FeatureStore(tmp_path / "f", [0], 4, top_k=2)
    again.add("c", np.full((2, 4), 2.0), np.zeros((2, 2)), np.zeros((2, 2)))
    reopened = FeatureStore(tmp_path / "f", [0], 4, top_k=2)
    assert sorted(reopened.index) == ["a", "c"] and (reopened.get("c")[0] == 2).all()
    with open(tmp_path / "f" / "index.jsonl", "a") as fh:  # as an older writer glued its next line on
        fh.write('{"key": "d", "sta{"key": "e", "start": 5, "length": 1}\n')
    assert sorted(FeatureStore(tmp_path / "f", [0], 4, top_k=2).index) == ["a", "c"]


@pytest.mark.parametrize("arch", [{}, TINY2], ids=["dflash1", "dflash2"])
def test_resume_continues_exactly(tmp_path, monkeypatch, arch):
    """Stopping after 3 steps and resuming gives the same weights as 6 uninterrupted steps."""
    model = tiny_target(vocab=48)
    data = random_training_data(tmp_path, monkeypatch, model, max_token=40)

    def args(out: str, **fields) -> TrainArgs:
        return tiny_train_args(
            data,
            tmp_path / out,
            seed=0,
            batch_size=3,
            max_steps=6,
            log_every=1,
            loss_vocab="sampled",
            negatives=8,
            **arch,
            **fields,
        )

    whole = train(args("whole"), log=lambda s: None)

    class Stop(Exception):
        pass

    def stop_at_step_3(line: str) -> None:
        if line.startswith("step 3/"):
            raise Stop

    with pytest.raises(Stop):  # the cut run really stopped at step 3 (else "resume" would redo nothing)
        train(args("cut"), log=stop_at_step_3)
    resumed = train(args("cut", resume=True), log=lambda s: None)
    assert resumed["step"] == whole["step"] == 6
    assert type(resumed["drafter"]) is type(whole["drafter"])
    a = dict(tree_flatten(whole["drafter"].parameters()))
    b = dict(tree_flatten(resumed["drafter"].parameters()))
    for k in a:
        np.testing.assert_allclose(np.array(a[k]), np.array(b[k]), atol=1e-6, err_msg=k)


def test_a_store_refuses_another_models_features(tmp_path):
    """Features of one target are not another's, even at the same layers, width and top-K."""
    FeatureStore(tmp_path / "f", [0], 4, top_k=2, model="/models/a").add(
        "s", np.ones((3, 4)), np.zeros((3, 2)), np.zeros((3, 2))
    )
    assert len(FeatureStore(tmp_path / "f", [0], 4, top_k=2, model="/models/a")) == 1
    assert len(FeatureStore(tmp_path / "f", [0], 4, top_k=2)) == 1  # a reader that names no model
    with pytest.raises(
        ValueError, match="holds features of model '/models/a', not '/models/b'; use another --features"
    ):
        FeatureStore(tmp_path / "f", [0], 4, top_k=2, model="/models/b")
