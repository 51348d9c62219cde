"""`dflash train --ema DECAY`: the moving average of the drafter's weights, what the held-out
evaluations measure and the delivered drafter holds, kept by the checkpoint for an exact
`--resume` and by the compact resume point (in float16) for a new machine."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dflash_mlx.train.loop as loop
from convert_helpers import assert_fails, cli
from dflash_mlx.train.curves import read_curve
from dflash_mlx.train.loop import TrainArgs, Trainer, train
from tiny_training import random_training_data, tiny_target, tiny_train_args

DECAY = 0.9  # far from 1, so that the average stays well apart from the last weights
FLAGS = ["--block-size", "4", "--batch-size", "2", "--num-anchors", "4", "--target-layer-ids", "1,3", "--no-progress"]


def _args(data, out, **fields) -> TrainArgs:
    return tiny_train_args(data, out, **{"ema": DECAY, **fields})


def _flat(drafter) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(drafter.trainable_parameters())}


def _file(path) -> dict[str, np.ndarray]:
    return {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(path)).items()}


def _averaged(start: dict, *steps: dict) -> dict[str, np.ndarray]:
    """The average by hand: from `start`, each step's weights folded in."""
    avg = {k: v.astype(np.float32) for k, v in start.items()}
    for weights in steps:
        avg = {k: np.float32(DECAY) * avg[k] + np.float32(1 - DECAY) * weights[k] for k in avg}
    return avg


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.allclose(a[k], b[k], rtol=1e-6, atol=1e-7) for k in a)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_the_average_after_three_steps_is_the_hand_made_one(tmp_path, monkeypatch):
    """ema = 0.9 ema + 0.1 weights after each step, from the run's first weights; the
    checkpoint keeps it beside the raw weights and OUT's drafter is it."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    out, after_step = tmp_path / "run", []
    trainer = Trainer(
        _args(data, out, max_steps=3, log_every=1),
        log=lambda line: line.startswith("step ") and after_step.append(_flat(trainer.drafter)),
    )
    start = _flat(trainer.drafter)
    trainer.run()
    assert len(after_step) == 3
    expected = _averaged(start, *after_step)
    assert _close(_file(out / "checkpoint" / "average.npz"), expected)
    assert _close(_file(out / "model.safetensors"), expected)
    assert _equal(_file(out / "checkpoint" / "model.safetensors"), after_step[-1])
    assert not _close(expected, after_step[-1])


def test_a_resumed_run_ends_with_the_weights_and_average_of_an_uninterrupted_one(tmp_path, monkeypatch):
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    train(_args(data, tmp_path / "whole", max_steps=4), log=lambda s: None)

    def stop_at_step_3(line: str) -> None:  # the log line comes before that step's checkpoint
        if line.startswith("step 3/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(_args(data, tmp_path / "parts", max_steps=4, log_every=1), log=stop_at_step_3)
    assert json.loads((tmp_path / "parts" / "checkpoint" / "state.json").read_text())["step"] == 2
    train(_args(data, tmp_path / "parts", max_steps=4, resume=True), log=lambda s: None)
    for name in ("checkpoint/model.safetensors", "checkpoint/average.npz", "model.safetensors"):
        assert _equal(_file(tmp_path / "whole" / name), _file(tmp_path / "parts" / name)), name


def test_a_run_restored_from_a_resume_point_goes_on_with_its_average(tmp_path, monkeypatch):
    """The resume point keeps the average in float16; the run restored from it on a new
    machine folds its next step into that average, not into one started afresh."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point, again = tmp_path / "point", tmp_path / "again"
    train(_args(data, tmp_path / "run", max_steps=2, resume_point=str(point)), log=lambda s: None)
    assert sorted(os.listdir(point)) == [
        "average.safetensors",
        "config.json",
        "model.safetensors",
        "optimizer.safetensors",
        "state.json",
        "train_log.jsonl",
    ]
    assert {v.dtype for v in mx.load(str(point / "average.safetensors")).values()} == {mx.float16}
    saved = _file(point / "average.safetensors")
    assert _close_half(saved, _file(tmp_path / "run" / "checkpoint" / "average.npz"))
    assert not _close_half(saved, _file(point / "model.safetensors"))  # DECAY 0.9: well apart
    result = cli("train", "-d", data, "-o", again, "--resume-from", point, "--max-steps", "3", "--ema", DECAY, *FLAGS)
    assert result.exit_code == 0, result.output
    assert not [line for line in result.output.splitlines() if line.startswith("--ema:")]
    expected = _averaged(saved, _file(again / "checkpoint" / "model.safetensors"))
    assert _close(_file(again / "checkpoint" / "average.npz"), expected)


def _close_half(a: dict, b: dict) -> bool:
    """Equal up to float16's rounding."""
    return a.keys() == b.keys() and all(np.allclose(a[k], b[k], rtol=1e-3, atol=1e-4) for k in a)


def test_a_run_resumed_with_ema_that_had_none_starts_it_from_its_weights(tmp_path, monkeypatch):
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    out = tmp_path / "run"
    train(_args(data, out, max_steps=2, ema=None), log=lambda s: None)
    assert not (out / "checkpoint" / "average.npz").exists()
    before = _file(out / "checkpoint" / "model.safetensors")
    assert _equal(_file(out / "model.safetensors"), before)  # without --ema OUT's drafter is the raw weights
    lines: list[str] = []
    train(_args(data, out, max_steps=3, resume=True), log=lines.append)
    assert sum(line.startswith("--ema:") for line in lines) == 1
    expected = _averaged(before, _file(out / "checkpoint" / "model.safetensors"))
    assert _close(_file(out / "checkpoint" / "average.npz"), expected)


@pytest.mark.parametrize("decay, message", [("1.5", "--ema must be below 1, got 1.5"), ("0", "--ema must be above 0")])
def test_a_decay_outside_0_1_is_refused_before_any_work(tmp_path, monkeypatch, decay, message):
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    out = tmp_path / "run"
    assert_fails(cli("train", "-d", data, "-o", out, "--ema", decay, *FLAGS), out, message)
    assert not (tmp_path / "features").exists()


def test_the_evaluations_measure_the_average_and_say_so(tmp_path, monkeypatch):
    """The held-out tau is the average's (the weights replayed are OUT's drafter's at the
    run's last evaluation), its record says `"weights": "ema"`, the raw weights come back
    after it, and `dflash curves` reads the log."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    (tmp_path / "heldout.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    replayed: list[dict] = []
    replay_tau = loop.replay_tau

    def recording(drafter, *rest, **kw):
        replayed.append(_flat(drafter))
        return replay_tau(drafter, *rest, **kw)

    monkeypatch.setattr(loop, "replay_tau", recording)
    out = tmp_path / "run"
    train(_args(data, out, max_steps=2, eval_minutes=1e6, eval_tokens=4), log=lambda s: None)
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "heldout_tau" in r]
    assert [(r["step"], r["weights"]) for r in evaluations] == [(2, "ema")]
    assert _equal(replayed[-1], _file(out / "model.safetensors"))
    assert not _close(_file(out / "checkpoint" / "model.safetensors"), replayed[-1])
    assert len(read_curve(out)) == 1
