"""`tokenmill batch-api --runner prefect`: each batch is a flow run of the served
batch-inference deployment, named after the batch, and its answers come back through
the API as with the in-process runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
from test_serve import wait_for_deployment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "batch_api"))
from api_helpers import ServerProcess, batch_lines, jsonl  # noqa: E402

from tokenmill.flows import FLOW_NAME  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# A deployment of the flow with no schedule, as a team's worker would serve it.
SERVE = (
    "from prefect.types.entrypoint import EntrypointType\n"
    "from tokenmill.flows.batch_flow import batch_inference\n"
    "batch_inference.serve(name={name!r}, entrypoint_type=EntrypointType.MODULE_PATH)\n"
)


def test_each_batch_is_a_flow_run_of_the_deployment(prefect_api, tiny_model, tmp_path, unique):
    name = f"batch-api-{unique}"
    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        serve = subprocess.Popen(
            [sys.executable, "-c", SERVE.format(name=name)],
            env=os.environ.copy(),
            stdout=sink,
            stderr=sink,
        )
    server = ServerProcess(
        str(tmp_path / "store"),
        Path(tiny_model),
        "--runner",
        "prefect",
        "--prefect-deployment",
        f"{FLOW_NAME}/{name}",
        "--option",
        "max_tokens=4",
        "--option",
        "dtype=float32",
    )
    try:
        wait_for_deployment(name, serve, log)
        server.start(tmp_path / "server.log")
        client = server.client()
        uploaded = client.files.create(file=("in.jsonl", jsonl(batch_lines(6))), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 300
        while (done := client.batches.retrieve(batch.id)).status not in (
            "completed",
            "failed",
            "cancelled",
            "expired",
        ):
            assert time.monotonic() < deadline, done
            time.sleep(0.5)
        assert done.status == "completed", (done.errors, (tmp_path / "server.log").read_text())
        output = client.files.content(done.output_file_id).text.splitlines()
        # Read before the serving process stops: on shutdown it marks its runs cancelled.
        with get_client(sync_client=True) as prefect:
            (run,) = prefect.read_flow_runs(
                flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[batch.id]))
            )
    finally:
        server.stop()
        serve.terminate()
        serve.wait(30)
    assert done.request_counts.total == 6 and done.request_counts.completed == 6
    counts = Counter(json.loads(line)["custom_id"] for line in output)
    assert sorted(counts) == [f"r{i}" for i in range(6)] and set(counts.values()) == {1}
    assert run.state.is_completed() and run.name.endswith(f"/batches/{batch.id}")
    assert run.parameters["output"] == str(tmp_path / "store" / "batches" / batch.id)
    assert run.parameters["format"] == "openai-batch"
