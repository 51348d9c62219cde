"""The drafter's context window (`draft_window`, `draft_sink`): `ContextCache` keeps the
first tokens and the latest ones at their own positions, bounded whatever the context;
it changes drafts, never output (greedy equals mlx-lm's with a 3-token window); and a
drafter with sliding-window layers drafts exactly as before when the cache's window
covers its attention window (the mask reads the kept tokens' real positions). A narrow
window does not stick to a sequence: a later turn with a wider one drafts from the whole
context it keeps (what the narrow turn dropped is prefilled again, from its sink on).
"""

from __future__ import annotations


import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import pytest

from dflash_mlx import make_prompt_cache
from dflash_mlx.context_cache import ContextCache
from dflash_mlx.options import DRAFT_WINDOW, DecodeOptions, OptionError
from dflash_mlx.targets import make_target
from references import dflash_tokens, greedy_reference
from tiny_drafters import MASK, prompt_of, random_drafter
from tiny_targets import HIDDEN, tiny_target


def test_context_cache_keeps_sink_and_window():
    full = mx.random.normal((1, 2, 20, 4))
    c = ContextCache(window=5, sink=2)
    for a, b in [(0, 1), (1, 9), (9, 10), (10, 20)]:
        c.update_and_fetch(full[..., a:b, :], -full[..., a:b, :])
    assert c.offset == 20 and c.stored == 7
    kept = [0, 1, 15, 16, 17, 18, 19]
    assert c.positions().tolist() == kept
    assert mx.array_equal(c.keys, full[..., mx.array(kept), :]) and mx.array_equal(c.values, -c.keys)
    c.trim(3)
    assert c.offset == 17 and c.positions().tolist() == [0, 1, 15, 16]
    c.update_and_fetch(full[..., 17:18, :], full[..., 17:18, :])
    assert c.positions().tolist() == [0, 1, 15, 16, 17]
    c.trim(17)
    assert c.offset == 1 and c.positions().tolist() == [0] and c.stored == 1


def _proposals(drafter, target, window, sink, context: int = 24) -> mx.array:
    cache = drafter.make_cache(window, sink)
    mx.random.seed(4)
    for n in (10, 1, 5, 8):  # context in several appends, as the loop adds it
        drafter.append_context(mx.random.normal((1, n, 2 * HIDDEN)), cache)
    return drafter.propose(mx.array([[1] + [MASK] * 7]), cache, target)


def test_window_changes_drafts_but_not_a_covering_sliding_window():
    target = make_target(tiny_target("llama"))
    full = random_drafter(target, 3)
    assert not mx.allclose(_proposals(full, target, 4, 1), _proposals(full, target, None, 0), atol=1e-4)
    sliding = random_drafter(target, 3, layer_types=["sliding_attention"], sliding_window=4)
    assert mx.allclose(_proposals(sliding, target, 6, 0), _proposals(sliding, target, None, 0), atol=1e-5)


@pytest.mark.parametrize("window, sink", [(3, 1), (1, 0), (0, 0)])
def test_greedy_with_a_window_is_mlx_lm_greedy(window, sink):
    model = tiny_target("llama", scale=2.0)
    target = make_target(model)
    prompt, n = prompt_of(21, 2), 28
    ref = greedy_reference(model, prompt, n)
    tokens, stats = dflash_tokens(
        model, prompt, random_drafter(target, 3), n, block_size=4, draft_window=window, draft_sink=sink
    )
    assert tokens == ref
    kept = len(prompt) + n if window == 0 else window + sink
    assert 0 < stats.draft_cache_tokens <= kept and stats.draft_cache_bytes > 0


def test_default_window():
    target = make_target(tiny_target("llama"))
    assert DecodeOptions().window(random_drafter(target, 3)) == DRAFT_WINDOW
    assert DecodeOptions(draft_window=0).window(random_drafter(target, 3)) is None
    own = random_drafter(target, 3, layer_types=["sliding_attention"], sliding_window=64)
    assert DecodeOptions().window(own) == 64
    with pytest.raises(OptionError, match="draft_window"):
        DecodeOptions(draft_window=-1)


def test_a_narrow_window_does_not_stick_to_the_sequence():
    model = tiny_target("llama", scale=2.0)
    drafter = random_drafter(make_target(model), 3)
    prompt = prompt_of(21, 2)
    sequence = make_prompt_cache(model, drafter)
    narrow = dict(draft_window=2, draft_sink=2)
    first, _ = dflash_tokens(model, prompt, drafter, 8, prompt_cache=sequence, block_size=4, **narrow)
    assert sequence.cache.draft[0].stored < sequence.cache.draft_length  # the narrow turn dropped context
    follow = prompt + first + prompt_of(4, 5)
    got, stats = dflash_tokens(model, follow, drafter, 8, prompt_cache=sequence, block_size=4)
    assert got == greedy_reference(model, follow, 8)
    sequence.cache.flush()
    assert sequence.cache.draft[0].stored == sequence.cache.draft_length  # every token, as a fresh run keeps
    assert stats.prompt_cached == 2  # the narrow turn's sink (draft_sink=2): kept
