"""Tokens/s through OpenAI-compatible servers, side by side: `dflash serve` vs `mlx_lm.server`.

    python -m app.server.bench http://127.0.0.1:8080 http://127.0.0.1:8081 [-m 64] [--prompts FILE]

Each server gets the same chat prompts, greedy, one request at a time, streamed; a
request's speed is its completion tokens over the time from its first streamed token to
its last (so prefill and queueing are left out, as in `dflash bench`). Servers are
interleaved prompt by prompt so that a busy machine slows them alike. Only plain HTTP
(httpx): it measures what a client sees, whichever server it is.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Optional, Sequence

import httpx

__all__ = ["measure", "main"]

PROMPTS = [
    "Write a Python function that returns the factorial of n.",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "List three prime numbers greater than 10.",
]


def measure(url: str, prompt: str, max_tokens: int, model: Optional[str] = None) -> dict:
    """One streamed greedy chat request: completion tokens, seconds after the first token, tokens/s."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0}
    body.update({"stream": True, "stream_options": {"include_usage": True}}, **({"model": model} if model else {}))
    first = last = None
    tokens = chunks = 0
    with httpx.stream("POST", f"{url.rstrip('/')}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in event.get("choices") or ()):
                chunks += 1
                last = time.perf_counter()
                first = first or last
    tokens = tokens or chunks  # a server without include_usage: count content chunks
    seconds = (last - first) if first and last and last > first else 0.0
    return {"tokens": tokens, "seconds": seconds, "tps": (tokens - 1) / seconds if seconds else 0.0}


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Print a markdown table: mean tokens/s per server over the prompts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="+", help="Server base URLs (without /v1).")
    parser.add_argument("-m", "--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=Path, help="One prompt a line (default: four built-in ones).")
    parser.add_argument("--model", help="The 'model' field to send (mlx_lm.server wants its model path).")
    args = parser.parse_args(argv)
    prompts = [p for p in args.prompts.read_text().splitlines() if p.strip()] if args.prompts else PROMPTS
    runs: dict[str, list[dict]] = {url: [] for url in args.urls}
    for url in args.urls:  # warm-up: first requests pay for lazy initialisation
        measure(url, prompts[0], 8, args.model)
    for prompt in prompts:
        for url in args.urls:
            runs[url].append(measure(url, prompt, args.max_tokens, args.model))
    print("| server | tokens | seconds | tokens/s per prompt | mean tokens/s |")
    print("|---|---|---|---|---|")
    for url, rows in runs.items():
        each = ", ".join(f"{r['tps']:.1f}" for r in rows)
        mean = sum(r["tps"] for r in rows) / len(rows)
        tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
        print(f"| {url} | {tokens} | {seconds:.2f} | {each} | {mean:.1f} |")


if __name__ == "__main__":
    main()
