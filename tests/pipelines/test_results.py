from __future__ import annotations

import pyarrow as pa
import pytest

from tokenmill.engine.types.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.pipelines.results import RESULT_COLUMNS, build_results, check_passthrough, latencies
from tokenmill.pipelines.tokenize import PromptRow


def _out(text="hi", reason="stop", error=None, latency=0.5):
    return RequestOutput(
        "0",
        None,
        [1, 2],
        [CompletionOutput(0, text, [3], reason)],
        2,
        1,
        1,
        RequestMetrics(arrival_time=1.0, finish_time=1.0 + latency),
        error=error,
    )


def test_build_results_rows_in_given_order_with_passthrough():
    rows = [
        PromptRow(5, "b", token_ids=[1, 2]),
        PromptRow(2, "a", error="prompt is null"),
        PromptRow(9, "c", token_ids=[1, 2]),
    ]
    outputs = {5: _out("x", "length"), 9: _out(error="too long", reason="error")}
    table = build_results(rows, outputs, passthrough=pa.table({"lang": ["en", "fr", "de"]}))
    assert table.column_names == [*RESULT_COLUMNS, "lang"]
    assert table.to_pylist() == [
        {
            "id": "b",
            "output": "x",
            "finish_reason": "length",
            "prompt_tokens": 2,
            "cached_tokens": 1,
            "completion_tokens": 1,
            "error": None,
            "lang": "en",
        },
        {
            "id": "a",
            "output": None,
            "finish_reason": "error",
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "completion_tokens": 0,
            "error": "prompt is null",
            "lang": "fr",
        },
        {
            "id": "c",
            "output": None,
            "finish_reason": "error",
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "completion_tokens": 0,
            "error": "too long",
            "lang": "de",
        },
    ]


def test_missing_output_is_an_error_row():
    table = build_results([PromptRow(0, "a", token_ids=[1])], {})
    assert table["error"].to_pylist() == ["no output from the engine"]


def test_passthrough_checks():
    with pytest.raises(ValueError, match="clash"):
        check_passthrough(["output"])
    with pytest.raises(ValueError, match="repeat"):
        check_passthrough(["a", "a"])
    with pytest.raises(ValueError, match="2 rows for 1"):
        build_results([PromptRow(0, "a", error="x")], {}, passthrough=pa.table({"k": [1, 2]}))


def test_latencies_skip_errors():
    assert latencies({0: _out(latency=0.25), 1: _out(error="e", reason="error")}) == [0.25]


def test_logprobs_column_keeps_each_rows_top_k_and_the_token_bytes():
    from tokenmill.engine.types.sampling_params import SamplingParams
    from tokenmill.pipelines.logprobs import LogprobsColumn
    from tokenmill.pipelines.results import extra_columns

    params = [SamplingParams(), SamplingParams(logprobs=1), SamplingParams(n=2, logprobs=2)]
    texts = {3: b"\xf0\x9f", 4: b"ab", 5: b"c", 6: b"d"}
    column = LogprobsColumn(lambda ids: [texts[i] for i in ids], params)
    # Token 3 was sampled but is not among the top 1: it is reported, not listed.
    first = CompletionOutput(0, "x", [3, 4], "stop", logprobs=[{3: -2.0, 5: -0.5}, {4: -0.1}])
    second = CompletionOutput(1, "y", [6], "stop", logprobs=[{6: -0.2, 5: -1.0, 4: -3.0}])
    out = RequestOutput("0", None, [1], [first, second], 1, 0, 3, RequestMetrics(arrival_time=0.0))
    rows = [
        PromptRow(0, "a", token_ids=[1], params_index=1),
        PromptRow(1, "b", token_ids=[1], params_index=2),
    ]
    extras = extra_columns(params)
    assert extras == ("completions", "logprobs")
    table = build_results(rows, {0: out, 1: out}, extras=extras, logprobs=column)
    a, b = table.to_pylist()
    assert a["logprobs"][0] == {
        "token": "\ufffd",
        "logprob": -2.0,
        "bytes": [0xF0, 0x9F],
        "top_logprobs": [{"token": "c", "logprob": -0.5, "bytes": [99]}],
    }
    assert [t["token"] for t in b["completions"][1]["logprobs"][0]["top_logprobs"]] == ["d", "c"]
    assert b["completions"][0]["logprobs"] == b["logprobs"]
    with pytest.raises(ValueError, match="LogprobsColumn"):
        build_results(rows, {}, extras=extras)
