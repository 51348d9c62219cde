"""The passes of a training run over its data (`dflash_mlx/train/passes.py`), without a model:
which sequences a pass covers, in chunks and in a moved run's catch-up."""

from dflash_mlx.train.checkpoint import TrainState
from dflash_mlx.train.passes import Passes


def _passes(n: int, chunk: int, stored: set, **state) -> Passes:
    passes = Passes(TrainState(**state), chunk, lambda key: key in stored)
    passes.set_data([f"s{i}" for i in range(n)])
    return passes


def test_an_epoch_of_a_growing_store_adds_one_chunk_and_covers_what_is_stored():
    stored = {f"s{i}" for i in range(4)}
    passes = _passes(10, 3, stored, featured=4)
    assert passes.to_feature() == list(range(7))  # what the run had and one chunk more
    stored.update({"s4", "s5", "s6"})
    passes.features_done()
    passes.begin()
    assert passes.state.featured == 7 and passes.indices() == list(range(7))


def test_a_machine_lacking_the_runs_features_catches_up_a_slice_of_every_nth_sequence():
    passes = _passes(10, 4, set(), featured=10, epoch=3, first=4, epoch_size=6)
    assert passes.to_feature() == [0, 3, 6, 9]  # slice 0 of ceil(10 / 4) = 3
    assert passes.state.catch_up and passes.state.epoch == 3
    slices = []
    while passes.state.catch_up:
        slices.append(passes.indices())
        passes.advance()
    assert slices == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]  # each sequence once
    assert passes.state.epoch == 4 and passes.state.first == 0


def test_a_catch_up_moved_again_goes_on_at_its_slice():
    passes = _passes(10, 4, {"s0", "s3"}, featured=10, first=1, catch_up=True)
    assert passes.to_feature() == [1, 4, 7]


def test_a_catch_up_resumed_without_feature_chunks_ends_and_the_epoch_covers_everything():
    stored = {f"s{i}" for i in range(10)}
    passes = _passes(10, 0, stored, featured=10, first=2, catch_up=True, repeat=1, pos=3, epoch_size=3)
    assert passes.to_feature() == list(range(10))
    passes.begin()  # under a catch-up, slices() would divide by the chunk, 0
    assert not passes.state.catch_up and passes.indices() == list(range(10))


def test_a_pass_past_the_end_of_shrunk_data_starts_over_at_0():
    passes = _passes(5, 4, set(), featured=5, first=8, pos=4, epoch_size=4)
    assert (passes.state.first, passes.state.pos, passes.state.epoch_size) == (0, 0, 0)


def test_a_pass_is_taken_in_a_seeded_order_each_sequence_once_before_any_again():
    stored = {f"s{i}" for i in range(8)}
    passes = _passes(8, 0, stored, featured=8)
    assert passes.needs_next(4)
    passes.begin()
    first, second = passes.take(4, seed=0), passes.take(4, seed=0)
    assert sorted(first + second) == list(range(8)) and first != list(range(4))
    assert passes.needs_next(4)
    again = _passes(8, 0, stored, featured=8)
    again.begin()
    assert again.take(4, seed=0) == first


def test_catch_up_passes_train_each_slice_so_many_times_in_a_row_each_in_its_own_order():
    keys = {f"s{i}" for i in range(10)}
    passes = Passes(TrainState(featured=10, catch_up=True), 4, keys.__contains__, repeats=3)
    passes.set_data(sorted(keys, key=lambda k: int(k[1:])))
    trained = []
    while passes.state.catch_up:
        passes.begin()
        trained.append((passes.state.first, passes.take(len(passes.indices()), seed=0)))
        passes.advance()
    assert [first for first, _ in trained] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    orders = [tuple(order) for first, order in trained if first == 0]
    assert [sorted(order) for order in orders] == [[0, 3, 6, 9]] * 3
    assert len(set(orders)) == 3  # a repeat is not the same order again
    assert passes.state.epoch == 1 and passes.state.repeat == 0
