"""Prompt cache files (`cache.save_file` / `load_file`, mlx-lm's format plus our metadata):
generating from a loaded prefix gives the same tokens as from the prompt alone, only the
rest is prefilled, and a file for another target or drafter is refused with one line.
"""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import pytest

from dflash_mlx.cache import PromptCache, load_file, save_file
from dflash_mlx.speculative import GenerationStats, generate_step
from dflash_mlx.targets import make_target
from test_draft_window import _drafter
from test_targets import prompt_of
from tiny_targets import tiny_target

N = 20


def _run(prompt, model, drafter, cache=None) -> tuple[list[int], GenerationStats]:
    tokens, stats = [], GenerationStats()
    for committed, _, _ in generate_step(
        prompt, model, drafter, max_tokens=N, block_size=4, prompt_cache=cache, stats=stats, draft_window=6
    ):
        tokens += committed
        if len(tokens) >= N:
            return tokens[:N], stats


def test_saved_prefix_gives_the_same_output(tmp_path):
    model = tiny_target("llama", scale=2.0)
    drafter = _drafter(make_target(model))
    prefix, rest = prompt_of(17, 3), prompt_of(5, 4)
    cache = PromptCache(model, drafter)
    list(zip(range(1), generate_step(prefix + [7], model, drafter, max_tokens=1, prompt_cache=cache, draft_window=6)))
    cache.reuse(prefix + [7], with_drafter=True)  # the prefix only, as cache-prompt leaves it
    path = str(tmp_path / "prefix.safetensors")
    save_file(path, cache, "tiny-llama", "tiny-drafter")
    loaded = load_file(path, model, drafter, "tiny-llama", "tiny-drafter")
    assert loaded.tokens == prefix
    want, _ = _run(prefix + rest, model, drafter)
    got, stats = _run(prefix + rest, model, drafter, loaded)
    assert got == want and stats.prompt_cached == len(prefix)
    with pytest.raises(ValueError, match="saved for model 'tiny-llama', not 'other'"):
        load_file(path, model, drafter, "other", "tiny-drafter")
    with pytest.raises(ValueError, match="saved for draft"):
        load_file(path, model, drafter, "tiny-llama", "other")
    (tmp_path / "junk.safetensors").write_text("junk")
    with pytest.raises(ValueError, match="not a prompt cache file"):
        load_file(str(tmp_path / "junk.safetensors"), model, drafter, "tiny-llama", "tiny-drafter")
