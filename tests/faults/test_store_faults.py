"""Object-store faults between tokenmill and S3 (moto), injected by a proxy on loopback.

Transient faults (reset, 500, 503 SlowDown, stall) on reads and writes are retried by
the one store retry policy and the job completes with exactly one row per id; past
the retry budget the job fails naming the store operation, and leaves no partial part.
A store down for a while (every request reset) is retried through, or fails the same way
and a rerun finishes the job exactly once.
"""

from __future__ import annotations

import botocore.exceptions
import pytest
from proxy import ALL, READS, WRITES, FaultProxy, FaultRule
from store_fixtures import NUM_ROWS, _isolated_cache, bucket_objects, s3, tiny_llm  # noqa: F401 - fixtures
from store_scenarios import drop_own_unreleased_lock, run_through_proxy, transient_rules

from tokenmill.connectors.atomic import TEMP_MARKER
from tokenmill.connectors.fs import resolve
from tokenmill.connectors.store_retries import (
    STORE_RETRY_POLICY,
    StoreError,
    is_store_error,
    store_options,
)
from tokenmill.flows.retries import is_transient

pytestmark = pytest.mark.integration


def test_transient_faults_are_retried_and_the_job_completes(s3, tiny_llm):  # noqa: F811
    run = run_through_proxy(s3, tiny_llm, transient_rules())

    assert run.error is None, run.error
    assert (run.rows_lost, run.rows_duplicated) == (0, 0)
    assert run.num_faults == 7  # every rule fired as often as it was told to
    # Each shard's part was PUT once, plus the two PUTs refused with SlowDown: the
    # retries happened per request, not by redoing shards.
    assert run.num_shards > 2
    assert run.part_puts == run.num_shards + 2


def test_past_the_retry_budget_the_job_fails_clearly_and_leaves_no_part(s3, tiny_llm):  # noqa: F811
    prefix = "store-budget"
    always = [FaultRule("503", WRITES, probability=1.0, path_contains="/out/results/")]
    run = run_through_proxy(s3, tiny_llm, always, prefix=prefix)

    assert isinstance(run.error, StoreError)
    message = str(run.error)
    assert message.startswith(f"writing s3://{s3.bucket}/{prefix}/out/results/")
    assert message.endswith(
        ".parquet failed: SlowDown from the object store on PutObject after 3 attempt(s)"
    )
    assert run.part_puts == 3  # the budget (3 attempts in this test's policy), no more
    assert not is_transient(run.error)  # a flow's task retry would not multiply them
    # Nothing half-written: no part at all, and no temporary object anywhere.
    keys = bucket_objects(s3, prefix)
    assert not [k for k in keys if "/out/results/" in k]
    assert not [k for k in keys if TEMP_MARKER in k]
    assert run.rows_lost == NUM_ROWS

    # The store recovers: the same job resumes and completes, one row per id.
    again = run_through_proxy(s3, tiny_llm, [], prefix=prefix)
    assert again.error is None and (again.rows_lost, again.rows_duplicated) == (0, 0)


def test_a_stalled_store_times_out_and_is_retried(s3, tiny_llm):  # noqa: F811
    rules = [
        FaultRule("stall", READS, first=1, path_contains="/in/", stall_s=2.0),
        FaultRule("stall", WRITES, first=1, path_contains="/out/results/", stall_s=2.0),
    ]
    run = run_through_proxy(s3, tiny_llm, rules, timeouts=True)

    assert run.error is None, run.error
    assert (run.rows_lost, run.rows_duplicated, run.num_faults) == (0, 0, 2)
    assert run.part_puts == run.num_shards + 1


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["reset", "500", "503", "stall"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_faults_on_every_request(s3, tiny_llm, kind, seed):  # noqa: F811
    # One request in five fails. A job makes ~130 requests, so with this test's budget of
    # 3 attempts about one request per job fails all three (0.2^3 x 130): some runs fail.
    # A failed run must fail with the store's error, never half-write, and resume.
    prefix = f"store-random-{kind}-{seed}"
    rules = [FaultRule(kind, ALL, probability=0.2, stall_s=1.5)]
    run = run_through_proxy(s3, tiny_llm, rules, prefix=prefix, seed=seed, timeouts=kind == "stall")

    assert run.num_faults > 0 and run.rows_duplicated == 0
    assert not [k for k in bucket_objects(s3, prefix) if TEMP_MARKER in k]
    if run.error is None:
        assert run.rows_lost == 0
        return
    assert isinstance(run.error, StoreError) and not is_transient(run.error), run.error
    again = run_through_proxy(s3, tiny_llm, [], prefix=prefix)
    assert again.error is None and (again.rows_lost, again.rows_duplicated) == (0, 0)


def test_the_policy_is_configured_once_and_user_settings_win(s3):  # noqa: F811
    fs, _ = resolve(s3.url("x"), {**s3.storage_options, "skip_instance_cache": True})
    retries = fs.config_kwargs["retries"]
    assert retries == {"mode": "standard", "total_max_attempts": STORE_RETRY_POLICY.max_attempts}
    assert fs.retries == 1  # s3fs's own loop is off: botocore's is the only one

    mine = store_options("s3", {"config_kwargs": {"retries": {"total_max_attempts": 2}}})
    assert mine["config_kwargs"]["retries"] == {"total_max_attempts": 2}
    assert store_options("file", {"auto_mkdir": True}) == {"auto_mkdir": True}


@pytest.mark.slow
def test_default_policy_attempts_per_request(s3):  # noqa: F811
    rule = FaultRule("500", WRITES, probability=1.0)
    with FaultProxy(s3.endpoint_url, [rule]) as proxy:
        options = {**s3.storage_options, "endpoint_url": proxy.url, "skip_instance_cache": True}
        fs, path = resolve(s3.url("policy/obj"), options)
        with pytest.raises(OSError) as info:
            fs.pipe_file(path, b"x")
    assert proxy.attempts("PUT") == STORE_RETRY_POLICY.max_attempts
    assert is_store_error(info.value) and not is_transient(info.value)
    assert isinstance(info.value.__cause__, botocore.exceptions.ClientError)


@pytest.mark.parametrize(
    "outage_s",
    [1.0, pytest.param(40.0, marks=pytest.mark.slow)],
    ids=["short", "past-the-budget"],
)
def test_a_store_down_for_a_while_ends_exactly_once_after_at_most_one_rerun(s3, tiny_llm, outage_s):  # noqa: F811
    """Every request reset (a stopped server) for `outage_s` after the first part: a short
    outage is absorbed by the retry policy or fails as a StoreError; one past any backoff
    (at most 1+2+4+8 s of waits) always fails as a StoreError. A rerun then finishes."""
    from scenarios_b import outage

    prefix = f"outage-{int(outage_s)}"
    run = run_through_proxy(s3, tiny_llm, [], prefix=prefix, on_proxy=outage(outage_s))
    assert run.num_faults > 0, "the store never went down"
    if outage_s > 20:
        assert isinstance(run.error, StoreError), run.error
    if run.error is not None:
        assert isinstance(run.error, StoreError), run.error
        message = str(run.error)  # names the operation, the object and the retries
        assert f" s3://{s3.bucket}/{prefix}/out/" in message, message
        assert "failed: " in message and "attempt" in message, message
        # The failed run may not have released its lock while the store was down.
        drop_own_unreleased_lock(s3, prefix)
        run = run_through_proxy(s3, tiny_llm, [], prefix=prefix)
    assert run.error is None, run.error
    assert (run.rows_lost, run.rows_duplicated) == (0, 0)
    assert [k for k in bucket_objects(s3, f"{prefix}/out") if TEMP_MARKER in k] == []
