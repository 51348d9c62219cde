"""top_k_columns finds what one argpartition over the whole row finds: the same k values in
every row, at distinct columns holding them, for any vocabulary size, dtype and rank."""

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx.topk import BLOCK, top_k_columns


def _check(x: mx.array, k: int) -> None:
    got = top_k_columns(x, k)
    want = mx.argpartition(-x, k - 1, axis=-1)[..., :k]
    assert got.shape == want.shape
    rows, cols = np.array(x.astype(mx.float32)).reshape(-1, x.shape[-1]), np.array(got).reshape(-1, k)
    assert ((cols >= 0) & (cols < x.shape[-1])).all()
    assert all(len(set(r)) == k for r in cols.tolist())  # distinct columns
    values = np.sort(np.take_along_axis(rows, cols, axis=-1), axis=-1)
    expected = np.sort(np.take_along_axis(rows, np.array(want).reshape(-1, k), axis=-1), axis=-1)
    np.testing.assert_array_equal(values, expected)


@pytest.mark.parametrize("vocab", [49152, 4096, 10_000, 4 * 8 * BLOCK, 300])
@pytest.mark.parametrize("k", [1, 5, 8, 16])
def test_the_k_largest_values_of_every_row(vocab, k):
    rng = np.random.default_rng(vocab + k)
    _check(mx.array(rng.standard_normal((3, 7, vocab)).astype(np.float32)), k)


def test_largest_values_crowded_in_one_block_and_in_the_ragged_tail():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 10_000)).astype(np.float32)
    x[0, 128:136] += 10  # all in one block: the first partition must not stop at one per block
    x[1, 9_990:] += 10  # in the columns after the last whole block
    x[2, ::BLOCK] += 10  # one in each of many blocks
    _check(mx.array(x), 8)


def test_ties_and_masked_columns():
    """Rounded values tie often; a draft vocabulary leaves most columns at -inf, fewer
    finite than k in the last row (the tree puts those -inf candidates last)."""
    rng = np.random.default_rng(1)
    x = np.round(rng.standard_normal((3, 49152)), 1).astype(np.float32)
    x[1:, :] = -np.inf
    x[1, rng.choice(49152, 4096, replace=False)] = rng.standard_normal(4096)
    x[2, [7, 70_00, 40_000]] = [1.0, 2.0, 3.0]
    _check(mx.array(x), 8)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_and_a_single_row(dtype):
    rng = np.random.default_rng(2)
    _check(mx.array(rng.standard_normal((2, 49152))).astype(dtype), 8)
    _check(mx.array(rng.standard_normal(49152).astype(np.float32)), 5)  # (V,): the server's logprobs
