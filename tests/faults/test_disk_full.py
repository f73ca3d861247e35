"""The output's filesystem fills up mid-job (a real tmpfs, filled by a ballast file as
soon as the job has published its first part): the job fails with a message saying
the disk is full and that rerunning resumes, leaves no corrupt part and no temporary
file, and a rerun completes once the ballast is deleted."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from fault_jobs import FaultJob, NoSmallDisk, fill_after_first_part, small_disk


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
