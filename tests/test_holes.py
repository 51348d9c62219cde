"""The hole-keeping batch KV cache (`dflash_mlx/holes.py`): a row's rejected slots stay as
masked holes, its RoPE offset goes back, and every later query sees the row's tokens alone.

Checked on the cache itself (offsets, the mask, `extract` dropping the holes, `trim`,
`filter`, `extend`, `compact`) and through a tiny random llama: each row's logits after
holes equal the logits of that row's kept tokens fed alone, float32.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from dflash_mlx import host
from dflash_mlx.holes import COMPACT_SHARE, HoleKVCache

from tiny_targets import VOCAB, tiny_target

HEADS, DIM = 2, 4


def _kv(n: int, rows: int = 1) -> tuple[mx.array, mx.array]:
    """Random keys and values (rows, HEADS, n, DIM)."""
    return mx.random.normal((rows, HEADS, n, DIM)), mx.random.normal((rows, HEADS, n, DIM))


def _solo(keys: mx.array, values: mx.array) -> KVCache:
    c = KVCache()
    c.update_and_fetch(keys, values)
    return c


def _two_rows() -> tuple[HoleKVCache, list[list[mx.array]]]:
    """A batch of rows holding 3 and 5 tokens, fed a block of 4 whose last 0 and 2 are
    rejected; with each row's kept keys and values (1, HEADS, n, DIM) in order."""
    mx.random.seed(0)
    rows = [_kv(3), _kv(5)]
    batch = HoleKVCache.merge([_solo(*rows[0]), _solo(*rows[1])])
    block = _kv(4, rows=2)
    batch.update_and_fetch(*block)
    batch.punch([0, 2])
    kept = [
        [mx.concatenate([rows[0][j], block[j][0:1]], axis=2) for j in range(2)],
        [mx.concatenate([rows[1][j], block[j][1:2, :, :2]], axis=2) for j in range(2)],
    ]
    return batch, kept


def _assert_host_copies(batch: HoleKVCache) -> None:
    """The host's copies of the holes and the left padding are the device's, slot for slot."""
    holes = batch._holes(batch._idx).tolist()
    known = [[any(s <= j < e for s, e in runs) for j in range(batch._idx)] for runs in batch.runs]
    assert known == holes and batch.hole_counts() == [sum(row) for row in holes]
    assert batch.pads == batch.left_padding.tolist()


def _assert_rows(batch: HoleKVCache, kept: list[list[mx.array]]) -> None:
    _assert_host_copies(batch)
    for i, (keys, values) in enumerate(kept):
        row = batch.extract(i)
        assert row.offset == keys.shape[2] == batch.offset[i].item()
        assert mx.array_equal(row.keys[..., : row.offset, :], keys)
        assert mx.array_equal(row.values[..., : row.offset, :], values)


def test_punch_moves_offsets_back_and_masks_the_holes():
    batch, kept = _two_rows()
    assert batch._idx == 9 and batch.offset.tolist() == [7, 7] and batch.left_padding.tolist() == [2, 0]
    mask = batch.make_mask(2)  # (B, 1, 2, 11)
    visible = [[True] * 9 + [True, False], [True] * 7 + [False, False] + [True, False]]
    visible[0][:2] = [False, False]  # left padding
    assert mask[:, 0, 0].tolist() == visible
    _assert_rows(batch, kept)


def test_new_tokens_follow_the_holes_and_extract_drops_them():
    batch, kept = _two_rows()
    step = _kv(1, rows=2)
    batch.update_and_fetch(*step)
    for i in range(2):
        kept[i] = [mx.concatenate([kept[i][j], step[j][i : i + 1]], axis=2) for j in range(2)]
    assert batch.offset.tolist() == [8, 8]
    _assert_rows(batch, kept)
    batch.compact()
    assert batch._idx == 8 and batch.holes is None and batch.left_padding.tolist() == [0, 0]
    _assert_rows(batch, kept)


def test_a_state_set_on_another_cache_keeps_its_holes():
    batch, kept = _two_rows()
    other = HoleKVCache([0])
    other.state = batch.state
    _assert_rows(other, kept)
    other.punch([1, 0])
    kept[0] = [a[..., :-1, :] for a in kept[0]]
    _assert_rows(other, kept)


def test_trim_counts_only_tokens_and_filter_extend_keep_the_holes():
    batch, kept = _two_rows()
    assert batch.trim(3) == 3  # row 0 loses 3 tokens, row 1 one token and its 2 holes
    assert batch.offset.tolist() == [4, 6] and batch.holes.shape[1] == 6
    kept = [[a[..., :4, :] for a in kept[0]], [a[..., :6, :] for a in kept[1]]]
    _assert_rows(batch, kept)
    block = _kv(2, rows=2)
    batch.update_and_fetch(*block)
    batch.punch([2, 0])  # row 0 rejects both
    kept[1] = [mx.concatenate([kept[1][j], block[j][1:2]], axis=2) for j in range(2)]
    _assert_rows(batch, kept)
    joining = _kv(12)
    batch.extend(HoleKVCache.merge([_solo(*joining)]))  # a longer row: the others shift right
    assert batch._idx == 12 and batch.holes.shape == (3, 12) and batch.left_padding.tolist() == [6, 4, 0]
    _assert_rows(batch, [*kept, joining])
    batch.filter([1, 2])
    _assert_rows(batch, [kept[1], joining])
    batch.filter([0])  # the row with holes goes: mlx-lm shifts the batch left by its padding
    assert batch._idx == 8 and batch.holes.shape == (1, 8)
    _assert_rows(batch, [kept[1]])


def test_a_hole_heavy_batch_compacts_itself():
    batch, kept = _two_rows()
    batch.punch([0, 5])  # row 1: 3 more tokens go, over its 2 holes; 5 of 9 slots are holes
    assert batch.holes is None and batch._idx == 7 and batch.left_padding.tolist() == [0, 3]
    _assert_rows(batch, [kept[0], [a[..., :4, :] for a in kept[1]]])


def test_compaction_comes_exactly_when_a_row_passes_the_share():
    """Row 0 rejects 3 of each block of 4, row 1 rejects 1 of each 4 then none: the batch
    compacts in the very cycle where a row's holes pass `COMPACT_SHARE` of the slots, never
    before; the host knows the counts (nothing is read back from the device), and every
    row's tokens stay exactly right throughout."""
    mx.random.seed(1)
    rows = [_kv(3), _kv(3)]
    batch = HoleKVCache.merge([_solo(*rows[0]), _solo(*rows[1])])
    kept = [list(r) for r in rows]
    compactions = 0
    for cycle in range(12):
        block = _kv(4, rows=2)
        batch.update_and_fetch(*block)
        rejected = [3, 1 if cycle < 4 else 0]
        counts = [c + r for c, r in zip(batch.hole_counts(), rejected)]
        passes = max(counts) > COMPACT_SHARE * batch._idx
        with host.watching() as watch:
            batch.punch(rejected)
        assert watch.reads == 0
        assert (batch.holes is None) == passes and batch.hole_counts() == ([0, 0] if passes else counts)
        compactions += passes
        for i, r in enumerate(rejected):
            kept[i] = [mx.concatenate([kept[i][j], block[j][i : i + 1, :, : 4 - r]], axis=2) for j in range(2)]
        _assert_rows(batch, kept)
    assert compactions >= 2 and batch.offset.tolist() == [3 + 12, 3 + 12 * 4 - 4]


def test_bad_counts_name_the_batch():
    batch, _ = _two_rows()
    with pytest.raises(ValueError, match="counts"):
        batch.punch([1])


def test_a_model_sees_each_row_as_its_kept_tokens_alone():
    model = tiny_target("llama")
    prompts = [[3, 9, 27, 81], [5, 25, 125, 7, 35, 175]]
    block = [[11, 12, 13, 14], [21, 22, 23, 24]]
    keep = [4, 1]  # row 0 keeps its whole block, row 1 its first token
    solo = []
    for p in prompts:
        c = make_prompt_cache(model)
        model(mx.array([p]), cache=c)
        solo.append(c)
    cache = [HoleKVCache.merge([s[j] for s in solo]) for j in range(len(solo[0]))]
    model(mx.array(block), cache=cache)
    for c in cache:
        c.punch([len(block[0]) - k for k in keep])
    after = [[31], [41]]
    logits = model(mx.array(after), cache=cache)[:, -1]  # (B, V)
    for i, (p, b, k, a) in enumerate(zip(prompts, block, keep, after)):
        alone = model(mx.array([p + b[:k] + a]))[0, -1]  # (V,)
        assert logits.shape[1] == VOCAB
        assert mx.allclose(logits[i], alone, atol=1e-4), f"row {i}"
        assert mx.argmax(logits[i]).item() == mx.argmax(alone).item()


def test_empty_rows_merge_into_a_hole_cache():
    """One-token prompts: nothing fed yet, still a hole cache (mlx-lm's merge gives a plain one)."""
    batch = HoleKVCache.merge([KVCache(), KVCache()])
    assert type(batch) is HoleKVCache and batch.offset.tolist() == [0, 0]
