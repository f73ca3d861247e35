"""Jobs over input with bytes that are not text: the good rows are answered, each bad
one is an error row naming its file and line, and `--encoding` / `--on-decode-error`
are job options like any other (CLI flag, run_job and generate keyword)."""

from __future__ import annotations

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tokenmill.cli import main
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.notebook import generate
from tokenmill.pipelines.option_types import CLI, FLOW, JOB, NOTEBOOK
from tokenmill.pipelines.options import check_options
from tokenmill.pipelines.output import read_results
from tokenmill.pipelines.spec import JobSpec

BAD = b"b\xffd"
ENGINE = ["--engine-option", f"kv_cache_memory={8 << 20}", "--dtype", "float32"]


def _by_id(out) -> dict[str, dict]:
    return {r["id"]: r for r in read_results(str(out)).to_pylist()}


def _csv(path, bad_row: bytes = b"b," + BAD) -> str:
    path.write_bytes(b"id,prompt\na,first question\n" + bad_row + b"\nc,third question\n")
    return str(path)


def test_a_csv_row_that_is_not_utf8_is_one_error_row(tmp_path, fake_llm):
    src = _csv(tmp_path / "in.csv")
    out = tmp_path / "out"

    ledger = run_job(src, str(out), llm=fake_llm, id_column="id", max_tokens=4)

    rows = _by_id(out)
    # The row's id could not be read either: it gets its position id.
    assert sorted(rows) == ["a", "c", "row-000000001"]
    assert rows["a"]["error"] is None and rows["c"]["error"] is None
    assert (
        rows["row-000000001"]["error"] == f"{src}: line 3: not valid UTF-8 (byte 0xff at offset 3)"
    )
    assert (ledger.rows_ok, ledger.rows_failed) == (2, 1)
    assert "decode_replaced" not in read_results(str(out)).column_names


def test_replace_answers_the_row_and_says_so(tmp_path, fake_llm):
    src = tmp_path / "in.jsonl"
    src.write_bytes(
        b'{"id": "a", "prompt": "first"}\n'
        b'{"id": "b", "prompt": "' + BAD + b'"}\n'
        b'{"id": "c", "prompt": "third"}\n'
    )
    out = tmp_path / "out"

    ledger = run_job(
        str(src),
        str(out),
        llm=fake_llm,
        id_column="id",
        on_decode_error="replace",
        passthrough=["prompt"],
    )

    results = read_results(str(out))
    # The flag comes after the job's own columns, before the passthrough ones.
    assert results.column_names[-2:] == ["decode_replaced", "prompt"]
    rows = {r["id"]: r for r in results.to_pylist()}
    assert {i: r["decode_replaced"] for i, r in rows.items()} == {"a": False, "b": True, "c": False}
    assert rows["b"]["error"] is None and rows["b"]["prompt"] == "b\ufffdd"
    assert (ledger.rows_ok, ledger.rows_failed) == (3, 0)
    assert ledger.prompt_tokens == sum(results["prompt_tokens"].to_pylist())


def test_encoding_reads_a_latin_1_export(tmp_path, fake_llm):
    src = tmp_path / "in.csv"
    src.write_bytes("id,prompt\na,café au lait\nb,crème brûlée\n".encode("latin-1"))

    bad = run_job(str(src), str(tmp_path / "as-utf8"), llm=fake_llm, id_column="id")
    good = run_job(
        str(src), str(tmp_path / "out"), llm=fake_llm, id_column="id", encoding="latin-1"
    )

    assert (bad.rows_ok, bad.rows_failed) == (0, 2)
    assert (good.rows_ok, good.rows_failed) == (2, 0)


def test_a_parquet_binary_prompt_column_is_decoded(tmp_path, fake_llm):
    src = tmp_path / "in.parquet"
    prompts = pa.array([b"first question", BAD, b"third question"], pa.binary())
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": prompts}), src)
    out = tmp_path / "out"

    ledger = run_job(str(src), str(out), llm=fake_llm, id_column="id")

    rows = _by_id(out)
    assert rows["b"]["error"] == (
        f"{src}: row index 1: column 'prompt': not valid UTF-8 (byte 0xff at offset 1)"
    )
    assert (ledger.rows_ok, ledger.rows_failed) == (2, 1)


def test_the_options_are_on_every_surface_and_checked_there():
    for surface in (CLI, FLOW, JOB, NOTEBOOK):
        values = check_options({}, surface=surface)
        assert (values["encoding"], values["on_decode_error"]) == ("utf-8", "error-row")
    with pytest.raises(ValueError, match="encoding: 'latin-9000' is not an encoding"):
        JobSpec("in.csv", "out", encoding="latin-9000")
    with pytest.raises(ValueError, match="on_decode_error must be one of error-row, replace"):
        JobSpec("in.csv", "out", on_decode_error="skip")


def test_tokenmill_run_with_a_bad_row_and_the_flags(tmp_path, tiny_model_dir):
    src = _csv(tmp_path / "in.csv")

    def run(out: str, *flags: str):
        args = ["run", src, str(tmp_path / out), "--model", str(tiny_model_dir)]
        args += ["--id-column", "id", "--max-tokens", "2", "--no-progress", *ENGINE, *flags]
        return CliRunner().invoke(main, args)

    plain = run("a")
    assert plain.exit_code == 0, plain.output
    assert "2 ok, 1 failed" in plain.output
    replaced = run("b", "--on-decode-error", "replace")
    assert replaced.exit_code == 0, replaced.output
    assert "3 ok, 0 failed" in replaced.output
    assert _by_id(tmp_path / "b")["b"]["decode_replaced"] is True
    refused = run("c", "--encoding", "nope")
    assert refused.exit_code != 0 and "'nope' is not an encoding" in refused.output


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return llm_cache.get_llm(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 << 20).llm


def test_generate_decodes_bytes_and_binary_columns(llm):
    answers = generate([b"first question", BAD, None], llm=llm, max_tokens=2)
    assert answers["error"].to_list() == [
        None,
        "row index 1: column 'prompt': not valid UTF-8 (byte 0xff at offset 1)",
        "prompt is null",
    ]

    frame = pl.DataFrame(
        {"id": [b"a", BAD, b"c"], "q": [b"one", b"two", "caf\xe9".encode("latin-1")]}
    )
    res = generate(frame, prompt_column="q", id_column="id", llm=llm, max_tokens=2)
    assert res["id"].to_list() == ["a", "row-000000001", "c"]
    assert (
        res["error"].to_list()[1]
        == "row index 1: column 'id': not valid UTF-8 (byte 0xff at offset 1)"
    )
    assert res["error"].to_list()[2].startswith("row index 2: column 'q': not valid UTF-8")

    latin = generate(
        frame, prompt_column="q", id_column="id", llm=llm, max_tokens=2, encoding="latin-1"
    )
    assert latin["error"].to_list() == [None, None, None]
    assert latin["id"].to_list() == ["a", "b\xffd", "c"]

    replaced = generate(
        frame, prompt_column="q", id_column="id", llm=llm, max_tokens=2, on_decode_error="replace"
    )
    assert replaced["decode_replaced"].to_list() == [False, True, True]
    assert replaced["error"].to_list() == [None, None, None]

    with pytest.raises(TypeError, match="mixes text and bytes"):
        generate(["text", b"bytes"], llm=llm)
