"""A Dask worker killed mid-shard: the shard runs again on another worker, the flow
completes, no row is lost or duplicated, and the ledger equals the rows."""

from __future__ import annotations

import json
import os

import pytest
from store_fixtures import _isolated_cache, prefect_api  # noqa: F401 - fixtures
from tiny_model import build_tiny_model
from worker_scenarios import run_with_worker_death

pytestmark = pytest.mark.integration

NUM_ROWS = 16
OPTIONS = {
    "id_column": "id",
    "max_tokens": 6,
    "shard_tokens": 48,
    "dtype": "float32",
    "engine_options": {"kv_cache_memory": 16 << 20},
}


def write_prompts(path) -> str:
    rows = [
        {"id": f"w{i:03d}", "prompt": f"Count with me {i}: " + "one " * (i % 4)}
        for i in range(NUM_ROWS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def pid_is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_worker_killed_mid_shard_loses_and_duplicates_nothing(prefect_api, tmp_path):  # noqa: F811
    check_worker_death(tmp_path, kill_at=2)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [1, 4, 9, 14])
def test_worker_death_at_other_shards(prefect_api, tmp_path, kill_at):  # noqa: F811
    check_worker_death(tmp_path, kill_at=kill_at)


def check_worker_death(tmp_path, kill_at: int) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    src = write_prompts(tmp_path / "prompts.jsonl")

    run = run_with_worker_death(
        src,
        str(tmp_path / "out"),
        str(model),
        str(tmp_path / "kill.marker"),
        kill_at=kill_at,
        **OPTIONS,
    )

    assert run.killed_pid is not None, "the fault hook never fired"
    assert not pid_is_alive(run.killed_pid)  # the worker really died
    assert run.completed, run.message
    assert (run.rows_lost, run.rows_duplicated) == (0, 0)
    assert run.ledger_rows == NUM_ROWS and run.num_shards > 2
    assert (run.num_parts, run.num_temp_files) == (run.num_shards, 0)
