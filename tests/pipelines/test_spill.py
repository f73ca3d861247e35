"""A shard's rows through its plan-file table and back."""

from __future__ import annotations

from array import array

import pyarrow as pa

from tokenmill.pipelines.spill import PASSTHROUGH_PREFIX, shard_rows, shard_table
from tokenmill.pipelines.tokenize import PromptRow

ROWS = [
    PromptRow(7, "b", token_ids=array("i", [1, 2, 3]), params_index=1),
    PromptRow(2, "a", error="prompt is null"),
    PromptRow(5, "c", token_ids=[4, 2**31 - 1]),  # a plain list is stored the same way
]


def test_rows_round_trip_in_run_order():
    back = shard_rows(shard_table(ROWS))
    assert [(r.row_index, r.id, r.error, r.params_index) for r in back.rows] == [
        (7, "b", None, 1),
        (2, "a", "prompt is null", 0),
        (5, "c", None, 0),
    ]
    assert [r.token_ids for r in back.rows] == [
        array("i", [1, 2, 3]),
        None,
        array("i", [4, 2**31 - 1]),
    ]
    assert back.passthrough is None and back.endpoints is None


def test_passthrough_columns_cannot_clash_with_ours():
    passthrough = pa.table({"id": ["x", "y", "z"], "n": pa.array([1, None, 3], pa.int16())})
    table = shard_table(ROWS, passthrough=passthrough, endpoints=["/v1/a", None, "/v1/b"])
    assert table["id"].to_pylist() == ["b", "a", "c"]
    assert table[PASSTHROUGH_PREFIX + "id"].to_pylist() == ["x", "y", "z"]
    back = shard_rows(table)
    assert back.passthrough.equals(passthrough)  # names and types as read
    assert back.endpoints == ["/v1/a", None, "/v1/b"]


def test_token_ids_are_int32_lists_with_nulls_for_error_rows():
    table = shard_table(ROWS)
    assert table.schema.field("token_ids").type == pa.list_(pa.int32())
    assert table["token_ids"].null_count == 1
