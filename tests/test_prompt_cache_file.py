"""Prompt cache files (`cache.save_file` / `load_file`, mlx-lm's format plus our metadata):
generating from a loaded prefix gives the same tokens as from the prompt alone, only the
rest is prefilled, and a file for another target or drafter is refused with one line. A
file holds the rows the caches use, not the 256-row steps mlx-lm's KV caches grow by: its
size grows with the tokens saved (issue 44: 2 tokens made 11.8 MB).
"""

from __future__ import annotations

import threading

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import pytest

from dflash_mlx.atomic import atomic_file
from dflash_mlx.cache import PromptCache, cache_ids, load_file, save_file
from dflash_mlx.targets import make_target
from references import dflash_tokens
from tiny_drafters import DECODE, N, prompt_of, random_drafter
from tiny_targets import tiny_target


def test_saved_prefix_gives_the_same_output(tmp_path):
    model = tiny_target("llama", scale=2.0)
    drafter = random_drafter(make_target(model), 3)
    prefix, rest = prompt_of(17, 3), prompt_of(5, 4)
    cache = PromptCache(model, drafter)
    dflash_tokens(model, prefix + [7], drafter, 1, prompt_cache=cache, draft_window=6)
    cache.reuse(prefix + [7], with_drafter=True)  # the prefix only, as cache-prompt leaves it
    path = str(tmp_path / "prefix.safetensors")
    save_file(path, cache, "tiny-llama", "tiny-drafter")
    loaded = load_file(path, model, drafter, "tiny-llama", "tiny-drafter")
    assert loaded.tokens == prefix
    assert all(c.keys.shape[2] == len(prefix) for c in loaded.target)  # the used rows, loaded as a working cache
    want, _ = dflash_tokens(model, prefix + rest, drafter, N, **DECODE)
    got, stats = dflash_tokens(model, prefix + rest, drafter, N, prompt_cache=loaded, **DECODE)
    assert got == want and stats.prompt_cached == len(prefix)
    with pytest.raises(ValueError, match="saved for model 'tiny-llama', not 'other'"):
        load_file(path, model, drafter, "other", "tiny-drafter")
    with pytest.raises(ValueError, match="saved for draft"):
        load_file(path, model, drafter, "tiny-llama", "other")
    (tmp_path / "junk.safetensors").write_text("junk")
    with pytest.raises(ValueError, match="not a prompt cache file"):
        load_file(str(tmp_path / "junk.safetensors"), model, drafter, "tiny-llama", "tiny-drafter")


def test_a_failed_write_leaves_the_old_file(tmp_path):
    """`save_file` (`dflash cache-prompt`) writes through `atomic_file`: a write that fails
    halfway (a full disk) leaves the file there was, and nothing beside it."""
    path = tmp_path / "prefix.safetensors"
    path.write_text("the old prefix")
    with pytest.raises(OSError, match="No space"):
        with atomic_file(path) as tmp:
            assert tmp.parent == tmp_path and tmp.suffix == ".safetensors"  # mlx's save adds none
            tmp.write_text("half of a new")
            raise OSError("No space left on device")
    assert path.read_text() == "the old prefix" and [p.name for p in tmp_path.iterdir()] == [path.name]
    model = tiny_target("llama", scale=2.0)
    drafter = random_drafter(make_target(model), 3)
    cache = PromptCache(model, drafter)
    dflash_tokens(model, prompt_of(5, 3) + [7], drafter, 1, prompt_cache=cache)
    save_file(str(path), cache, "tiny-llama", "tiny-drafter")
    assert load_file(str(path), model, drafter, "tiny-llama", "tiny-drafter").tokens == cache.tokens
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def _saved(tmp_path, model, drafter, n: int) -> tuple[int, PromptCache]:
    """The size of the file of an n-token prefix, and the cache saved."""
    prefix = prompt_of(n, 3)
    cache = PromptCache(model, drafter)
    dflash_tokens(model, prefix + [7], drafter, 1, prompt_cache=cache)
    cache.reuse(prefix + [7], with_drafter=True)
    path = tmp_path / f"{n}.safetensors"
    save_file(str(path), cache, "tiny-llama", "tiny-drafter")
    return path.stat().st_size, cache


def test_a_file_holds_the_used_rows(tmp_path):
    model = tiny_target("llama", scale=2.0)
    drafter = random_drafter(make_target(model), 3)
    small, cache = _saved(tmp_path, model, drafter, 4)
    large, _ = _saved(tmp_path, model, drafter, 68)
    per_token = (large - small) / 64
    buffers = sum(c.keys.nbytes + c.values.nbytes for c in cache.target)  # 256 rows a layer
    assert cache.target[0].keys.shape[2] == 256 and small < buffers / 4, (small, buffers)
    assert small < 4 * per_token + 4096, (small, per_token)  # the rest: names, shapes, metadata


def _saved_prefix(tmp_path, model, drafter, prefix: list[int]) -> str:
    """`prefix` prefilled and saved as `dflash cache-prompt` saves it (for the default pair,
    or for the target alone where `drafter` is None); the file's path."""
    cache = PromptCache(model, drafter)
    dflash_tokens(model, prefix + prefix[-1:], drafter, 1, prompt_cache=cache)
    cache.reuse(prefix + prefix[-1:], with_drafter=drafter is not None)
    path = str(tmp_path / "prefix.safetensors")
    save_file(path, cache, *cache_ids(None, None, no_draft=drafter is None))
    return path


def _greedy_chat_turn(path: str) -> tuple[list, list[dict]]:
    """One greedy turn of N tokens through the chat's engine started with the prompt cache
    file `path`: the events it sent, and the turn's messages."""
    from app.chat.engine import Engine, Finished, Settings
    from dflash_mlx.options import DecodeOptions

    events, finished = [], threading.Event()
    engine = Engine(lambda e: (events.append(e), isinstance(e, Finished) and finished.set()), prompt_cache_file=path)
    engine.start()
    engine.load()
    messages = [{"role": "user", "content": "When does the shop open?"}]
    engine.generate(messages, Settings(DecodeOptions(temp=0.0), max_tokens=N))
    assert finished.wait(120)
    engine.shutdown()
    return events, messages


def test_chat_starts_after_a_saved_prompt_cache(tmp_path, default_model_dir):
    """`dflash-chat --prompt-cache-file`: the engine loads the file, the conversation
    follows its tokens (none of them prefilled again) and the reply is the one a fresh
    prefill of prefix + conversation gives; a file for another model is refused in one line."""
    from app.chat.main import main
    from app.chat.engine import Finished, Loaded, Token
    from dflash_mlx import load, load_draft, stream_generate
    from dflash_mlx.messages import apply_chat_template

    model, tokenizer = load(None)
    drafter = load_draft(None, model=model)
    prefix = tokenizer.encode("Notes: the shop opens at nine and closes at five. " * 6)
    path = _saved_prefix(tmp_path, model, drafter, prefix)

    events, messages = _greedy_chat_turn(path)
    [loaded] = [e for e in events if isinstance(e, Loaded)]
    [done] = [e for e in events if isinstance(e, Finished)]
    assert loaded.prefix == len(prefix) and done.stats.prompt_cached == len(prefix)
    prompt = prefix + apply_chat_template(tokenizer, messages)
    want = "".join(r.text for r in stream_generate(model, tokenizer, prompt, drafter, max_tokens=N))
    assert "".join(e.text for e in events if isinstance(e, Token)) == want
    with pytest.raises(SystemExit, match="saved for model 'default', not 'other'"):
        main(["--prompt-cache-file", path, "--model", "other"])


def test_a_load_the_file_does_not_fit_leaves_it_for_the_next(tmp_path, default_model_dir):
    """dflash-chat --prompt-cache-file: a `/load` of a pair the file was not saved for starts
    from nothing (a note), and a later `/load` of the pair it was saved for uses it again."""
    from app.chat.engine import Engine, Loaded
    from app.model_thread import Failed
    from dflash_mlx import load, load_draft

    model, tokenizer = load(None)
    drafter = load_draft(None, model=model)
    prefix = tokenizer.encode("Notes: the shop opens at nine.")
    path = _saved_prefix(tmp_path, model, drafter, prefix)

    events, done = [], threading.Semaphore(0)
    engine = Engine(lambda e: (events.append(e), isinstance(e, Loaded) and done.release()), prompt_cache_file=path)
    engine.start()
    engine.load(str(default_model_dir))  # saved for "default", not for this name: not used
    engine.load()
    assert done.acquire(timeout=120) and done.acquire(timeout=120)
    engine.shutdown()
    assert [e.prefix for e in events if isinstance(e, Loaded)] == [0, len(prefix)]
    [note] = [e.message for e in events if isinstance(e, Failed)]
    assert "Prompt cache not used" in note and "saved for model 'default'" in note


def test_chat_uses_a_prompt_cache_saved_without_a_drafter(tmp_path, default_model_dir):
    """A file from `dflash cache-prompt --no-draft` (the target's cache alone) starts the
    chat's conversations too, with its drafter: the drafter's context starts empty, so the
    first DFlash turn prefills the prefix for it, and the reply is the one a fresh prefill gives."""
    from app.chat.main import app_from_args, check_prompt_cache
    from app.chat.engine import Loaded, Token
    from dflash_mlx import load, load_draft, stream_generate
    from dflash_mlx.messages import apply_chat_template

    model, tokenizer = load(None)
    prefix = tokenizer.encode("Notes: the shop opens at nine and closes at five.")
    path = _saved_prefix(tmp_path, model, None, prefix)
    check_prompt_cache(app_from_args(["--prompt-cache-file", path]))  # not refused

    events, messages = _greedy_chat_turn(path)
    [loaded] = [e for e in events if isinstance(e, Loaded)]
    assert loaded.prefix == len(prefix) and loaded.draft is not None
    prompt = prefix + apply_chat_template(tokenizer, messages)
    drafter = load_draft(None, model=model)
    want = "".join(r.text for r in stream_generate(model, tokenizer, prompt, drafter, max_tokens=N))
    assert "".join(e.text for e in events if isinstance(e, Token)) == want
