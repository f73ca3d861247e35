"""Atomic parts, JSON documents and append-only datasets on local disk and memory://."""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import subprocess
import sys

import fsspec
import pyarrow as pa
import pytest

from tokenmill.connectors import (
    append_to_dataset,
    lines_writer,
    list_parts,
    open_source,
    read_json,
    read_parts,
    write_json_atomic,
    write_part,
)
from tokenmill.connectors import sink as sink_module

RESULTS = pa.table(
    {
        "id": ["a", "b"],
        "output": ["yes", None],
        "finish_reason": ["stop", "error"],
        "prompt_tokens": [5, 0],
        "error": [None, "prompt too long"],
    }
)


@pytest.fixture(params=["local", "memory"])
def out_dir(request, tmp_path, memory_root) -> str:
    return str(tmp_path / "out") if request.param == "local" else f"{memory_root}/out"


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_written_part_is_listed_and_reads_back_complete(out_dir, fmt):
    url = write_part(RESULTS, out_dir, "part-00000", format=fmt)

    assert url.endswith(f"/out/part-00000.{fmt}")
    assert list_parts(out_dir) == [url]
    assert read_parts(out_dir).to_pylist() == RESULTS.to_pylist()


def test_parts_list_sorted_and_ignore_temp_and_hidden_files(tmp_path):
    out = tmp_path / "out"
    write_part(RESULTS, str(out), "part-00001")
    write_part(RESULTS, str(out), "part-00000.parquet")
    (out / ".part-00002.parquet.tmp-1234").write_bytes(b"PAR1 half written")
    (out / "_SUCCESS").write_text("")
    (out / "ledger.json").write_text("{}")

    names = [os.path.basename(p) for p in list_parts(str(out))]

    assert names == ["part-00000.parquet", "part-00001.parquet"]
    assert read_parts(str(out)).num_rows == 4


def test_missing_directory_has_no_parts(tmp_path):
    assert list_parts(str(tmp_path / "nothing")) == []
    assert read_parts(str(tmp_path / "nothing")).num_rows == 0


def test_existing_part_is_not_overwritten_by_default(out_dir):
    write_part(RESULTS, out_dir, "part-00000")

    with pytest.raises(FileExistsError, match="part-00000.parquet already exists"):
        write_part(RESULTS.slice(0, 1), out_dir, "part-00000")
    assert read_parts(out_dir).num_rows == 2

    write_part(RESULTS.slice(0, 1), out_dir, "part-00000", overwrite=True)
    assert read_parts(out_dir).num_rows == 1


def _crashing_serializer(table, fmt, f):
    f.write(b"PAR1" + b"\0" * 1000)  # some bytes reach the file first
    raise RuntimeError("killed mid-write")


def test_crash_mid_write_leaves_no_visible_part(out_dir, monkeypatch):
    write_part(RESULTS, out_dir, "part-00000")
    monkeypatch.setattr(sink_module, "_serialize", _crashing_serializer)

    with pytest.raises(RuntimeError, match="killed mid-write"):
        write_part(RESULTS, out_dir, "part-00001")

    assert [p.rsplit("/", 1)[1] for p in list_parts(out_dir)] == ["part-00000.parquet"]
    fs, path = fsspec.core.url_to_fs(out_dir)
    assert [p.rsplit("/", 1)[1] for p in fs.ls(path, detail=False)] == ["part-00000.parquet"]


def test_crash_mid_overwrite_keeps_the_old_part(tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    write_part(RESULTS, out, "part-00000")
    monkeypatch.setattr(sink_module, "_serialize", _crashing_serializer)

    with pytest.raises(RuntimeError):
        write_part(RESULTS.slice(0, 1), out, "part-00000", overwrite=True)

    assert read_parts(out).to_pylist() == RESULTS.to_pylist()


def test_part_name_must_be_plain():
    for bad in ["", "a/b", ".hidden", "_tmp"]:
        with pytest.raises(ValueError, match="part_name"):
            write_part(RESULTS, "memory://x", bad)
    with pytest.raises(ValueError, match="format"):
        write_part(RESULTS, "memory://x", "p", format="csv")


def test_jsonl_part_is_valid_json_lines(tmp_path):
    table = pa.table({"x": [1.5, float("nan")], "when": [dt.date(2024, 1, 2), None]})

    url = write_part(table, str(tmp_path), "p", format="jsonl")

    lines = _read_bytes(url).decode().splitlines()
    assert [json.loads(ln) for ln in lines] == [
        {"x": 1.5, "when": "2024-01-02"},
        {"x": None, "when": None},
    ]


def test_json_document_roundtrip_and_overwrite(out_dir):
    uri = f"{out_dir}/ledger.json"
    ledger = {"job_id": "j1", "cost": {"total": 0.25}, "p99": float("nan")}

    write_json_atomic(uri, ledger)
    write_json_atomic(uri, {**ledger, "job_id": "j2"})

    assert read_json(uri) == {"job_id": "j2", "cost": {"total": 0.25}, "p99": None}
    with pytest.raises(FileExistsError):
        write_json_atomic(uri, ledger, overwrite=False)


def test_append_dataset_never_rewrites_and_unifies_schemas(out_dir):
    first = append_to_dataset(out_dir, pa.table({"job": ["a"], "rows": [10]}))
    before = _read_bytes(first)
    append_to_dataset(out_dir, pa.table({"job": ["b"], "rows": [2.5], "device": ["cpu"]}))
    append_to_dataset(out_dir, pa.table({"job": ["c"], "rows": [None]}))

    assert _read_bytes(first) == before
    assert len(list_parts(out_dir)) == 3
    table = read_parts(out_dir)
    assert table.schema == pa.schema(
        [("job", pa.string()), ("rows", pa.float64()), ("device", pa.string())]
    )
    assert table.to_pylist() == [
        {"job": "a", "rows": 10.0, "device": None},
        {"job": "b", "rows": 2.5, "device": "cpu"},
        {"job": "c", "rows": None, "device": None},
    ]
    assert read_parts(out_dir, columns=["job"]).column_names == ["job"]


def test_lines_file_is_written_whole(tmp_path):
    url = str(tmp_path / "out.jsonl")
    with lines_writer(url) as write:
        write('{"a":1}')
        write('{"a":2}')

    assert _read_bytes(url) == b'{"a":1}\n{"a":2}\n'
    assert open_source(url).to_table().num_rows == 2


def test_lines_file_is_not_published_when_the_block_raises(tmp_path):
    url = tmp_path / "out.jsonl"
    with (
        pytest.raises(RuntimeError, match="part 2 does not match"),
        lines_writer(str(url)) as write,
    ):
        write('{"a":1}')
        raise RuntimeError("part 2 does not match")
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temp file


def test_a_full_disk_publishes_nothing_and_says_so(tmp_path, monkeypatch):
    from tokenmill.connectors import DiskFullError, atomic

    write_part(pa.table({"x": [1]}), str(tmp_path), "part-00000")

    def full(fd):  # the kernel reports ENOSPC at fsync when delayed allocation fails
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "fsync", full)
    with pytest.raises(DiskFullError, match="no space left.*rerun the same command") as info:
        write_part(pa.table({"x": [2]}), str(tmp_path), "part-00001")
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part-00000.parquet"]  # no temp


def _read_bytes(url: str) -> bytes:
    with fsspec.open(url, "rb") as f:
        return f.read()


def test_reading_parts_leaves_no_native_threads_to_abort_the_exit(tmp_path):
    """A process that reads result parts exits cleanly. Read through a Python file object
    on Arrow's thread pools, some fresh processes aborted at exit after their work was
    done (`terminate called without an active exception`, exit -6: 9 of 60 on a busy
    machine, and once in CI's hostile-input job). Several fresh processes, each reading the
    parts and exiting: every one exits 0 (with the pools, this failed 2 of 3 runs), and
    none gained a thread by reading."""
    out = str(tmp_path / "out")
    for i in range(3):
        write_part(RESULTS, out, f"part-{i}")
    # The abort is rare, so the deterministic check is its cause: reading starts no native
    # thread (pq.read_table's dataset reader started one even without the pools).
    script = (
        "import os\nfrom tokenmill.connectors import read_parts\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        f"assert read_parts({out!r}).num_rows == 6\n"
        "assert len(os.listdir('/proc/self/task')) == before, 'reading started a thread'\n"
    )
    runs = [
        subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
        for _ in range(8)
    ]
    assert [r.returncode for r in runs] == [0] * 8, runs[0].stderr.decode()[-500:]
