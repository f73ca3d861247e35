"""Part B's fault scenarios, one function each, for tests/faults/fault_matrix.py.

Each function sets up what it needs (moto on loopback, the tiny model, temporary
directories), runs its scenario once and returns `(rows_lost, rows_duplicated)`;
a scenario that ends in a failed job first resumes it, as an operator would, and
counts what the resumed job left. Put this directory and tests/ on sys.path first;
`worker_death` needs a Prefect server (PREFECT_API_URL) and, since it starts worker
processes, a caller under `if __name__ == "__main__":`.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proxy import ALL, WRITES, FaultRule
from store_fixtures import BUCKET, load_tiny_llm, lost_and_duplicated
from store_scenarios import drop_own_unreleased_lock, run_through_proxy, transient_rules
from tiny_model import build_tiny_model

ENGINE = {"dtype": "float32", "engine_options": {"kv_cache_memory": 8 << 20}}


@contextmanager
def _store(task: str = "generate") -> Iterator[tuple]:
    from s3_server import moto_s3

    with tempfile.TemporaryDirectory() as tmp, moto_s3(bucket=BUCKET) as endpoint:
        yield endpoint, load_tiny_llm(Path(tmp), task)


def _resumed(endpoint, llm, run, prefix: str, task: str = "generate") -> tuple[int, int]:
    if run.error is None:
        return run.rows_lost, run.rows_duplicated
    again = run_through_proxy(endpoint, llm, [], prefix=prefix, task=task)
    if again.error is not None:
        raise again.error
    return again.rows_lost, again.rows_duplicated


def store_transient(seed: int = 0, task: str = "generate") -> tuple[int, int]:
    """Reset, 500, 503 SlowDown on reads and writes, a few times each: retried, completes."""
    with _store(task) as (endpoint, llm):
        run = run_through_proxy(endpoint, llm, transient_rules(), seed=seed, task=task)
    if run.error is not None:
        raise run.error
    return run.rows_lost, run.rows_duplicated


def store_past_budget(seed: int = 0, task: str = "generate") -> tuple[int, int]:
    """Every part PUT answered 503 until the job fails; then the store heals and it resumes."""
    rules = [FaultRule("503", WRITES, probability=1.0, path_contains="/out/results/")]
    prefix = f"budget-{uuid.uuid4().hex[:8]}"
    with _store(task) as (endpoint, llm):
        run = run_through_proxy(endpoint, llm, rules, prefix=prefix, seed=seed, task=task)
        assert run.error is not None, "the job should have run out of attempts"
        return _resumed(endpoint, llm, run, prefix, task)


def store_random(
    kind: str = "503", seed: int = 0, probability: float = 0.2, task: str = "generate"
) -> tuple[int, int]:
    """A fault of `kind` on any request with `probability`; resumed once if it failed."""
    rules = [FaultRule(kind, ALL, probability=probability, stall_s=1.5)]
    prefix = f"random-{kind}-{uuid.uuid4().hex[:8]}"
    with _store(task) as (endpoint, llm):
        run = run_through_proxy(
            endpoint, llm, rules, prefix=prefix, seed=seed, timeouts=kind == "stall", task=task
        )
        return _resumed(endpoint, llm, run, prefix, task)


def store_outage(seed: int = 0, outage_s: float = 3.0, task: str = "generate") -> tuple[int, int]:
    """The store goes down (every request reset, as a stopped server's port) for `outage_s`
    seconds once the first part is written, then comes back. Requests retry through the
    store's retry policy; a job that ran out of attempts must say so (StoreError) and
    is resumed once."""
    from tokenmill.connectors.store_retries import StoreError

    prefix = f"outage-{uuid.uuid4().hex[:8]}"
    with _store(task) as (endpoint, llm):
        run = run_through_proxy(
            endpoint, llm, [], prefix=prefix, seed=seed, task=task, on_proxy=outage(outage_s)
        )
        if run.error is not None and not _caused_by(run.error, StoreError):
            raise run.error
        if run.error is not None:
            drop_own_unreleased_lock(endpoint, prefix)
        return _resumed(endpoint, llm, run, prefix, task)


def outage(seconds: float, after_part_puts: int = 1):
    """An `on_proxy` hook: a thread that resets every request for `seconds` once
    `after_part_puts` part PUTs went through, then lets everything through again."""

    def start(proxy) -> None:
        def down_then_up() -> None:
            while proxy.attempts("PUT", "/out/results/") < after_part_puts:
                time.sleep(0.01)
            proxy.set_rules([FaultRule("reset", ALL, probability=1.0)])
            time.sleep(seconds)
            proxy.set_rules([])

        threading.Thread(target=down_then_up, daemon=True).start()

    return start


def _caused_by(error: BaseException, kind: type) -> bool:
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__ or error.__context__
    return False


def worker_death(num_rows: int = 16, operator: str | None = None) -> tuple[int, int]:
    """A Dask worker SIGKILLed inside a shard, on a 2-worker LocalCluster; or, with
    `operator` "restarted" or "never-back", on a cluster of `dask scheduler` and `dask
    worker` processes whose killed worker its nanny restarts, or that has no nanny."""
    from operator_cluster import operator_cluster
    from worker_scenarios import run_with_worker_death

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        address = None
        if operator is not None:
            nanny = {"restarted": True, "never-back": False}[operator]
            address = stack.enter_context(operator_cluster(tmp / "cluster", 2, nanny=nanny)).address
        model = build_tiny_model(tmp / "tiny")
        src = tmp / "prompts.jsonl"
        rows = [
            {"id": f"w{i:03d}", "prompt": f"Count {i}: " + "one " * (i % 4)}
            for i in range(num_rows)
        ]
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        run = run_with_worker_death(
            str(src),
            str(tmp / "out"),
            str(model),
            str(tmp / "kill.marker"),
            scheduler_address=address,
            id_column="id",
            max_tokens=6,
            shard_tokens=48,
            **ENGINE,
        )
    assert run.killed_pid is not None and run.completed, run
    return run.rows_lost, run.rows_duplicated


def scheduler_restart(num_rows: int = 16) -> tuple[int, int]:
    """The `dask scheduler` SIGKILLed once 2 parts are published and started again on the
    same address (its workers too, which close with it): the flow fails naming the lost
    scheduler, and a rerun on the restarted cluster finishes the job."""
    from operator_cluster import operator_cluster
    from worker_scenarios import run_with_scheduler_restart

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(tmp / "tiny")
        src = tmp / "prompts.jsonl"
        rows = [
            {"id": f"w{i:03d}", "prompt": f"Count {i}: " + "one " * (i % 4)}
            for i in range(num_rows)
        ]
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with operator_cluster(tmp / "cluster", 2) as cluster:
            run = run_with_scheduler_restart(
                cluster,
                str(src),
                str(tmp / "out"),
                str(model),
                id_column="id",
                max_tokens=6,
                shard_tokens=48,
                **ENGINE,
            )
    assert run.restarted and run.rerun_completed, run
    assert run.first_completed or "scheduler-connection-lost" in (run.first_message or ""), run
    return run.rows_lost, run.rows_duplicated


def hostile_ids() -> tuple[int, int]:
    """Ids like `../../x`, absolute paths, NUL bytes, 5,000 characters."""
    from test_hostile_input import HOSTILE_IDS

    from tokenmill.pipelines.job import run_job
    from tokenmill.pipelines.output import read_results

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "in.jsonl"
        src.write_text("".join(json.dumps({"id": i, "prompt": "p"}) + "\n" for i in HOSTILE_IDS))
        model = build_tiny_model(tmp / "tiny")
        run_job(
            str(src), str(tmp / "out"), model=str(model), id_column="id", max_tokens=2, **ENGINE
        )
        outside = [p for p in tmp.rglob("*") if p.is_file() and "out" not in p.parts]
        assert sorted(p.name for p in outside if p.parent == tmp) == ["in.jsonl"], outside
        ids = read_results(str(tmp / "out"))["id"].to_pylist()
    return lost_and_duplicated(ids, HOSTILE_IDS)


def hostile_bytes(field_mib: int = 40) -> tuple[int, int]:
    """Invalid UTF-8 in a JSONL prompt, a JSONL id, a CSV row and a gzipped CSV with a
    BOM, and a `field_mib` MB CSV field: one job each; the good rows must be answered and
    each bad row must be one error row naming its line."""
    from hostile_bytes import write_hostile_inputs

    from tokenmill.pipelines.job import run_job
    from tokenmill.pipelines.output import read_results

    lost = duplicated = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(tmp / "tiny")
        for index, hostile in enumerate(write_hostile_inputs(tmp / "in", field_mib=field_mib)):
            out = tmp / f"out-{index}"
            run_job(
                str(hostile.path),
                str(out),
                model=str(model),
                id_column="id",
                max_tokens=2,
                **ENGINE,
            )
            rows_lost, rows_duplicated = hostile.check(read_results(str(out)))
            lost, duplicated = lost + rows_lost, duplicated + rows_duplicated
    return lost, duplicated


SCENARIOS = {
    "store_transient": store_transient,
    "store_past_budget": store_past_budget,
    "store_random": store_random,
    "worker_death": worker_death,
    "store_outage": store_outage,
    "scheduler_restart": scheduler_restart,
    "hostile_ids": hostile_ids,
    "hostile_bytes": hostile_bytes,
}


def main(argv: list[str]) -> None:
    """`python tests/faults/scenarios_b.py SCENARIO [RUNS]`: one JSON line per run."""
    import time

    name, runs = argv[0], int(argv[1]) if len(argv) > 1 else 1
    for index in range(runs):
        start = time.monotonic()
        kwargs = {"seed": index} if name.startswith("store") else {}
        lost, duplicated = SCENARIOS[name](**kwargs)
        record = {"scenario": name, "run": index, "rows_lost": lost}
        record.update(rows_duplicated=duplicated, seconds=round(time.monotonic() - start, 1))
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
