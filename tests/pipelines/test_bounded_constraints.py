"""One row's constraint cannot stop a job: a schema nested too deep, a 200,000-value enum,
a recursive `$ref` that admits no value, a catastrophic regex pattern and invalid JSON
each become that row's error, naming the limit; every other row is answered. Through
`tokenmill run`, the flow's plan task, OpenAI batch lines and `tokenmill.generate`."""

from __future__ import annotations

import csv
import json

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

import tokenmill
from tokenmill.cli import main
from tokenmill.flows.tasks import plan_task
from tokenmill.pipelines.job import run_job
from tokenmill.pipelines.output import read_ledger, read_results
from tokenmill.pipelines.planning import load_shard
from tokenmill.pipelines.spec import JobSpec

ENGINE = {"dtype": "float32", "engine_options": {"kv_cache_memory": 8 << 20}}
CLI_ENGINE = ["--engine-option", f"kv_cache_memory={8 << 20}", "--dtype", "float32"]
FUEL = "(limit: compile fuel, in lexer expressions built, 1,000,000)"
NAME = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
TREE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
    "required": ["name"],
}
ENUM = {"enum": [f"v{i}" for i in range(200_000)]}
ENUM_BYTES = len(json.dumps(ENUM).encode())


def deep_schema(objects: int) -> str:
    """A schema of `objects` nested objects as JSON text (written without recursion)."""
    head = '{"type": "object", "properties": {"a": ' * objects
    return head + '{"type": "string"}' + "}}" * objects


# id -> (schema cell, the row's error; None: answered)
ROWS = {
    "good-1": (json.dumps(NAME), None),
    "deep": (deep_schema(900), "json schema nests deeper than the limit of 64 levels"),
    "enum": (
        json.dumps(ENUM),
        f"json schema is {ENUM_BYTES:,} bytes, over the limit of 1,048,576",
    ),
    "self-ref": (
        json.dumps({"$ref": "#"}),
        "structured outputs json schema: cannot start: no token can begin a value it accepts",
    ),
    "tree": (json.dumps(TREE), None),
    "regex": (
        json.dumps({"type": "string", "pattern": "^(a{1000}){1000}$"}),
        "structured outputs json schema: cannot start: lexer error: too many expressions "
        f"constructed {FUEL}",
    ),
    "invalid": (
        "{not json",
        "json schema is not valid JSON: Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1)",
    ),
    "good-2": (json.dumps(NAME), None),
}
EXPECTED = {row_id: error for row_id, (_, error) in ROWS.items()}


def errors_by_id(output) -> dict[str, str | None]:
    return {r["id"]: r["error"] for r in read_results(str(output)).to_pylist()}


def test_one_cli_job_answers_every_good_row_and_names_each_bad_constraint(tmp_path, tiny_model_dir):
    source = tmp_path / "rows.csv"
    with source.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "q", "schema"])
        for row_id, (schema, _) in ROWS.items():
            writer.writerow([row_id, "Give a name.", schema])
    output = tmp_path / "out"
    args = ["run", str(source), str(output), "--model", str(tiny_model_dir), "--id-column"]
    args += ["id", "--prompt-column", "q", "--json-schema-column", "schema", "--max-tokens"]
    result = CliRunner().invoke(main, [*args, "4", *CLI_ENGINE])
    assert result.exit_code == 0, result.output
    assert errors_by_id(output) == EXPECTED
    ledger = read_ledger(str(output))
    assert (ledger.rows_ok, ledger.rows_failed) == (3, 5)


def test_the_flows_plan_task_makes_bad_constraints_error_rows(tmp_path, tiny_model_dir):
    rows = [{"id": i, "q": "Give a name.", "schema": s} for i, (s, _) in ROWS.items()]
    source = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    spec = JobSpec(
        str(source),
        str(tmp_path / "out"),
        model=str(tiny_model_dir),
        prompt_column="q",
        id_column="id",
        json_schema_column="schema",
        max_tokens=4,
        **ENGINE,
    )
    plan = plan_task.fn(spec)
    planned = [r for s in plan.shards for r in load_shard(plan, s).to_pylist()]
    assert {r["id"]: r["error"] for r in planned} == EXPECTED
    assert (plan.num_rows, plan.num_failed) == (8, 5)


def batch_line(custom_id: str, schema: str | None) -> str:
    """A chat completions line, its response_format's schema spliced in as JSON text."""
    body = {"messages": [{"role": "user", "content": "Give a name."}], "max_tokens": 4}
    request = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
    line = json.dumps({**request, "body": body})
    if schema is None:
        return line
    response_format = '{"type": "json_schema", "json_schema": {"name": "x", "schema": '
    # The line ends with its body's and its own closing braces; the format closes two more.
    return line[:-2] + ', "response_format": ' + response_format + schema + "}" * 4


def test_openai_batch_response_formats_fail_alone(tmp_path, tiny_model_dir):
    """The same rows as OpenAI batch lines (a schema 40 objects deep, where the line reads;
    one 900 deep, past what a JSON line can be read with, and a line that is not JSON fail
    as lines)."""
    schemas = {i: s for i, (s, _) in ROWS.items() if i != "invalid"}
    schemas["deep"] = deep_schema(40)
    lines = [batch_line(i, s) for i, s in schemas.items()]
    lines += [batch_line("too-deep", deep_schema(900)), "{not json"]
    source = tmp_path / "batch.jsonl"
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out"
    run_job(str(source), str(output), model=str(tiny_model_dir), format="openai-batch", **ENGINE)
    expected = {i: e for i, e in EXPECTED.items() if i != "invalid"}
    expected["row-000000007"] = (
        f"{source}: line 8: JSON nested too deep to read (about 1,000 levels)"
    )
    expected["row-000000008"] = (
        f"{source}: line 9: invalid JSON (Expecting property name enclosed in double quotes "
        "at column 2)"
    )
    assert errors_by_id(output) == expected


def test_generate_in_a_notebook_does_not_raise_for_a_bad_row(tiny_model_dir):
    picked = ["good-1", "deep", "regex", "invalid", "good-2"]
    df = pl.DataFrame({"q": ["Give a name."] * len(picked), "s": [ROWS[i][0] for i in picked]})
    res = tokenmill.generate(
        df,
        prompt_column="q",
        json_schema_column="s",
        max_tokens=4,
        model=str(tiny_model_dir),
        **ENGINE,
    )
    assert res["error"].to_list() == [EXPECTED[i] for i in picked]
    assert res["id"].to_list() == [f"row-{i:09d}" for i in range(len(picked))]


def test_a_schema_column_is_read_whole_from_json_and_jsonl(tmp_path):
    """A job's schema column comes as each value's JSON text, every key in order (not a
    struct guessed from the first rows); an element or line nested past what Python's
    parser reads is that row's error."""
    from tokenmill.connectors import open_source
    from tokenmill.connectors.jsonl_reader import DEEP_JSON

    first = {"type": "object", "properties": {"name": {"type": "string"}}}
    other = {"enum": ["x", "y"], "description": "keys the first row lacks"}
    deep = '{"schema": ' + deep_schema(900) + "}"
    records = [json.dumps({"schema": first}), deep, json.dumps({"schema": other})]
    (tmp_path / "rows.json").write_text("[" + ",\n".join(records) + "]")
    (tmp_path / "rows.jsonl").write_text("\n".join(records) + "\n")
    for name, unit in (("rows.json", "array index 1"), ("rows.jsonl", "line 2")):
        source = open_source(
            str(tmp_path / name), on_bad_line="skip_row", json_text_columns=["schema"]
        )
        [batch] = list(source.iter_batches())
        columns = batch.to_pydict()
        assert columns["schema"] == [json.dumps(first), None, json.dumps(other)]
        assert columns["__error__"] == [None, f"{tmp_path / name}: {unit}: {DEEP_JSON}", None]
