"""A batch's life on the in-process server: OpenAI's validation rules, cancel mid-run,
expiry, two batches at once (fair across keys, in creation order within a key), and every
custom_id answered exactly once whatever happened."""

from __future__ import annotations

import os
import time

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

from tokenmill.batch_api.database import files

# Many small shards: a batch runs for a while, and stops between or inside them.
LONG = {"max_tokens": 24, "shard_tokens": 400}


def _answered(client, who: str, batch: dict) -> tuple[list[dict], list[dict]]:
    return (
        content_lines(client, who, batch["output_file_id"]),
        content_lines(client, who, batch["error_file_id"]),
    )


def test_a_file_breaking_openais_rules_fails_the_batch_naming_its_lines(api):
    server, client = api
    lines = batch_lines(4)
    lines[1]["url"] = "/v1/completions"  # not the batch's endpoint
    lines[3]["custom_id"] = "r0"  # a repeat
    lines[2]["body"]["model"] = "gpt-4o"  # not served
    batch = wait_for(client, "alice", submit(client, "alice", lines)["id"])
    assert batch["status"] == "failed" and batch["failed_at"]
    assert [(e["code"], e["line"]) for e in batch["errors"]["data"]] == [
        ("url_mismatch", 2),
        ("model_not_found", 3),
        ("duplicate_custom_id", 4),
    ]
    assert batch["output_file_id"] is None and batch["error_file_id"] is None


def test_too_many_lines_fails_the_batch(tmp_path, tiny_model_dir):
    server = ApiServer(tmp_path / "store", tiny_model_dir, max_lines=3)
    with server.client() as client:
        batch = wait_for(client, "alice", submit(client, "alice", batch_lines(4))["id"])
    assert batch["status"] == "failed"
    assert batch["errors"]["data"][0]["code"] == "too_many_requests"
    assert "4 requests; a batch takes at most 3" in batch["errors"]["data"][0]["message"]


def test_cancel_mid_run_keeps_finished_rows_and_bills_only_them(tmp_path, tiny_model_dir):
    server = ApiServer(tmp_path / "store", tiny_model_dir, job_options=LONG)
    ids = [f"r{i}" for i in range(120)]
    with server.client() as client:
        batch = submit(client, "alice", batch_lines(120, max_tokens=24))
        while (
            client.get(f"/v1/batches/{batch['id']}", headers=auth("alice")).json()[
                "request_counts"
            ]["completed"]
            < 1
        ):
            time.sleep(0.05)
        asked = time.monotonic()
        cancelling = client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth("alice"))
        assert cancelling.json()["status"] == "cancelling"
        done = wait_for(client, "alice", batch["id"])
        stopped_in = time.monotonic() - asked
        output, errors = _answered(client, "alice", done)
    assert done["status"] == "cancelled" and done["cancelled_at"] and done["cancelling_at"]
    assert stopped_in < 10, stopped_in
    exactly_once(output + errors, ids)
    assert 1 <= len(output) < 120
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    counts = done["request_counts"]
    assert (counts["total"], counts["completed"], counts["failed"]) == (
        120,
        len(output),
        len(errors),
    )
    billed = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in output)
    assert done["usage"]["output_tokens"] == billed


def _wait_completed(client, who: str, batch_id: str, at_least: int) -> None:
    while True:
        batch = client.get(f"/v1/batches/{batch_id}", headers=auth(who)).json()
        assert batch["status"] in ("validating", "in_progress"), batch
        if batch["request_counts"]["completed"] >= at_least:
            return
        time.sleep(0.05)


def test_an_expired_batch_keeps_what_finished(tmp_path, tiny_model_dir):
    # A server allowing 48 hours, as one on slow hardware would; it says so in expires_at.
    server = ApiServer(
        tmp_path / "store", tiny_model_dir, job_options=LONG, completion_window_s=48 * 3600
    )
    with server.client() as client:
        batch = submit(client, "alice", batch_lines(120, max_tokens=24))
        queued = submit(client, "alice", batch_lines(5, prefix="q"))  # waits behind it
        assert batch["expires_at"] - batch["created_at"] == 48 * 3600
        _wait_completed(client, "alice", batch["id"], 1)
        # The window ends now, for both: the running batch mid-run, the queued one unstarted
        # (waiting out a real window would make the test as slow as the machine is busy).
        for b in (batch, queued):
            server.db.update_batch(b["id"], expires_at=int(time.time()) - 1)
        done = wait_for(client, "alice", batch["id"])
        output, errors = _answered(client, "alice", done)
        unstarted = wait_for(client, "alice", queued["id"])
        never_ran = _answered(client, "alice", unstarted)
    assert done["status"] == "expired" and done["expired_at"] >= done["expires_at"]
    exactly_once(output + errors, [f"r{i}" for i in range(120)])
    assert 1 <= len(output) < 120
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    counts = done["request_counts"]
    assert (counts["completed"], counts["failed"]) == (len(output), len(errors))
    assert unstarted["status"] == "expired" and unstarted["in_progress_at"] is None
    assert never_ran[0] == []
    exactly_once(never_ran[1], [f"q{i}" for i in range(5)])
    assert unstarted["request_counts"]["failed"] == 5


def test_two_keys_batches_run_together_and_a_keys_own_in_creation_order(tmp_path, tiny_model_dir):
    server = ApiServer(tmp_path / "store", tiny_model_dir, job_options=LONG)
    with server.client() as client:
        first = submit(client, "alice", batch_lines(60, prefix="a"))
        second = submit(client, "alice", batch_lines(10, prefix="b"))
        other = submit(client, "bob", batch_lines(10, prefix="c"))
        done = {
            b["id"]: wait_for(client, who, b["id"])
            for who, b in (("alice", first), ("alice", second), ("bob", other))
        }
        answers = {
            b: _answered(client, who, done[b])[0]
            for who, b in (("alice", first["id"]), ("alice", second["id"]), ("bob", other["id"]))
        }
    a, b, c = done[first["id"]], done[second["id"]], done[other["id"]]
    assert {x["status"] for x in (a, b, c)} == {"completed"}
    exactly_once(answers[first["id"]], [f"a{i}" for i in range(60)])
    exactly_once(answers[second["id"]], [f"b{i}" for i in range(10)])
    exactly_once(answers[other["id"]], [f"c{i}" for i in range(10)])
    # Bob's batch did not wait for Alice's long one: its shards took turns with it.
    assert c["completed_at"] <= a["completed_at"] and c["in_progress_at"] <= a["completed_at"]
    # Alice's second batch started after her first finished.
    assert b["in_progress_at"] >= a["completed_at"]


def test_metadata_and_window_are_checked_as_openai_checks_them(api):
    server, client = api
    file_id = upload(client, "alice", jsonl(batch_lines(1))).json()["id"]
    too_many = {f"k{i}": "v" for i in range(17)}
    for extra, words in (
        ({"metadata": too_many}, "at most 16 keys"),
        ({"metadata": {"k" * 65: "v"}}, "64 characters"),
        ({"metadata": {"k": "v" * 513}}, "512 characters"),
        ({"completion_window": "48h"}, "'24h'"),
    ):
        refused = create(client, "alice", file_id, **extra)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error"
    assert create(client, "alice", file_id, metadata={"k" * 64: "v" * 512}).status_code == 200


def test_the_queued_work_per_key_is_bounded(tmp_path, tiny_model_dir):
    server = ApiServer(tmp_path / "store", tiny_model_dir, max_queued_lines_per_key=5)
    with server.client(start_runner=False) as client:
        file_id = upload(client, "alice", jsonl(batch_lines(3))).json()["id"]
        assert create(client, "alice", file_id).status_code == 200
        refused = create(client, "alice", file_id)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "queue_limit_exceeded"
        # Another key's queue is its own.
        other = upload(client, "bob", jsonl(batch_lines(3))).json()["id"]
        assert create(client, "bob", other).status_code == 200


def test_retention_deletes_expired_files_and_old_batches_work(tmp_path, tiny_model_dir):
    server = ApiServer(tmp_path / "store", tiny_model_dir, retention_s=3600)
    with server.client(start_runner=False) as client:
        old, kept = (upload(client, "alice", jsonl(batch_lines(1))).json()["id"] for _ in "ab")
        batch_id = create(client, "alice", kept).json()["id"]
        work = tmp_path / "store" / "batches" / batch_id
        work.mkdir(parents=True)
        (work / "ledger.json").write_text("{}")
        server.db.update_batch(batch_id, status="completed", created_at=int(time.time()) - 7200)
        # An hour past both expiries; the runner sweeps on its first step.
        with server.db.engine.begin() as db:
            db.execute(files.update().where(files.c.id == old).values(expires_at=0))
        server.app.state.runner.step()
        gone = client.get(f"/v1/files/{old}", headers=auth("alice"))
        still = client.get(f"/v1/files/{kept}", headers=auth("alice"))
    assert gone.status_code == 404 and still.status_code == 200
    assert sorted(os.listdir(tmp_path / "store" / "files")) == [f"{kept}.jsonl"]
    assert not work.exists() and server.db.batch_by_id(batch_id)["work_removed"] == 1


def test_models_lists_the_served_model_and_its_adapters(tmp_path, tiny_model_dir):
    server = ApiServer(tmp_path / "store", tiny_model_dir, lora={"sql": str(tmp_path / "sql")})
    with server.client(start_runner=False) as client:
        listed = client.get("/v1/models", headers=auth("bob")).json()
    assert listed["object"] == "list"
    assert [(m["id"], m["owned_by"]) for m in listed["data"]] == [
        (tiny_model_dir.name, "tokenmill"),
        ("sql", tiny_model_dir.name),
    ]
