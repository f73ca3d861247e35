"""The Batch API server's kill scenario, for its tests and the fault matrix
(tests/faults/fault_matrix.py): `tokenmill batch-api` SIGKILLed mid-batch, started
again on the same store, and every custom_id of the running batch and of the one queued
behind it answered exactly once."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from api_helpers import ServerProcess, batch_lines, jsonl

# Many small shards, so a kill lands between some of them and inside one.
SLOW_ARGS = ("--option", "max_tokens=24", "--option", "shard_tokens=400")
FINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class KillOutcome:
    statuses: list[str]
    lost: int
    duplicated: int
    errors: int  # error lines (none expected: a kill is not a reason to fail a request)
    shards: int  # the running batch's shards
    shards_after_restart: int  # run by the restarted server (the rest were resumed)


def store_args(
    workdir: Path, storage_options: dict[str, Any] | None, database_url: str | None
) -> list[str]:
    """`--store` aside, what the server needs for the store and its database: an object
    store keeps its SQLite database on local disk, unless a database is given."""
    args = []
    if storage_options is not None:
        database_url = database_url or f"sqlite:///{workdir / 'state.sqlite3'}"
        args += ["--storage-options", json.dumps(storage_options)]
    if database_url is not None:
        args += ["--database-url", database_url]
    return args


def _poll(client, batch_id: str, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in FINAL:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch still {batch.status} after {timeout} s")
        time.sleep(0.2)


def _custom_ids(client, file_id: str | None) -> list[str]:
    if file_id is None:
        return []
    text = client.files.content(file_id).text
    return [json.loads(line)["custom_id"] for line in text.splitlines() if line.strip()]


def kill_and_restart(
    workdir: Path,
    model_dir: Path,
    store: str,
    *,
    storage_options: dict[str, Any] | None = None,
    database_url: str | None = None,
    rng: random.Random | None = None,
    read_ledger=None,
    timeout: float = 300.0,
) -> KillOutcome:
    """Run the scenario; `read_ledger(batch_id)` gives the running batch's ledger."""
    rng = rng or random.Random(0)
    server = ServerProcess(
        store, model_dir, *SLOW_ARGS, *store_args(workdir, storage_options, database_url)
    )
    log = workdir / "server.log"
    server.start(log)
    expected = {}
    try:
        client = server.client()
        batches = []
        for prefix, count in (("a", 60), ("b", 10)):
            lines = batch_lines(count, prefix=prefix, max_tokens=24)
            uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            batch = client.batches.create(
                input_file_id=uploaded.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
            batches.append(batch.id)
            expected[batch.id] = [line["custom_id"] for line in lines]
        # Kill once some shards of the first batch are published, a random number of them.
        after = rng.randint(1, 30)
        deadline = time.monotonic() + timeout
        while client.batches.retrieve(batches[0]).request_counts.completed < after:
            assert time.monotonic() < deadline, "the first batch never got going"
            time.sleep(0.02)
        server.kill()
        server.start(log)
        client = server.client()
        done = [_poll(client, batch_id, timeout) for batch_id in batches]
        answers = [
            (_custom_ids(client, b.output_file_id), _custom_ids(client, b.error_file_id))
            for b in done
        ]
    finally:
        server.stop()
    lost = duplicated = errors = 0
    for batch, (answered, failed) in zip(done, answers):
        counts = Counter(answered + failed)
        lost += len(set(expected[batch.id]) - set(counts))
        duplicated += sum(n - 1 for n in counts.values())
        errors += len(failed)
    ledger = read_ledger(batches[0]) if read_ledger else None
    return KillOutcome(
        [b.status for b in done],
        lost,
        duplicated,
        errors,
        ledger.num_shards if ledger else 0,
        ledger.num_shards_run if ledger else 0,
    )
