"""OpenAI batch input files: one request per line, turned into prompt rows.

A line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions" | "/v1/embeddings", "body": {...}}`. Each becomes a row with
`custom_id`, `messages` (chat) or `prompt` (completions) and one column per sampling
parameter, null when the request does not set it, so the pipeline can apply per-row
overrides; an embeddings line becomes one row per input string, with its `dimensions`
(`openai_embeddings.py`). A body's
`response_format` (`text`, `json_object`, or `json_schema` with its `schema` and
`strict`) is checked for shape here and kept as its JSON text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from tokenmill.connectors.batches import ERROR_COLUMN, FileHead, ReadOptions, with_replaced
from tokenmill.connectors.decoding import open_decoded
from tokenmill.connectors.fs import open_text_stream
from tokenmill.connectors.jsonl_reader import UNPAIRED_SURROGATE, parse_object
from tokenmill.connectors.lines import BadLine, iter_line_chunks
from tokenmill.connectors.openai_embeddings import EMBEDDINGS_URL, embedding_request_rows

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])

# body key -> column type. Keys outside this table and response_format (tools...) are ignored.
SAMPLING_FIELDS: dict[str, pa.DataType] = {
    "max_tokens": pa.int64(),
    "min_tokens": pa.int64(),
    "temperature": pa.float64(),
    "top_p": pa.float64(),
    "top_k": pa.int64(),
    "min_p": pa.float64(),
    "seed": pa.int64(),
    "stop": pa.list_(pa.string()),
    "stop_token_ids": pa.list_(pa.int64()),
    "n": pa.int64(),
    "logprobs": pa.bool_(),
    "top_logprobs": pa.int64(),
    "presence_penalty": pa.float64(),
    "frequency_penalty": pa.float64(),
}

OPENAI_BATCH_SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("url", pa.string()),
        ("model", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("prompt", pa.string()),
        *SAMPLING_FIELDS.items(),
        ("response_format", pa.string()),
        ("dimensions", pa.int64()),  # /v1/embeddings
    ]
)
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class OpenAIBatchReader:
    """The `openai-batch` format for `open_source`: a fixed schema, validated per line."""

    conflicts_to_string = False

    def head(self, fs, path: str, *, options: ReadOptions) -> FileHead:
        if options.on_bad_line == "error":
            # Checking the first chunk catches a file that is not a batch file at all.
            with open_text_stream(fs, path, head=True) as f:
                lines = open_decoded(f, options.decoding)
                for chunk in iter_line_chunks(
                    lines, min(options.batch_size, 1000), options.decoding
                ):
                    parse_request_lines(zip(chunk.line_numbers, chunk.lines))
                    break
        return FileHead(schema=OPENAI_BATCH_SCHEMA)

    def iter_batches(
        self, fs, path: str, schema: pa.Schema, *, name: str, options: ReadOptions
    ) -> Iterator[pa.RecordBatch]:
        seen: set[str] = set()
        with open_text_stream(fs, path) as f:
            lines = open_decoded(f, options.decoding)
            for chunk in iter_line_chunks(lines, options.batch_size, options.decoding):
                batch = parse_request_lines(
                    zip(chunk.line_numbers, chunk.lines),
                    name=name,
                    on_bad_line=options.on_bad_line,
                    seen_ids=seen,
                )
                yield with_replaced(batch, chunk.replaced)


def read_openai_batch_rows(
    lines: Iterable[bytes | str], *, name: str = "<input>", on_bad_line: str = "error"
) -> pa.RecordBatch:
    """Parses the lines of an OpenAI batch input file into one record batch.

    Args:
        lines: the file's lines; blank ones are skipped but still counted.
        name: the file name used in error messages.
        on_bad_line: "error" raises `BadLine` (a `ValueError` naming the line number) at
            the first bad line; "skip_row" keeps it as a row of nulls (custom_id kept when
            readable) with an `__error__` message.

    Returns:
        A batch with `OPENAI_BATCH_SCHEMA`, plus `__error__` when a line was bad.
    """
    numbered = ((number, line) for number, line in enumerate(lines, start=1) if line.strip())
    return parse_request_lines(numbered, name=name, on_bad_line=on_bad_line)


def parse_request_lines(
    lines: Iterable[tuple[int, bytes | str]],
    *,
    name: str = "<input>",
    on_bad_line: str = "error",
    seen_ids: set[str] | None = None,
) -> pa.RecordBatch:
    """Like `read_openai_batch_rows`, for `(line_number, line)` pairs.

    Args:
        lines: `(line_number, line)` pairs.
        name: the file name used in error messages.
        on_bad_line: "error" raises `BadLine` at the first bad line; "skip_row" keeps it
            as a row of nulls (custom_id kept when readable) with an `__error__` message.
        seen_ids: custom_ids met so far in this file; duplicates are bad lines.

    Returns:
        A batch with `OPENAI_BATCH_SCHEMA`, plus `__error__` when a line was bad.
    """
    seen_ids = set() if seen_ids is None else seen_ids
    rows: list[dict[str, Any]] = []
    errors: list[str | None] = []
    for number, line in lines:
        raw = line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line
        custom_id = None
        try:
            obj = parse_object(raw, number)
            custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
            line_rows = request_rows(obj, number)
            if any(row["custom_id"] in seen_ids for row in line_rows):
                raise BadLine(number, "duplicate custom_id")
            if not _is_unicode(line_rows):
                raise BadLine(number, UNPAIRED_SURROGATE)
            seen_ids.update(row["custom_id"] for row in line_rows)
            rows += line_rows
            errors += [None] * len(line_rows)
        except BadLine as e:
            if on_bad_line == "error":
                raise
            rows.append({"custom_id": custom_id if _is_unicode(custom_id) else None})
            errors.append(f"{name}: {e}")
    batch = pa.RecordBatch.from_pylist(rows, schema=OPENAI_BATCH_SCHEMA)
    if not any(errors):
        return batch
    return batch.append_column(ERROR_COLUMN, pa.array(errors, pa.string()))


def _is_unicode(value: Any) -> bool:
    """Whether every string in `value` can be written as UTF-8."""
    if isinstance(value, str):
        return value.isascii() or _encodes(value)
    if isinstance(value, dict):
        return all(_is_unicode(v) for v in value.values())
    if isinstance(value, list):
        return all(_is_unicode(v) for v in value)
    return True


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def request_rows(obj: dict[str, Any], number: int) -> list[dict[str, Any]]:
    """One request object as rows: one, or for an embeddings line one per input."""
    if obj.get("url") == EMBEDDINGS_URL and isinstance(obj.get("custom_id"), str):
        if obj.get("method", "POST") != "POST":
            raise BadLine(number, "method must be POST")
        if not obj["custom_id"]:
            raise BadLine(number, "custom_id must be a non-empty string")
        return embedding_request_rows(obj, number)
    return [request_to_row(obj, number)]


def request_to_row(obj: dict[str, Any], number: int) -> dict[str, Any]:
    """One request object as a row dict; raises `BadLine` naming the offending key."""
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine(number, "custom_id must be a non-empty string")
    method = obj.get("method", "POST")
    if method != "POST":
        raise BadLine(number, "method must be POST")
    url = obj.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise BadLine(number, f"url must be {CHAT_URL}, {COMPLETIONS_URL} or {EMBEDDINGS_URL}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadLine(number, "body must be a JSON object")
    model = body.get("model")
    row: dict[str, Any] = {
        "custom_id": custom_id,
        "url": url,
        "model": model if isinstance(model, str) else None,
    }
    if url == CHAT_URL:
        row["messages"] = _messages(body.get("messages"), number)
    else:
        row["prompt"] = _prompt(body.get("prompt"), number)
    row.update(_sampling(body, number))
    if body.get("response_format") is not None:
        row["response_format"] = _response_format(body["response_format"], number)
    return row


def _response_format(value: Any, number: int) -> str:
    """A response_format's JSON text, once its shape is OpenAI's; else BadLine."""
    kinds = ", ".join(RESPONSE_FORMAT_TYPES)
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        raise BadLine(number, f"body.response_format must be an object with type one of {kinds}")
    if value["type"] == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BadLine(
                number, "body.response_format.json_schema must be an object with a schema object"
            )
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise BadLine(number, "body.response_format.json_schema.strict must be a boolean")
    return json.dumps(value, ensure_ascii=False)


def _messages(messages: Any, number: int) -> list[dict[str, str | None]]:
    if not isinstance(messages, list) or not messages:
        raise BadLine(number, "body.messages must be a non-empty list for chat completions")
    out = []
    for i, message in enumerate(messages):
        where = f"body.messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadLine(number, f"{where} must be an object with a string role")
        out.append(
            {"role": message["role"], "content": _content(message.get("content"), where, number)}
        )
    return out


def _content(content: Any, where: str, number: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        # The "parts" form: only text parts can be served by a text model.
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise BadLine(number, f"{where}.content: only text parts are supported")
            if not isinstance(part.get("text"), str):
                raise BadLine(number, f"{where}.content: a text part needs a string text")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadLine(number, f"{where}.content must be a string or a list of text parts")


def _prompt(prompt: Any, number: int) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadLine(number, "body.prompt must be a string (one prompt per request)")
    return prompt


def _sampling(body: dict[str, Any], number: int) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, dtype in SAMPLING_FIELDS.items():
        value = body.get(key)
        if key == "max_tokens" and body.get("max_completion_tokens") is not None:
            # The newer name wins: OpenAI deprecated max_tokens for chat in its favour.
            value = body["max_completion_tokens"]
            key_name = "max_completion_tokens"
        else:
            key_name = key
        if value is None:
            continue
        if key == "stop" and isinstance(value, str):
            value = [value]
        if not _fits(value, dtype):
            raise BadLine(number, f"body.{key_name} must be {_describe(dtype)}")
        values[key] = value
    return values


def _fits(value: Any, dtype: pa.DataType) -> bool:
    if pa.types.is_boolean(dtype):
        return isinstance(value, bool)
    if pa.types.is_integer(dtype):
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63
    if pa.types.is_floating(dtype):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if pa.types.is_list(dtype):
        return isinstance(value, list) and all(_fits(v, dtype.value_type) for v in value)
    return isinstance(value, str)


def _describe(dtype: pa.DataType) -> str:
    if pa.types.is_list(dtype):
        return f"a list of {_describe(dtype.value_type)}s"
    if pa.types.is_boolean(dtype):
        return "a boolean"
    if pa.types.is_integer(dtype):
        return "an integer"
    return "a number" if pa.types.is_floating(dtype) else "a string"
