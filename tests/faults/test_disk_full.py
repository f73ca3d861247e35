"""The output's filesystem fills up mid-job: the job fails with a message saying the
disk is full and that rerunning resumes, leaves no corrupt part and no temporary file,
and a rerun completes once space is freed. Twice: a real tmpfs filled by a ballast file
as soon as the job has published its first part (the CLI; mounting needs root), and an
fsspec filesystem with a byte budget (in-process; runs anywhere)."""

from __future__ import annotations

import errno
import time

import fsspec
import pyarrow.parquet as pq
import pytest
from fault_jobs import FaultJob, NoSmallDisk, fill_after_first_part, small_disk
from fsspec.implementations.memory import MemoryFileSystem


@pytest.fixture
def disk(tmp_path):
    """A small tmpfs (mounting one needs root: elsewhere this test cannot run)."""
    try:
        with small_disk(tmp_path / "disk") as mounted:
            yield mounted
    except NoSmallDisk as exc:
        pytest.skip(str(exc))


def test_full_disk_fails_clearly_then_resumes(disk, tiny_model_dir, fault_job):
    # Longer answers: the job is still running when the disk fills up.
    job = FaultJob(tiny_model_dir, fault_job.input, disk / "out", extra_args=["--max-tokens", "12"])
    returncode, output, ballast = fill_after_first_part(job, disk)
    assert returncode == 1, output[-2000:]
    assert "no space left on the output's filesystem" in output
    assert "rerun the same command: the job resumes" in output
    assert "Traceback" not in output
    published = job.published_parts()
    assert published  # it failed mid-job, after publishing parts
    assert not (job.output / "ledger.json").exists()
    for name in published:  # every part a reader sees is complete
        assert pq.read_table(job.output / "results" / name).num_rows > 0
    assert job.outcome().temp_files == []

    ballast.unlink()  # space is freed
    rerun = job.run()
    assert rerun.returncode == 0, rerun.output[-2000:]
    outcome = job.outcome()
    assert outcome.ok and outcome.rows_failed == 0
    assert all((job.output / "results" / n).exists() for n in published)


# -- the same on a filesystem behind fsspec, without root -----------------------------


class FullMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem with a byte budget: a write past it raises ENOSPC,
    as a full network filesystem or an exhausted quota would."""

    protocol = ("fullmem",)
    budget: list[int | None] = [None]  # bytes left; None = unlimited
    written: dict[str, int] = {}  # bytes written, by the directory written into

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("fullmem://"))

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "w" not in mode and "x" not in mode:
            return f
        write = f.write
        directory = path.rstrip("/").rsplit("/", 2)[-2]

        def counted(data):
            self.written[directory] = self.written.get(directory, 0) + len(data)
            left = self.budget[0]
            if left is not None:
                if len(data) > left:
                    raise OSError(errno.ENOSPC, "No space left on device")
                self.budget[0] = left - len(data)
            return write(data)

        f.write = counted
        return f


def test_full_fsspec_filesystem_fails_clearly_then_resumes(tiny_model_dir, fault_job):
    fsspec.register_implementation("fullmem", FullMemoryFileSystem, clobber=True)
    from tokenmill.connectors import DiskFullError
    from tokenmill.engine.api.llm import LLM
    from tokenmill.pipelines.job import run_job
    from tokenmill.pipelines.output import read_ledger, read_results

    output = f"fullmem://faults-{time.time_ns()}/out"
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 << 20)
    options = dict(id_column="id", max_tokens=4, shard_tokens=60, llm=llm)
    fs = FullMemoryFileSystem()
    published: list[str] = []

    def results():
        directory = output.removeprefix("fullmem://") + "/results"
        return sorted(p for p in fs.ls(directory, detail=False)) if fs.exists(directory) else []

    # Room for the plan files and half the parts: the disk fills up mid-job.
    FullMemoryFileSystem.budget[0] = None
    FullMemoryFileSystem.written.clear()
    run_job(str(fault_job.input), output + "-probe", **options)
    written = FullMemoryFileSystem.written
    FullMemoryFileSystem.budget[0] = (
        written["_plan"] + (written["results"] + written["shard_stats"]) // 2
    )
    try:
        with pytest.raises(DiskFullError, match="no space left on the output's filesystem") as info:
            run_job(str(fault_job.input), output, **options)
        assert "rerun the same command: the job resumes" in str(info.value)
        published = results()
        assert published and not any(
            ".tmp-" in p for p in fs.find(output.removeprefix("fullmem://"))
        )
        FullMemoryFileSystem.budget[0] = None  # space is freed
        ledger = run_job(str(fault_job.input), output, **options)
    finally:
        FullMemoryFileSystem.budget[0] = None
    assert 0 < ledger.num_shards_run < ledger.num_shards
    assert set(published) <= set(results())
    rows = read_results(output)
    assert sorted(rows["id"].to_pylist()) == sorted(f"id-{i}" for i in range(fault_job.num_rows))
    assert read_ledger(output).completion_tokens == sum(rows["completion_tokens"].to_pylist())
