"""`dflash serve --keep-conversations DIR`: each finished chat request's text turns and reply
go to DIR/conversations-YYYYMMDD.jsonl (off by default), the log `dflash adapt` reads; a
bad DIR is a one-line error before the model loads."""

from __future__ import annotations

import json

import dflash_mlx  # noqa: F401  (OpenBLAS before mlx)
import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

from app.cli.main import app
from dflash_mlx.train.transcripts import read_conversation_log, read_conversations

pytestmark = pytest.mark.slow

TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": [{"type": "text", "text": "And a fruit?"}]},
]


@pytest.fixture(scope="module")
def kept(default_model_dir, tmp_path_factory):
    """A worker keeping conversations, the folder it keeps them in, and its client."""
    from app.server.routes import create_app
    from app.server.worker import Worker

    folder = tmp_path_factory.mktemp("kept")
    worker = Worker(default_max_tokens=8, keep_conversations=str(folder))
    worker.start(timeout=600)
    with TestClient(create_app(worker)) as client:
        yield folder, client
    worker.shutdown()


def test_chat_requests_are_kept_as_dflash_adapt_reads_them(kept):
    folder, client = kept
    chat = client.post("/v1/chat/completions", json={"messages": TURNS, "max_tokens": 8, "temperature": 0})
    reply = chat.json()["choices"][0]["message"]["content"]
    anthropic = client.post(
        "/v1/messages",
        json={"model": "x", "system": "Be brief.", "messages": [TURNS[1]], "max_tokens": 8, "temperature": 0},
    )
    assert chat.status_code == anthropic.status_code == 200
    client.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 4})  # not a chat: not kept
    [log] = folder.glob("conversations-*.jsonl")
    records = [json.loads(line) for line in log.read_text().splitlines() if line]
    assert [r["reply"] for r in records[:1]] == [reply] and len(records) == 2
    first, second = read_conversation_log(log)
    assert first == [{**t, "content": "And a fruit?"} if i == 3 else t for i, t in enumerate(TURNS)]
    assert second == [{"role": "system", "content": "Be brief."}, TURNS[1]]
    [conversation] = read_conversations([str(folder)])  # the second request began the first's conversation
    assert conversation.kind == "log" and [p[-1]["content"] for p in conversation.prompts] == [
        "Name a colour.",
        "And a fruit?",
    ]


def test_a_bad_folder_is_one_line_before_the_model_loads(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    for folder, message in ((afile, "is a file"), (tmp_path / "no" / "such", "does not exist")):
        result = CliRunner().invoke(app, ["serve", "--keep-conversations", str(folder)])
        assert result.exit_code != 0 and message in result.output, result.output
        assert len(result.output.strip().splitlines()) == 1
