"""`dflash bench concurrency`: `dflash serve` against `mlx_lm.server` under N concurrent clients.

Both servers run the same target, side by side in one run (`mlx_lm.server` with
`--decode-concurrency` and `--prompt-concurrency` at `--mlx-lm-batch`, and OpenBLAS loaded
as under ours: without it MLX's CPU backend runs its reference BLAS at about half the
speed, which would flatter us). At each level N, N clients share the prompts, each asking
its share one after the other: streamed greedy chat completions over HTTP, as an app
would; or, with `--burst`, N at a time fired at the same moment, the next N once those are
answered. Per server and level: aggregate tokens/s (completion tokens over the level's wall
time), p50/p95 latency and time to first token. Every answer is checked against the one
that server gave that prompt alone (level 1, always run first): batching must not change
a text.
"""

from __future__ import annotations

import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

#: How `mlx_lm.server` is started: OpenBLAS first (`import dflash_mlx`), then its own main.
MLX_LM_SERVER = "import sys, dflash_mlx; from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
START_SECONDS = 600  # a server that is not answering by then has failed


@dataclass
class Answer:
    """One completion as a client saw it."""

    text: str
    tokens: int
    ttft: float  # seconds to the first content
    latency: float  # seconds to the end


def free_port() -> int:
    """A TCP port on the loopback that nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(name: str, argv: list[str], port: int, log: Path) -> subprocess.Popen:
    """Start a server and wait until it answers GET /v1/models; one line if it dies or hangs."""
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} while starting (its log: {log})")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{name} did not answer within {START_SECONDS} s (its log: {log})")


def ask(port: int, prompt: str, max_tokens: int) -> Answer:
    """One streamed greedy chat completion; its usage gives the token count."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tic = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"the server answered {resp.status}: {resp.read()[:200]!r}")
    text, tokens, ttft = [], 0, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - tic
            text.append(piece)
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    latency = time.perf_counter() - tic
    return Answer("".join(text), tokens, latency if ttft is None else ttft, latency)


def run_level(
    port: int, prompts: Sequence[str], clients: int, max_tokens: int, burst: bool = False
) -> tuple[list[Answer], float]:
    """`clients` threads share the prompts (client c asks prompts c, c + N, ...): each in
    turn, or, in a `burst`, all N at the same moment and the next N once every one of them
    is answered (agents and a team behind one server). The answers in prompt order and the
    level's wall seconds."""
    answers: list[Optional[Answer]] = [None] * len(prompts)
    errors: list[BaseException] = []
    together = threading.Barrier(clients) if burst else None

    def client(c: int) -> None:
        for i in range(c, c + clients * -(-len(prompts) // clients), clients):
            if together is not None:
                together.wait()  # every client's request of this burst starts at once
            try:
                if i < len(prompts) and not errors:
                    answers[i] = ask(port, prompts[i], max_tokens)
            except BaseException as e:  # reported once all clients are done
                errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"a client failed with {clients} clients: {type(errors[0]).__name__}: {errors[0]}")
    return answers, time.perf_counter() - tic  # type: ignore[return-value]


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarize(answers: list[Answer], seconds: float, solo: Optional[list[Answer]]) -> dict:
    """A level's numbers for one server."""
    latencies, ttfts = [a.latency for a in answers], [a.ttft for a in answers]
    return {
        "tok_s": sum(a.tokens for a in answers) / seconds,
        "seconds": seconds,
        "latency_p50": _percentile(latencies, 50),
        "latency_p95": _percentile(latencies, 95),
        "ttft_p50": _percentile(ttfts, 50),
        "ttft_p95": _percentile(ttfts, 95),
        "same_as_solo": sum(a.text == s.text for a, s in zip(answers, solo or answers)),
        "answers": len(answers),
    }


def server_commands(model: Optional[str], draft: Optional[str], mlx_lm_batch: int) -> dict[str, Callable]:
    """Per server, a function of the port that gives its command line."""
    from dflash_mlx import default_model_path

    path = model or str(default_model_path())
    ours = [sys.executable, "-m", "app.cli", "serve", "--model", path] + (["--draft", draft] if draft else [])
    theirs = [sys.executable, "-c", MLX_LM_SERVER, "--model", path]
    theirs += ["--decode-concurrency", str(mlx_lm_batch), "--prompt-concurrency", str(mlx_lm_batch)]
    return {
        "dflash serve": lambda port: ours + ["--port", str(port)],
        "mlx_lm.server": lambda port: theirs + ["--port", str(port)],
    }


def run_concurrency_bench(
    levels: Sequence[int],
    prompts: Sequence[str],
    *,
    model: Optional[str] = None,
    draft: Optional[str] = None,
    max_tokens: int = 64,
    mlx_lm_batch: int = 8,
    burst: bool = False,
    progress: Callable[[str], None] = lambda s: None,
) -> dict:
    """Both servers at every level (1 first: the solo answers), the clients asking in turn
    or in bursts (`run_level`); the report."""
    levels = [1] + [n for n in levels if n != 1]
    logs = Path(tempfile.mkdtemp(prefix="dflash-bench-concurrency-"))
    procs, ports, rows = {}, {}, []
    solo: dict[str, list[Answer]] = {}
    try:
        for name, command in server_commands(model, draft, mlx_lm_batch).items():
            progress(f"starting {name}")
            ports[name] = free_port()
            procs[name] = start_server(name, command(ports[name]), ports[name], logs / f"{name.split()[0]}.log")
        for n in levels:
            row = {"clients": n}
            for name, port in ports.items():
                progress(f"{name}: {n} clients, {len(prompts)} prompts")
                answers, seconds = run_level(port, prompts, n, max_tokens, burst)
                solo.setdefault(name, answers)
                row[name] = summarize(answers, seconds, solo[name])
            rows.append(row)
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    return {
        "max_tokens": max_tokens,
        "prompts": len(prompts),
        "mlx_lm_batch": mlx_lm_batch,
        "burst": burst,
        "rows": rows,
    }


def concurrency_table(report: dict) -> str:
    """Markdown: aggregate tok/s, the ratio, p50 latency and TTFT of both, texts equal to solo."""
    head = (
        "| clients | dflash serve tok/s | mlx_lm.server tok/s | ratio | p50 / p95 latency s (ours, theirs) "
        "| p50 TTFT s (ours, theirs) | same as solo (ours, theirs) |"
    )
    lines = [head, "|---:|---:|---:|---:|---|---|---|"]
    for row in report["rows"]:
        a, b = row["dflash serve"], row["mlx_lm.server"]
        lines.append(
            f"| {row['clients']} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | {a['tok_s'] / b['tok_s']:.2f}x "
            f"| {a['latency_p50']:.2f} / {a['latency_p95']:.2f}, {b['latency_p50']:.2f} / {b['latency_p95']:.2f} "
            f"| {a['ttft_p50']:.2f}, {b['ttft_p50']:.2f} "
            f"| {a['same_as_solo']}/{a['answers']}, {b['same_as_solo']}/{b['answers']} |"
        )
    return "\n".join(lines)


def plot_concurrency(report: dict, path: Path) -> None:
    """Aggregate tokens/s against clients, both servers, into a PNG."""
    from dflash_mlx.train.curves import pyplot

    plt = pyplot()

    clients = [row["clients"] for row in report["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("dflash serve", "mlx_lm.server"):
        ax.plot(clients, [row[name]["tok_s"] for row in report["rows"]], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title(f"{report['prompts']} prompts x {report['max_tokens']} tokens, greedy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
