"""`dflash bench host`: how long the host keeps the device waiting, per kind of cycle.

On an Apple GPU every blocking read (`dflash_mlx/host.py`) drains the device's queue, and the
device then idles until the host queues more: while the loop rolls back, records, charges,
yields, detokenizes, plans and looks up. No CPU benchmark of tokens/s shows that loss, so
this one counts it. Each kind of cycle decodes the same prompts under `host.watching()`:
the blocking reads per cycle, and the host milliseconds per cycle during which nothing was
queued on the device (from a read that drained it until the next work was queued). The
prefill's reads and gaps are counted in too (a few a generation).

Kinds: `plain` (the target alone: mlx-lm's pipelined steps), `chain` (a fixed chain of the
drafter's block), `tree N` (a fixed tree of N nodes), `defaults` (the adaptive policy, as
`dflash generate` decodes).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

#: The tree budget of the `tree` kind (DDTree's sweet spot on this CPU is 8-16 nodes).
TREE_NODES = 16


def kinds(block: int) -> dict[str, Optional[dict]]:
    """Each kind's decoding options (None: the target alone)."""
    return {
        "plain": None,
        f"chain {block}": dict(block_size=block, tree_budget=0),
        f"tree {TREE_NODES}": dict(block_size=block, tree_budget=TREE_NODES),
        "defaults": dict(),
    }


def run_host_bench(
    model_path: Optional[str],
    draft_path: Optional[str],
    prompts: Sequence[str],
    max_tokens: int = 64,
    progress: Optional[Callable[[str], None]] = None,
) -> dict:
    """Decode `prompts` with each kind of cycle; a JSON-able report, one row per kind."""
    from dflash_mlx import apply_chat_template, default_model_path, host, load, load_draft, stream_generate

    model, tokenizer = load(model_path or str(default_model_path()))
    drafter = load_draft(draft_path, model=model)
    texts = [apply_chat_template(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    rows = []
    for kind, options in kinds(drafter.config.block_size).items():
        cycles = tokens = reads = 0
        idle = seconds = 0.0
        for i, prompt in enumerate(texts):
            if progress:
                progress(f"{kind}: prompt {i + 1} of {len(texts)}")
            draft = drafter if options is not None else None
            with host.watching() as watch:
                tic = time.perf_counter()
                *_, last = stream_generate(model, tokenizer, prompt, draft, max_tokens=max_tokens, **options or {})
                seconds += time.perf_counter() - tic
            view = last.stats.to_dict()
            cycles += view["cycles"]
            tokens += last.generation_tokens
            reads, idle = reads + watch.reads, idle + watch.idle
        rows.append(
            {
                "kind": kind,
                "cycles": cycles,
                "tokens_per_cycle": tokens / cycles,
                "reads_per_cycle": reads / cycles,
                "idle_ms_per_cycle": 1000 * idle / cycles,
                "cycle_ms": 1000 * seconds / cycles,
            }
        )
    return {
        "model": model_path or str(default_model_path()),
        "prompts": len(texts),
        "max_tokens": max_tokens,
        "results": rows,
    }


def host_table(report: dict) -> str:
    """The report as a markdown table."""
    lines = [
        f"{report['prompts']} prompts x {report['max_tokens']} new tokens, greedy; per cycle: blocking reads "
        "and the host's milliseconds with nothing queued on the device",
        "",
        "| cycles | count | tokens/cycle | blocking reads/cycle | host idle ms/cycle | cycle ms | idle share |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        share = r["idle_ms_per_cycle"] / r["cycle_ms"] if r["cycle_ms"] else 0.0
        lines.append(
            f"| {r['kind']} | {r['cycles']} | {r['tokens_per_cycle']:.2f} | {r['reads_per_cycle']:.2f} "
            f"| {r['idle_ms_per_cycle']:.2f} | {r['cycle_ms']:.1f} | {share:.1%} |"
        )
    return "\n".join(lines)
