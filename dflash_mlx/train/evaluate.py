"""`dflash eval`: acceptance length tau of a drafter on prompt sets, greedy and sampled.

tau is the mean number of tokens committed per draft/verify cycle (1 .. B). Reported per
prompt kind (the `set` field of a prompt file's records, else their `source`) and overall, also as
one table of tau by kind and temperature, with the histogram of accepted
lengths (histogram[n - 1] = cycles that committed n tokens) and tokens/s.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from ..messages import apply_chat_template, prompt_kind
from ..options import DecodeOptions
from ..stats import histogram, tau


def evaluate(
    model: Any,
    tokenizer: Any,
    drafter: Any,
    prompts: Sequence[dict],
    *,
    max_tokens: int = 128,
    temps: Sequence[float] = (0.0, 1.0),
    block_size: Optional[int] = None,
    seed: int = 0,
    log: Optional[Callable[[str], None]] = None,
) -> dict:
    """Run every prompt at every temperature with a fixed block (the drafter's B unless
    given) and no prompt lookup: tau measures the drafter, not the policy nor the lookup; returns
    {temp: {kind: {tau, histogram, position_acceptance, cycles, tokens, ...}, "all": {...}}},
    the kind a prompt's `set`, else its `source` (`messages.prompt_kind`)."""
    from ..speculative import stream_generate

    fixed = DecodeOptions(block_size=block_size, lookup=0).fixed(drafter)
    B = fixed.block_size
    vocab = set(drafter.draft_vocab.tolist()) if drafter.draft_vocab is not None else None
    results: dict = {}
    for temp in temps:
        per: dict[str, dict] = {}
        for i, p in enumerate(prompts):
            ids = apply_chat_template(tokenizer, p["messages"])
            t0 = time.perf_counter()
            options = replace(fixed, temp=temp, seed=seed + i if temp > 0 else None)
            responses = list(stream_generate(model, tokenizer, ids, drafter, options, max_tokens=max_tokens))
            dt = time.perf_counter() - t0
            s = responses[-1].stats.to_dict()
            covered = sum(r.token in vocab for r in responses) if vocab is not None else 0
            for key in (prompt_kind(p), "all"):
                agg = per.setdefault(
                    key, {"accepted_lengths": [], "tokens": 0, "seconds": 0.0, "prompts": 0, "covered": 0}
                )
                agg["accepted_lengths"] += s["accepted_lengths"]
                agg["tokens"] += s["generated_tokens"]
                agg["seconds"] += dt
                agg["prompts"] += 1
                agg["covered"] += covered
            if log:
                log(f"temp {temp:g} [{i + 1}/{len(prompts)}] {prompt_kind(p)}: tau {s['tau']:.2f}")
        out = {}
        for key, agg in per.items():
            out[key] = {
                **summarize(agg["accepted_lengths"], B),
                "tokens": agg["tokens"],
                "prompts": agg["prompts"],
                "tokens_per_s": round(agg["tokens"] / max(agg["seconds"], 1e-9), 2),
            }
            if vocab is not None:
                out[key]["vocab_coverage"] = round(agg["covered"] / max(agg["tokens"], 1), 4)
        results[f"{temp:g}"] = out
    return results


def summarize(lengths: Sequence[int], block_size: int) -> dict:
    """tau, the histogram of committed lengths, per-position acceptance and the cycle count
    of cycles that committed `lengths` tokens each."""
    hist = histogram(lengths, block_size)
    return {
        "tau": round(tau(sum(lengths), len(lengths)), 3),
        "histogram": hist,
        "position_acceptance": position_acceptance(hist),
        "cycles": len(lengths),
    }


def position_acceptance(hist: Sequence[int]) -> list[Optional[float]]:
    """P(draft k accepted | drafts 1..k-1 accepted) for k = 1 .. B-1, from a histogram of
    committed lengths (a cycle that commits n tokens accepted drafts 1..n-1 and rejected
    draft n, unless n = B). None where no cycle reached position k."""
    out: list[Optional[float]] = []
    for k in range(1, len(hist)):
        reached = sum(hist[k - 1 :])  # cycles that accepted drafts 1..k-1
        out.append(round(sum(hist[k:]) / reached, 3) if reached else None)
    return out


def format_table(results: dict) -> str:
    """tau by prompt kind (rows, "all" last) and temperature (columns), as a Markdown table."""
    temps = list(results)
    kinds = sorted({k for per in results.values() for k in per}, key=lambda k: (k == "all", k))
    lines = [
        "| kind | prompts | " + " | ".join(f"tau T={t}" for t in temps) + " |",
        "|---|---:|" + "---:|" * len(temps),
    ]
    for kind in kinds:
        cells = [f"{results[t][kind]['tau']:.2f}" if kind in results[t] else "-" for t in temps]
        prompts = next(results[t][kind]["prompts"] for t in temps if kind in results[t])
        name = f"**{kind}**" if kind == "all" else kind
        lines.append(f"| {name} | {prompts} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_results(results: dict) -> str:
    """Every temperature's numbers per prompt kind, then the table of tau by kind."""
    lines = []
    for temp, per in results.items():
        lines.append(f"temperature {temp}")
        for key, r in sorted(per.items(), key=lambda kv: (kv[0] == "all", kv[0])):
            coverage = f", {r['vocab_coverage']:.1%} in the draft vocab" if "vocab_coverage" in r else ""
            speed = f", {r['tokens_per_s']:.1f} tok/s" if "tokens_per_s" in r else ""
            lines.append(
                f"  {key:<12} tau {r['tau']:5.2f}  ({r['cycles']} cycles, {r['tokens']} tokens{coverage}{speed})  "
                f"histogram {r['histogram']}"
            )
            if key == "all":
                acc = " ".join("-" if a is None else f"{a:.2f}" for a in r["position_acceptance"])
                lines.append(f"  per-position acceptance (drafts 1..): {acc}")
    return "\n".join(lines + ["", format_table(results)]) if results else ""
