"""Every input shape (`tests/input_shapes.py`) through `tokenmill run` and
`tokenmill.generate`: exact row counts and ids, and rows_read = rows_ok + rows_failed +
rows_skipped_blank in the ledger. Empty input succeeds with a warning; input that is
not empty but gives no rows, and bad paths, fail in one line before any compute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pandas as pd
import polars as pl
import pytest
from click.testing import CliRunner
from input_shapes import write_input_shapes

from tokenmill.cli import main
from tokenmill.connectors.batches import ReadCounts
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.notebook import generate
from tokenmill.pipelines.output import read_results
from tokenmill.pipelines.planning import check_rows_read

CLI_ENGINE = ["--engine-option", f"kv_cache_memory={8 << 20}", "--dtype", "float32"]
SHAPES = ["cr.csv", "semi.csv", "tabs.tsv", "pipe.csv", "rows.json", "lines.jsonl"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    return {s.path.name: s for s in write_input_shapes(tmp_path_factory.mktemp("shapes"))}


def _run(*args: str):
    return CliRunner().invoke(main, ["run", *args, "--no-progress"], catch_exceptions=False)


@pytest.mark.parametrize("name", SHAPES)
def test_tokenmill_run_answers_or_names_every_row(shapes, name, tiny_model_dir, tmp_path):
    shape = shapes[name]
    out = tmp_path / "out"

    result = _run(
        str(shape.path),
        str(out),
        "--model",
        str(tiny_model_dir),
        "--id-column",
        "id",
        "--passthrough",
        "prompt",
        "--max-tokens",
        "2",
        "--json",
        *shape.cli_args,
        *CLI_ENGINE,
    )

    assert result.exit_code == 0, result.output
    ledger = json.loads(result.stdout[result.stdout.index("{") :])
    counts = [ledger[k] for k in ("rows_ok", "rows_failed", "rows_skipped_blank", "rows_read")]
    assert counts == [
        len(shape.rows) - shape.rows_failed,
        shape.rows_failed,
        shape.blank,
        shape.rows_read,
    ]
    assert ledger["rows_read"] == ledger["rows_ok"] + ledger["rows_failed"] + shape.blank
    results = read_results(str(out))
    assert sorted(results["id"].to_pylist()) == sorted(r.id for r in shape.rows)
    assert shape.check(results) == (0, 0)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return llm_cache.get_llm(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 << 20).llm


@pytest.mark.parametrize(
    ("name", "read"),
    [
        ("cr.csv", lambda p: pd.read_csv(p, dtype=str, keep_default_na=False)),
        ("tabs.tsv", lambda p: pd.read_csv(p, sep="\t", dtype=str, keep_default_na=False)),
        ("pipe.csv", lambda p: pd.read_csv(p, sep="|", quotechar="'", dtype=str)),
        (
            "rows.json",
            lambda p: pl.DataFrame(
                [
                    e
                    for e in json.loads(p.read_text())
                    if isinstance(e, dict) and isinstance(e["prompt"], str)
                ]
            ),
        ),
    ],
)
def test_generate_on_the_reference_readers_frame_answers_as_the_job(
    shapes, name, read, llm, tmp_path
):
    # pandas (or json) reads the file; tokenmill.generate answers its rows; the job reads
    # the same file itself: the same ids and, greedy, the same answers row for row.
    shape = shapes[name]
    frame = read(shape.path)

    answers = generate(frame, prompt_column="prompt", id_column="id", llm=llm, max_tokens=3)
    run_job(
        str(shape.path),
        str(tmp_path / "out"),
        llm=llm,
        id_column="id",
        max_tokens=3,
        **shape.options,
    )

    good = [r.id for r in shape.rows if r.error is None]
    assert answers["id"].to_list() == good
    assert answers["error"].null_count() == len(good)
    job = {r["id"]: r["output"] for r in read_results(str(tmp_path / "out")).to_pylist()}
    assert answers["output"].to_list() == [job[i] for i in good]


@pytest.mark.parametrize(
    ("name", "data", "blank"),
    [
        ("header.csv", b"id,prompt\r\n", 0),
        ("blank.csv", b"id,prompt\r\n\r\n\r\n", 2),
        ("zero.jsonl", b"", 0),
        ("blank.jsonl", b"\n  \n\r\n", 3),
        ("empty.json", b"[ ]\n", 0),
    ],
)
def test_empty_input_succeeds_with_a_warning(tiny_model_dir, tmp_path, name, data, blank):
    path = tmp_path / name
    path.write_bytes(data)
    loads = llm_cache.num_loads()

    result = _run(
        str(path), str(tmp_path / "out"), "--model", str(tiny_model_dir), "--json", *CLI_ENGINE
    )

    assert result.exit_code == 0, result.output
    ledger = json.loads(result.stdout[result.stdout.index("{") :])
    counts = [ledger[k] for k in ("rows_ok", "rows_failed", "rows_skipped_blank", "rows_read")]
    assert counts == [0, 0, blank, blank]
    warning = f"warning: {path} is empty (no records{f', {blank} blank' if blank else ''}): "
    assert result.stderr == f"{warning}the job has no rows\n"
    assert llm_cache.num_loads() == loads  # nothing to compute, no model loaded


def test_input_with_bytes_but_no_rows_fails_saying_what_was_seen():
    source = SimpleNamespace(uri="in.csv", files=["in.csv"], format="csv", is_empty=False)
    with pytest.raises(ValueError) as raised:
        check_rows_read(source, ReadCounts(rows=0, blank=2), 0)
    assert str(raised.value) == (
        "in.csv: no rows were read, yet its file is not empty (2 blank records seen): the "
        "bytes are not what the csv format expects - check --format, and for delimited "
        "text --csv-delimiter and --csv-quote"
    )
    check_rows_read(SimpleNamespace(**{**vars(source), "is_empty": True}), ReadCounts(), 0)


def _one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    return lines[0][len("Error: ") :]


def test_bad_paths_fail_in_one_line_before_any_compute(shapes, tiny_model_dir, tmp_path):
    src = str(shapes["cr.csv"].path)
    model = ["--model", str(tiny_model_dir), *CLI_ENGINE]
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    no_data = tmp_path / "notes"
    no_data.mkdir()
    (no_data / "readme.txt").write_text("hello")
    hidden_only = tmp_path / "hidden"
    hidden_only.mkdir()
    (hidden_only / "_SUCCESS").write_text("")
    loads = llm_cache.num_loads()

    assert _one_line_error(_run(src, str(a_file), *model)) == (
        f"{a_file} is an existing file; the output is a directory of results: give a "
        "directory path (a new one is created), or move the file"
    )
    assert _one_line_error(_run(src, str(a_file / "out"), *model)) == (
        f"{a_file / 'out'} cannot be a directory: {a_file} is a file; the output is a "
        "directory of results: give a directory path (a new one is created), or move the file"
    )
    message = _one_line_error(_run(str(no_data), str(tmp_path / "o1"), *model))
    assert message.startswith(f"{no_data}: no file in it has a data format's name (1 file, ")
    assert "--format: parquet, jsonl, json, csv, tsv, openai-batch" in message
    assert _one_line_error(_run(str(hidden_only), str(tmp_path / "o2"), *model)) == (
        f"{hidden_only}: no data files in this directory (names starting with _ or . are "
        "skipped): point the input at the directory or file that holds the data"
    )
    assert llm_cache.num_loads() == loads
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


# Runs `tokenmill run` twice in a child process that may not read or write what its
# file modes deny: as root, the capabilities that let root pass them are dropped from
# the child (PR_CAPBSET_DROP of CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH), so the
# kernel answers EACCES as it would to anyone - not a simulated error.
_CHILD = """
import json, sys
from click.testing import CliRunner
from tokenmill.cli import main
runs = []
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(main, ["run", *args, "--no-progress"])
    runs.append([result.exit_code, result.stderr, repr(result.exception)])
print(json.dumps(runs))
"""


def _without_file_access_override() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_paths_without_permission_fail_in_one_line(shapes, tiny_model_dir, tmp_path):
    secret = tmp_path / "secret.csv"
    secret.write_bytes(shapes["cr.csv"].path.read_bytes())
    secret.chmod(0o000)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    model = ["--model", str(tiny_model_dir), *CLI_ENGINE]
    runs = [
        [str(secret), str(tmp_path / "out"), *model],
        [str(shapes["cr.csv"].path), str(locked / "out"), *model],
    ]

    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(runs)],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_without_file_access_override if os.geteuid() == 0 else None,
    )

    assert child.returncode == 0, child.stderr[-3000:]
    (read_code, read_err, _), (write_code, write_err, _) = json.loads(child.stdout.splitlines()[-1])
    assert read_code == 1 and read_err.strip() == (
        f"Error: {secret}: access denied - the job may not read it: grant read access (or "
        "give credentials that have it), or copy the data where the job can read it"
    )
    assert write_code == 1 and write_err.strip() == (
        f"Error: {locked / 'out'}: the job cannot write here (Permission denied): choose an "
        "output location it may create and write, or grant it write access"
    )
    assert not (tmp_path / "out").exists() and not (locked / "out").exists()
