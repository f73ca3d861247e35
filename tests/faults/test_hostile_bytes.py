"""Bytes that are not text and fields larger than the limit, through `tokenmill run` and
an object store: every good row is answered, each bad row is one error row naming its
file and line, and the job's peak memory stays within 500 MB of the same job without
the bad row (read from the kernel's accounting of the child process)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import s3fs
from fault_jobs import FaultJob
from hostile_bytes import HostileInput, write_hostile_inputs
from scenarios_b import hostile_bytes

from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_results

ENGINE = {"dtype": "float32", "engine_options": {"kv_cache_memory": 8 << 20}}
# The three cases: a bad JSONL line, a bad CSV row, a 40 MB CSV field.
CLI_CASES = ["prompt.jsonl", "prompt.csv", "field.csv"]
RSS_MARGIN_MIB = 500


def run_cli(model_dir: Path, src: Path, out: Path) -> tuple[int, str, float]:
    """`tokenmill run` in a child process: (exit code, output, peak RSS in MiB)."""
    child = subprocess.Popen(
        FaultJob(model_dir, src, out).command(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={k: v for k, v in os.environ.items() if k != "TOKENMILL_FAULT_POINT"},
    )
    output = child.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    child.stdout.close()
    return child.returncode, output, usage.ru_maxrss / 1024  # Linux reports KiB


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory, tiny_model_dir) -> dict[str, tuple[HostileInput, dict]]:
    """Each CLI case and its baseline run once: name -> (input, measurements)."""
    directory = tmp_path_factory.mktemp("hostile-bytes")
    inputs = {h.path.name: h for h in write_hostile_inputs(directory / "in")}
    runs = {}
    for name in CLI_CASES:
        hostile = inputs[name]
        measured = {}
        for kind, src in (("baseline", hostile.baseline), ("hostile", hostile.path)):
            out = directory / f"out-{kind}-{name}"
            code, output, peak = run_cli(tiny_model_dir, src, out)
            assert code == 0, output[-3000:]
            measured[kind] = peak
            measured[f"{kind}_results"] = read_results(str(out))
        runs[name] = (hostile, measured)
    return runs


@pytest.mark.parametrize("name", CLI_CASES)
def test_tokenmill_run_answers_good_rows_and_names_the_bad_line(cli_runs, name):
    hostile, measured = cli_runs[name]

    assert hostile.check(measured["hostile_results"]) == (0, 0)
    assert measured["baseline_results"].num_rows == len(hostile.good_ids)
    growth = measured["hostile"] - measured["baseline"]
    assert growth < RSS_MARGIN_MIB, (name, measured["baseline"], measured["hostile"])


def test_every_hostile_input_on_an_object_store(tmp_path, s3, tiny_model_dir):
    fs = s3fs.S3FileSystem(**s3.storage_options)
    for hostile in write_hostile_inputs(tmp_path / "in"):
        url = s3.url(f"hostile-bytes/{hostile.path.name}")
        fs.put_file(str(hostile.path), url)
        out = s3.url(f"hostile-bytes/out-{hostile.path.name}")

        ledger = run_job(
            url,
            out,
            model=str(tiny_model_dir),
            id_column="id",
            max_tokens=2,
            storage_options=s3.storage_options,
            **ENGINE,
        )

        results = read_results(out, s3.storage_options)
        assert hostile.check(results, shown_as=url) == (0, 0), hostile.name
        assert (ledger.rows_ok, ledger.rows_failed) == (3, len(hostile.bad_lines))


def test_the_fault_matrix_scenario_counts_nothing_lost():
    assert hostile_bytes() == (0, 0)
