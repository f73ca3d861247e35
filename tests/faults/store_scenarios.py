"""Object-store fault runs: a batch job on S3 through the fault-injecting proxy.

`run_through_proxy` is what the tests call with their fixtures; `store_faults_once`
sets everything up itself (moto, the tiny model) for tests/faults/fault_matrix.py and
returns `(rows_lost, rows_duplicated)`.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from proxy import READS, WRITES, FaultProxy, FaultRule
from store_fixtures import (
    BUCKET,
    EMBED_JOB_OPTIONS,
    JOB_OPTIONS,
    load_tiny_llm,
    lost_and_duplicated,
    prompt_rows,
    through,
    upload_rows,
)

from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_results


@dataclass
class StoreRun:
    """What one job run through the proxy did."""

    rows_lost: int
    rows_duplicated: int
    num_requests: int  # requests the proxy saw (faulted ones included)
    num_faults: int  # requests it failed on purpose
    part_puts: int  # PUTs of result parts (one per shard, plus retried ones)
    num_shards: int
    error: BaseException | None


def transient_rules() -> list[FaultRule]:
    """Each fault kind a few times on reads and writes: a retry budget of 3 absorbs them."""
    return [
        FaultRule("503", WRITES, first=2, path_contains="/results/"),
        FaultRule("500", WRITES, first=1, path_contains="/shard_stats/"),
        FaultRule("reset", WRITES, first=1, path_contains="/_plan/"),
        FaultRule("500", READS, first=1, path_contains="/in/"),
        FaultRule("503", READS, first=1, path_contains="/_plan/"),
        FaultRule("reset", READS, first=1, path_contains="/results"),
    ]


def run_through_proxy(
    endpoint,
    llm,
    rules: list[FaultRule],
    *,
    prefix: str | None = None,
    seed: int = 0,
    timeouts: bool = False,
    task: str = "generate",
    on_proxy: Callable[[FaultProxy], object] | None = None,
) -> StoreRun:
    """Runs one job on S3 with every request going through a proxy with `rules`.

    Args:
        endpoint: the moto server (`S3Endpoint`).
        llm: the engine to run the job on.
        rules: the faults to inject.
        prefix: the job's key prefix in the bucket (default: a fresh one).
        seed: the proxy's random seed (for probability rules).
        timeouts: use 1 s connect/read timeouts (for stall rules).
        task: "generate", or "embed" (then `llm` is an embedding model).
        on_proxy: called with the started proxy before the job runs (e.g. to start a
            thread that changes its rules mid-job).

    Returns:
        Rows lost and duplicated (counted straight from moto, without faults), the
        requests seen, and the job's error if it failed.
    """
    prefix = prefix or f"store-{uuid.uuid4().hex[:8]}"
    rows = prompt_rows()
    src = upload_rows(endpoint, f"{prefix}/in/data.parquet", rows)
    out = endpoint.url(f"{prefix}/out")
    error = None
    num_shards = 0
    with FaultProxy(endpoint.endpoint_url, rules, seed=seed) as proxy:
        if on_proxy is not None:
            on_proxy(proxy)
        try:
            ledger = run_job(
                src,
                out,
                llm=llm,
                storage_options=through(endpoint, proxy.url, timeouts=timeouts),
                **(EMBED_JOB_OPTIONS if task == "embed" else JOB_OPTIONS),
            )
            num_shards = ledger.num_shards
        except Exception as exc:  # the caller judges the failure
            error = exc
    ids = read_results(out, endpoint.storage_options)["id"].to_pylist()
    lost, duplicated = lost_and_duplicated(ids, [r["id"] for r in rows])
    return StoreRun(
        rows_lost=lost,
        rows_duplicated=duplicated,
        num_requests=proxy.attempts(),
        num_faults=proxy.faults(),
        part_puts=proxy.attempts("PUT", "/out/results/"),
        num_shards=num_shards,
        error=error,
    )


def store_faults_once(seed: int = 0) -> tuple[int, int]:
    """One job through the proxy with `transient_rules` (fault matrix entry).

    Returns:
        (rows_lost, rows_duplicated); raises if the job itself failed.
    """
    from s3_server import moto_s3

    with tempfile.TemporaryDirectory() as tmp, moto_s3(bucket=BUCKET) as endpoint:
        run = run_through_proxy(endpoint, load_tiny_llm(Path(tmp)), transient_rules(), seed=seed)
    if run.error is not None:
        raise run.error
    return run.rows_lost, run.rows_duplicated


def drop_own_unreleased_lock(endpoint, prefix: str) -> bool:
    """Delete `prefix`/out's lock if this process's own failed run left it (it could not
    release it while the store was down); says whether there was one.

    A rerun from another process on this host takes such a lock over at once (its pid is
    gone), and from another host once its heartbeat is `STALE_AFTER_S` old; a rerun in
    this same process, as the tests do, would be refused, so it plays the dead holder."""
    import json
    import os

    import s3fs

    fs = s3fs.S3FileSystem(**endpoint.storage_options, skip_instance_cache=True)
    path = f"{endpoint.bucket}/{prefix}/out/_lock.json"
    if not fs.exists(path):
        return False
    holder = json.loads(fs.cat(path))
    if holder["pid"] != os.getpid():
        raise AssertionError(f"the lock is held by another process: {holder}")
    fs.rm(path)
    return True
