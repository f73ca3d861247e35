"""Two runs on one output at once: the second is refused while the first holds the
output lock, and the output ends with exactly the first run's rows - on local disk
(flock) and on S3 (a conditionally created lock object with a heartbeat)."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import s3fs
from fault_jobs import FaultJob, write_input

from tokenmill.pipelines.output_lock import LockHolder, OutputLockedError, output_lock


def test_second_cli_run_is_refused_while_the_first_runs(fault_job, tmp_path):
    # The first run stalls in its first engine step, holding the lock.
    first = fault_job.start("engine_step:1:stall", stall_s=5)
    try:
        deadline = time.monotonic() + 60
        while (
            not (fault_job.output / "results").exists()
            and not (fault_job.output / "_input.json").exists()
        ):
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()
            time.sleep(0.05)
        other_input = write_input(tmp_path / "other.parquet", variant="-other")
        second = FaultJob(fault_job.model_dir, other_input, fault_job.output).run()
        assert second.returncode == 1
        assert "is in use by run" in second.output and f"pid {first.pid}" in second.output
        assert "use another output location" in second.output
        output, _ = first.communicate(timeout=120)
        assert first.returncode == 0, output[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    outcome = fault_job.outcome()
    assert outcome.ok  # only the first run's rows, each once
    assert not (fault_job.output / "_lock.json").exists()


@pytest.mark.slow
def test_local_lock_is_released_by_a_killed_holder(fault_job):
    killed = fault_job.run("engine_step:2")
    assert killed.killed
    holder = json.loads((fault_job.output / "_lock.json").read_text())
    assert holder["pid"] != os.getpid()  # the dead run's file is still there...
    assert fault_job.run().returncode == 0  # ...but its flock died with it
    assert fault_job.outcome().ok


def test_local_lock_refuses_a_second_holder_in_the_same_process(tmp_path):
    with output_lock(str(tmp_path / "out")) as holder:
        with (
            pytest.raises(OutputLockedError, match=f"pid {os.getpid()}"),
            output_lock(str(tmp_path / "out")),
        ):
            pass
        assert json.loads((tmp_path / "out" / "_lock.json").read_text())["run_id"] == holder.run_id
    assert not (tmp_path / "out").exists()  # nothing was written: no directory left
    with output_lock(str(tmp_path / "out")):
        pass


def test_s3_lock_refuses_takes_over_stale_and_heartbeats(s3):
    out = s3.url(f"lock-{time.time_ns()}/out")
    opts = s3.storage_options
    fs = s3fs.S3FileSystem(**opts)
    key = out.removeprefix("s3://") + "/_lock.json"
    with output_lock(out, opts, heartbeat_s=0.2) as holder:
        with pytest.raises(OutputLockedError, match="is in use by run"), output_lock(out, opts):
            pass
        first = json.loads(fs.cat_file(key))
        time.sleep(0.7)
        fs.invalidate_cache()
        assert json.loads(fs.cat_file(key))["heartbeat_at"] > first["heartbeat_at"]
        assert first["run_id"] == holder.run_id
    fs.invalidate_cache()
    assert not fs.exists(key)  # released

    # A lock left by a dead process on this host is stale at once.
    dead = LockHolder("dead-run", socket.gethostname(), _dead_pid(), time.time(), time.time())
    fs.pipe_file(key, dead.to_bytes())
    with output_lock(out, opts) as holder:
        assert json.loads(fs.cat_file(key))["run_id"] == holder.run_id
    # One from another host is stale only when its heartbeat is old.
    elsewhere = LockHolder("far-run", "other-host", 1, time.time(), time.time())
    fs.pipe_file(key, elsewhere.to_bytes())
    with pytest.raises(OutputLockedError, match="pid 1 on other-host"), output_lock(out, opts):
        pass
    elsewhere.heartbeat_at -= 3600
    fs.pipe_file(key, elsewhere.to_bytes())
    with output_lock(out, opts, stale_after_s=60):
        pass


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_a_store_failing_to_release_the_lock_fails_nothing(s3, monkeypatch):
    """The lock's delete times out after the run: the run's own outcome stands (its error
    is not replaced), a warning says so, and the lock left behind goes stale."""
    import logging

    from botocore.exceptions import ReadTimeoutError

    from tokenmill.pipelines import output_lock as module

    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append  # the CLI tests may have stopped propagation
    module.log.addHandler(handler)

    out = s3.url(f"lock-{time.time_ns()}/out")
    # a filesystem made after the patch below (fsspec binds cached instances' methods)
    opts = {**s3.storage_options, "skip_instance_cache": True}
    key = out.removeprefix("s3://") + "/_lock.json"

    def timing_out(self, path, *args, **kwargs):
        raise ReadTimeoutError(endpoint_url="http://127.0.0.1/bucket?delete")

    monkeypatch.setattr(s3fs.S3FileSystem, "rm", timing_out)
    with pytest.raises(ValueError, match="the run's own error"), output_lock(out, opts):
        raise ValueError("the run's own error")
    with output_lock(out + "2", opts):
        pass
    module.log.removeHandler(handler)
    assert any("could not release the lock" in r.getMessage() for r in warnings)
    monkeypatch.undo()
    fs = s3fs.S3FileSystem(**opts)
    assert fs.exists(key)  # left behind; a later run takes it over once stale
    with output_lock(out, opts, stale_after_s=0):
        pass


def test_a_store_failing_to_take_the_lock_fails_the_run_with_a_store_error(s3, monkeypatch):
    """The lock's create times out at job start: the run stops there with a StoreError
    naming the lock object (credentials redacted), not the client's raw exception."""
    from botocore.exceptions import ReadTimeoutError

    from tokenmill.connectors.store_retries import StoreError

    out = s3.url(f"lock-{time.time_ns()}/out")
    opts = {**s3.storage_options, "skip_instance_cache": True}

    def timing_out(self, path, *args, **kwargs):
        raise ReadTimeoutError(endpoint_url="http://127.0.0.1/bucket/out/_lock.json")

    monkeypatch.setattr(s3fs.S3FileSystem, "pipe_file", timing_out)
    body_ran = False
    with (
        pytest.raises(StoreError, match=r"taking the lock s3://.*/_lock\.json failed: ReadTimeout"),
        output_lock(out, opts),
    ):
        body_ran = True
    assert not body_ran


def test_the_heartbeat_outlives_a_store_that_fails_some_beats(s3, monkeypatch):
    """Reading the lock fails on two beats in a row: each is logged and the next beat
    renews the lock, rather than the error ending the heartbeat thread for good (which
    would let the lock go stale under a live run)."""
    import logging

    from botocore.exceptions import ReadTimeoutError

    from tokenmill.pipelines import output_lock as module

    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    module.log.addHandler(handler)

    out = s3.url(f"lock-{time.time_ns()}/out")
    opts = {**s3.storage_options, "skip_instance_cache": True}
    key = out.removeprefix("s3://") + "/_lock.json"
    real_cat_file = s3fs.S3FileSystem.cat_file
    failures = {"left": 2}

    def failing_twice(self, path, *args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise ReadTimeoutError(endpoint_url="http://127.0.0.1/bucket/out/_lock.json")
        return real_cat_file(self, path, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "cat_file", failing_twice)
    try:
        with output_lock(out, opts, heartbeat_s=0.2) as holder:
            started = holder.heartbeat_at
            deadline = time.time() + 10
            while holder.heartbeat_at == started and time.time() < deadline:
                time.sleep(0.1)
            monkeypatch.undo()
            fs = s3fs.S3FileSystem(**opts)
            stored = json.loads(fs.cat_file(key))
    finally:
        module.log.removeHandler(handler)
    assert failures["left"] == 0
    assert stored["run_id"] == holder.run_id and stored["heartbeat_at"] > started
    renew_failures = [r for r in warnings if "could not renew the lock" in r.getMessage()]
    assert len(renew_failures) == 2
