"""Hot prefixes: a prompt that shares a long prefix (an agent's system prompt and tools)
with what a prompt cache holds prefills only the rest, and decodes exactly what a fresh
prefill would. A hybrid target (gated-delta layers, which cannot forget tokens) goes back
to a snapshot at a prefix boundary instead (`PromptCache.marks`): the second request
that shares the prefix prefills from zero and snapshots it, the third restores that."""

from __future__ import annotations

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import pytest

from app.server.worker import HOT_PREFIX, CachePool, Worker
from dflash_mlx.cache import MARKS, PromptCache
from dflash_mlx.cycles import PREFILL_STEP
from dflash_mlx.targets import make_target
from references import dflash_tokens
from references import mlx_lm_greedy
from server_helpers import CHAT
from tiny_drafters import DECODE, N, prompt_of, random_drafter
from tiny_targets import tiny_target

SYSTEM = prompt_of(40, 1)  # the shared prefix


@pytest.mark.parametrize("family", ["qwen3_5", "llama"])
def test_a_shared_prefix_is_reused_and_lossless(family):
    model = tiny_target(family, scale=2.0)
    drafter = random_drafter(make_target(model), 3)
    cache = PromptCache(model, drafter)
    hybrid = family == "qwen3_5"
    cached = []
    for seed in (2, 3, 4):
        prompt = SYSTEM + prompt_of(6, seed)
        want, _ = dflash_tokens(model, prompt, drafter, N, **DECODE)
        got, stats = dflash_tokens(model, prompt, drafter, N, prompt_cache=cache, **DECODE)
        assert got == want
        cached.append(stats.prompt_cached)
    if hybrid:  # 2nd: nothing to go back to, but the shared prefix is snapshotted on the way
        assert cached[1] == 0 and cached[2] >= len(SYSTEM)
        assert len(SYSTEM) <= min(m.length for m in cache.marks) and len(cache.marks) <= MARKS
    else:
        assert cached[1] >= len(SYSTEM) and cached[2] >= len(SYSTEM)


def test_the_pool_gives_a_hot_prefix_its_cache_while_there_is_room():
    class Cache:
        def __init__(self):
            self.tokens = []

    pool = CachePool(Cache, size=4, hot=3)
    a = pool.take([1, 2, 3, 4])
    a.tokens = [1, 2, 3, 4, 5]
    assert pool.take([1, 2, 9]) is not a  # 2 shared tokens: not hot, a fresh cache
    assert pool.take([1, 2, 3, 8]) is a  # 3 shared: a's cache, trimmed there by the loop


def test_the_pool_takes_the_least_recently_used_of_equal_prefixes():
    class Cache:
        def __init__(self):
            self.tokens = []

    pool = CachePool(Cache, size=3, hot=3)
    caches = []
    for n in (10, 20, 30):  # three conversations after one system prompt, the latest last
        caches.append(pool.take([n]))
        caches[-1].tokens = [1, 2, 3, n]
    assert pool.take([1, 2, 3, 40]) is caches[0]  # the oldest gives way, not the one that just ran
    assert pool.take([1, 2, 3, 20, 5]) is caches[1]  # a conversation's next turn still takes its own


def test_a_long_prompt_logs_its_prefill_progress():
    lines = []
    progress = Worker(log=lines.append).prefill_progress()
    progress(100, 100)  # one chunk: quiet
    progress(PREFILL_STEP, PREFILL_STEP + 5)
    assert lines == [lines[0]] and lines[0].startswith(f"prefill {PREFILL_STEP}/{PREFILL_STEP + 5} prompt tokens")


@pytest.mark.slow
def test_an_agents_system_prompt_is_prefilled_once(client, default_model):  # noqa: F811 (the fixture)
    """Requests with the same long system prompt and other questions: the later ones
    prefill only their question, and answer exactly as mlx-lm does from scratch."""
    _, tokenizer = default_model
    system = {"role": "system", "content": " ".join(f"Rule {i}: answer briefly and politely." for i in range(40))}
    assert len(tokenizer.encode(system["content"])) > 2 * HOT_PREFIX
    for n, question in enumerate(["Name a fruit.", "Name a city."]):
        messages = [system, {"role": "user", "content": question}]
        body = client.post(CHAT, json={"messages": messages, "max_tokens": 12, "temperature": 0}).json()
        want, _ = mlx_lm_greedy(default_model, tokenizer.apply_chat_template(messages, add_generation_prompt=True), 12)
        assert body["choices"][0]["message"]["content"] == want
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert (cached > 2 * HOT_PREFIX) if n else cached == 0
