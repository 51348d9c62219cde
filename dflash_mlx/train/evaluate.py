"""`dflash eval`: acceptance length tau of a drafter on prompt sets, greedy and sampled.

tau is the mean number of tokens committed per draft/verify cycle (1 .. B). Reported per
prompt set (the `source` of each prompt) and overall, with the histogram of accepted
lengths (histogram[n - 1] = cycles that committed n tokens) and tokens/s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .data import encode_prompt
from .prompts import collect_prompts, read_prompt_file


def read_eval_prompts(path: str | Path) -> list[dict]:
    """Held-out prompts written by `dflash data` (records with `messages`), or any prompt
    JSONL that `dflash data` accepts."""
    out = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if line.strip():
            rec = json.loads(line)
            if "messages" in rec and "source" in rec:
                out.append(rec)
            else:
                return read_prompt_file(path)
    return out


def evaluate(model: Any, tokenizer: Any, drafter: Any, prompts: Sequence[dict], *, max_tokens: int = 128,
             temps: Sequence[float] = (0.0, 1.0), block_size: Optional[int] = None, seed: int = 0,
             log: Optional[Callable[[str], None]] = None) -> dict:
    """Run every prompt at every temperature; returns
    {temp: {source: {tau, histogram, cycles, tokens, seconds}, "all": {...}}}."""
    from ..speculative import stream_generate

    results: dict = {}
    for temp in temps:
        per: dict[str, dict] = {}
        for i, p in enumerate(prompts):
            ids = encode_prompt(tokenizer, p["messages"])
            last = None
            t0 = time.perf_counter()
            for last in stream_generate(model, tokenizer, ids, drafter, max_tokens=max_tokens, temp=temp,
                                        block_size=block_size, seed=seed + i if temp > 0 else None):
                pass
            dt = time.perf_counter() - t0
            s = last.stats
            for key in (p.get("source", "prompts"), "all"):
                agg = per.setdefault(key, {"accepted_lengths": [], "tokens": 0, "seconds": 0.0, "prompts": 0})
                agg["accepted_lengths"] += list(s.accepted_lengths)
                agg["tokens"] += s.generated_tokens
                agg["seconds"] += dt
                agg["prompts"] += 1
            if log:
                log(f"temp {temp:g} [{i + 1}/{len(prompts)}] {p.get('source', '')}: tau {s.mean_acceptance:.2f}")
        B = block_size or drafter.config.block_size
        out = {}
        for key, agg in per.items():
            lengths = agg["accepted_lengths"]
            hist = [0] * max(B, max(lengths, default=0))
            for n in lengths:
                hist[n - 1] += 1
            out[key] = {"tau": round(sum(lengths) / max(len(lengths), 1), 3), "histogram": hist,
                        "cycles": len(lengths), "tokens": agg["tokens"], "prompts": agg["prompts"],
                        "tokens_per_s": round(agg["tokens"] / max(agg["seconds"], 1e-9), 2)}
        results[f"{temp:g}"] = out
    return results


def format_results(results: dict) -> str:
    lines = []
    for temp, per in results.items():
        lines.append(f"temperature {temp}")
        for key, r in sorted(per.items(), key=lambda kv: (kv[0] == "all", kv[0])):
            lines.append(f"  {key:<12} tau {r['tau']:5.2f}  ({r['cycles']} cycles, {r['tokens']} tokens, "
                         f"{r['tokens_per_s']:.1f} tok/s)  histogram {r['histogram']}")
    return "\n".join(lines)


def prompts_for(sources: Sequence[str], limit: Optional[int] = None) -> list[dict]:
    """Eval prompts from files (held-out JSONL) or built-in source names."""
    out = []
    for s in sources:
        if Path(s).is_file():
            out.extend(read_eval_prompts(s))
        else:
            out.extend(collect_prompts([s]))
    return out[:limit] if limit else out
