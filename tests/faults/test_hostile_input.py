"""Hostile rows: ids built to escape the output folder, and single JSONL lines far larger
than any prompt. Nothing is written outside the output, ids come back exactly as given,
a line over the limit becomes an error row, and peak memory stays bounded."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from store_fixtures import _isolated_cache  # noqa: F401 - fixture
from tiny_model import build_tiny_model

from tokenmill.connectors.lines import MAX_LINE_BYTES, OversizedLine, iter_lines
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_results

ENGINE = {"dtype": "float32", "engine_options": {"kv_cache_memory": 8 << 20}}
HOSTILE_IDS = [
    "../../escaped",
    "../../../../../../../../tmp/escaped-abs",
    "/tmp/escaped-absolute",
    "a/../../b",
    "..",
    ".",
    "with\x00nul",
    "x" * 5000,
    "C:\\Windows\\escaped",
    "results/../ledger.json",
    "~/.ssh/authorized_keys",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("hostile-input") / "tiny")


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("output_format", ["parquet", "jsonl"])
def test_ids_cannot_write_outside_the_output(tiny_dir, tmp_path, output_format):
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    src = work / "in.jsonl"
    rows = [{"id": i, "prompt": f"prompt {n}"} for n, i in enumerate(HOSTILE_IDS)]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = files_under(tmp_path)
    out = work / "out"

    ledger = run_job(
        str(src),
        str(out),
        model=str(tiny_dir),
        id_column="id",
        max_tokens=2,
        output_format=output_format,
        **ENGINE,
    )

    # Every new file is inside the output directory; no id became a path.
    new = files_under(tmp_path) - before
    assert new and all(f.startswith("a/b/c/out/") for f in new), sorted(new)
    assert not any(Path(p).exists() for p in ("/tmp/escaped-abs", "/tmp/escaped-absolute"))
    names = {Path(f).name for f in new}
    assert not any("escaped" in n or "\x00" in n or len(n) > 255 for n in names)
    # ... and each id comes back exactly once, byte for byte.
    results = read_results(str(out))
    assert sorted(results["id"].to_pylist()) == sorted(HOSTILE_IDS)
    assert ledger.rows_ok == len(HOSTILE_IDS)


def peak_rss_of_job(tmp_path: Path, tiny_dir: Path, line_bytes: int) -> dict:
    """In a fresh process, runs a job whose second JSONL line has `line_bytes`, after the
    same job with an empty prompt there (the baseline).

    Returns:
        {"baseline_mib": peak RSS after the baseline job, "peak_mib": after the huge one,
         "rows": [(id, error), ...] of the huge one}.
    """
    script = textwrap.dedent(
        f"""
        import json, resource
        from tokenmill.pipelines.job import run_job
        from tokenmill.pipelines.output import read_results

        def job(name, num_mib):
            src = {str(tmp_path)!r} + f"/{{name}}.jsonl"
            with open(src, "w") as f:
                f.write(json.dumps({{"id": "first", "prompt": "hello"}}) + "\\n")
                # Written in pieces: no process ever holds the line in memory.
                f.write('{{"id": "huge", "prompt": "')
                for _ in range(num_mib):
                    f.write("x" * (1 << 20))
                f.write('"}}\\n')
                f.write(json.dumps({{"id": "last", "prompt": "bye"}}) + "\\n")
            out = {str(tmp_path)!r} + f"/out-{{name}}"
            run_job(src, out, model={str(tiny_dir)!r}, id_column="id", max_tokens=2,
                    dtype="float32", engine_options={{"kv_cache_memory": 8 << 20}})
            table = read_results(out)
            rows = sorted(zip(table["id"].to_pylist(), table["error"].to_pylist()))
            return rows, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

        _, baseline = job("baseline", 0)
        rows, peak = job("huge", {line_bytes >> 20})
        print(json.dumps({{"baseline_mib": baseline, "peak_mib": peak, "rows": rows}}))
        """
    )
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_huge_line_run(measured: dict, line_bytes: int) -> None:
    rows = dict(measured["rows"])
    assert rows["first"] is None and rows["last"] is None  # the good rows are kept
    # The huge line could not be read, so its id is unknown: a position id, and why.
    (error,) = [e for i, e in rows.items() if i.startswith("row-")]
    size = line_bytes + len('{"id": "huge", "prompt": ""}')
    limit = MAX_LINE_BYTES >> 20
    assert error.endswith(f"line 2: longer than the line limit of {limit} MiB ({size:,} bytes)")


def test_a_line_over_the_limit_becomes_an_error_row(tiny_dir, tmp_path):
    line_bytes = 48 << 20
    measured = peak_rss_of_job(tmp_path, tiny_dir, line_bytes)

    check_huge_line_run(measured, line_bytes)
    # Reading past the line costs a read chunk, not the line.
    assert measured["peak_mib"] - measured["baseline_mib"] < 48, measured


@pytest.mark.slow
def test_a_200_mb_line_keeps_memory_bounded(tiny_dir, tmp_path):
    line_bytes = 200 << 20
    measured = peak_rss_of_job(tmp_path, tiny_dir, line_bytes)

    check_huge_line_run(measured, line_bytes)
    assert measured["peak_mib"] - measured["baseline_mib"] < 48, measured


def test_the_line_reader_forgets_a_line_once_it_passes_the_limit():
    data = b"a\n\n" + b"x" * 50 + b"\nb\n" + b"y" * 11 + b"\n" + b"z" * 10
    lines = list(iter_lines(io.BytesIO(data), max_line_bytes=10))

    assert [(n, bytes(line)) for n, line in lines if not isinstance(line, OversizedLine)] == [
        (1, b"a"),
        (4, b"b"),
        (6, b"z" * 10),  # exactly at the limit: kept
    ]
    assert [(n, line.size) for n, line in lines if isinstance(line, OversizedLine)] == [
        (3, 50),
        (5, 11),
    ]
