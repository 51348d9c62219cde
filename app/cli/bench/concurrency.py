"""`dflash bench concurrency`: `dflash serve` beside `mlx_lm.server` under N clients at once.

Both servers run as their own processes on loopback over the same target: `dflash serve`
with its defaults (continuous batching; a request alone decodes speculatively) and
`mlx_lm.server --decode-concurrency 8 --prompt-concurrency 8` (mlx-lm's continuous
batching, no drafter). Each first answers every prompt alone (its solo texts). Then for
each N, N greedy chat completions of the prompts (in turn) are streamed to one server at
once, then to the other: aggregate tokens/s (all completion tokens over the wall time of
the N), p50 / p95 latency, p50 time to first token, and whether every text equals that
server's solo text of its prompt. Only plain HTTP (httpx): what a client sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import httpx

from dflash_mlx import default_model_path

__all__ = ["check_arguments", "concurrency_header", "concurrency_line", "plot_concurrency", "run_concurrency_bench"]

#: mlx_lm.server's decode and prompt concurrency (its batch), as `dflash serve --max-batch` defaults.
MLX_LM_CONCURRENCY = 8
STARTUP_SECONDS = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_commands(model: str, draft: Optional[str], port: int) -> dict[str, list[str]]:
    """The command line of each server on `port` (dflash) and `port + 1` (mlx-lm)."""
    ours = [sys.executable, "-m", "app.cli", "serve", "--model", model, "--port", str(port)]
    theirs = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port + 1)]
    theirs += ["--decode-concurrency", str(MLX_LM_CONCURRENCY), "--prompt-concurrency", str(MLX_LM_CONCURRENCY)]
    return {"dflash": ours + (["--draft", draft] if draft else []), "mlx_lm": theirs}


@contextlib.contextmanager
def _running(name: str, command: list[str], url: str) -> Iterator[None]:
    """`command` started and answering `url`/v1/models; stopped on the way out."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + STARTUP_SECONDS
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    last = (log.read().strip().splitlines() or ["no output"])[-1]
                    raise RuntimeError(f"{name} did not start: {last}")
                time.sleep(0.5)
            yield
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def _one(http: httpx.AsyncClient, body: dict) -> dict:
    """One streamed chat completion: its text, tokens, time to first token and latency."""
    tic, first, text, tokens = time.perf_counter(), None, [], 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            piece = "".join(c.get("delta", {}).get("content") or "" for c in event.get("choices") or ())
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
    done = time.perf_counter()
    return {"text": "".join(text), "tokens": tokens, "ttft": (first or done) - tic, "latency": done - tic}


async def _at_once(url: str, bodies: Sequence[dict]) -> tuple[list[dict], float]:
    """Every body sent at once; their results and the wall time."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        tic = time.perf_counter()
        results = await asyncio.gather(*(_one(http, b) for b in bodies))
        return list(results), time.perf_counter() - tic


def _percentile(values: Sequence[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, round(q * (len(ranked) - 1)))]


def _body(prompt: str, max_tokens: int, model: str) -> dict:
    messages = [{"role": "user", "content": prompt}]
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _row(server: str, n: int, results: list[dict], wall: float, solo: Sequence[str]) -> dict:
    tokens = sum(r["tokens"] for r in results)
    latencies, ttfts = [r["latency"] for r in results], [r["ttft"] for r in results]
    same = sum(r["text"] == solo[i % len(solo)] for i, r in enumerate(results))
    return {
        "server": server,
        "clients": n,
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_second": round(tokens / wall, 2) if wall else 0.0,
        "p50_latency": round(_percentile(latencies, 0.5), 3),
        "p95_latency": round(_percentile(latencies, 0.95), 3),
        "p50_ttft": round(_percentile(ttfts, 0.5), 3),
        "solo_texts": same,
    }


def check_arguments(levels: Sequence[int], max_tokens: int) -> None:
    """A one-line ValueError naming the flag for a bad number of clients or tokens."""
    if not levels or any(n < 1 for n in levels):
        raise ValueError(f"--levels must be integers >= 1, got {list(levels)}")
    if max_tokens < 1:
        raise ValueError(f"--max-tokens must be positive, got {max_tokens}")


def run_concurrency_bench(
    model: Optional[str],
    draft: Optional[str],
    levels: Sequence[int],
    prompts: Sequence[str],
    max_tokens: int = 64,
    progress: Callable[[str], None] = lambda _: None,
    on_row: Callable[[dict], None] = lambda _: None,
) -> dict:
    """Both servers at each number of concurrent clients in `levels`; the report (one row
    per server and level). `model`: a model directory or Hub repo both servers load (None:
    the default model)."""
    check_arguments(levels, max_tokens)
    model = model or str(default_model_path())
    prompts, port, rows = list(prompts)[: max(levels)], _free_port(), []
    for server, command in server_commands(model, draft, port).items():
        url = f"http://127.0.0.1:{port + (server == 'mlx_lm')}"
        progress(f"starting {server}")
        with _running(server, command, url):
            progress(f"{server}: solo texts")
            solo = [asyncio.run(_at_once(url, [_body(p, max_tokens, model)]))[0][0]["text"] for p in prompts]
            for n in levels:
                progress(f"{server}: {n} clients at once")
                bodies = [_body(prompts[i % len(prompts)], max_tokens, model) for i in range(n)]
                row = _row(server, n, *asyncio.run(_at_once(url, bodies)), solo)
                rows.append(row)
                on_row(row)
    return {"model": model, "max_tokens": max_tokens, "prompts": len(prompts), "results": rows}


def concurrency_header(max_tokens: int) -> list[str]:
    """The table's head."""
    return [
        f"N concurrent greedy chat completions of {max_tokens} tokens; solo: texts equal to the server's own solo text",
        "| server | N | tokens/s | p50 latency (s) | p95 latency (s) | p50 TTFT (s) | solo |",
        "|---|---|---|---|---|---|---|",
    ]


def concurrency_line(row: dict) -> str:
    """One table row."""
    return (
        f"| {row['server']} | {row['clients']} | {row['tokens_per_second']:.1f} | {row['p50_latency']:.2f} | "
        f"{row['p95_latency']:.2f} | {row['p50_ttft']:.2f} | {row['solo_texts']}/{row['clients']} |"
    )


def plot_concurrency(rows: Sequence[dict], path: str | Path) -> None:
    """Aggregate tokens/s (left) and p50 latency (right) of both servers against N, as a PNG."""
    from dflash_mlx.train.curves import pyplot

    plt = pyplot()
    fig, (speed, latency) = plt.subplots(1, 2, figsize=(9, 3.6))
    for server in dict.fromkeys(r["server"] for r in rows):
        mine = sorted((r for r in rows if r["server"] == server), key=lambda r: r["clients"])
        x = [r["clients"] for r in mine]
        speed.plot(x, [r["tokens_per_second"] for r in mine], "o-", label=server)
        latency.plot(x, [r["p50_latency"] for r in mine], "o-", label=server)
    speed.set_ylabel("aggregate tokens/s")
    latency.set_ylabel("p50 latency (s)")
    for ax in (speed, latency):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
