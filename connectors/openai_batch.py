"""OpenAI batch input files: one request per line, turned into prompt rows.

A line is `{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions" | "/v1/responses" | "/v1/embeddings", "body": {...}}`. Each
becomes a row with `custom_id`, `url`, `messages` (chat, responses) or `prompt`
(completions), and the columns its body's fields fill - one per sampling option (null
when the request does not set it, so the pipeline applies per-row overrides),
`response_format` (JSON text), `tools` and `tool_calls` (JSON text). Which field fills
what, is ignored or is refused is the one table in `connectors/openai_fields.py`; a
refused field makes the line an error line naming it. An embeddings line becomes one row
per input string, with its `dimensions` (`openai_embeddings.py`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa

from tokenmill.connectors.batches import (
    ERROR_COLUMN,
    BlankTally,
    FileHead,
    ReadOptions,
    with_replaced,
)
from tokenmill.connectors.decoding import open_decoded
from tokenmill.connectors.fs import open_text_stream
from tokenmill.connectors.jsonl_reader import UNPAIRED_SURROGATE, parse_object
from tokenmill.connectors.lines import BadLine, iter_line_chunks
from tokenmill.connectors.openai_embeddings import EMBEDDINGS_URL, embedding_request_rows
from tokenmill.connectors.openai_fields import (
    CHAT_URL,
    COMPLETIONS_URL,
    SAMPLING_COLUMNS,
    URLS,
    body_columns,
)

# A message's fields the chat template receives (tool_calls as JSON text); any other
# field of a message (name, refusal, audio, function_call) is refused. `parts` is set
# only for content with image parts: the parts in order, as JSON text - {"type": "text",
# "text": ...} and {"type": "image", "url": ...} - which the pipeline reads the images of.
MESSAGE_TYPE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("tool_calls", pa.string()),
        ("tool_call_id", pa.string()),
        ("parts", pa.string()),
    ]
)
_MESSAGE_FIELDS = frozenset(MESSAGE_TYPE.names) - {"parts"}

OPENAI_BATCH_SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("url", pa.string()),
        ("model", pa.string()),
        ("messages", pa.list_(MESSAGE_TYPE)),
        ("prompt", pa.string()),
        *SAMPLING_COLUMNS.items(),
        ("response_format", pa.string()),
        ("tools", pa.string()),  # the function tools, for the chat template
        ("tool_calls", pa.string()),  # how to read the answer as tool calls (openai_tools.py)
        ("dimensions", pa.int64()),  # /v1/embeddings
        ("reasoning_effort", pa.string()),  # for the chat template (gpt-oss's)
    ]
)


class OpenAIBatchReader:
    """The `openai-batch` format for `open_source`: a fixed schema, validated per line."""

    conflicts_to_string = False

    def head(self, fs, path: str, *, options: ReadOptions) -> FileHead:
        with open_text_stream(fs, path, head=True) as f:
            lines = open_decoded(f, options.decoding)
            for chunk in iter_line_chunks(lines, min(options.batch_size, 1000), options.decoding):
                if options.on_bad_line == "error":
                    # Checking the first chunk catches a file that is not a batch file at all.
                    parse_request_lines(zip(chunk.line_numbers, chunk.lines))
                return FileHead(schema=OPENAI_BATCH_SCHEMA)
        return FileHead(schema=OPENAI_BATCH_SCHEMA, is_empty=True)  # no request line

    def iter_batches(
        self,
        fs,
        path: str,
        schema: pa.Schema,
        *,
        name: str,
        options: ReadOptions,
        blanks: BlankTally | None = None,
    ) -> Iterator[pa.RecordBatch]:
        seen: set[str] = set()
        # Blank lines, by the request lines before them; an embeddings line is a row per
        # input, so the tally hears of them by the rows before them.
        pending: list[int] = []
        lines_done = rows_done = 0
        with open_text_stream(fs, path) as f:
            lines = open_decoded(f, options.decoding)
            for chunk in iter_line_chunks(
                lines, options.batch_size, options.decoding, pending.append
            ):
                rows_per_line: list[int] = []
                batch = parse_request_lines(
                    zip(chunk.line_numbers, chunk.lines),
                    name=name,
                    on_bad_line=options.on_bad_line,
                    seen_ids=seen,
                    rows_per_line=rows_per_line,
                )
                if blanks is not None:
                    # rows_before[k]: the rows before the chunk's k-th line
                    rows_before = list(itertools.accumulate(rows_per_line, initial=rows_done))
                    for position in pending:
                        blanks.add(rows_before[min(position - lines_done, len(rows_per_line))])
                pending.clear()
                lines_done += len(rows_per_line)
                rows_done += batch.num_rows
                yield with_replaced(batch, chunk.replaced)
        if blanks is not None:
            for _ in pending:  # after the last request line
                blanks.add(rows_done)


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
    rows_per_line: list[int] | None = None,
) -> pa.RecordBatch:
    """Like `read_openai_batch_rows`, for `(line_number, line)` pairs.

    Args:
        lines: `(line_number, line)` pairs.
        name: the file name used in error messages.
        on_bad_line: "error" raises `BadLine` at the first bad line; "skip_row" keeps it
            as a row of nulls (custom_id kept when readable) with an `__error__` message.
        seen_ids: custom_ids met so far in this file; duplicates are bad lines.
        rows_per_line: if given, each line's number of rows is appended to it.

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
            num_rows = len(line_rows)
        except BadLine as e:
            if on_bad_line == "error":
                raise
            rows.append({"custom_id": custom_id if _is_unicode(custom_id) else None})
            errors.append(f"{name}: {e}")
            num_rows = 1
        if rows_per_line is not None:
            rows_per_line.append(num_rows)
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


# The keys of a batch line itself; the request's own fields go in `body`.
LINE_KEYS = ("custom_id", "method", "url", "body")


def request_rows(obj: dict[str, Any], number: int) -> list[dict[str, Any]]:
    """One request object as rows: one, or for an embeddings line one per input."""
    for key in obj:
        if key not in LINE_KEYS:
            # A request field written beside `body` would otherwise be dropped unseen.
            raise BadLine(
                number,
                f"{key} is refused: a batch line holds only {', '.join(LINE_KEYS)} "
                "(request fields go in body)",
            )
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
    if url not in URLS:
        raise BadLine(number, f"url must be one of {', '.join((*URLS, EMBEDDINGS_URL))}")
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
    elif url == COMPLETIONS_URL:
        row["prompt"] = _prompt(body.get("prompt"), number)
    else:  # /v1/responses
        row["messages"] = _response_input(body, number)
    row.update(body_columns(url, body, number))
    return row


def _messages(messages: Any, number: int) -> list[dict[str, str | None]]:
    if not isinstance(messages, list) or not messages:
        raise BadLine(number, "body.messages must be a non-empty list for chat completions")
    return [_message(m, f"body.messages[{i}]", number) for i, m in enumerate(messages)]


def _message(message: Any, where: str, number: int) -> dict[str, str | None]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadLine(number, f"{where} must be an object with a string role")
    for key, value in message.items():
        if key not in _MESSAGE_FIELDS and value is not None:
            raise BadLine(number, f"{where}.{key} is refused: not a message field tokenmill serves")
    content, parts = _content(message.get("content"), where, number)
    out = {"role": message["role"], "content": content, "parts": parts}
    call_id = message.get("tool_call_id")
    if call_id is not None and not isinstance(call_id, str):
        raise BadLine(number, f"{where}.tool_call_id must be a string")
    out["tool_call_id"] = call_id
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise BadLine(number, f"{where}.tool_calls must be a list")
    out["tool_calls"] = json.dumps(calls, ensure_ascii=False) if calls else None
    return out


def _content(content: Any, where: str, number: int) -> tuple[str | None, str | None]:
    """A message's content as (its text, its parts as JSON text when it has images)."""
    if content is None or isinstance(content, str):
        return content, None
    if isinstance(content, list):
        # The "parts" form: text parts (the Responses API names them input_text and
        # output_text) and image parts (image_url; the Responses API's input_image).
        texts, parts = [], []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_url", "input_image"):
                parts.append({"type": "image", "url": _image_url(part, kind, where, number)})
                continue
            if kind not in ("text", "input_text", "output_text"):
                raise BadLine(number, f"{where}.content: only text and image parts are supported")
            if not isinstance(part.get("text"), str):
                raise BadLine(number, f"{where}.content: a text part needs a string text")
            texts.append(part["text"])
            parts.append({"type": "text", "text": part["text"]})
        has_images = any(p["type"] == "image" for p in parts)
        return "\n".join(texts), json.dumps(parts, ensure_ascii=False) if has_images else None
    raise BadLine(number, f"{where}.content must be a string or a list of text and image parts")


def _image_url(part: dict[str, Any], kind: str, where: str, number: int) -> str:
    """An image part's URL: chat's {"image_url": {"url": ...}}, the Responses API's
    {"image_url": "..."}; a `file_id` image is refused (batch files carry no files)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) and kind == "image_url" else value
    if not isinstance(url, str) or not url:
        raise BadLine(number, f"{where}.content: an {kind} part needs its image URL as a string")
    return url


def _response_input(body: dict[str, Any], number: int) -> list[dict[str, str | None]]:
    """A Responses request's `instructions` and `input` as chat messages."""
    value = body.get("input")
    if isinstance(value, str):
        messages = [_plain_message("user", value)]
    elif isinstance(value, list) and value:
        messages = []
        for i, item in enumerate(value):
            where = f"body.input[{i}]"
            if isinstance(item, dict) and item.get("type", "message") != "message":
                raise BadLine(number, f"{where} is refused: only message items are served")
            item = (
                {k: v for k, v in item.items() if k != "type"} if isinstance(item, dict) else item
            )
            messages.append(_message(item, where, number))
    else:
        raise BadLine(number, "body.input must be a string or a non-empty list of messages")
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadLine(number, "body.instructions must be a string")
        messages.insert(0, _plain_message("system", instructions))
    return messages


def _plain_message(role: str, content: str) -> dict[str, str | None]:
    return {
        "role": role,
        "content": content,
        "tool_calls": None,
        "tool_call_id": None,
        "parts": None,
    }


def _prompt(prompt: Any, number: int) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadLine(number, "body.prompt must be a string (one prompt per request)")
    return prompt
