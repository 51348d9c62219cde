"""`dflash serve` before and around the model: the command line (bind address, start-up
failures as one line), the cache pool, the error body, and the worker's drafter."""

from __future__ import annotations

import json
import logging
import socket

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
from typer.testing import CliRunner

from app.server.request import APIError
from app.server.worker import LOG, CachePool, Worker, print_log
from app.server.routes import host_warning


def test_host_warning():
    assert host_warning("127.0.0.1") is None and host_warning("localhost") is None and host_warning("::1") is None
    assert "0.0.0.0" in host_warning("0.0.0.0")


def test_cli_serve_warns_for_every_interface_and_fails_in_one_line(monkeypatch):
    from app.cli.main import app

    def no_model(self, timeout=None):
        raise RuntimeError("no model here")

    monkeypatch.setattr(Worker, "start", no_model)
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 1
    assert "warning: listening on 0.0.0.0" in result.output and "error: no model here" in result.output
    assert "Traceback" not in result.output
    result = CliRunner().invoke(app, ["serve", "--block-size", "1"])
    assert result.exit_code == 1 and "--block-size must be an integer >= 2" in result.output


def test_cli_serve_busy_port_is_one_line():
    from app.cli.main import app

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = CliRunner().invoke(app, ["serve", "--port", str(taken.getsockname()[1])])
    assert result.exit_code == 1 and "error: cannot listen on 127.0.0.1" in result.output


def test_cli_serve_bad_draft_vocab_is_one_line(default_model_dir, tmp_path):
    from app.cli.main import app

    bad = tmp_path / "v.json"
    bad.write_text(json.dumps({"ids": [3, 1], "eos_token_ids": [2]}))
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--draft-vocab", str(bad)])
    assert result.exit_code == 1 and "ids are unsorted" in result.output and "Traceback" not in result.output


def test_worker_drafts_with_the_given_vocabulary(default_model_dir, tmp_path):
    vocab = tmp_path / "v.json"
    vocab.write_text(json.dumps({"ids": [0, 1, 2, 7], "eos_token_ids": [2]}))
    w = Worker(draft_vocab=str(vocab))
    try:
        assert w.start(timeout=600).has_draft and w.draft.draft_vocab.tolist() == [0, 1, 2, 7]
    finally:
        w.shutdown()


def test_cache_pool_continues_a_conversation_else_takes_a_fresh_cache():
    class Cache:
        def __init__(self):
            self.tokens = []

    pool = CachePool(Cache, size=2)
    a = pool.take([1, 2, 3])
    a.tokens = [1, 2, 3, 4]
    assert pool.take([1, 2, 3, 4, 5, 6]) is a  # extends a's conversation
    b = pool.take([1, 2, 9])  # diverges from a: a fresh cache while there is room
    assert b is not a
    b.tokens = [1, 2, 9]
    assert pool.take([1, 2, 3, 7]) is a  # full: the longest shared prefix
    pool.drop(a)
    assert pool.caches == [b]


def test_error_body_is_openai_shaped():
    body = APIError("bad", param="top_p", code="x").body()
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "top_p", "code": "x"}}


def test_worker_lines_are_log_records_that_serve_prints(caplog, capsys):
    """The worker's lines are `dflash.server` records (a test captures them, nothing leaks
    to stderr); `dflash serve` prints them bare to stderr while it runs, and only then."""
    caplog.set_level(logging.INFO, logger=LOG.name)
    worker = Worker()  # not started: no model needed to log
    worker.log("request done (stop): 3 tokens")
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("dflash.server", "request done (stop): 3 tokens")]
    assert capsys.readouterr().err == ""
    handlers = list(LOG.handlers)
    with print_log():
        worker.log("queue: one at a time")
    assert capsys.readouterr().err == "queue: one at a time\n"
    assert LOG.handlers == handlers and LOG.level == logging.INFO
