"""`dflash serve`: an OpenAI- and Anthropic-compatible HTTP server with DFlash under it.

Starlette on uvicorn does the HTTP; `worker.Worker` does every MLX evaluation on
one thread, concurrent requests batched (`scheduler`, whose policy `/health` names);
`openai_api` (OpenAI's chat and text
completions) and `anthropic_api` (Anthropic's Messages) check requests into one
`CompletionRequest` and shape the answers; the path from a checked request to its
answer (`complete`) is the same for both. A chat reply that may hold reasoning or tool
calls is split as it streams (`output.OutputSplitter`) into each API's deltas or
blocks. `/metrics` reads the worker's running totals (`jobs.Metrics`). Every request, greedy
or sampled, alone or in a batch, draws the target's own tokens (a batch row the same ones
as alone), so what comes back is exactly the target's own distribution (greedy: its own
tokens).

A client that goes away stops its request: Starlette cancels a stream whose client
disconnected, and a non-streamed request polls for the disconnect while it waits; both
cancel the job, which the worker sees after the token it is on.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
import sys
from functools import partial
from typing import AsyncIterator, Callable, Optional

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.server import anthropic_api
from app.server.openai_api import (
    chunk,
    completion_body,
    dflash_stats,
    finish,
    logprobs_body,
    parse_request,
    piece_chunks,
    usage,
)
from app.server.request import APIError, CompletionRequest, ModelInfo, check_body
from app.server.output import Piece
from app.server.worker import Delta, Done, Failed, Job, QueueFull, Worker

__all__ = ["create_app", "host_warning", "metrics_text", "run_server"]

DISCONNECT_POLL = 0.25  # seconds between disconnect checks of a non-streamed request
MESSAGES = "/v1/messages"  # Anthropic's Messages API (`anthropic_api`)


def _is_anthropic(request: Request) -> bool:
    """Whether `request` is on Anthropic's routes, whose errors have Anthropic's shape."""
    return request.url.path.startswith(MESSAGES)


def _error(request: Request, exc: APIError) -> JSONResponse:
    worker = getattr(request.app.state, "worker", None)
    if worker is not None and exc.status < 500:
        worker.metrics.rejected += 1
    body = anthropic_api.error_body(exc) if _is_anthropic(request) else exc.body()
    return JSONResponse(body, status_code=exc.status)


async def _api_error(request: Request, exc: Exception) -> Response:
    return _error(request, exc)  # type: ignore[arg-type]


async def _http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return _error(request, APIError(str(getattr(exc, "detail", "")) or "error", status=status, code=code))


async def _server_error(request: Request, exc: Exception) -> Response:
    error = APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, code="internal_error")
    return _error(request, error)


def _sse(payload: dict | str, event: Optional[str] = None) -> bytes:
    """One server-sent event; Anthropic's streams name theirs (`event:`), OpenAI's do not."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data}\n\n".encode()


class _JobStream(StreamingResponse):
    """A streamed answer that cancels its job however the response ends (done, client
    gone, server stopping): the worker then moves on to the next request."""

    def __init__(self, job: Job, content: AsyncIterator[bytes]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def _finish(req: CompletionRequest, done: Done) -> tuple[dict, dict]:
    """(usage, dflash) of a finished request."""
    use = usage(done.prompt_tokens or len(req.prompt), done.completion_tokens, done.cached_tokens)
    return use, dflash_stats(done.stats, done.generation_tps, done.prompt_tps)


async def _events(job: Job) -> AsyncIterator[Delta | Done]:
    """The job's events up to its `Done`; a failure mid-stream raises `APIError`."""
    while True:
        event = await job.events.get()
        if isinstance(event, Failed):
            raise APIError(event.message, status=500, code="generation_failed")
        yield event
        if isinstance(event, Done):
            return


async def _stream(job: Job) -> AsyncIterator[bytes]:
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; a chat
    reply that splits (tools, reasoning) streams its pieces as their own deltas."""
    req, offset = job.request, 0  # offset: of the next token in the text (legacy logprobs)
    splitter = req.splitter()
    if req.chat:
        yield _sse(chunk(req, None))
    try:
        async for event in _events(job):
            if isinstance(event, Delta):
                logprobs = logprobs_body(req, event.logprobs, offset)
                offset += sum(len(e.token) for e in event.logprobs)
                if splitter is None:
                    yield _sse(chunk(req, event.text, logprobs=logprobs))
                for out in piece_chunks(req, splitter.feed(event.text), logprobs) if splitter else ():
                    yield _sse(out)
                continue
            for out in piece_chunks(req, splitter.close(), None) if splitter else ():
                yield _sse(out)
            use, dflash = _finish(req, event)
            reason = finish(event.finish_reason, bool(splitter and splitter.calls))
            yield _sse(chunk(req, None, reason, dflash=dflash))
            if req.include_usage:
                yield _sse({**chunk(req, None), "choices": [], "usage": use, "dflash": dflash})
    except APIError as exc:
        yield _sse(exc.body())
    yield _sse("[DONE]")


async def _anthropic_stream(job: Job) -> AsyncIterator[bytes]:
    """Server-sent events in Anthropic's sequence, each named by its `event:` line."""
    req, blocks = job.request, anthropic_api.MessageStream(job.request)
    splitter = req.splitter()
    for name, data in blocks.start():
        yield _sse(data, name)
    try:
        async for event in _events(job):
            if isinstance(event, Delta):
                pieces = splitter.feed(event.text) if splitter else [Piece("text", event.text)] * bool(event.text)
                pairs = blocks.pieces(pieces)
            else:
                pairs = blocks.pieces(splitter.close() if splitter else []) + blocks.stop(event, _finish(req, event)[1])
            for name, data in pairs:
                yield _sse(data, name)
    except APIError as exc:
        yield _sse(anthropic_api.error_body(exc), "error")


async def _collect(job: Job, request: Request) -> tuple[Delta, Done]:
    """Wait for the whole answer of a non-streamed request (all of its text and token
    log-probabilities as one `Delta`), cancelling it if the client leaves."""
    text, logprobs, loop = [], [], asyncio.get_running_loop()
    check = loop.time() + DISCONNECT_POLL
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL)
        except asyncio.TimeoutError:
            event = None
        if loop.time() >= check:  # by the clock: tokens may arrive faster than the poll
            check = loop.time() + DISCONNECT_POLL
            if await request.is_disconnected():
                job.cancel()
        if event is None:
            continue
        if isinstance(event, Delta):
            text.append(event.text)
            logprobs += event.logprobs
        elif isinstance(event, Failed):
            raise APIError(event.message, status=500, code="generation_failed")
        else:
            return Delta("".join(text), tuple(logprobs)), event


def _openai_body(req: CompletionRequest, whole: Delta, done: Done) -> dict:
    use, dflash = _finish(req, done)
    return completion_body(req, whole.text, done.finish_reason, use, dflash, logprobs_body(req, whole.logprobs))


def _anthropic_body(req: CompletionRequest, whole: Delta, done: Done) -> dict:
    return anthropic_api.message_body(req, whole.text, done, _finish(req, done)[1])


async def _json_body(request: Request) -> object:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(f"the request body is not valid JSON ({exc})", code="invalid_json") from None


def create_app(worker: Worker) -> Starlette:
    """The Starlette app over a started `worker`."""

    def model_info() -> ModelInfo:
        if worker.info is None:
            raise APIError(f"the model is not loaded: {worker.load_error or 'loading'}", status=503)
        return worker.info

    async def complete(request: Request, parse: Callable, whole: Callable, stream: Callable) -> Response:
        """Check a request with `parse(body, info)`, run it on the worker, and answer with
        `whole(req, delta, done)` (all of its text as one `Delta`) or, streamed, `stream(job)`'s server-sent events."""
        info, body = model_info(), await _json_body(request)
        req = await anyio.to_thread.run_sync(lambda: parse(body, info))
        job = Job(req, asyncio.get_running_loop())
        try:
            worker.submit(job)
        except QueueFull as exc:
            raise APIError(f"the server is busy: {exc}; retry later", status=429, code="queue_full") from None
        if req.stream:
            return _JobStream(job, stream(job))
        try:
            return JSONResponse(whole(req, *await _collect(job, request)))
        finally:
            job.cancel()

    async def chat_completions(request: Request) -> Response:
        return await complete(request, partial(parse_request, chat=True), _openai_body, _stream)

    async def completions(request: Request) -> Response:
        return await complete(request, partial(parse_request, chat=False), _openai_body, _stream)

    async def messages(request: Request) -> Response:
        return await complete(request, anthropic_api.parse_messages, _anthropic_body, _anthropic_stream)

    async def count_tokens(request: Request) -> Response:
        info, body = model_info(), await _json_body(request)
        return JSONResponse(await anyio.to_thread.run_sync(lambda: anthropic_api.count_tokens(body, info)))

    def model_card(info: ModelInfo) -> dict:
        return {"id": info.id, "object": "model", "created": 0, "owned_by": "mlx-dflash"}

    async def models(request: Request) -> Response:
        info = worker.info
        return JSONResponse({"object": "list", "data": [model_card(info)] if info else []})

    async def model(request: Request) -> Response:
        """One model (the openai client's `models.retrieve`): this server's, by its name or an alias."""
        info = model_info()
        check_body({"model": request.path_params["name"]}, info)  # a 404 naming any other
        return JSONResponse(model_card(info))

    async def health(request: Request) -> Response:
        status = "ok" if worker.info else "error" if worker.load_error else "loading"
        queue = {"policy": worker.policy, "running": worker.active, "waiting": worker.waiting}
        info = worker.info
        body = {"status": status, "model": info and info.id, "draft": bool(info and info.has_draft), "queue": queue}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        return Response(metrics_text(worker), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route(MESSAGES, messages, methods=["POST"]),
        Route(f"{MESSAGES}/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers = {APIError: _api_error, HTTPException: _http_error, Exception: _server_error}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.worker = worker
    return app


def metrics_text(worker: Worker) -> str:
    """The worker's counters in Prometheus' text format (each metric with HELP and TYPE)."""
    m = worker.metrics
    rows = [
        ("requests_total", "counter", "requests finished, by finish reason", dict(m.finished) or {"stop": 0}),
        ("requests_rejected_total", "counter", "requests refused with a 4xx before the queue", m.rejected),
        ("queue_waiting", "gauge", "requests waiting for the worker, in arrival order", worker.waiting),
        ("queue_running", "gauge", "requests decoding now", worker.active),
        ("queue_seconds_total", "counter", "seconds requests waited before they started", round(m.queue_seconds, 6)),
        ("batch_occupancy", "gauge", "rows of the last batch cycle (continuous batching)", m.occupancy),
        ("batch_steps_total", "counter", "batched cycles (one target forward each)", m.batch_steps),
        ("batch_drafted_cycles_total", "counter", "batched cycles that verified a drafted block", m.batch_drafted),
        ("batch_rows_total", "counter", "rows of those steps, summed (over steps: the mean occupancy)", m.batch_rows),
        ("prompt_tokens_total", "counter", "prompt tokens of finished requests", m.prompt_tokens),
        ("prompt_cache_hits_total", "counter", "requests that read part of their prompt from a cache", m.cache_hits),
        ("prompt_cached_tokens_total", "counter", "prompt tokens read from a prompt cache", m.cached_tokens),
        ("prompt_prefilled_tokens_total", "counter", "prompt tokens prefilled (not read from a cache)", m.prefilled),
        ("caught_up_tokens_total", "counter", "batched tokens prefilled again to decode alone", m.caught_up),
        ("completion_tokens_total", "counter", "tokens generated", m.completion_tokens),
        ("generation_seconds_total", "counter", "seconds spent generating them", round(m.generation_seconds, 6)),
        ("tokens_per_second", "gauge", "generation speed of the last finished request", m.last_tokens_per_second),
        ("cycles_total", "counter", "draft/verify cycles, alone and batched", m.cycles),
        ("tau", "gauge", "mean tokens committed per cycle, all requests", round(m.tau, 4)),
    ]
    lines = []
    for name, kind, about, value in rows:
        lines += [f"# HELP dflash_{name} {about}", f"# TYPE dflash_{name} {kind}"]
        values = value if isinstance(value, dict) else {None: value}
        for label, v in values.items():
            lines.append(f'dflash_{name}{{finish_reason="{label}"}} {v}' if label else f"dflash_{name} {v}")
    return "\n".join(lines) + "\n"


def host_warning(host: str) -> Optional[str]:
    """A warning for a bind address other than loopback, else None."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return f"warning: listening on {host}: anyone who can reach this machine can use the model (no authentication)"


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a busy port is one clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def run_server(worker: Worker, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info") -> None:
    """Bind, load the model on the worker, and serve until interrupted."""
    import uvicorn

    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    warning = host_warning(host)
    if warning:
        print(warning, file=sys.stderr)
    sock = _bind(host, port)
    try:
        info = worker.start()
        print(f"serving {info.id} on http://{host}:{sock.getsockname()[1]}/v1 ({worker.policy})", file=sys.stderr)
        config = uvicorn.Config(create_app(worker), log_level=log_level, timeout_graceful_shutdown=5)
        try:
            uvicorn.Server(config).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises Ctrl+C after its graceful shutdown
            print("stopped", file=sys.stderr)
    finally:
        worker.shutdown()
        sock.close()
