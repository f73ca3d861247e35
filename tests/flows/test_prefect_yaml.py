"""The `examples/prefect.yaml` work-pool deployment is valid: `prefect deploy` registers it."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest
from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists

from tokenmill.flows import FLOW_NAME, batch_inference

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "prefect.yaml"


def test_example_prefect_yaml_deploys(prefect_api, tmp_path):
    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):
        client.create_work_pool(WorkPoolCreate(name="tokenmill-pool", type="process"))
    deploy = subprocess.run(
        ["prefect", "--no-prompt", "deploy", "--prefect-file", str(EXAMPLE), "--all"],
        cwd=tmp_path,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(f"{FLOW_NAME}/nightly-answers")
    assert deployment.entrypoint == "tokenmill.flows.batch_flow.batch_inference"
    assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
    assert deployment.work_pool_name == "tokenmill-pool"
    batch_inference.validate_parameters(deployment.parameters)  # the schema accepts them
