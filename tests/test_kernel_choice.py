"""Kernels only where they were checked and win (dflash_mlx/kernels/choice.py, tune.py), off a Mac.

The timing and the kernels' own outputs need Metal; the decision does not. With a fake
timer (scripted seconds per step, nothing run) and a fake check, the faster side is kept
per (shape, rows), the choice is cached per chip, MLX version and model and read back
instead of timed again, and the pairs are built from a real quantized mlx-lm target's own
shapes at the loop's sizes. The real check runs on steps that are MLX's own ops: a kernel
whose output differs loses, however fast, and a shape nobody checked runs MLX's op.
"""

from __future__ import annotations

import json

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import mlx.nn as nn
import pytest

from dflash_mlx.kernels import choice, metal_ready, tune
from dflash_mlx.kernels.qmm import verify_qmm, verify_qmm_reference
from tiny_targets import tiny_target

WINS_UP_TO = 4  # the fake kernel is faster for M <= 4 and slower above


def fake_timer(step: choice.Step) -> float:
    """Scripted seconds: the kernel 1 s at small M, 3 s at large M; MLX's op always 2 s."""
    if not step.custom:
        return 2.0
    rows = int(step.key.rsplit("M", 1)[1]) if step.key.startswith("qmm") else int(step.key.rsplit("T", 1)[1])
    return 1.0 if rows <= WINS_UP_TO else 3.0


def passing_check(custom: choice.Step, own: choice.Step) -> dict:
    """A check that passes without running anything (the kernel side needs Metal)."""
    return {"same_argmax": True, "max_abs_diff": 0.0, "bound": 1e-4, "passed": True}


def refusing_timer(step: choice.Step) -> float:
    raise AssertionError(f"timed {step.key} again: the cache was not read")


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch, tmp_path):
    """An empty choice and cache directory per test (the choice is process-wide)."""
    monkeypatch.setattr(choice, "_chosen", {})
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))


@pytest.fixture(scope="module")
def quantized_llama():
    model = tiny_target("llama")
    nn.quantize(model, group_size=32, bits=4)
    return model


def test_pairs_cover_the_targets_shapes_at_the_loops_sizes(quantized_llama):
    layers = quantized_llama.model.layers
    pairs = tune.qmm_pairs([p for layer in layers for p in tune.decoder.projections(layer)])
    keys = {custom.key for custom, _ in pairs}
    shapes = {(p.weight.shape[0], p.scales.shape[1] * 32) for p in tune.decoder.projections(layers[0])}
    assert len(keys) == len(pairs) == len(shapes) * len(tune.VERIFY_ROWS)  # one pair per shape and M, layers shared
    assert all(custom.custom and not own.custom and custom.key == own.key for custom, own in pairs)
    _, own = pairs[0]
    own.run()  # MLX's side runs anywhere


def test_faster_side_is_kept_per_shape_and_rows(quantized_llama):
    pairs = tune.qmm_pairs(tune.decoder.projections(quantized_llama.model.layers[0]))
    timings = choice.decide(pairs, fake_timer, passing_check)
    choice.adopt(timings)
    for custom, _ in pairs:
        rows = int(custom.key.rsplit("M", 1)[1])
        assert choice.kernel_wins(custom.key) is (rows <= WINS_UP_TO), custom.key
        assert timings[custom.key]["mlx_s"] == 2.0
    assert not choice.kernel_wins("qmm 7x64 4b g32 float32 M3")  # nothing checked: MLX's op


def test_choice_is_cached_per_machine_and_model(quantized_llama, tmp_path):
    layer = quantized_llama.model.layers[0]
    pairs = tune.qmm_pairs(tune.decoder.projections(layer))
    first = choice.load_or_time(pairs, fake_timer, passing_check)
    path = choice.cache_path([custom.key for custom, _ in pairs])
    assert path.is_relative_to(tmp_path / "kernel-choice") and mx.__version__ in path.parent.name
    assert json.loads((path / choice.FILE).read_text()) == first
    choice._chosen.clear()
    assert choice.load_or_time(pairs, refusing_timer, passing_check) == first  # read, not timed again
    assert not choice.kernel_wins(pairs[-1][0].key)  # and adopted
    other = tune.qmm_pairs(tune.decoder.projections(layer)[:1])  # another model: its own entry
    with pytest.raises(AssertionError, match="timed"):
        choice.load_or_time(other, refusing_timer, passing_check)


def test_replay_pairs_for_a_hybrid_target():
    layers = tiny_target("qwen3_5").model.layers
    pairs = tune.replay_pairs(layers)
    assert [int(c.key.rsplit("T", 1)[1]) for c, _ in pairs] == list(tune.REPLAY_TOKENS)
    choice.adopt(choice.decide(pairs, fake_timer, passing_check))
    assert [choice.kernel_wins(c.key) for c, _ in pairs] == [t <= WINS_UP_TO for t in tune.REPLAY_TOKENS]
    pairs[0][1].run()


def test_building_the_pairs_leaves_the_global_rng_alone(quantized_llama):
    """Tuning on a user's first generation draws its inputs from keys of its own: the
    global RNG (mlx-lm's samplers, a user's mx.random.seed) is where it was."""
    hybrid = tiny_target("qwen3_5").model.layers  # built first: a new model draws its weights
    mx.random.seed(7)
    expected = mx.random.uniform(shape=(4,))
    mx.random.seed(7)
    tune.qmm_pairs(tune.decoder.projections(quantized_llama.model.layers[0]), rows=range(1, 3))
    tune.replay_pairs(hybrid, tokens=range(1, 3))
    assert mx.array_equal(mx.random.uniform(shape=(4,)), expected).item()


def test_bench_prints_the_choice(quantized_llama):
    """`dflash bench kernels` shows which side runs per shape and rows, or why nothing was chosen."""
    from app.cli.bench.kernels import choice_lines

    pairs = tune.qmm_pairs(tune.decoder.projections(quantized_llama.model.layers[0]), rows=range(3, 6))
    table = "\n".join(choice_lines(choice.decide(pairs, fake_timer, passing_check)))
    assert table.count("| kernel |") == len(pairs) // 3 * 2 and table.count("| MLX |") == len(pairs) // 3
    assert "nothing to choose here" in "\n".join(choice_lines({}))


@pytest.mark.skipif(metal_ready(), reason="off a Mac only")
def test_off_metal_nothing_is_timed_and_the_fallback_runs(quantized_llama):
    assert tune.tune(quantized_llama.model.layers, timer=refusing_timer) == {}
    p = tune.decoder.projections(quantized_llama.model.layers[0])[0]
    x = mx.random.normal((3, p.scales.shape[1] * 32))
    args = (x, p.weight, p.scales, p.biases, 32, 4)
    assert mx.array_equal(verify_qmm(*args), verify_qmm_reference(*args))


def mlx_steps(key: str, error: float) -> tuple[choice.Step, choice.Step]:
    """A (kernel, MLX) pair whose "kernel" is MLX's own product plus `error` on one output."""
    x, w = mx.random.normal((4, 64), key=mx.random.key(1)), mx.random.normal((32, 64), key=mx.random.key(2))
    wrong = mx.zeros((4, 32)).at[2, 5].add(error)
    custom = choice.Step(key, True, lambda: choice.evaluated(x @ w.T + wrong))
    return custom, choice.Step(key, False, lambda: choice.evaluated(x @ w.T))


def test_a_kernel_runs_only_once_checked_and_faster():
    """The real check: outputs within the stated bound and the same argmax pass; a kernel
    off by more (here one output moved far enough to change its row's argmax, then one
    moved within the argmax but past the bound) is never chosen, even where it is faster;
    a shape nobody checked runs MLX's op."""
    good, bad, off = (mlx_steps(f"qmm 32x64 4b g32 float32 M{m}", e) for m, e in ((2, 1e-6), (3, 100.0), (4, 0.5)))
    timings = choice.decide([good, bad, off], fake_timer)  # the kernel is the faster at M <= 4
    choice.adopt(timings)
    assert choice.kernel_wins(good[0].key) and timings[good[0].key]["passed"]
    assert not timings[bad[0].key]["same_argmax"] and not choice.kernel_wins(bad[0].key)
    diff, bound = timings[off[0].key]["max_abs_diff"], timings[off[0].key]["bound"]
    assert diff == pytest.approx(0.5, rel=1e-3) and diff > bound and not choice.kernel_wins(off[0].key)
    assert not choice.kernel_wins("qmm 32x64 4b g32 float32 M5")  # never checked
    assert bound == pytest.approx(choice.TOLERANCE["float32"] * float(mx.abs(off[1].run()).max()))
