"""The Batch API on Postgres (`--database-url postgresql://...`): the same life of a
batch as on SQLite, the compare-and-set that keeps a cancel and a finish from both
winning, and (slow) a server SIGKILLed mid-batch and restarted."""

from __future__ import annotations

import random

import pytest
from api_faults import kill_and_restart
from api_helpers import (
    ApiServer,
    auth,
    batch_lines,
    content_lines,
    create,
    exactly_once,
    jsonl,
    submit,
    upload,
    wait_for,
)

from tokenmill.batch_api.database import Database

pytestmark = pytest.mark.integration


def test_a_batch_runs_to_completion_with_its_state_in_postgres(
    tmp_path, tiny_model_dir, postgres_url
):
    server = ApiServer(tmp_path / "store", tiny_model_dir, database_url=postgres_url)
    with server.client() as client:
        first = submit(client, "alice", batch_lines(5), metadata={"run": "pg"})
        second = submit(client, "alice", batch_lines(3, prefix="s"))
        done = wait_for(client, "alice", first["id"])
        assert wait_for(client, "alice", second["id"])["status"] == "completed"
        output = content_lines(client, "alice", done["output_file_id"])
        page = client.get("/v1/batches?limit=1", headers=auth("alice")).json()
        after = client.get(f"/v1/batches?limit=1&after={second['id']}", headers=auth("alice"))
        hidden = client.get(f"/v1/batches/{first['id']}", headers=auth("bob"))
        bobs = client.get("/v1/files", headers=auth("bob")).json()["data"]
    assert server.settings.database == postgres_url
    assert done["status"] == "completed" and done["metadata"] == {"run": "pg"}
    assert done["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    exactly_once(output, [f"r{i}" for i in range(5)])
    assert done["usage"]["output_tokens"] == sum(
        o["response"]["body"]["usage"]["completion_tokens"] for o in output
    )
    assert [b["id"] for b in page["data"]] == [second["id"]] and page["has_more"]
    assert [b["id"] for b in after.json()["data"]] == [first["id"]]
    assert hidden.status_code == 404 and bobs == []


def test_a_status_change_is_a_compare_and_set(tmp_path, tiny_model_dir, postgres_url):
    server = ApiServer(tmp_path / "store", tiny_model_dir, database_url=postgres_url)
    with server.client(start_runner=False) as client:
        file_id = upload(client, "alice", jsonl(batch_lines(2))).json()["id"]
        batch_id = create(client, "alice", file_id).json()["id"]
    db = Database(postgres_url)
    try:
        assert db.transition(batch_id, ("validating",), status="cancelling", cancelling_at=1)
        # The runner, taking it in a moment later, loses: it was cancelled.
        assert not db.transition(batch_id, ("validating",), status="in_progress")
        assert db.batch_by_id(batch_id)["status"] == "cancelling"
    finally:
        db.close()


@pytest.mark.slow
def test_sigkill_mid_batch_then_restart_with_postgres(tmp_path, tiny_model_dir, postgres_url):
    outcome = kill_and_restart(
        tmp_path,
        tiny_model_dir,
        str(tmp_path / "store"),
        database_url=postgres_url,
        rng=random.Random(3),
    )
    assert outcome.statuses == ["completed", "completed"]
    assert (outcome.lost, outcome.duplicated, outcome.errors) == (0, 0, 0)
