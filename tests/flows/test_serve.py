"""`tokenmill serve` registers a cron-scheduled deployment, and a triggered run completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
from flow_helpers import ENGINE, prompt_rows
from prefect import get_client
from prefect.exceptions import ObjectNotFound

from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.flows import FLOW_NAME

pytestmark = pytest.mark.integration

CRON = "0 3 * * *"


def wait_for_deployment(name: str, serve: subprocess.Popen, log, timeout_s: float = 90.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert serve.poll() is None, f"tokenmill serve exited:\n{log.read_text()[-3000:]}"
        try:
            with get_client(sync_client=True) as client:
                return client.read_deployment_by_name(f"{FLOW_NAME}/{name}")
        except ObjectNotFound:
            time.sleep(0.5)
    raise AssertionError(f"deployment never registered:\n{log.read_text()[-3000:]}")


def test_served_deployment_runs_on_demand(prefect_api, jsonl_input, tmp_path, tiny_model, unique):
    name = f"tm-test-{unique}"
    # {date}: each scheduled run gets its own output directory.
    output = tmp_path / "daily-{date}"
    args = ["tokenmill", "serve", jsonl_input, str(output), "--name", name, "--cron", CRON]
    args += ["--model", tiny_model, "--id-column", "id", "--max-tokens", "4"]
    args += ["--shard-tokens", "64", "--dtype", ENGINE["dtype"]]
    args += [f"--engine-option=kv_cache_memory={ENGINE['engine_options']['kv_cache_memory']}"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        serve = subprocess.Popen(args, env=os.environ.copy(), stdout=sink, stderr=sink)
    try:
        deployment = wait_for_deployment(name, serve, log)
        assert [s.schedule.cron for s in deployment.schedules] == [CRON]
        assert deployment.parameters["input"] == jsonl_input
        assert deployment.parameters["output"] == str(output)
        assert deployment.parameters["max_tokens"] == 4
        assert deployment.entrypoint == "tokenmill.flows.batch_flow.batch_inference"

        # Flat parameters override the deployment's one by one, as `-p k=v`.
        overrides = ["-p", "max_tokens=2", "-p", "raw=true"]
        run = subprocess.run(
            ["prefect", "deployment", "run", f"{FLOW_NAME}/{name}", *overrides, "--watch"],
            env=os.environ.copy(),
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:] + log.read_text()
        ledgers = list(tmp_path.glob("daily-*/ledger.json"))
        assert len(ledgers) == 1 and "{date}" not in str(ledgers[0])
        ledger = json.loads(ledgers[0].read_text())
        assert ledger["completion_tokens"] <= 2 * ledger["rows_ok"]
        tokenizer = Tokenizer.from_dir(tiny_model)  # raw=true: the prompts as they are
        prompts = [r["prompt"] for r in prompt_rows() if r["prompt"] is not None]
        assert ledger["prompt_tokens"] == sum(len(tokenizer.encode(p)) for p in prompts)
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
