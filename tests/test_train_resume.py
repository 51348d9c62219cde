"""The long run's survival kit: features computed a chunk at a time while training goes on,
and the compact resume point that a new machine resumes from (`make resume-training`)."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx.drafters import load_drafter_dir
from dflash_mlx.train.checkpoint import restore_resume_point
from dflash_mlx.train.loop import train
from tiny_training import random_training_data, store_size, tiny_target, tiny_train_args


def _weights(path) -> dict:
    return dict(tree_flatten(load_drafter_dir(path).parameters()))


def test_feature_chunks_grow_the_store_an_epoch_at_a_time(tmp_path, monkeypatch):
    """Epoch e trains on the first (e + 1) chunks: 2 sequences (1 step), then 4 (2 steps)..."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    out = tmp_path / "run"
    train(tiny_train_args(data, out, max_steps=1, feature_chunk=2), log=lambda s: None)
    assert store_size(data) == 2
    train(tiny_train_args(data, out, max_steps=3, feature_chunk=2, resume=True), log=lambda s: None)
    assert store_size(data) == 4
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert (state["epoch"], state["epoch_size"]) == (1, 4)


def test_a_chunked_run_resumed_ends_as_an_uninterrupted_one(tmp_path, monkeypatch):
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    train(tiny_train_args(data, tmp_path / "whole", max_steps=6, feature_chunk=2), log=lambda s: None)
    shutil.rmtree(data.parent / "features")  # the second run computes its own, chunk by chunk

    def stop_at_step_3(line: str) -> None:  # the log line comes before that step's checkpoint
        if line.startswith("step 3/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_train_args(data, tmp_path / "parts", max_steps=6, feature_chunk=2, log_every=1), log=stop_at_step_3)
    assert json.loads((tmp_path / "parts" / "checkpoint" / "state.json").read_text())["step"] == 2
    train(tiny_train_args(data, tmp_path / "parts", max_steps=6, feature_chunk=2, resume=True), log=lambda s: None)
    whole, parts = _weights(tmp_path / "whole"), _weights(tmp_path / "parts")
    assert all(mx.array_equal(whole[k], parts[k]).item() for k in whole)


def test_a_chunk_below_the_batch_is_refused_before_any_work(tmp_path, monkeypatch):
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    with pytest.raises(ValueError, match="--feature-chunk must be 0 or at least --batch-size"):
        train(tiny_train_args(data, tmp_path / "run", max_steps=1, feature_chunk=1), log=lambda s: None)
    assert not (data.parent / "features").exists()


def test_the_resume_point_is_compact_and_a_new_machine_resumes_from_it(tmp_path, monkeypatch):
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point = tmp_path / "assets" / "long-run"
    train(
        tiny_train_args(data, tmp_path / "run", max_steps=3, feature_chunk=2, resume_point=str(point)),
        log=lambda s: None,
    )
    weights = mx.load(str(point / "model.safetensors"))
    moments = mx.load(str(point / "optimizer.safetensors"))
    assert {v.dtype for v in weights.values()} == {mx.float16}
    assert {v.dtype for v in moments.values() if v.size > 1} == {mx.bfloat16}
    assert not [k for k in moments if k.endswith(".m")] and [k for k in moments if k.endswith(".v")]
    assert json.loads((point / "state.json").read_text())["step"] == 3
    original = _weights(tmp_path / "run")
    assert all(np.allclose(np.array(original[k]), np.array(weights[k].astype(mx.float32)), atol=1e-3) for k in original)

    # A new machine: no run directory, no features; it catches up a chunk at a time.
    shutil.rmtree(tmp_path / "run")
    shutil.rmtree(data.parent / "features")
    restore_resume_point(point, tmp_path / "again")
    with pytest.raises(FileExistsError, match="--resume-from"):
        restore_resume_point(point, tmp_path / "again")
    result = train(
        tiny_train_args(data, tmp_path / "again", max_steps=5, feature_chunk=2, resume=True), log=lambda s: None
    )
    assert result["step"] == 5
    state = json.loads((tmp_path / "again" / "checkpoint" / "state.json").read_text())
    assert state["seen"] == 10


def test_a_restored_run_re_warms_its_first_moments_and_keeps_its_second(tmp_path, monkeypatch):
    """The resume point carries AdamW's second moments (bfloat16), not its first: restored,
    the first moments are zero (smaller first steps), the second as saved. A point saved
    before session 27, first moments and all, restores them too."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point = tmp_path / "point"
    train(tiny_train_args(data, tmp_path / "run", max_steps=3, resume_point=str(point)), log=lambda s: None)
    full = mx.load(str(tmp_path / "run" / "checkpoint" / "optimizer.npz"))
    restore_resume_point(point, tmp_path / "again")
    restored = mx.load(str(tmp_path / "again" / "checkpoint" / "optimizer.npz"))
    assert restored.keys() == full.keys()
    for k, v in full.items():
        if k.endswith(".m"):
            assert not restored[k].any().item() and full[k].any().item(), k
        elif k.endswith(".v"):
            np.testing.assert_allclose(np.array(restored[k]), np.array(v), rtol=1e-2, atol=1e-12)
    older = tmp_path / "older"  # the format before: every moment
    shutil.copytree(point, older)
    mx.save_safetensors(
        str(older / "optimizer.safetensors"), {k: v.astype(mx.bfloat16) if v.size > 1 else v for k, v in full.items()}
    )
    restore_resume_point(older, tmp_path / "older-run")
    old = mx.load(str(tmp_path / "older-run" / "checkpoint" / "optimizer.npz"))
    assert all(old[k].any().item() for k in old if k.endswith(".m"))


def test_a_checkpoint_comes_right_before_each_new_chunks_features(tmp_path, monkeypatch):
    """A run that ends during a chunk's target pass (here: the second chunk's) resumes from
    the checkpoint and resume point saved right before that pass, and ends as an
    uninterrupted run does."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point, parts = tmp_path / "point", tmp_path / "parts"
    run = dict(max_steps=4, feature_chunk=2, checkpoint_every=1000, resume_point=str(point))
    train(tiny_train_args(data, tmp_path / "whole", **run), log=lambda s: None)
    shutil.rmtree(data.parent / "features")
    passes = []

    def stop_in_the_second_pass(line: str) -> None:
        if line.startswith("features:"):
            passes.append(line)
            if len(passes) == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_train_args(data, parts, **run), log=stop_in_the_second_pass)
    for state in (parts / "checkpoint" / "state.json", point / "state.json"):
        saved = json.loads(state.read_text())
        assert (saved["step"], saved["epoch"], saved["pos"], saved["epoch_size"]) == (1, 1, 0, 0)
    train(tiny_train_args(data, parts, resume=True, **run), log=lambda s: None)
    whole, resumed = _weights(tmp_path / "whole"), _weights(parts)
    assert all(mx.array_equal(whole[k], resumed[k]).item() for k in whole)


def test_a_restart_mid_epoch_computes_no_features_even_after_the_chunk_grew(tmp_path, monkeypatch):
    """An epoch adds one chunk to what the run had featured, whatever chunk size earlier
    epochs used; a restart in the middle of an epoch computes nothing (it used to compute
    up to (epoch + 1) x chunk: features the epoch does not use, and a larger next epoch
    than the uninterrupted run's)."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines + [line.replace('"id": "', '"id": "copy-') for line in lines]) + "\n")  # 16

    def stop_at_step_4(line: str) -> None:  # the log line comes before that step's checkpoint
        if line.startswith("step 4/"):
            raise KeyboardInterrupt

    runs = {}
    for name in ("whole", "parts"):  # epochs of 2 sequences (chunk 2), then 6 and 10 (chunk 4)
        out = runs[name] = tmp_path / name
        train(tiny_train_args(data, out, max_steps=1, feature_chunk=2), log=lambda s: None)
        if name == "parts":
            with pytest.raises(KeyboardInterrupt):
                train(
                    tiny_train_args(data, out, max_steps=9, feature_chunk=4, resume=True, log_every=1),
                    log=stop_at_step_4,
                )
            assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 3  # mid-epoch 1
            assert store_size(data) == 6
        train(tiny_train_args(data, out, max_steps=9, feature_chunk=4, resume=True), log=lambda s: None)
        shutil.rmtree(data.parent / "features")
    state = json.loads((runs["parts"] / "checkpoint" / "state.json").read_text())
    assert (state["epoch"], state["epoch_size"], state["featured"]) == (2, 10, 10)
    whole, parts = _weights(runs["whole"]), _weights(runs["parts"])
    assert all(mx.array_equal(whole[k], parts[k]).item() for k in whole)


def test_a_run_resumed_after_its_last_checkpoint_logs_each_step_once(tmp_path, monkeypatch):
    """A session that ends past its last checkpoint (here: at step 4, checkpointed at 2) has
    logged steps the resumed run trains and logs again: the log keeps one record a step."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    run = dict(max_steps=6, checkpoint_every=2, log_every=1)

    def stop_at_step_4(line: str) -> None:
        if line.startswith("step 4/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(tiny_train_args(data, tmp_path / "run", **run), log=stop_at_step_4)
    log = tmp_path / "run" / "train_log.jsonl"
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3]
    train(tiny_train_args(data, tmp_path / "run", resume=True, **run), log=lambda s: None)
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]


def test_a_finished_run_resumed_again_adds_no_evaluation(tmp_path, monkeypatch):
    """`make resume-training` once the budget is spent trains no step: the curve's last
    point, logged when the run ended, is not logged again at the same step."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    run = dict(max_steps=2, eval_minutes=1e6, eval_tokens=4)
    train(tiny_train_args(data, tmp_path / "run", **run), log=lambda s: None)
    train(tiny_train_args(data, tmp_path / "run", resume=True, **run), log=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "heldout_tau" in r] == [2]


def test_a_restored_checkpoint_keeps_every_optimizer_dtype(tmp_path, monkeypatch):
    """The resume point narrows the weights and moments; restoring widens those back to
    float32 and leaves the rest as it was (AdamW's step count stays an unsigned integer)."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point = tmp_path / "point"
    train(tiny_train_args(data, tmp_path / "run", max_steps=2, resume_point=str(point)), log=lambda s: None)
    restore_resume_point(point, tmp_path / "again")
    before = mx.load(str(tmp_path / "run" / "checkpoint" / "optimizer.npz"))
    after = mx.load(str(tmp_path / "again" / "checkpoint" / "optimizer.npz"))
    assert {k: v.dtype for k, v in after.items()} == {k: v.dtype for k, v in before.items()}
    assert after["step"].item() == 2


def test_a_restored_run_takes_the_resume_points_log(tmp_path, monkeypatch):
    """OUT without a checkpoint may still hold a log (a run that ended before its first
    checkpoint): restoring the resume point there takes the point's log, the run's curve."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point, again = tmp_path / "point", tmp_path / "again"
    train(tiny_train_args(data, tmp_path / "run", max_steps=2, resume_point=str(point)), log=lambda s: None)
    again.mkdir()
    (again / "train_log.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    restore_resume_point(point, again)
    assert (again / "train_log.jsonl").read_text() == (point / "train_log.jsonl").read_text()


def test_a_rank_that_loses_the_race_to_restore_trains_from_the_winners_checkpoint(tmp_path, monkeypatch):
    """Under mlx.launch with one filesystem every rank runs `--resume-from`: the one whose
    restore finds the checkpoint already made (FileExistsError) goes on from it, instead of
    failing while the others wait for it in their first all_sum."""
    import dflash_mlx.train.checkpoint as checkpoint
    from convert_helpers import cli

    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point = tmp_path / "point"
    train(tiny_train_args(data, tmp_path / "first", max_steps=2, resume_point=str(point)), log=lambda s: None)
    restore = checkpoint.restore_resume_point

    def restored_by_another_rank_meanwhile(src, out):
        restore(src, out)  # the other rank, between this one's check and its restore
        restore(src, out)  # this one: FileExistsError

    monkeypatch.setattr(checkpoint, "restore_resume_point", restored_by_another_rank_meanwhile)
    out = tmp_path / "again"
    flags = ["--block-size", "4", "--batch-size", "2", "--num-anchors", "4", "--target-layer-ids", "1,3"]
    result = cli("train", "-d", data, "-o", out, "--resume-from", point, "--max-steps", "3", "--no-progress", *flags)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == 3
