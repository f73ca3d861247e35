"""OpenAI batch input lines -> prompt rows, and result rows -> OpenAI batch output lines."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from tokenmill.connectors import (
    ERROR_COLUMN,
    OPENAI_BATCH_SCHEMA,
    SourceError,
    open_source,
    openai_batch_output_lines,
    read_openai_batch_rows,
)

CHAT = {
    "custom_id": "req-1",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        "max_completion_tokens": 16,
        "temperature": 0.2,
        "seed": 7,
        "stop": "END",
    },
}
COMPLETION = {
    "custom_id": "req-2",
    "method": "POST",
    "url": "/v1/completions",
    "body": {
        "model": "smollm2",
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "top_p": 0.9,
        "n": 2,
    },
}


def _msg(role: str, content: str | None) -> dict:
    """A message row as the reader gives it: the fields it passes to the chat template."""
    return {
        "role": role,
        "content": content,
        "tool_calls": None,
        "tool_call_id": None,
        "parts": None,
    }


def _write(path, lines) -> str:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def test_chat_and_completion_lines_become_rows(tmp_path):
    path = _write(tmp_path / "batch.jsonl", [CHAT, COMPLETION])

    source = open_source(path, format="openai-batch")

    assert source.schema == OPENAI_BATCH_SCHEMA
    rows = source.to_table().to_pylist()
    assert rows[0] == {
        **dict.fromkeys(OPENAI_BATCH_SCHEMA.names),
        "custom_id": "req-1",
        "url": "/v1/chat/completions",
        "model": "smollm2",
        "messages": [_msg("system", "Be brief."), _msg("user", "Hi")],
        "max_tokens": 16,
        "temperature": 0.2,
        "seed": 7,
        "stop": ["END"],
    }
    assert rows[1] == {
        **dict.fromkeys(OPENAI_BATCH_SCHEMA.names),
        "custom_id": "req-2",
        "url": "/v1/completions",
        "model": "smollm2",
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "top_p": 0.9,
        "n": 2,
    }


def test_column_types():
    assert OPENAI_BATCH_SCHEMA.field("messages").type == pa.list_(
        pa.struct(
            [
                ("role", pa.string()),
                ("content", pa.string()),
                ("tool_calls", pa.string()),
                ("tool_call_id", pa.string()),
                ("parts", pa.string()),
            ]
        )
    )
    assert OPENAI_BATCH_SCHEMA.field("stop").type == pa.list_(pa.string())
    assert OPENAI_BATCH_SCHEMA.field("max_tokens").type == pa.int64()
    assert OPENAI_BATCH_SCHEMA.field("temperature").type == pa.float64()


BAD_REQUESTS = [
    ({**CHAT, "custom_id": 5}, "custom_id must be a non-empty string"),
    ({**CHAT, "url": "/v1/moderations"}, "url must be"),
    # A chat body sent to /v1/embeddings: its fields are refused by name.
    ({**CHAT, "url": "/v1/embeddings"}, "body.max_completion_tokens is not supported"),
    ({**CHAT, "method": "GET"}, "method must be POST"),
    ({**CHAT, "body": {"model": "m"}}, "body.messages must be a non-empty list"),
    ({**COMPLETION, "body": {"prompt": ["a", "b"]}}, "body.prompt must be a string"),
    ({**CHAT, "body": {**CHAT["body"], "temperature": "hot"}}, "body.temperature must be a number"),
    (
        {**CHAT, "body": {**CHAT["body"], "max_completion_tokens": 1.5}},
        "body.max_completion_tokens",
    ),
    (
        {**CHAT, "body": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}},
        r"body.messages\[0\].content: an image_url part needs its image URL as a string",
    ),
    (
        {**CHAT, "body": {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}},
        r"body.messages\[0\].content: only text and image parts",
    ),
    (CHAT, "duplicate custom_id"),
]


@pytest.mark.parametrize(("request_obj", "message"), BAD_REQUESTS)
def test_bad_request_lines_name_the_line(tmp_path, request_obj, message):
    path = _write(tmp_path / "batch.jsonl", [CHAT, request_obj])

    with pytest.raises(SourceError, match=f"{path}: line 2: .*{message}"):
        open_source(path, format="openai-batch")


def test_skip_row_keeps_the_custom_id_of_a_bad_request(tmp_path):
    bad = {**COMPLETION, "custom_id": "req-bad", "body": {"prompt": 3}}
    path = _write(tmp_path / "batch.jsonl", [CHAT, bad, "not json", COMPLETION])

    table = open_source(path, format="openai-batch", on_bad_line="skip_row").to_table()

    assert table.column("custom_id").to_pylist() == ["req-1", "req-bad", None, "req-2"]
    assert table.column("prompt").to_pylist() == [None, None, None, "Once upon a time"]
    errors = table.column(ERROR_COLUMN).to_pylist()
    assert errors[0] is None and errors[3] is None
    assert errors[1] == f"{path}: line 2: body.prompt must be a string (one prompt per request)"
    assert errors[2].startswith(f"{path}: line 3: invalid JSON")


def test_read_rows_from_lines_directly():
    batch = read_openai_batch_rows([json.dumps(CHAT), "", json.dumps(COMPLETION)])

    assert batch.schema == OPENAI_BATCH_SCHEMA
    assert batch.column("custom_id").to_pylist() == ["req-1", "req-2"]
    with pytest.raises(ValueError, match="line 2: invalid JSON"):
        read_openai_batch_rows([json.dumps(CHAT), "{"])


RESULTS = pa.table(
    {
        "id": ["req-1", "req-2", "req-3"],
        "output": ["Hello!", "there was", None],
        "finish_reason": ["stop", "length", "error"],
        "prompt_tokens": [12, 4, 0],
        "cached_tokens": [8, 0, 0],
        "completion_tokens": [3, 8, 0],
        "error": [None, None, "prompt exceeds the context window"],
        "url": ["/v1/chat/completions", "/v1/completions", "/v1/chat/completions"],
    }
)


def check_output_line(obj: dict) -> None:
    """The structure of one OpenAI batch output line (asserts every field's type)."""
    assert set(obj) == {"id", "custom_id", "response", "error"}
    assert isinstance(obj["id"], str) and obj["id"].startswith("batch_req_")
    assert isinstance(obj["custom_id"], str)
    if obj["response"] is None:
        assert set(obj["error"]) == {"code", "message"}
        assert isinstance(obj["error"]["code"], str) and isinstance(obj["error"]["message"], str)
        return
    assert obj["error"] is None
    response = obj["response"]
    assert set(response) == {"status_code", "request_id", "body"}
    assert response["status_code"] == 200 and isinstance(response["request_id"], str)
    body = response["body"]
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] in ("chat.completion", "text_completion")
    assert isinstance(body["created"], int) and isinstance(body["model"], str)
    for index, choice in enumerate(body["choices"]):
        assert choice["index"] == index
        assert choice["finish_reason"] in ("stop", "length")
        if body["object"] == "chat.completion":
            assert body["id"].startswith("chatcmpl-")
            assert choice["message"]["role"] == "assistant"
            assert isinstance(choice["message"]["content"], str)
        else:
            assert body["id"].startswith("cmpl-")
            assert isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert isinstance(usage["prompt_tokens_details"]["cached_tokens"], int)


def test_output_lines_follow_the_openai_batch_schema():
    lines = openai_batch_output_lines(RESULTS, model_name="smollm2", created=1_700_000_000)

    objs = [json.loads(line) for line in lines]
    for obj in objs:
        check_output_line(obj)
    assert [o["custom_id"] for o in objs] == ["req-1", "req-2", "req-3"]
    chat = objs[0]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello!"},
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert chat["usage"] == {
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    completion = objs[1]["response"]["body"]
    assert completion["object"] == "text_completion"
    assert completion["choices"][0]["text"] == "there was"
    assert completion["choices"][0]["finish_reason"] == "length"
    assert objs[2]["response"] is None
    assert objs[2]["error"] == {
        "code": "processing_error",
        "message": "prompt exceeds the context window",
    }


def test_output_ids_are_stable_and_endpoint_can_be_forced():
    first = openai_batch_output_lines(RESULTS, model_name="m", created=1)
    again = openai_batch_output_lines(RESULTS, model_name="m", created=1)
    forced = openai_batch_output_lines(
        RESULTS.drop_columns(["url"]), model_name="m", endpoint="/v1/completions", created=1
    )

    assert first == again
    assert json.loads(forced[0])["response"]["body"]["object"] == "text_completion"


def test_output_rejects_incomplete_results_before_work():
    with pytest.raises(ValueError, match="results lack column"):
        openai_batch_output_lines(RESULTS.drop_columns(["error"]), model_name="m")
    with pytest.raises(ValueError, match="endpoint"):
        openai_batch_output_lines(RESULTS, model_name="m", endpoint="/v1/embeddings")


def test_input_to_output_roundtrip(tmp_path):
    path = _write(tmp_path / "batch.jsonl", [CHAT, COMPLETION])
    rows = open_source(path, format="openai-batch").to_table()
    results = pa.table(
        {
            "id": rows.column("custom_id"),
            "output": ["a", "b"],
            "finish_reason": ["stop", "stop"],
            "prompt_tokens": [1, 2],
            "completion_tokens": [1, 1],
            "error": pa.nulls(2, pa.string()),
            "url": rows.column("url"),
        }
    )

    objs = [json.loads(x) for x in openai_batch_output_lines(results, model_name="smollm2")]

    assert [o["response"]["body"]["object"] for o in objs] == ["chat.completion", "text_completion"]
    assert objs[0]["response"]["body"]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
