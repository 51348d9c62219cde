"""Thread control (`--threads N|auto`, following the CPU lock another process holds) and the
core-hours a training run records, across `--resume`. Uses its own lock file: the test
run itself may hold /tmp/dflash-cpu.lock."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import numpy as np
import pytest

from dflash_mlx import blas
from dflash_mlx.train.threads import ThreadControl, lock_is_held, parse_threads

needs_openblas = pytest.mark.skipif(blas.num_threads() is None, reason="OpenBLAS is not loaded here")

_HOLDER = (
    "import fcntl, sys, time\nf = open(sys.argv[1], 'a')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\ntime.sleep(120)\n"
)


@pytest.fixture
def restore_threads():
    before = blas.num_threads()
    yield
    if before:
        blas.set_num_threads(before)


def test_parse_threads():
    assert parse_threads(None) is None and parse_threads("auto") == "auto" and parse_threads("3") == 3
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="--threads must be"):
            parse_threads(bad)


@needs_openblas
def test_auto_threads_follow_the_cpu_lock(tmp_path, restore_threads):
    lock = str(tmp_path / "cpu.lock")
    control = ThreadControl("auto", lock_path=lock, interval=0.0)
    assert control.threads == 2 and blas.num_threads() == 2
    # it never keeps the lock: another process can take it at once
    assert subprocess.run(["flock", "-n", lock, "true"]).returncode == 0
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, lock], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lock_is_held(lock)
        assert control.poll() == 1 and blas.num_threads() == 1
    finally:
        holder.kill()
        holder.wait()
    assert not lock_is_held(lock)
    assert control.poll() == 2 and blas.num_threads() == 2
    slow = ThreadControl("auto", lock_path=lock, interval=3600.0)  # looks at most every `interval`
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, lock], stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()
        assert slow.poll() == 2 and slow.poll(force=True) == 1
    finally:
        holder.kill()
        holder.wait()
    assert ThreadControl(1).threads == 1 and blas.num_threads() == 1


@needs_openblas
def test_core_hours_survive_resume(tmp_path, monkeypatch, restore_threads):
    """The CPU time of the training steps, summed in the checkpointed state: a resumed run
    starts from exactly the saved value and adds its own steps' (at most threads x seconds);
    a --core-hours budget stops the run once it is spent."""
    from tiny_training import random_training_data, tiny_target, tiny_train_args

    from dflash_mlx.train.loop import Trainer, train

    model = tiny_target(vocab=48)
    data = random_training_data(tmp_path, monkeypatch, model, max_token=40)
    out = tmp_path / "d"

    def args(**fields):
        return tiny_train_args(data, out, seed=0, log_every=1, **fields)

    first = train(args(max_steps=3, threads=1), log=lambda s: None)
    saved = json.loads((out / "checkpoint" / "state.json").read_text())
    assert 0 < saved["core_seconds"] <= 1.1 * first["elapsed"] + 0.05  # one thread: at most its wall time

    resumed = Trainer(args(max_steps=6, threads=2, resume=True), log=lambda s: None)
    assert resumed.state.core_seconds == saved["core_seconds"]  # exactly, not re-measured
    second = resumed.run()
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["step"] == 6
    added = state["core_seconds"] - saved["core_seconds"]
    assert 0 < added <= 2 * 1.1 * (second["elapsed"] - saved["elapsed"]) + 0.05
    hours = [json.loads(line)["core_hours"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert len(hours) == 6 and (np.diff(hours) >= 0).all()
    assert hours[-1] == pytest.approx(state["core_seconds"] / 3600, abs=1e-5)

    budget = state["core_seconds"] / 3600 + 1e-7  # spent after the next step
    third = train(args(max_steps=None, core_hours=budget, threads=1, resume=True), log=lambda s: None)
    assert third["step"] == 7 and third["core_seconds"] >= budget * 3600


@needs_openblas
def test_new_datas_features_are_not_charged_as_training(tmp_path, monkeypatch, restore_threads):
    """Data that grows during a run gets its features at the next epoch; that pass is data
    work, not training: it stays out of the core-hours (here it burns a known CPU second)."""
    from tiny_training import random_training_data, tiny_target

    import dflash_mlx.train.loop as loop

    model = tiny_target(vocab=48)
    data = random_training_data(tmp_path, monkeypatch, model, max_token=40)
    args = loop.TrainArgs(
        data=str(data), out=str(tmp_path / "d"), num_layers=1, target_layer_ids=[1, 3], block_size=4,
        batch_size=4, num_anchors=4, progress=False, max_steps=4, threads=1, eval_minutes=0,
    )  # fmt: skip
    trainer = loop.Trainer(args, log=lambda s: None)  # the first 8 sequences' features: before any step
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines + [line.replace('"id": "', '"id": "new') for line in lines]) + "\n")

    def slow_fill(*a, **kw):
        busy = time.process_time()
        while time.process_time() - busy < 1.0:
            pass
        return fill(*a, **kw)

    fill = loop.fill_store
    monkeypatch.setattr(loop, "fill_store", slow_fill)
    wall = time.perf_counter()
    trainer.run()  # steps 3 and 4 are the second epoch: 16 sequences, 8 of them new
    assert len(trainer.seqs) == 16 and sum(k.startswith("new") for k, _, _ in trainer.seqs) == 8
    assert time.perf_counter() - wall > 1.0  # the slow feature pass ran
    assert 0 < trainer.state.core_seconds < time.perf_counter() - wall - 0.9
