"""Credentials in storage options and URLs never appear in anything a job writes or says:
logs at DEBUG (every logger, botocore's included), stderr, the ledger, the output
objects, error messages and tracebacks, and - for a flow - the Prefect server's logs,
artifacts and run parameters."""

from __future__ import annotations

import json
import logging
import traceback
import uuid

import pytest
from proxy import WRITES, FaultProxy, FaultRule
from store_fixtures import (  # noqa: F401 - fixtures
    FAST_STORE,
    JOB_OPTIONS,
    _isolated_cache,
    bucket_objects,
    prefect_api,
    prompt_rows,
    s3,
    tiny_llm,
    upload_rows,
)

from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_ledger

pytestmark = pytest.mark.integration

SECRET = "sekrit-faults-b-3c9f1e"  # moto accepts any secret: this one can be searched for
TOKEN = "tok3n-faults-b-77aa"
KEY_ID = "AKIDFAULTSB"


def secret_options(endpoint, endpoint_url: str | None = None) -> dict:
    return {
        "key": KEY_ID,
        "secret": SECRET,
        "token": TOKEN,
        "endpoint_url": endpoint_url or endpoint.endpoint_url,
    }


def assert_clean(text: str, where: str) -> None:
    assert SECRET not in text, where
    assert TOKEN not in text, where


def everything_in_bucket(endpoint, prefix: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(**endpoint.storage_options)
    return "\n".join(fs.cat(k).decode("utf-8", "replace") for k in bucket_objects(endpoint, prefix))


@pytest.fixture
def debug_logs(caplog):
    """Every logger at DEBUG: botocore then logs each request it signs and sends."""
    caplog.set_level(logging.DEBUG)
    for name in ("botocore", "aiobotocore", "s3fs", "fsspec", "tokenmill", "urllib3"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


def test_a_job_never_writes_or_logs_its_credentials(s3, tiny_llm, debug_logs, capfd):  # noqa: F811
    prefix = f"creds-{uuid.uuid4().hex[:8]}"
    src = upload_rows(s3, f"{prefix}/in/data.parquet", prompt_rows())
    out = s3.url(f"{prefix}/out")

    ledger = run_job(src, out, llm=tiny_llm, storage_options=secret_options(s3), **JOB_OPTIONS)

    assert ledger.rows_ok == len(prompt_rows())
    assert len(debug_logs.records) > 50  # DEBUG logging really was on
    assert_clean(debug_logs.text, "log records")
    captured = capfd.readouterr()
    assert_clean(captured.out + captured.err, "stdout/stderr")
    assert_clean(json.dumps(read_ledger(out, s3.storage_options).to_dict()), "ledger")
    assert_clean(repr(ledger), "ledger repr")
    assert_clean(everything_in_bucket(s3, prefix), "objects written")


def failure_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


def test_errors_never_carry_credentials(s3, tiny_llm, debug_logs):  # noqa: F811
    prefix = f"creds-err-{uuid.uuid4().hex[:8]}"
    src = upload_rows(s3, f"{prefix}/in/data.parquet", prompt_rows())
    failures = []

    # A URL with credentials in it, a missing input, and a store failing past its budget.
    for bad_input in (f"s3://{KEY_ID}:{SECRET}@{s3.bucket}/{prefix}/in/", s3.url("nope/x.parquet")):
        with pytest.raises(Exception) as info:
            run_job(
                bad_input, s3.url(f"{prefix}/o1"), llm=tiny_llm, storage_options=secret_options(s3)
            )
        failures.append(info.value)
    rule = FaultRule("500", WRITES, probability=1.0, path_contains="/o2/results/")
    with FaultProxy(s3.endpoint_url, [rule]) as proxy:
        options = {**secret_options(s3, proxy.url), **FAST_STORE}
        with pytest.raises(Exception) as info:
            run_job(
                src, s3.url(f"{prefix}/o2"), llm=tiny_llm, storage_options=options, **JOB_OPTIONS
            )
        failures.append(info.value)

    assert "credentials in the URL are not supported" in str(failures[0])
    assert "InternalError from the object store on PutObject" in str(failures[-1])
    for exc in failures:
        assert_clean(failure_text(exc), f"error {type(exc).__name__}")
    assert_clean(debug_logs.text, "log records")


def test_a_flow_never_sends_credentials_to_the_prefect_server(prefect_api, s3, tmp_path):  # noqa: F811
    from prefect import get_client
    from prefect.blocks.system import Secret
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from tiny_model import build_tiny_model

    from tokenmill.flows import batch_inference

    unique = uuid.uuid4().hex[:8]
    prefix = f"creds-flow-{unique}"
    src = upload_rows(s3, f"{prefix}/in/data.parquet", prompt_rows(8))
    out = s3.url(f"{prefix}/out")
    Secret(value=secret_options(s3)).save(f"tm-faults-b-{unique}", overwrite=True)
    model = build_tiny_model(tmp_path / "tiny")

    logging.getLogger("botocore").setLevel(logging.DEBUG)  # the flow's logs at their loudest
    try:
        state = batch_inference(
            input=src,
            output=out,
            model=str(model),
            storage_secret=f"tm-faults-b-{unique}",
            dtype="float32",
            engine_options={"kv_cache_memory": 8 << 20},
            return_state=True,
            **JOB_OPTIONS,
        )
    finally:
        logging.getLogger("botocore").setLevel(logging.NOTSET)
    assert state.is_completed(), state.message
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()

    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(run_id)
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200
        )
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id]))
        )
    assert logs and len(artifacts) >= 2
    server_side = [
        flow_run.model_dump_json(),
        state.model_dump_json(),
        *(log.model_dump_json() for log in logs),
        *(a.model_dump_json() for a in artifacts),
        *(t.model_dump_json() for t in task_runs),
    ]
    for text in server_side:
        assert_clean(text, "Prefect server")
    assert_clean(everything_in_bucket(s3, prefix), "objects written")
