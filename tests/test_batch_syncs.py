"""Blocking reads of the device per batched cycle (`dflash_mlx/batch.py`, `batch_spec.py`,
`holes.py`): one per drafted cycle (`speculate`) and per plain step (`step`, `cycle`), none
more in a cycle that compacts the holes, and a lazy graph that does not grow from cycle to
cycle.

Counted twice: by `host.watching()` (the engine's one door to the device), and by wrapping
MLX's public blocking calls (`mx.eval`, `array.item`, `array.tolist`, and the conversions
`__array__`, `__bool__`, `__int__`, `__float__`, `__index__`) for the test: the calls made
from `dflash_mlx/host.py` are the counted reads (the calls of one `host.read` count once),
and any other call from the engine's code or from mlx-lm's during a cycle is a stray. The
rows are real (tiny random llama, gated-delta qwen3_5 and sliding-window gpt_oss targets),
drafted by a scripted drafter whose drafts some rows accept and another rejects every
time, so that holes pile up and the batch compacts them; their texts stay their solo texts.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx import host
from dflash_mlx.batch import BatchDecoder
from dflash_mlx.batch_spec import BatchSpeculator
from dflash_mlx.batch_width import BatchWidth
from dflash_mlx.holes import HoleKVCache
from dflash_mlx.sampling import SamplingParams

from host_reads import Calls
from batch_rows import BLOCK, PATTERNS, SAMPLED, join_row, prefill, row_prompt, scripted_drafter
from references import greedy_reference, target_alone
from tiny_targets import tiny_target

#: every draft wrong: the row rejects its whole block each cycle, and its holes pile up
REJECTS = lambda cycle, k: True  # noqa: E731
#: (prompt length, drafter pattern): one row accepts every draft, one none, two in between
ROWS = [(5, PATTERNS[0]), (13, REJECTS), (9, PATTERNS[2]), (1, PATTERNS[3])]


def _one_read(calls: Calls, watch: host.Watch, what: str) -> None:
    assert not calls.strays, f"{what}: blocking calls outside host.py: {calls.strays}"
    assert calls.reads == watch.reads == 1, f"{what}: {calls.reads} reads (host's watch: {watch.reads})"


def _graph_edges(arrays, path: Path) -> int:
    """Edges of the lazy graph behind `arrays` (a tree; 0: every one of them computed, or queued)."""
    mx.export_to_dot(str(path), *[a for _, a in tree_flatten(arrays) if isinstance(a, mx.array)])
    return path.read_text().count("->")


def _speculating(model, samplings):
    """A speculating batch of ROWS, drafted by the scripted drafter; each row's solo text."""
    drafter, solo = scripted_drafter(model), {}
    spec = BatchSpeculator(model, drafter, BatchWidth((1, 3, BLOCK)))
    for k, ((length, pattern), sampling) in enumerate(zip(ROWS, samplings)):
        prompt = row_prompt(length, k)
        uid, draft = join_row(spec, model, drafter, prompt, sampling)
        solo[uid] = target_alone(model, prompt, 60, sampling)
        drafter.watch(draft, prompt + solo[uid], pattern)
    return spec, solo


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_a_drafted_cycle_reads_once_compacting_or_not(calls, family, tmp_path):
    """Ten drafted cycles after a plain step: one read each, also those that compact the
    rejecting row's holes; each cycle's caches and log-probabilities are queued, so no lazy
    graph is left behind them."""
    model = tiny_target(family, scale=2.0)
    spec, solo = _speculating(model, [SamplingParams(), SAMPLED[0], SamplingParams(), SAMPLED[1]])
    got = {c.uid: c.tokens for c in spec.cycle()}  # a plain step: the one-token prompt has no drafter context yet
    kv = next(c for c in spec.cache if isinstance(c, HoleKVCache))
    compactions, edges = 0, []
    for cycle in range(10):
        width = (BLOCK, 3)[cycle % 2]
        holes = kv.holes is not None
        with calls.counting() as watch:
            out = spec.speculate(width)
        _one_read(calls, watch, f"drafted cycle {cycle}")
        compactions += holes and kv.holes is None
        for c in out:
            got[c.uid] += c.tokens
        lps = [lp for c in out for lp in c.logprobs or []]
        edges.append(_graph_edges([c.state for c in spec.cache] + lps, tmp_path / "graph.dot"))
    assert compactions >= 1, "the rejecting row's holes never passed the share: no compaction was counted"
    assert max(edges) == 0, f"the lazy graph after each cycle: {edges} edges"
    for uid, tokens in got.items():
        assert tokens == solo[uid][: len(tokens)], f"{family} row {uid}: not its solo text"


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gpt_oss"])
def test_a_plain_step_reads_once_and_is_queued_ahead(calls, family):
    """Every step reads once, the first of a batch too, and that read is made behind the
    next step (the device has work queued); a row that joins mid-way and one that leaves
    change nothing, and every text is its solo text."""
    model = tiny_target(family, scale=2.0)
    decoder, prompts, got = BatchDecoder(model), {}, {}

    def join(k: int, length: int) -> None:
        cache, prompt = make_prompt_cache(model), row_prompt(length, k)
        list(prefill(model, prompt[:-1], cache))
        uid = decoder.add(cache, prompt[-1], SamplingParams())
        prompts[uid], got[uid] = prompt, []

    for k, length in enumerate((5, 12, 1)):
        join(k, length)
    for step in range(12):
        if step == 4:
            join(3, 9)
        if step == 7:
            decoder.remove(decoder.uids[0])
        with calls.counting() as watch:
            drawn = decoder.step()
        _one_read(calls, watch, f"{family} step {step}")
        assert not watch.gaps, f"step {step}: its read drained the device"
        for uid, token, _ in drawn:
            got[uid].append(token)
    for uid, tokens in got.items():
        assert tokens == greedy_reference(model, prompts[uid], len(tokens)), f"{family} row {uid}"


class Scripted(BatchWidth):
    """A chooser whose widths come from a fixed sequence (cycled)."""

    def __init__(self, sequence):
        super().__init__(sorted(set(sequence)))
        self.sequence = itertools.cycle(sequence)

    def choose(self, records) -> int:
        return next(self.sequence)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_cycles_read_once_whatever_their_width(calls, family):
    """`cycle` as the server runs it, plain steps and drafted blocks in turn: one read a
    cycle, plain steps queued ahead while the next is plain too (its read then leaves the
    device busy)."""
    model = tiny_target(family, scale=2.0)
    spec, solo = _speculating(model, [SamplingParams()] * len(ROWS))
    spec.chooser = Scripted([1, 1, 1, BLOCK, 1, 3, 3, 1, 1])
    got = {c.uid: c.tokens for c in spec.cycle()}  # the one-token prompt's first step: the chooser is not asked
    widths, ahead = [], 0
    for cycle in range(18):
        with calls.counting() as watch:
            out = spec.cycle()
        _one_read(calls, watch, f"{family} cycle {cycle} (width {spec.width})")
        widths.append(spec.width)
        if spec.width == 1 and spec._queued is not None:
            assert not watch.gaps, f"cycle {cycle}: a plain step queued ahead drained the device"
            ahead += 1
        for c in out:
            got[c.uid] += c.tokens
    assert ahead >= 4 and set(widths) == {1, 3, BLOCK}, widths
    for uid, tokens in got.items():
        assert tokens == solo[uid][: len(tokens)], f"{family} row {uid}: not its solo text"
