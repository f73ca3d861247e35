"""OpenAI batch output files: one response (or error) line per result row.

A row's body has the shape of its request's endpoint: a ChatCompletion (with
`logprobs.content` where asked for, `message.tool_calls` where the request's tools were
called), a legacy Completion (with its `logprobs` of tokens, token_logprobs, top_logprobs
and text_offset), or a Responses API `Response` - the shapes the `openai` package's own
types validate. An answer whose reasoning was written apart (a `reasoning_content`
result column) carries it as vLLM does: `message.reasoning_content` in a ChatCompletion,
a `reasoning` output item before the message in a Response; its `reasoning_tokens`
column is the usage's `completion_tokens_details.reasoning_tokens` (Responses:
`output_tokens_details.reasoning_tokens`, 0 without the column: nothing was split).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from tokenmill.connectors.jsonutil import dumps_line
from tokenmill.connectors.openai_fields import CHAT_URL, RESPONSES_URL, URLS
from tokenmill.connectors.openai_tools import read_tool_calls

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
            `completions` column list them ({output, finish_reason, logprobs?} each).
            Optional: `logprobs` (the results column), `tool_calls` (the request's
            tool_calls column: its answer is read as tool calls), `max_tokens_capped`
            ({requested, applied}: the budget was capped at the context left; stated in
            the usage).
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
    if endpoint is not None and endpoint not in URLS:
        raise ValueError(f"endpoint must be one of {', '.join(URLS)}, got {endpoint!r}")
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
    if url == RESPONSES_URL:
        return _response_body(row, model_name, created, digest)
    is_chat = url == CHAT_URL
    choices = []
    for index, (text, reason, logprobs) in enumerate(_completions(row)):
        choice: dict[str, Any] = {"index": index}
        if is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if row.get("tool_calls") and text is not None:
                content, calls = read_tool_calls(
                    text, row["tool_calls"], f"{digest}:{index}", cut=reason == "length"
                )
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": calls}
                    reason = "tool_calls" if reason == "stop" else reason
            if "reasoning_content" in row:  # as vLLM: the reasoning written apart, or null
                message["reasoning_content"] = row["reasoning_content"] if index == 0 else None
            choice["message"] = message
            choice["logprobs"] = None if logprobs is None else _chat_logprobs(logprobs)
        else:
            choice["text"] = text
            choice["logprobs"] = None if logprobs is None else _completion_logprobs(logprobs)
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
        "usage": _with_cap(
            row,
            {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": int(row.get("cached_tokens") or 0)},
                **(
                    {"completion_tokens_details": {"reasoning_tokens": row["reasoning_tokens"]}}
                    if "reasoning_tokens" in row
                    else {}
                ),
            },
        ),
    }


def _with_cap(row: dict, usage: dict[str, Any]) -> dict[str, Any]:
    """`usage`, stating the completion budget when the request's max_tokens was capped at
    the context its prompt left (`max_tokens_capped`: {requested, applied})."""
    if row.get("max_tokens_capped"):
        usage["max_tokens_capped"] = dict(row["max_tokens_capped"])
    return usage


def _completions(row: dict) -> list[tuple[str | None, str, list | None]]:
    """(text, finish_reason, logprobs) of each of a row's completions."""
    if row.get("completions"):  # n > 1: every completion is a choice
        return [(c["output"], c["finish_reason"], c.get("logprobs")) for c in row["completions"]]
    outputs = row["output"] if isinstance(row["output"], list) else [row["output"]]
    reasons = row["finish_reason"]
    if not isinstance(reasons, list):
        reasons = [reasons] * len(outputs)
    logprobs = [row.get("logprobs")] + [None] * (len(outputs) - 1)
    return list(zip(outputs, reasons, logprobs))


def _token(entry: dict) -> dict[str, Any]:
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": list(entry["bytes"])}


def _chat_logprobs(entries: list[dict]) -> dict[str, Any]:
    content = [
        {**_token(e), "top_logprobs": [_token(t) for t in e["top_logprobs"] or []]} for e in entries
    ]
    return {"content": content, "refusal": None}


def _completion_logprobs(entries: list[dict]) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
    offsets, offset = [], 0
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {t["token"]: t["logprob"] for t in e["top_logprobs"] or []} for e in entries
        ],
        "text_offset": offsets,
    }


def _reasoning_items(row: dict, digest: str) -> list[dict[str, Any]]:
    """The Responses API's reasoning item before the message, when the row's answer
    wrote reasoning apart (its text as `reasoning_text` content; no summary is made)."""
    reasoning = row.get("reasoning_content")
    if reasoning is None:
        return []
    return [
        {
            "type": "reasoning",
            "id": f"rs_{digest[:32]}",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": reasoning}],
        }
    ]


def _response_body(row: dict, model_name: str, created: int, digest: str) -> dict[str, Any]:
    """A Responses API `Response`: the reasoning item if the answer wrote one apart,
    then one output message holding the text."""
    text, reason, _ = _completions(row)[0]
    is_complete = reason != "length"
    prompt_tokens = int(row["prompt_tokens"] or 0)
    completion_tokens = int(row["completion_tokens"] or 0)
    return {
        "id": f"resp_{digest[:32]}",
        "object": "response",
        "created_at": created,
        "status": "completed" if is_complete else "incomplete",
        "incomplete_details": None if is_complete else {"reason": "max_output_tokens"},
        "error": None,
        "model": model_name,
        "output": [
            *_reasoning_items(row, digest),
            {
                "type": "message",
                "id": f"msg_{digest[32:64]}",
                "status": "completed" if is_complete else "incomplete",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            },
        ],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "usage": _with_cap(
            row,
            {
                "input_tokens": prompt_tokens,
                # Cache writes are not billed apart here: none are reported.
                "input_tokens_details": {
                    "cached_tokens": int(row.get("cached_tokens") or 0),
                    "cache_write_tokens": 0,
                },
                "output_tokens": completion_tokens,
                "output_tokens_details": {
                    "reasoning_tokens": int(row.get("reasoning_tokens") or 0)
                },
                "total_tokens": prompt_tokens + completion_tokens,
            },
        ),
    }
