"""`tokenmill flow run` and `tokenmill serve`: options, parameters and exit status."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from flow_helpers import ENGINE

from tokenmill.cli import main
from tokenmill.cli.flow import flow_parameters, run_flow
from tokenmill.cli.options import given_options
from tokenmill.cli.run import run as run_command
from tokenmill.cli.serve import serve
from tokenmill.flows import batch_inference
from tokenmill.pipelines.option_types import FLOW

FLOW_PARAMS = set(inspect.signature(batch_inference.fn).parameters)


def test_flow_run_takes_every_job_option_of_tokenmill_run():
    run_options = {p.name for p in run_command.params if isinstance(p, click.Option)}
    flow_options = {p.name for p in run_flow.params}
    assert run_options - {"progress", "as_json"} <= flow_options
    assert {"dask_workers", "dask_address", "ray_address", "storage_secret"} <= flow_options
    assert {p.name for p in serve.params} >= run_options - {"progress", "as_json"}


def test_every_option_becomes_a_flow_parameter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["in.jsonl", "out", "--model", "m", "--format", "jsonl", "--passthrough", "a"]
    args += ["--stop", "\n", "--storage-option", "endpoint_url=http://e", "--max-tokens", "7"]
    args += ["--engine-option", "kv_cache_memory=1024", "--shard-tokens", "99", "--raw"]
    args += ["--price-input", "1", "--storage-secret", "blk", "--no-resume"]
    args += ["--plan-window-rows", "5000"]
    with run_flow.make_context(run_flow.name, args) as ctx:
        params = flow_parameters("in.jsonl", "out", given_options(ctx, FLOW))
    assert set(params) <= FLOW_PARAMS
    assert params["input"] == str(tmp_path / "in.jsonl")  # tasks may run elsewhere
    assert params["output"] == str(tmp_path / "out")
    assert params["format"] == "jsonl" and params["passthrough"] == ["a"]
    assert params["stop"] == ["\n"] and params["max_tokens"] == 7
    assert params["storage_options"] == {"endpoint_url": "http://e"}
    assert params["engine_options"] == {"kv_cache_memory": 1024}
    assert params["shard_tokens"] == 99 and params["resume"] is False
    assert params["plan_window_rows"] == 5000
    assert params["storage_secret"] == "blk" and params["raw"] is True
    assert "max_tokens" in params and "temperature" not in params  # unset: the flow's default
    batch_inference.validate_parameters(params)  # the flow's schema accepts them all


def test_credentials_on_the_command_line_are_refused_before_any_run():
    result = CliRunner().invoke(
        main, ["flow", "run", "in.jsonl", "s3://b/out", "--storage-option", "secret=hunter2"]
    )
    assert result.exit_code == 2
    assert "storage_secret" in result.output and "hunter2" not in result.output


def test_two_clusters_are_refused():
    result = CliRunner().invoke(
        main, ["flow", "run", "a", "b", "--dask-workers", "2", "--dask-address", "tcp://x:1"]
    )
    assert result.exit_code == 2 and "at most one" in result.output


def engine_args() -> list[str]:
    return ["--dtype", ENGINE["dtype"]] + [
        f"--engine-option={k}={v}" for k, v in ENGINE["engine_options"].items()
    ]


@pytest.mark.integration
def test_flow_run_command_completes_and_prints_the_ledger(
    prefect_api, jsonl_input, tmp_path, tiny_model
):
    output = tmp_path / "out"
    args = ["flow", "run", jsonl_input, str(output), "--model", tiny_model, "--id-column", "id"]
    args += ["--max-tokens", "4", "--shard-tokens", "64", "--json", *engine_args()]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output[result.output.index("{") :])
    assert printed == json.loads((output / "ledger.json").read_text())
    assert printed["rows_ok"] + printed["rows_failed"] == 16


@pytest.mark.integration
def test_flow_run_command_exits_non_zero_when_the_flow_fails(prefect_api, tmp_path, tiny_model):
    missing = tmp_path / "missing.jsonl"
    args = ["flow", "run", str(missing), str(tmp_path / "out"), "--model", tiny_model]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "flow run Failed" in result.output and "missing.jsonl" in result.output
    assert not Path(tmp_path / "out").exists()
