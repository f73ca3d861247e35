"""The `openai` package drives `tokenmill batch-api`, started as a user starts it: upload,
create, poll, download, list, cancel and delete, each through the client's own calls,
and every output line parses with the client's own types."""

from __future__ import annotations

import json
import time

import openai
import pytest
from api_helpers import KEYS, ServerProcess, batch_lines, jsonl
from openai.types import Batch
from openai.types.chat import ChatCompletion


@pytest.fixture
def server(tmp_path, tiny_model_dir):
    process = ServerProcess(str(tmp_path / "store"), tiny_model_dir, "--option", "max_tokens=4")
    process.start(tmp_path / "server.log")
    yield process
    process.stop()


def _poll(client, batch_id: str, timeout: float = 300.0) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def test_the_openai_client_round_trip(server, tmp_path):
    client = server.client("alice")
    (model,) = [m.id for m in client.models.list()]  # the model directory's name
    lines = batch_lines(6, model=model)
    # A line wrong on its own is an error line of the output, not a failed batch.
    lines.append(
        {
            "custom_id": "refused",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "x"}},
        }
    )
    # Work per line is bounded as OpenAI bounds it: n above 128 is an error line.
    lines.append(
        {
            "custom_id": "too-many-n",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}], "n": 100_000},
        }
    )
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(jsonl(lines))

    # The five lines of client code a team already has.
    with open(requests, "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"team": "search"},
    )
    assert batch.status == "validating" and batch.metadata == {"team": "search"}
    assert batch.expires_at - batch.created_at == 24 * 3600
    done = _poll(client, batch.id)

    assert done.status == "completed", done.errors
    assert done.model == model
    assert (done.request_counts.total, done.request_counts.completed) == (8, 6)
    assert done.request_counts.failed == 2
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == [f"r{i}" for i in range(6)]
    bodies = [ChatCompletion.model_validate(o["response"]["body"]) for o in output]
    assert all(b.usage.completion_tokens <= 4 for b in bodies)
    assert done.usage.output_tokens == sum(b.usage.completion_tokens for b in bodies)
    assert done.usage.input_tokens == sum(b.usage.prompt_tokens for b in bodies)
    errors = {e["custom_id"]: e for e in errors}
    assert sorted(errors) == ["refused", "too-many-n"]
    assert errors["refused"]["response"] is None
    assert "body.audio is refused" in errors["refused"]["error"]["message"]
    assert errors["too-many-n"]["error"]["message"] == (
        "n=100000 is over the limit of 128 completions (max_n)"
    )

    # Lists: files (the input, the output and error files) and batches, by cursor.
    names = {f.id: f.purpose for f in client.files.list()}
    assert names == {
        uploaded.id: "batch",
        done.output_file_id: "batch_output",
        done.error_file_id: "batch_output",
    }
    second = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    page = client.batches.list(limit=1)
    assert [b.id for b in page.data] == [second.id] and page.has_more
    assert [b.id for b in client.batches.list(limit=1, after=second.id).data] == [batch.id]

    # Cancel: the second batch ends cancelled (or completed, had it already finished).
    cancelled = client.batches.cancel(second.id)
    assert cancelled.status in ("cancelling", "cancelled", "completed")
    assert _poll(client, second.id).status in ("cancelled", "completed")

    # Delete, and the id is gone; the client raises its usual exceptions.
    assert client.files.delete(done.error_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(done.error_file_id)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 32)
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h"
        )
    # Nothing of a request reaches the server's log: no prompt, no key.
    logged = (tmp_path / "server.log").read_text()
    assert "Question number" not in logged and KEYS["alice"] not in logged
    stranger = server.client("bob")
    with pytest.raises(openai.NotFoundError):
        stranger.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        stranger.files.content(done.output_file_id)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0).models.list()
