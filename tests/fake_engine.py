"""A scripted stand-in for `dflash_mlx` (load / load_draft / make_prompt_cache /
stream_generate), so the chat app's real worker-thread `Engine` can be tested fast and
deterministically.

A scripted reply is a string whose blocks are separated by "|": every token of a block
but the last counts as an accepted drafted token, the last one as the target's own.
"""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace

from app.chat.engine import Engine
from dflash_mlx.options import DecodeOptions
from dflash_mlx.speculative import GenerationResponse
from dflash_mlx.stats import GenerationStats


class FakeTokenizer:
    chat_template = "<role>content</role>"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return [ord(c) for c in text + ("<assistant>" if add_generation_prompt else "")]


class FakeDraft:
    """A drafter as the app sees one: its config's block size B."""

    config = SimpleNamespace(block_size=8)


class FakeCache:
    def __init__(self, draft):
        self.draft = draft
        self.tokens: list[int] = []


def blocks_of(script: str) -> list[list[str]]:
    return [re.findall(r"\s*\S+\s*|\s+", block) for block in script.split("|")]


class FakeBackend:
    """Scripted replies with fixed numbers; records the thread and arguments of each call.

    Args:
        replies: scripted replies, used in turn (the last one repeats).
        load_error / draft_error / generate_error: exceptions to raise.
        gate: if given, every token after the first `free_tokens` waits for it to be set.
        load_gate: if given, loading a target waits for it to be set.
        prefill_gate: if given, every prefill waits for it to be set (halfway: a long prompt).
    """

    def __init__(
        self,
        replies=("Hello| there!",),
        *,
        load_error=None,
        draft_error=None,
        generate_error=None,
        gate=None,
        free_tokens=1,
        load_gate=None,
        prefill_gate=None,
    ):
        self.replies = list(replies)
        self.load_error = load_error
        self.draft_error = draft_error
        self.generate_error = generate_error
        self.gate = gate
        self.free_tokens = free_tokens
        self.load_gate = load_gate
        self.prefill_gate = prefill_gate
        self.threads: set[int] = set()
        self.calls: list[dict] = []  # stream_generate keyword arguments (+ prefilled)
        self.drafters: list[tuple] = []  # (path_or_repo, draft_vocab) of each load_draft
        self.caches: list[FakeCache] = []
        self.waiting = threading.Event()  # set while a token waits for the gate

    def _touch(self):
        self.threads.add(threading.get_ident())

    def load(self, path_or_repo=None):
        self._touch()
        if self.load_gate is not None:
            self.load_gate.wait(10)
        if self.load_error:
            raise self.load_error
        return "fake-model", FakeTokenizer()

    def load_draft(self, path_or_repo=None, model=None, draft_vocab=None):
        self._touch()
        self.drafters.append((path_or_repo, draft_vocab))
        if self.draft_error:
            raise self.draft_error
        return FakeDraft()

    def make_prompt_cache(self, model, draft=None):
        self._touch()
        cache = FakeCache(draft)
        self.caches.append(cache)
        return cache

    def _hold(self, gate) -> None:
        """Wait at `gate` (if any) until the test opens it, showing that we wait."""
        if gate is not None:
            self.waiting.set()
            gate.wait(10)
            self.waiting.clear()

    def stream_generate(
        self,
        model,
        tokenizer,
        prompt,
        draft_model=None,
        options=None,
        *,
        max_tokens=256,
        stop=(),
        prompt_cache=None,
        prompt_progress_callback=None,
    ):
        self._touch()
        options = options or DecodeOptions()
        block_size = options.block_size
        common = 0
        for a, b in zip(prompt_cache.tokens, prompt):
            if a != b:
                break
            common += 1
        prefilled = len(prompt) - common
        self.calls.append(
            dict(
                prompt=prompt,
                draft_model=draft_model,
                max_tokens=max_tokens,
                temp=options.temp,
                top_p=options.top_p,
                block_size=block_size,
                kernels=options.kernels,
                prompt_cache=prompt_cache,
                prefilled=prefilled,
            )
        )
        del prompt_cache.tokens[common:]
        if prompt_progress_callback:
            prompt_progress_callback(0, prefilled)
            self._hold(self.prefill_gate)
            prompt_progress_callback(prefilled, prefilled)
        prompt_cache.tokens.extend(prompt[common:])
        if self.generate_error:
            raise self.generate_error
        script = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
        stats = GenerationStats(
            block_size=block_size or FakeDraft.config.block_size, prompt_cached=common, prompt_time=prefilled / 412.0
        )
        blocks = blocks_of(script) if draft_model is not None else [[t] for b in blocks_of(script) for t in b]
        n = 0
        for b, block in enumerate(blocks):
            stats.cycles += 1
            stats.accepted_lengths.append(len(block))
            stats.block_sizes.append(stats.block_size if draft_model is not None else 1)
            stats.trees.append(False)
            if draft_model is not None:
                stats.drafted_tokens += stats.block_size - 1
                stats.accepted_drafted_tokens += len(block) - 1
            for i, piece in enumerate(block):
                if n >= self.free_tokens:
                    self._hold(self.gate)
                n += 1
                prompt_cache.tokens.append(1000 + n)
                last = b == len(blocks) - 1 and i == len(block) - 1
                finish = "stop" if last else "length" if n >= max_tokens else None
                yield GenerationResponse(
                    text=piece,
                    token=1000 + n,
                    logprobs=None,
                    from_draft=draft_model is not None and i < len(block) - 1,
                    prompt_tokens=len(prompt),
                    prompt_tps=412.0 if prefilled else 0.0,
                    generation_tokens=n,
                    generation_tps=84.2,
                    peak_memory=0.61,
                    finish_reason=finish,
                    stats=stats,
                )
                if n >= max_tokens:
                    return


def fake_engine_factory(backend: FakeBackend):
    """An `engine_factory` for ChatApp: the real Engine thread over the fake backend."""
    return lambda on_event: Engine(on_event, backend=backend)
