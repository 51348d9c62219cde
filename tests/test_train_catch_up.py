"""A long run moved to a machine that lacks its features catches up in slices of every n-th
sequence it had, each trained on once, going on where it stopped when moved again
(`dflash_mlx/train/passes.py`; tests/test_passes.py checks the passes without a model)."""

import json
import shutil

from dflash_mlx.train.checkpoint import restore_resume_point
from dflash_mlx.train.loop import train
from tiny_training import batches_trained, random_training_data, store_size, tiny_target, tiny_train_args


def _moved_run(tmp_path, monkeypatch, out: str):
    """A run of 6 steps over chunks of 2 (6 sequences featured), moved to a machine without
    its features: its resume point restored into tmp_path / out. Returns (data, point, run)."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point = tmp_path / "point"
    run = dict(feature_chunk=2, checkpoint_every=1000, resume_point=str(point))
    train(tiny_train_args(data, tmp_path / "run", max_steps=6, **run), log=lambda s: None)
    shutil.rmtree(data.parent / "features")
    restore_resume_point(point, tmp_path / out)
    return data, point, run


def test_a_new_machine_catches_up_a_chunk_a_pass_each_sequence_once(tmp_path, monkeypatch):
    """A run that had features for 6 sequences, resumed where none are stored, trains on
    each new slice alone as it is computed (every third sequence: 0 and 3, 1 and 4, 2 and 5;
    each once, each slice a sample of the whole data), then goes on to the next epoch over
    all of them, instead of on the first chunks again and again (an epoch over 2, then 4)."""
    data, point, run = _moved_run(tmp_path, monkeypatch, "again")  # epochs of 2, 4, 6 sequences
    assert json.loads((point / "state.json").read_text())["featured"] == 6

    trained = batches_trained(data, monkeypatch)
    lines: list[str] = []
    train(tiny_train_args(data, tmp_path / "again", max_steps=13, resume=True, **run), log=lines.append)
    assert trained[:3] == [[0, 3], [1, 4], [2, 5]]
    assert sorted(sum(trained[3:], [])) == list(range(8))  # then epoch 3 over all 8
    assert [line for line in lines if line.startswith("catching up")] == [
        f"catching up: features here for {n} of the run's 6 sequences" for n in (0, 2, 4)
    ]
    state = json.loads((tmp_path / "again" / "checkpoint" / "state.json").read_text())
    assert (state["epoch"], state["first"], state["featured"]) == (3, 0, 8)


def test_a_catch_up_moved_to_another_machine_goes_on_where_it_stopped(tmp_path, monkeypatch):
    """A catch-up that trained slices {0, 3} and {1, 4} on one new machine and moved to
    another goes on with slice {2, 5} there (slice {1, 4}'s features computed again, as its
    pass had not moved on), then the next epoch, instead of starting the catch-up over
    (each move used to retrain the first chunks, and the last ones rarely)."""
    data, point, run = _moved_run(tmp_path, monkeypatch, "second")
    trained = batches_trained(data, monkeypatch)
    train(tiny_train_args(data, tmp_path / "second", max_steps=8, resume=True, **run), log=lambda s: None)
    assert trained == [[0, 3], [1, 4]]
    assert json.loads((point / "state.json").read_text())["first"] == 1  # the slice

    shutil.rmtree(data.parent / "features")
    restore_resume_point(point, tmp_path / "third")
    trained.clear()
    lines: list[str] = []
    train(tiny_train_args(data, tmp_path / "third", max_steps=12, resume=True, **run), log=lines.append)
    assert trained[0] == [2, 5]
    assert sorted(sum(trained[1:], [])) == list(range(6))  # then the next epoch, once each
    assert [line for line in lines if line.startswith("features:")] == ["features: 2 sequences"] * 3


def test_a_data_order_catch_up_saved_before_slices_begins_one_at_slice_0(tmp_path, monkeypatch):
    """A resume point saved in the middle of a catch-up by contiguous chunks (before session
    27's slices: no `catch_up` in its state, `first` a sequence) begins a sliced catch-up of
    its epoch on a new machine."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point = tmp_path / "point"
    run = dict(feature_chunk=2, checkpoint_every=1000, resume_point=str(point))
    train(tiny_train_args(data, tmp_path / "run", max_steps=6, **run), log=lambda s: None)
    state = json.loads((point / "state.json").read_text())
    del state["catch_up"]
    (point / "state.json").write_text(json.dumps({**state, "first": 2, "pos": 0, "epoch_size": 0}))
    shutil.rmtree(data.parent / "features")
    restore_resume_point(point, tmp_path / "again")
    trained = batches_trained(data, monkeypatch)
    train(tiny_train_args(data, tmp_path / "again", max_steps=8, resume=True, **run), log=lambda s: None)
    assert trained == [[0, 3], [1, 4]]


def test_a_catch_up_stops_at_what_the_run_had_before_new_data(tmp_path, monkeypatch):
    """A run that had 5 of 8 sequences, resumed on a new machine with chunks of 2, catches
    up over {0, 3}, {1, 4} and {2} alone: the sequences it never had (5-7) join at the next
    epoch, one chunk more, not inside the catch-up."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point = tmp_path / "point"
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[:5]))
    train(
        tiny_train_args(data, tmp_path / "run", max_steps=5, feature_chunk=2, resume_point=str(point)),
        log=lambda s: None,
    )
    assert json.loads((point / "state.json").read_text())["featured"] == 5
    data.write_text("".join(lines))  # new data arrives; then a new machine
    shutil.rmtree(data.parent / "features")
    restore_resume_point(point, tmp_path / "again")
    trained = batches_trained(data, monkeypatch)
    train(tiny_train_args(data, tmp_path / "again", max_steps=11, feature_chunk=2, resume=True), log=lambda s: None)
    assert trained[:3] == [[0, 3], [1, 4], [2, 2]]  # a pass of one sequence fills its batch with it
    assert max(sum(trained[3:], [])) <= 6  # the next epoch: 0-4 and one chunk more (5-6)
    state = json.loads((tmp_path / "again" / "checkpoint" / "state.json").read_text())
    assert (state["first"], state["epoch_size"], state["featured"]) == (0, 7, 7)


def test_a_pass_past_the_end_of_shrunk_data_starts_over_at_its_first_sequence(tmp_path, monkeypatch):
    """A run whose pass began past what its data now holds (the file was cut short) trains
    from sequence 0 on, instead of an empty pass (a division by zero)."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    run = dict(feature_chunk=2, checkpoint_every=1000)
    train(tiny_train_args(data, tmp_path / "run", max_steps=2, **run), log=lambda s: None)
    state_file = tmp_path / "run" / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "first": 40, "pos": 2, "epoch_size": 2}))
    trained = batches_trained(data, monkeypatch)
    train(tiny_train_args(data, tmp_path / "run", max_steps=3, resume=True, **run), log=lambda s: None)
    assert len(trained) == 1 and max(trained[0]) < 6  # a new epoch over the 4 featured and one chunk more


def test_a_catch_up_stopped_during_its_features_finishes_that_chunk_first(tmp_path, monkeypatch):
    """A new machine stopped while computing a catch-up slice's features (here: sequence 0
    of slice {0, 3} stored) computes the rest of that slice and trains on it, not a whole
    chunk more before its first step."""
    data = random_training_data(tmp_path, monkeypatch, tiny_target(vocab=48), max_token=40)
    point = tmp_path / "point"
    run = dict(feature_chunk=2, checkpoint_every=1000, resume_point=str(point))
    train(tiny_train_args(data, tmp_path / "run", max_steps=6, **run), log=lambda s: None)
    shutil.rmtree(data.parent / "features")
    first = data.with_name("first.jsonl")  # beside the data: the same feature store
    first.write_text(data.read_text().splitlines(keepends=True)[0])
    train(tiny_train_args(first, tmp_path / "scratch", max_steps=1), log=lambda s: None)  # stores sequence 0
    assert store_size(data) == 1
    restore_resume_point(point, tmp_path / "again")

    trained = batches_trained(data, monkeypatch)
    lines: list[str] = []
    train(
        tiny_train_args(data, tmp_path / "again", max_steps=9, resume=True, **run), log=lines.append
    )  # 3 steps on from 6
    assert trained == [[0, 3], [1, 4], [2, 5]]
    assert [line for line in lines if line.startswith("features:")] == ["features: 1 sequences"] + [
        "features: 2 sequences"
    ] * 2


def test_catch_up_passes_train_each_slice_again_before_its_next_is_computed(tmp_path, monkeypatch):
    """With --catch-up-passes 2, a moved run trains on each slice twice in a row, and the
    next slice's features are computed only after that (3 target passes, as with 1)."""
    data, _, run = _moved_run(tmp_path, monkeypatch, "again")

    trained = batches_trained(data, monkeypatch)
    lines: list[str] = []
    again = tiny_train_args(data, tmp_path / "again", max_steps=12, resume=True, catch_up_passes=2, **run)
    train(again, log=lines.append)
    assert trained == [[0, 3], [0, 3], [1, 4], [1, 4], [2, 5], [2, 5]]
    assert len([line for line in lines if line.startswith("catching up")]) == 3


def test_a_finished_run_moved_to_a_new_machine_ends_without_computing_features(tmp_path, monkeypatch):
    """A run whose budget is spent, resumed where its features are missing, ends at once: no
    target passes for a pass it will never train (the long run's point, resumed on a new
    machine after its 12 core-hours, spent 16 minutes on a catch-up slice). It delivers its
    drafter there and leaves its resume point as it was."""
    data, point, run = _moved_run(tmp_path, monkeypatch, "again")
    before = {p.name: p.read_bytes() for p in point.iterdir()}
    lines: list[str] = []
    trained = batches_trained(data, monkeypatch)
    out = train(tiny_train_args(data, tmp_path / "again", max_steps=6, resume=True, **run), log=lines.append)
    assert out["step"] == 6 and trained == []
    assert not [line for line in lines if line.startswith(("catching up", "features:"))], lines
    assert not (data.parent / "features").exists() or store_size(data) == 0
    assert {p.name: p.read_bytes() for p in point.iterdir()} == before
    assert (tmp_path / "again" / "model.safetensors").is_file()
