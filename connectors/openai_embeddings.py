"""OpenAI batch `/v1/embeddings` lines: requests in, `CreateEmbeddingResponse` lines out.

A request line is `{"custom_id", "method": "POST", "url": "/v1/embeddings", "body":
{"model", "input", "dimensions", "encoding_format", "user"}}`. Its body fields have
their fates in `openai_fields.py`'s `EMBEDDINGS_FIELDS`: honoured (`input`,
`dimensions`, `encoding_format`), ignored because they cannot change the answer
(`model`: the job's model answers; `user`), or refused by name (any other key; `input`
as token ids).

One line may ask for several embeddings (`input` a list of strings): it becomes one
row per string, in order, with the ids `custom_id` (a single input) or
`custom_id` + U+001F + its index (a list of several), so every row keeps its own id,
result and error. The response writer (`EmbeddingResponses`) joins a line's rows back
into one response, its `data` in input order and its usage summed; if any of them
failed, the line is an error line naming the input that failed. A custom_id holding
U+001F itself is refused, so the join is unambiguous.

`encoding_format` travels with the row as part of its endpoint (`/v1/embeddings` or
`/v1/embeddings?encoding_format=base64`): it changes only how the answer is written.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from tokenmill.connectors.jsonutil import dumps_line
from tokenmill.connectors.lines import BadLine
from tokenmill.connectors.openai_fields import EMBEDDINGS_FIELDS, EMBEDDINGS_URL

BASE64_URL = EMBEDDINGS_URL + "?encoding_format=base64"
INPUT_SEPARATOR = "\x1f"
# OpenAI's own limit on the inputs of one request.
MAX_INPUTS = 2048
_BODY_KEYS = frozenset(f.name for f in EMBEDDINGS_FIELDS)
_DEFAULT_ERROR_CODE = "processing_error"


def is_embeddings_url(url: str | None) -> bool:
    """Whether a row's endpoint is /v1/embeddings (in either encoding)."""
    return url is not None and (url == EMBEDDINGS_URL or url.startswith(EMBEDDINGS_URL + "?"))


def embedding_request_rows(obj: dict[str, Any], number: int) -> list[dict[str, Any]]:
    """One /v1/embeddings request line as rows (one per input string).

    Raises:
        BadLine: naming the offending body field.
    """
    custom_id = obj["custom_id"]
    if INPUT_SEPARATOR in custom_id:
        raise BadLine(number, "custom_id must not hold the character U+001F")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise BadLine(number, "body must be a JSON object")
    unknown = sorted(set(body) - _BODY_KEYS)
    if unknown:
        raise BadLine(
            number,
            f"body.{unknown[0]} is not supported for {EMBEDDINGS_URL} (supported: "
            f"{', '.join(sorted(_BODY_KEYS))})",
        )
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) for t in inputs):
        raise BadLine(
            number,
            "body.input must be a string or a non-empty list of strings (token-id input "
            "is not supported)",
        )
    if len(inputs) > MAX_INPUTS:
        raise BadLine(number, f"body.input has {len(inputs)} strings; at most {MAX_INPUTS}")
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1
    ):
        raise BadLine(number, "body.dimensions must be a positive integer")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadLine(number, "body.encoding_format must be float or base64")
    model = body.get("model")
    url = BASE64_URL if encoding == "base64" else EMBEDDINGS_URL
    return [
        {
            "custom_id": custom_id if len(inputs) == 1 else f"{custom_id}{INPUT_SEPARATOR}{i}",
            "url": url,
            "model": model if isinstance(model, str) else None,
            "prompt": text,
            "dimensions": dimensions,
        }
        for i, text in enumerate(inputs)
    ]


def _split_id(row_id: str) -> tuple[str, int]:
    """(the request's custom_id, the row's input index)."""
    custom_id, sep, index = row_id.rpartition(INPUT_SEPARATOR)
    return (custom_id, int(index)) if sep else (row_id, 0)


class EmbeddingResponses:
    """Joins result rows of /v1/embeddings lines, in input order, into response lines.

    Args:
        model_name: the responses' `model`.
        batch_id: mixed into the generated ids (as openai_output does), so rewriting an
            output file gives identical bytes.
    """

    def __init__(self, *, model_name: str, batch_id: str = "") -> None:
        self.model_name = model_name
        self.batch_id = batch_id
        self._custom_id: str | None = None
        self._rows: list[dict[str, Any]] = []

    def add(self, rows: Iterable[dict[str, Any]]) -> Iterator[str]:
        """Take rows (result columns plus `url`) in input order; yield each line that
        is complete (its next row belongs to another request)."""
        for row in rows:
            custom_id, _ = _split_id(row["id"])
            if self._rows and custom_id != self._custom_id:
                yield self._line()
            self._custom_id = custom_id
            self._rows.append(row)

    def flush(self) -> Iterator[str]:
        """Yield the line of the rows taken so far, if any."""
        if self._rows:
            yield self._line()

    def _line(self) -> str:
        rows, custom_id = self._rows, self._custom_id
        self._rows, self._custom_id = [], None
        digest = hashlib.sha256(f"{self.batch_id}\x00{custom_id}".encode()).hexdigest()
        line: dict[str, Any] = {"id": f"batch_req_{digest[:32]}", "custom_id": custom_id}
        failed = [r for r in rows if r["error"] is not None or r["finish_reason"] == "error"]
        if failed:
            index = _split_id(failed[0]["id"])[1]
            where = f"input {index}: " if len(rows) > 1 else ""
            line["response"] = None
            line["error"] = {
                "code": failed[0].get("error_code") or _DEFAULT_ERROR_CODE,
                "message": where + (failed[0]["error"] or "the request failed"),
            }
            return dumps_line(line)
        is_base64 = rows[0].get("url") == BASE64_URL
        data = [
            {
                "object": "embedding",
                "index": _split_id(r["id"])[1],
                "embedding": _encoded(r["embedding"], is_base64),
            }
            for r in rows
        ]
        num_tokens = sum(int(r["prompt_tokens"] or 0) for r in rows)
        line["response"] = {
            "status_code": 200,
            "request_id": f"req_{digest[32:64]}",
            "body": {
                "object": "list",
                "data": data,
                "model": self.model_name,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
            },
        }
        line["error"] = None
        return dumps_line(line)


def _encoded(values: list[float], is_base64: bool) -> list[float] | str:
    """An embedding as OpenAI returns it: floats, or base64 of little-endian float32."""
    if not is_base64:
        return [float(v) for v in values]
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
