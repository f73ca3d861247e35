"""Faults of the Batch API server: SIGKILLed mid-batch and restarted (local store and the
loopback S3 server) with every custom_id answered exactly once, and a store outage that
fails clearly and resumes once the store is back."""

from __future__ import annotations

import random
import time

import pytest
from api_faults import kill_and_restart
from api_helpers import (
    ApiServer,
    auth,
    batch_lines,
    content_lines,
    exactly_once,
    free_port,
    jsonl,
    submit,
    upload,
    wait_for,
)

from tokenmill.pipelines import output as out

SLOW = {"max_tokens": 24, "shard_tokens": 400}  # many small shards


def _ledger_reader(store: str, storage_options=None):
    def read(batch_id: str):
        return out.read_ledger(out.join(store, "batches", batch_id), storage_options)

    return read


def _check(outcome) -> None:
    assert outcome.statuses == ["completed", "completed"]
    assert (outcome.lost, outcome.duplicated, outcome.errors) == (0, 0, 0)
    # The restarted server resumed the running batch: it ran only the shards left.
    assert 0 < outcome.shards_after_restart < outcome.shards


@pytest.mark.slow
@pytest.mark.integration
def test_sigkill_mid_batch_then_restart_local_store(tmp_path, tiny_model_dir):
    store = str(tmp_path / "store")
    _check(
        kill_and_restart(
            tmp_path, tiny_model_dir, store, rng=random.Random(1), read_ledger=_ledger_reader(store)
        )
    )


@pytest.mark.slow
@pytest.mark.integration
def test_sigkill_mid_batch_then_restart_s3_store(tmp_path, tiny_model_dir, s3):
    store = s3.url(f"api-{tmp_path.name}")
    outcome = kill_and_restart(
        tmp_path,
        tiny_model_dir,
        store,
        storage_options=s3.storage_options,
        rng=random.Random(2),
        read_ledger=_ledger_reader(store, s3.storage_options),
    )
    _check(outcome)


def test_a_stopped_server_resumes_its_batches_from_their_finished_shards(tmp_path, tiny_model_dir):
    """The fast check of the restart (the slow tests above kill a real process): the
    server stops mid-batch, a new one on the same store runs only the shards left."""
    store = tmp_path / "store"
    first = ApiServer(store, tiny_model_dir, job_options=SLOW)
    with first.client() as client:
        batch = submit(client, "alice", batch_lines(30, max_tokens=24))
        queued = submit(client, "alice", batch_lines(5, prefix="q"))
        while (
            client.get(f"/v1/batches/{batch['id']}", headers=auth("alice")).json()[
                "request_counts"
            ]["completed"]
            < 1
        ):
            time.sleep(0.02)
    stopped = first.db.batch_by_id(batch["id"])
    assert stopped["status"] == "in_progress" and stopped["completed_at"] is None
    with ApiServer(store, tiny_model_dir, job_options=SLOW).client() as client:
        done = [wait_for(client, "alice", b["id"]) for b in (batch, queued)]
        output = [content_lines(client, "alice", b["output_file_id"]) for b in done]
    assert [b["status"] for b in done] == ["completed", "completed"]
    assert [b["error_file_id"] for b in done] == [None, None]
    exactly_once(output[0], [f"r{i}" for i in range(30)])
    exactly_once(output[1], [f"q{i}" for i in range(5)])
    ledger = _ledger_reader(str(store))(batch["id"])
    assert 0 < ledger.num_shards_run < ledger.num_shards


@pytest.fixture
def outage_s3():
    """A loopback S3 server of the test's own, stopped and started again on its port."""
    from moto.server import ThreadedMotoServer
    from s3_server import moto_s3

    with moto_s3(bucket="tokenmill-batch-api-outage") as endpoint:
        port = free_port()
        state = {"server": ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)}
        state["server"].start()
        options = {
            **endpoint.storage_options,
            "endpoint_url": f"http://127.0.0.1:{port}",
            # One attempt a request: the outage shows at once, not after the backoff.
            "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}},
        }

        def down() -> None:
            state["server"].stop()

        def up() -> None:
            state["server"] = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            state["server"].start()

        try:
            yield endpoint.url("outage"), options, down, up
        finally:
            state["server"].stop()


@pytest.mark.integration
def test_a_store_outage_fails_clearly_and_the_batch_resumes_after(
    tmp_path, tiny_model_dir, outage_s3
):
    store, options, down, up = outage_s3
    server = ApiServer(
        store,
        tiny_model_dir,
        job_options=SLOW,
        storage_options=options,
        database_url=f"sqlite:///{tmp_path / 'state.sqlite3'}",
    )
    with server.client() as client:
        batch = submit(client, "alice", batch_lines(30, max_tokens=24))
        input_id = batch["input_file_id"]
        while (
            client.get(f"/v1/batches/{batch['id']}", headers=auth("alice")).json()[
                "request_counts"
            ]["completed"]
            < 1
        ):
            time.sleep(0.02)
        down()
        # The API says the store is unavailable, and changes nothing.
        refused = upload(client, "alice", jsonl(batch_lines(1)))
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "store_unavailable"
        unreadable = client.get(f"/v1/files/{input_id}/content", headers=auth("alice"))
        assert unreadable.status_code == 503, unreadable.text
        assert len(client.get("/v1/files", headers=auth("alice")).json()["data"]) == 1
        time.sleep(3)  # the runner meets the outage: the batch is put off, not failed
        assert (
            client.get(f"/v1/batches/{batch['id']}", headers=auth("alice")).json()["status"]
            == "in_progress"
        )
        up()
        done = wait_for(client, "alice", batch["id"])
        output = content_lines(client, "alice", done["output_file_id"])
    assert done["status"] == "completed" and done["error_file_id"] is None
    exactly_once(output, [f"r{i}" for i in range(30)])
