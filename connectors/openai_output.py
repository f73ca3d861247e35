"""OpenAI batch output files: one response (or error) line per result row."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from tokenmill.connectors.jsonutil import dumps_line
from tokenmill.connectors.openai_batch import CHAT_URL, COMPLETIONS_URL

RESULT_COLUMNS = ("output", "finish_reason", "prompt_tokens", "completion_tokens", "error")

# Our rows say only that a request failed and why; OpenAI's codes name causes we do
# not distinguish. An `error_code` column in the results overrides this per row.
DEFAULT_ERROR_CODE = "processing_error"


def openai_batch_output_lines(
    results: pa.Table,
    *,
    model_name: str,
    endpoint: str | None = None,
    created: int | None = None,
    batch_id: str = "",
    id_column: str = "id",
) -> list[str]:
    """Formats result rows as OpenAI batch output lines (JSON, no trailing newline).

    Args:
        results: rows with `id` (the request's custom_id), `output`, `finish_reason`,
            `prompt_tokens`, `cached_tokens` (optional), `completion_tokens`, `error`.
            `output` may also be a list of strings (n > 1: one choice each), or a
            `completions` column list them ({output, finish_reason} each).
        model_name: reported as the responses' `model` (a row's `adapter`, the LoRA
            adapter it ran with, when it has one).
        endpoint: the URL every request used; None takes each row's `url` column
            (passed through from the batch input) and falls back to chat completions.
        created: Unix time for `created` (default: now).
        batch_id: mixed into the generated ids, which are otherwise a pure function
            of the custom_id, so rewriting an output file gives identical bytes.
        id_column: the column holding the custom_id.

    Returns:
        One line per row, in row order.
    """
    _check(results, model_name=model_name, endpoint=endpoint, id_column=id_column)
    created = int(time.time()) if created is None else created
    return list(_lines(results, model_name, endpoint, created, batch_id, id_column))


def _check(results: pa.Table, *, model_name: str, endpoint: str | None, id_column: str):
    missing = [c for c in (id_column, *RESULT_COLUMNS) if c not in results.column_names]
    if missing:
        raise ValueError(f"results lack column(s) {missing}; have {results.column_names}")
    if endpoint not in (None, CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"endpoint must be {CHAT_URL} or {COMPLETIONS_URL}, got {endpoint!r}")
    if not model_name:
        raise ValueError("model_name must be a non-empty string")


def _lines(results, model_name, endpoint, created, batch_id, id_column) -> Iterator[str]:
    for batch in results.to_batches():
        for row in batch.to_pylist():
            custom_id = row[id_column]
            digest = hashlib.sha256(f"{batch_id}\x00{custom_id}".encode()).hexdigest()
            line: dict[str, Any] = {"id": f"batch_req_{digest[:32]}", "custom_id": custom_id}
            if row["error"] is not None or row["finish_reason"] == "error":
                line["response"] = None
                line["error"] = {
                    "code": row.get("error_code") or DEFAULT_ERROR_CODE,
                    "message": row["error"] or "the request failed",
                }
            else:
                url = endpoint or row.get("url") or CHAT_URL
                body = _body(row, url, model_name, created, digest)
                line["response"] = {
                    "status_code": 200,
                    "request_id": f"req_{digest[32:64]}",
                    "body": body,
                }
                line["error"] = None
            yield dumps_line(line)


def _body(row: dict, url: str, model_name: str, created: int, digest: str) -> dict[str, Any]:
    is_chat = url == CHAT_URL
    if row.get("completions"):  # n > 1: every completion is a choice
        outputs = [c["output"] for c in row["completions"]]
        reasons = [c["finish_reason"] for c in row["completions"]]
    else:
        outputs = row["output"] if isinstance(row["output"], list) else [row["output"]]
        reasons = row["finish_reason"]
    if not isinstance(reasons, list):
        reasons = [reasons] * len(outputs)
    choices = []
    for index, (text, reason) in enumerate(zip(outputs, reasons)):
        choice: dict[str, Any] = {"index": index}
        if is_chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = None
        choice["finish_reason"] = reason
        choices.append(choice)
    prompt_tokens = int(row["prompt_tokens"] or 0)
    completion_tokens = int(row["completion_tokens"] or 0)
    return {
        "id": f"{'chatcmpl' if is_chat else 'cmpl'}-{digest[:24]}",
        "object": "chat.completion" if is_chat else "text_completion",
        "created": created,
        "model": row.get("adapter") or model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int(row.get("cached_tokens") or 0)},
        },
    }
