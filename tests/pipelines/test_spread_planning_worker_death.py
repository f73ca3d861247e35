"""A Dask worker SIGKILLed in the middle of a planning part (after it staged one of its
windows, while writing the next): Dask runs the part again on a live worker, and the
plan is the local planner's, file for file - no row lost, none planned twice. Worker
processes (a nanny restarts the killed one); a tiny model's tokenizer, no compute."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from distributed import Client, LocalCluster

from tokenmill import faults
from tokenmill.flows.runners import DaskFanOut
from tokenmill.pipelines import output as out
from tokenmill.pipelines.job import plan_job
from tokenmill.pipelines.spec import JobSpec
from tokenmill.pipelines.spread_planning import plan_job_spread, read_part

NUM_ROWS = 40
WINDOW = 5  # each of the two parts stages four windows


def _input(path) -> str:
    lines = [
        json.dumps({"key": f"k{i}", "prompt": f"Note {i % 3}: say {i} twice."})
        for i in range(NUM_ROWS)
    ]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _spec(src: str, output, model: str) -> JobSpec:
    return JobSpec(
        src,
        str(output),
        model=model,
        id_column="key",
        shard_tokens=60,
        plan_window_rows=WINDOW,
        max_tokens=4,
    )


def _plan_files(output) -> dict[str, bytes]:
    return {p.stem: p.read_bytes() for p in (output / "_plan").glob("*.parquet")}


class KillOnceFanOut(DaskFanOut):
    """DaskFanOut whose first reading part kills its worker process at its second staged
    window's write (the fault point of every atomic write, `tokenmill/faults.py`); a
    marker file makes it happen once in the cluster, so the part's rerun lives."""

    def __init__(self, num_parts: int, marker: str):
        super().__init__(num_parts)
        self.marker = marker

    def map(self, fn, args):
        if fn is not read_part:
            return super().map(fn, args)
        marker = self.marker

        def read_part_killed_once(*part_args):
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:  # the kill happened: run the part as it is
                return read_part(*part_args)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            # staged pieces are named <window>-<first row>: "_windows/0" is only them
            os.environ[faults.ENV_VAR] = f"write@{out.WINDOWS_DIR}/0:2:kill"
            faults.reset()
            return read_part(*part_args)

        return super().map(read_part_killed_once, args[:1]) + super().map(read_part, args[1:])


@pytest.fixture
def worker_processes():
    with (
        LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


def test_a_worker_killed_mid_part_plans_every_row_once(tmp_path, tiny_model_dir, worker_processes):
    src = _input(tmp_path / "in.jsonl")
    output = tmp_path / "out"
    spec = _spec(src, output, str(tiny_model_dir))
    local = plan_job(spec, min_shards=2)
    local_files = _plan_files(output)
    shutil.rmtree(output)
    pids_before = set(worker_processes.run(os.getpid).values())

    marker = str(tmp_path / "killed.pid")
    spread = plan_job_spread(
        spec, fan_out=KillOnceFanOut(2, marker), min_shards=2, min_range_bytes=1
    )

    killed = int((tmp_path / "killed.pid").read_text())
    assert killed in pids_before  # a worker really ran the part and died in it
    assert killed not in set(worker_processes.run(os.getpid).values())
    assert spread.num_rows == local.num_rows == NUM_ROWS
    assert spread.shards == local.shards and spread.job_id == local.job_id
    assert _plan_files(output) == local_files  # every row once, byte for byte
    assert not (output / out.WINDOWS_DIR).exists()  # the killed part's staging is gone too
