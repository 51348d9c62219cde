"""Pilot tests of the chat's input and commands (issue 44) over the scripted fake backend,
and of the words its `/stats` and `dflash generate` use for what the cycles verified."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeBackend  # noqa: E402
from test_app import REPLY, answered, make_app, notes, run_async, say, until  # noqa: E402

from app.chat.engine import Settings  # noqa: E402
from app.chat.session import shape  # noqa: E402
from dflash_mlx import DecodeOptions  # noqa: E402
from dflash_mlx import format_stats  # noqa: E402
from dflash_mlx.speculative import GenerationResponse  # noqa: E402
from dflash_mlx.stats import GenerationStats  # noqa: E402


def _response(stats: GenerationStats) -> GenerationResponse:
    return GenerationResponse(
        text="",
        token=0,
        logprobs=None,
        from_draft=False,
        prompt_tokens=10,
        prompt_tps=100.0,
        generation_tokens=60,
        generation_tps=20.0,
        peak_memory=0.5,
        finish_reason="stop",
        stats=stats,
    )


def test_stats_tell_chains_from_trees():
    """Trees are not block sizes: a drafter of B=8 never shows a block of 17 (issue 44)."""
    stats = GenerationStats(block_size=8, adaptive=True)
    for _ in range(52):
        stats.record(8, 5)
    stats.record(17, 3, tree=True)
    stats.record(8, 7, guessed=True)
    text = format_stats(_response(stats))
    assert "Block size of the chains (adaptive, 1..8): histogram [0, 0, 0, 0, 0, 0, 0, 53]" in text
    assert "Widths: chain 8: 53, tree 16: 1" in text
    assert "in 1 chain\n" in text + "\n" and "chains verified its guess" not in text
    words = [shape(width, n) for width, n in stats.widths.items()]
    assert words == ["53 chains of 8 tokens", "1 tree of 16 nodes"]
    assert shape("plain", 2) == "2 plain steps"


@run_async
async def test_stats_command_names_the_cycles():
    app = make_app(FakeBackend([REPLY]))
    async with app.run_test() as pilot:
        await answered(pilot, "hi")
        await say(pilot, "/stats")
        await until(pilot, lambda: "Session:" in notes(app)[-1])
        assert "Cycles verified: 4 chains of 8 tokens" in notes(app)[-1]
        assert "Block sizes chosen" not in notes(app)[-1]


@run_async
async def test_baseline_offers_no_draft_colouring():
    app = make_app()
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.state == "ready")
        panel = app.query_one("StatsPanel")
        assert "ctrl+d" in str(panel.border_subtitle)
        assert any(b.binding.action == "toggle_tint" for b in app.active_bindings.values())
        await say(pilot, "/baseline")
        await pilot.pause(0.05)
        assert "ctrl+d" not in str(panel.border_subtitle) and "drafted" not in str(panel.border_subtitle)
        assert app.check_action("toggle_tint", ()) is False
        await pilot.press("ctrl+d")
        assert app.tint is False
        await say(pilot, "/baseline")
        await pilot.pause(0.05)
        assert "ctrl+d" in str(panel.border_subtitle)


@run_async
async def test_block_above_the_drafters_b_is_refused():
    """`/block 99` for a drafter of B=8: one line naming the limit, the old value kept, and the
    next message answered on the same KV cache (issue 44)."""
    backend = FakeBackend([REPLY])
    app = make_app(backend)
    async with app.run_test() as pilot:
        await answered(pilot, "hi")
        await say(pilot, "/block 4")
        await say(pilot, "/block 99")
        await pilot.pause(0.05)
        [error] = notes(app, "error")
        assert "/block must be at most the drafter's block size 8, got 99" in error and "\n" not in error
        assert app.settings.options.block_size == 4
        await answered(pilot, "and now?")
        call = backend.calls[-1]
        assert call["block_size"] == 4 and 0 < call["prefilled"] < len(call["prompt"])  # the cache was kept
        assert backend.calls[-1]["prompt_cache"] is backend.calls[0]["prompt_cache"]
        assert [m["role"] for m in app.messages] == ["user", "assistant"] * 2


@run_async
async def test_block_size_flag_above_b_ends_the_app_after_loading():
    app = make_app(settings=Settings(DecodeOptions(block_size=99)))
    async with app.run_test() as pilot:
        await until(pilot, lambda: app.return_code is not None)
        assert app.return_code == 1
        [message] = [str(m) for m in app._exit_renderables]
        assert message == "dflash-chat: error: --block-size must be at most the drafter's block size 8, got 99"
