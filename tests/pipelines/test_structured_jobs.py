"""Structured outputs in every job surface, on the real engine with a tiny random model:
the options (CLI, flow, run_job, generate), per-row schemas, OpenAI batch
`response_format` and `n`, and `parse=True`."""

from __future__ import annotations

import csv
import json
from datetime import datetime, timezone

import jsonschema
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tokenmill.cli import main
from tokenmill.flows import batch_inference
from tokenmill.flows.parameters import build_spec
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.notebook import generate
from tokenmill.pipelines.output import read_results
from tokenmill.pipelines.parsed import json_schema_dtype
from tokenmill.pipelines.results import RESULT_COLUMNS
from tokenmill.pipelines.spec import JobSpec

ENGINE = {"kv_cache_memory": 8 << 20}
# Bounded strings: a random model closes an open-ended string almost never.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
UNSUPPORTED = {"type": "array", "uniqueItems": True}


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from tokenmill.engine.api.llm import LLM

    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", **ENGINE)


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "prompt": ["Hi", "Who?", "Go"]}), path)
    return path


def check_rows(rows: list[dict], schema: dict) -> int:
    """Complete rows validate; the others are cut ("length") and say so."""
    complete = 0
    for row in rows:
        assert row["error"] is None
        if row["structured_output_complete"]:
            jsonschema.validate(json.loads(row["output"]), schema)
            complete += 1
        else:
            assert row["finish_reason"] == "length"
    return complete


def test_options_reach_sampling_params_and_exclude_each_other(tmp_path):
    spec = JobSpec("in.parquet", "out", choice=["yes", "no"])
    assert spec.sampling.structured_outputs.choice == ["yes", "no"]
    spec = JobSpec("in.parquet", "out", json_schema=json.dumps(PERSON))
    assert spec.sampling.structured_outputs.json == PERSON
    assert JobSpec("in.parquet", "out").sampling.structured_outputs is None
    with pytest.raises(ValueError, match="give either json_schema or regex, not both"):
        JobSpec("in.parquet", "out", json_schema=PERSON, regex="[a-z]+")
    with pytest.raises(ValueError, match="json_schema: not valid JSON"):
        JobSpec("in.parquet", "out", json_schema="{oops")
    with pytest.raises(ValueError, match="drop json_schema_column"):
        JobSpec("in.jsonl", "out", format="openai-batch", json_schema_column="s")
    # The flow takes the same options, typed for Prefect's schema, into the same JobSpec.
    props = batch_inference.parameters.model_dump()["properties"]
    assert {"json_schema", "regex", "choice", "grammar", "json_object"} <= set(props)
    assert "json_schema_column" in props and "parse" not in props
    params = batch_inference.validate_parameters(
        {"input": "in.parquet", "output": "out", "json_schema": PERSON}
    )
    spec = build_spec(scheduled=datetime.now(timezone.utc), **params)
    assert spec.sampling.structured_outputs.json == PERSON


def test_run_job_json_schema_and_an_invalid_one_before_compute(tmp_path, questions, tiny_llm):
    out = tmp_path / "out"
    ledger = run_job(str(questions), str(out), llm=tiny_llm, json_schema=PERSON, max_tokens=80)
    rows = read_results(str(out)).to_pylist()
    assert check_rows(rows, PERSON) == 3 and ledger.rows_ok == 3
    steps = tiny_llm.stats().num_steps
    with pytest.raises(ValueError, match=r"json schema: Unimplemented keys: \[\"uniqueItems\"\]"):
        run_job(str(questions), str(tmp_path / "bad"), llm=tiny_llm, json_schema=UNSUPPORTED)
    assert tiny_llm.stats().num_steps == steps  # nothing was computed
    with pytest.raises(ValueError, match="regex"):
        run_job(str(questions), str(tmp_path / "bad2"), llm=tiny_llm, regex="[a-")


def test_cli_flags(tmp_path, questions, tiny_model_dir):
    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(PERSON))
    grammar_file = tmp_path / "yn.lark"
    grammar_file.write_text('start: "yes" | "no"')
    engine = ["--model", str(tiny_model_dir), "--dtype", "float32"]
    engine += ["--engine-option", f"kv_cache_memory={8 << 20}", "--max-tokens", "80"]
    runs = {
        "schema": ["--json-schema", str(schema_file)],
        "inline": ["--json-schema", json.dumps(PERSON)],
        "grammar": ["--grammar", str(grammar_file)],
        "choice": ["--choice", "up", "--choice", "down"],
        "regex": ["--regex", "[0-9]{3}"],
    }
    results = {}
    for name, flags in runs.items():
        out = tmp_path / name
        done = CliRunner().invoke(main, ["run", str(questions), str(out), *engine, *flags])
        assert done.exit_code == 0, done.output
        results[name] = read_results(str(out)).to_pylist()
    assert check_rows(results["schema"], PERSON) >= 2
    assert [r["output"] for r in results["inline"]] == [r["output"] for r in results["schema"]]
    assert all(r["output"] in ("yes", "no") for r in results["grammar"])
    assert all(r["output"] in ("up", "down") for r in results["choice"])
    assert all(len(r["output"]) == 3 and r["output"].isdigit() for r in results["regex"])
    bad = CliRunner().invoke(
        main, ["run", str(questions), str(tmp_path / "x"), *engine, "--json-schema", "nope.json"]
    )
    assert bad.exit_code != 0 and "neither inline JSON nor a readable file" in bad.output
    # A schema the engine cannot enforce fails the job before the model is loaded.
    unsupported = ["--json-schema", json.dumps(UNSUPPORTED)]
    bad = CliRunner().invoke(
        main, ["run", str(questions), str(tmp_path / "y"), *engine, *unsupported]
    )
    assert bad.exit_code != 0 and "uniqueItems" in bad.output
    assert not (tmp_path / "y" / "results").exists()


def test_schema_column_rows_fail_alone(tmp_path, tiny_llm):
    schemas = [json.dumps(PERSON), json.dumps(UNSUPPORTED), "{not json", None]
    src = tmp_path / "in.parquet"
    pq.write_table(
        pa.table(
            {"id": ["ok", "unsupported", "broken", "free"], "prompt": ["Hi"] * 4, "s": schemas}
        ),
        src,
    )
    out = tmp_path / "out"
    run_job(str(src), str(out), llm=tiny_llm, json_schema_column="s", id_column="id", max_tokens=80)
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    check_rows([rows["ok"]], PERSON)  # valid, or cut and flagged
    assert rows["ok"]["structured_output_complete"] is not None
    assert "uniqueItems" in rows["unsupported"]["error"]
    assert rows["broken"]["error"].startswith("json schema is not valid JSON")
    assert rows["free"]["error"] is None and rows["free"]["structured_output_complete"] is None


def test_an_empty_csv_schema_cell_is_a_row_without_a_schema(tmp_path, tiny_llm):
    # CSV has no null: an empty cell (or one of spaces) sets no schema, as a null does in
    # Parquet; a cell that is not JSON is still that row's error.
    src = tmp_path / "in.csv"
    with open(src, "w", newline="") as f:
        csv.writer(f).writerow(["id", "prompt", "s"])
        csv.writer(f).writerow(["ok", "Hi", json.dumps(PERSON)])
        f.write('empty,Hi,\nquoted,Hi,""\nspaces,Hi,   \nbroken,Hi,{not json\n')
    out = tmp_path / "out"
    run_job(str(src), str(out), llm=tiny_llm, json_schema_column="s", id_column="id", max_tokens=8)
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert rows["ok"]["error"] is None and rows["ok"]["structured_output_complete"] is not None
    for free in ("empty", "quoted", "spaces"):
        assert rows[free]["error"] is None, rows[free]["error"]
        assert rows[free]["structured_output_complete"] is None  # unconstrained
        assert rows[free]["output"] == rows["empty"]["output"]
    assert rows["broken"]["error"].startswith("json schema is not valid JSON")


def test_openai_batch_response_format_and_n(tmp_path, tiny_llm):
    def line(custom_id: str, **body):
        messages = [{"role": "user", "content": "Describe someone."}]
        body = {"model": "m", "messages": messages, "max_tokens": 80, **body}
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": body,
        }

    strict = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    lines = [
        line("schema", response_format=strict),
        line("object", response_format={"type": "json_object"}, max_tokens=30),
        line("text", response_format={"type": "text"}, max_tokens=5),
        line("several", response_format=strict, n=2, seed=3, temperature=1.0),
        line("bad-schema", response_format={**strict, "json_schema": {"schema": UNSUPPORTED}}),
        line("bad-shape", response_format={"type": "xml"}),
    ]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    run_job(str(src), str(out), llm=tiny_llm, format="openai-batch", output_format="openai-batch")
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert check_rows([rows["schema"]], PERSON) == 1
    assert rows["text"]["structured_output_complete"] is None
    assert "uniqueItems" in rows["bad-schema"]["error"]
    assert "response_format must be an object with type" in rows["bad-shape"]["error"]
    several = rows["several"]["completions"]
    assert [c["index"] for c in several] == [0, 1]
    assert several[0]["output"] == rows["several"]["output"]
    written = {
        w["custom_id"]: w for w in map(json.loads, (out / "results.jsonl").read_text().splitlines())
    }
    choices = written["several"]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice, completion in zip(choices, several):
        assert choice["message"]["content"] == completion["output"]
        assert choice["finish_reason"] == completion["finish_reason"]
        if completion["structured_output_complete"]:
            jsonschema.validate(json.loads(completion["output"]), PERSON)
    content = written["schema"]["response"]["body"]["choices"][0]["message"]["content"]
    assert content == rows["schema"]["output"]
    assert rows["object"]["structured_output_complete"]
    assert isinstance(json.loads(rows["object"]["output"]), dict)
    assert written["bad-schema"]["error"]["message"] == rows["bad-schema"]["error"]


def test_generate_parses_complete_outputs_into_a_struct(tiny_llm):
    df = pl.DataFrame({"prompt": ["Hi", "Who?", "Go", "Yo"]})
    result = generate(df, llm=tiny_llm, json_schema=PERSON, max_tokens=80, parse=True)
    extras = ["structured_output_complete", "parsed"]
    assert result.columns == [*RESULT_COLUMNS, *extras, "prompt"]
    assert result.schema["parsed"] == json_schema_dtype(PERSON)
    for row in result.iter_rows(named=True):
        if row["structured_output_complete"]:
            assert row["parsed"] == json.loads(row["output"])
        else:
            assert row["parsed"] is None
    cut = generate(df, llm=tiny_llm, json_schema=PERSON, max_tokens=3, parse=True)
    assert cut["structured_output_complete"].to_list() == [False] * 4
    assert cut["parsed"].null_count() == 4
    with pytest.raises(ValueError, match="parse=True needs"):
        generate(df, llm=tiny_llm, parse=True)


def test_json_schema_dtype():
    assert json_schema_dtype(PERSON) == pl.Struct(
        {"name": pl.String, "age": pl.Int64, "tags": pl.List(pl.String)}
    )
    ref = {"$defs": {"p": {"type": "number"}}, "type": "array", "items": {"$ref": "#/$defs/p"}}
    assert json_schema_dtype(ref) == pl.List(pl.Float64)
    assert json_schema_dtype({"anyOf": [{"type": "integer"}, {"type": "number"}]}) == pl.Float64
    assert json_schema_dtype({"enum": ["a", None]}) == pl.String
    assert json_schema_dtype({"type": "object"}) is None  # no properties: inferred instead
    assert json_schema_dtype({"type": ["string", "integer"]}) is None
