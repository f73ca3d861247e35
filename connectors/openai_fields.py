"""Every field of an OpenAI batch request body and its fate, per endpoint.

A field is honoured (it fills a row column the job runs with), ignored because it cannot
change the answer, or refused by name: the line becomes an error line saying which field
and why. A field the table does not know is refused the same way, so nothing a request
asks for is accepted and dropped. The docs' tables (docs/openai-batch.md, "The field
tables") are generated from this one.

The tables hold exactly the request fields of the `openai` package's own types
(`CompletionCreateParams` of chat and of completions, `ResponseCreateParams`,
`EmbeddingCreateParams`), plus vLLM's extensions, marked `extension=True`. The dev
extras pin the package to one minor release; tests/connectors/test_openai_package_fields.py
fails when its fields and these tables part, naming each field to decide.

Sampling fields fill columns named after the job options they override
(`pipelines/options.py`, `per_row=True`); the rest fill the row's messages, prompt,
response_format, tools and tool_calls columns (`connectors/openai_batch.py`).

How to add a field: one `Field(...)` in the endpoint's tuple; an honoured one names its
column and the function that turns the body's value into it (a `BadLine` naming the
field when the value is wrong). The /v1/embeddings table is read by
`openai_embeddings.py`, which turns its lines into rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tokenmill.connectors.lines import BadLine
from tokenmill.connectors.openai_tools import ToolRequest

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
RESPONSES_URL = "/v1/responses"
URLS = (CHAT_URL, COMPLETIONS_URL, RESPONSES_URL)
EMBEDDINGS_URL = "/v1/embeddings"

HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"

# (body, line number) -> the row's column values; raises BadLine.
Convert = Callable[[dict[str, Any], int], dict[str, Any]]


@dataclass(frozen=True)
class Field:
    """One body field: its fate, what it does here (or why it is ignored or refused),
    and for an honoured field how its value becomes row columns."""

    name: str
    fate: str
    note: str
    convert: Convert | None = None  # honoured fields only
    # Not an OpenAI field (the openai package's types lack it): vLLM's extension.
    extension: bool = False


# -- values ------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, number: int, name: str, what: str) -> None:
    if not ok:
        raise BadLine(number, f"body.{name} must be {what}")


def _number(name: str, column: str | None = None) -> Convert:
    def convert(body: dict[str, Any], number: int) -> dict[str, Any]:
        _check(_is_number(body[name]), number, name, "a number")
        return {column or name: body[name]}

    return convert


def _integer(name: str, column: str | None = None) -> Convert:
    def convert(body: dict[str, Any], number: int) -> dict[str, Any]:
        _check(_is_int(body[name]), number, name, "an integer")
        return {column or name: body[name]}

    return convert


def _int_list(name: str) -> Convert:
    def convert(body: dict[str, Any], number: int) -> dict[str, Any]:
        value = body[name]
        ok = isinstance(value, list) and all(_is_int(v) for v in value)
        _check(ok, number, name, "a list of integers")
        return {name: value}

    return convert


def _strings(name: str) -> Convert:
    """A string or a list of strings (stop, bad_words) as a list."""

    def convert(body: dict[str, Any], number: int) -> dict[str, Any]:
        value = body[name]
        value = [value] if isinstance(value, str) else value
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        _check(ok, number, name, "a string or a list of strings")
        return {name: value}

    return convert


def _logit_bias(body: dict[str, Any], number: int) -> dict[str, Any]:
    value = body["logit_bias"]
    ok = isinstance(value, dict) and all(_is_number(v) for v in value.values())
    _check(ok, number, "logit_bias", "an object of token ids to numbers")
    return {"logit_bias": json.dumps(value)}  # checked as the job option is, per row


def _max_tokens(body: dict[str, Any], number: int) -> dict[str, Any]:
    # max_completion_tokens, OpenAI's newer name, wins when both are given.
    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    _check(_is_int(body[name]), number, name, "an integer")
    return {"max_tokens": body[name]}


def _chat_logprobs(body: dict[str, Any], number: int) -> dict[str, Any]:
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    _check(wanted is None or isinstance(wanted, bool), number, "logprobs", "a boolean")
    _check(top is None or (_is_int(top) and 0 <= top <= 20), number, "top_logprobs", "0-20")
    return {"logprobs": top or 0} if wanted else {}


def _completion_logprobs(body: dict[str, Any], number: int) -> dict[str, Any]:
    value = body["logprobs"]
    _check(_is_int(value) and 0 <= value <= 5, number, "logprobs", "an integer in 0-5")
    return {"logprobs": value}


def _needs(name: str, other: str) -> Convert:
    """A field read together with `other` (whose convert reads both): refused alone."""

    def convert(body: dict[str, Any], number: int) -> dict[str, Any]:
        if not body.get(other):
            raise BadLine(number, f"body.{name} is refused without body.{other}")
        return {}

    return convert


def _tool_choice(body: dict[str, Any], number: int) -> dict[str, Any]:
    if body.get("tools") is None and body["tool_choice"] != "none":
        raise BadLine(number, "body.tool_choice is refused without body.tools")
    return {}


def _parallel_tool_calls(body: dict[str, Any], number: int) -> dict[str, Any]:
    # Without tools there is no call to make: the answer is the same either way.
    return {}


def _response_format(body: dict[str, Any], number: int) -> dict[str, Any]:
    return {"response_format": response_format_text(body["response_format"], number)}


def response_format_text(value: Any, number: int, where: str = "body.response_format") -> str:
    """A chat response_format's JSON text, once its shape is OpenAI's; else BadLine."""
    kinds = ", ".join(RESPONSE_FORMAT_TYPES)
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        raise BadLine(number, f"{where} must be an object with type one of {kinds}")
    if value["type"] == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise BadLine(number, f"{where}.json_schema must be an object with a schema object")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise BadLine(number, f"{where}.json_schema.strict must be a boolean")
    return json.dumps(value, ensure_ascii=False)


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _text_format(body: dict[str, Any], number: int) -> dict[str, Any]:
    """The Responses API's text.format, as the chat response_format it means."""
    text = body["text"]
    if not isinstance(text, dict):
        raise BadLine(number, "body.text must be an object")
    unknown = sorted(set(text) - {"format"})
    if unknown:
        raise BadLine(number, f"body.text.{unknown[0]} is not supported (only text.format)")
    fmt = text.get("format")
    if fmt is None:
        return {}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        # Responses put the schema's name, schema and strict beside its type.
        spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        fmt = {"type": "json_schema", "json_schema": spec}
    return {"response_format": response_format_text(fmt, number, "body.text.format")}


def _choice_checked(name: str, allowed: tuple[Any, ...], why: str) -> Convert:
    """A field honoured only at the values tokenmill serves; any other is refused."""

    def convert(body: dict[str, Any], number: int) -> dict[str, Any]:
        if body[name] not in allowed:
            raise BadLine(number, f"body.{name}={json.dumps(body[name])} is refused: {why}")
        return {}

    return convert


def _best_of(body: dict[str, Any], number: int) -> dict[str, Any]:
    n = body.get("n") or 1
    if body["best_of"] != n:
        raise BadLine(
            number, "body.best_of is refused unless it equals n: tokenmill returns every sample"
        )
    return {}


def _reasoning_effort(body: dict[str, Any], number: int) -> dict[str, Any]:
    # Its values and whether the model reads it are the chat template's to say: the row
    # is rendered with it (pipelines/reasoning.py), and refused there by name.
    _check(isinstance(body["reasoning_effort"], str), number, "reasoning_effort", "a string")
    return {"reasoning_effort": body["reasoning_effort"]}


def _modalities(body: dict[str, Any], number: int) -> dict[str, Any]:
    if body["modalities"] != ["text"]:
        raise BadLine(number, 'body.modalities is refused unless it is ["text"]')
    return {}


def _tools(body: dict[str, Any], number: int) -> dict[str, Any]:
    return ToolRequest.from_body(body, number).columns()


def _prompt_cache_options(body: dict[str, Any], number: int) -> dict[str, Any]:
    # Breakpoints and lifetimes change only what OpenAI's cache keeps; a prewarm asks
    # for no answer at all, which a batch line cannot give.
    options = body["prompt_cache_options"]
    if not isinstance(options, dict):
        raise BadLine(number, "body.prompt_cache_options must be an object")
    if options.get("prewarm"):
        raise BadLine(
            number, "body.prompt_cache_options.prewarm is refused: every line is answered"
        )
    return {}


# -- the tables ------------------------------------------------------------------------------

_MODEL = Field("model", IGNORED, "the job's model answers every line (the response names it)")
_USER = Field("user", IGNORED, "an end-user id for abuse monitoring")
_STREAM = (
    Field("stream", IGNORED, "a batch answers whole"),
    Field("stream_options", IGNORED, "a batch answers whole"),
)
# The chat and Responses APIs' own: what OpenAI stores, bills and routes.
_SERVICE_IGNORED = (
    _USER,
    *_STREAM,
    *(
        Field(name, IGNORED, note)
        for name, note in (
            ("metadata", "tags stored with a request"),
            ("store", "whether OpenAI stores the output"),
            ("service_tier", "a billing tier"),
            ("safety_identifier", "an end-user id for abuse monitoring"),
            ("prompt_cache_key", "a cache routing hint; the prefix cache needs none"),
            ("prompt_cache_retention", "how long OpenAI keeps cached prefixes"),
        )
    ),
)
_MODERATION = Field("moderation", REFUSED, "no moderation model runs")
_SAMPLING = (
    Field("temperature", HONOURED, "temperature", _number("temperature")),
    Field("top_p", HONOURED, "top_p", _number("top_p")),
)
_SHARED_SAMPLING = (
    *_SAMPLING,
    Field("n", HONOURED, "n completions (choices)", _integer("n")),
    Field("seed", HONOURED, "seed", _integer("seed")),
    Field("stop", HONOURED, "stop strings", _strings("stop")),
    Field("frequency_penalty", HONOURED, "frequency_penalty", _number("frequency_penalty")),
    Field("presence_penalty", HONOURED, "presence_penalty", _number("presence_penalty")),
    Field("logit_bias", HONOURED, "logit_bias", _logit_bias),
    # vLLM's extensions of the same requests.
    *(
        Field(name, HONOURED, f"{name} (vLLM's extension)", convert, extension=True)
        for name, convert in (
            ("top_k", _integer("top_k")),
            ("min_p", _number("min_p")),
            ("min_tokens", _integer("min_tokens")),
            ("stop_token_ids", _int_list("stop_token_ids")),
            ("repetition_penalty", _number("repetition_penalty")),
            ("allowed_token_ids", _int_list("allowed_token_ids")),
            ("bad_words", _strings("bad_words")),
        )
    ),
)

CHAT_FIELDS: tuple[Field, ...] = (
    Field("messages", HONOURED, "the conversation, through the model's chat template"),
    _MODEL,
    Field("max_tokens", HONOURED, "max_tokens", _max_tokens),
    Field("max_completion_tokens", HONOURED, "max_tokens (wins over max_tokens)", _max_tokens),
    *_SHARED_SAMPLING,
    Field("logprobs", HONOURED, "choices[].logprobs.content", _chat_logprobs),
    Field(
        "top_logprobs",
        HONOURED,
        "top_logprobs of each token (with logprobs)",
        _needs("top_logprobs", "logprobs"),
    ),
    Field("response_format", HONOURED, "structured outputs", _response_format),
    Field(
        "tools",
        HONOURED,
        "function tools: rendered by the chat template, answered as message.tool_calls",
        _tools,
    ),
    Field(
        "tool_choice", HONOURED, "none, auto (where served), required or a function", _tool_choice
    ),
    Field("parallel_tool_calls", HONOURED, "false: at most one tool call", _parallel_tool_calls),
    Field("modalities", HONOURED, 'only ["text"]', _modalities),
    Field("prediction", IGNORED, "predicted output only speeds up generation"),
    *_SERVICE_IGNORED,
    Field(
        "prompt_cache_options",
        IGNORED,
        "cache breakpoints and lifetime; the prefix cache needs no hints",
    ),
    _MODERATION,
    Field("audio", REFUSED, "no audio output"),
    Field("functions", REFUSED, "deprecated: give tools"),
    Field("function_call", REFUSED, "deprecated: give tool_choice"),
    Field(
        "reasoning_effort",
        HONOURED,
        "to the chat template (low, medium, high); an error row for a model whose template "
        "does not read it",
        _reasoning_effort,
    ),
    Field("verbosity", REFUSED, "no verbosity control"),
    Field("web_search_options", REFUSED, "no web search"),
)

COMPLETIONS_FIELDS: tuple[Field, ...] = (
    Field("prompt", HONOURED, "one prompt, sent as it is"),
    _MODEL,
    Field("max_tokens", HONOURED, "max_tokens", _max_tokens),
    *_SHARED_SAMPLING,
    Field(
        "logprobs", HONOURED, "choices[].logprobs (tokens, top_logprobs...)", _completion_logprobs
    ),
    Field(
        "echo",
        HONOURED,
        "only false",
        _choice_checked("echo", (False,), "the output never repeats the prompt"),
    ),
    Field("best_of", HONOURED, "only equal to n", _best_of),
    _USER,
    *_STREAM,
    Field("suffix", REFUSED, "no fill-in-the-middle"),
)

RESPONSES_FIELDS: tuple[Field, ...] = (
    Field("input", HONOURED, "a string or a list of messages, through the chat template"),
    Field("instructions", HONOURED, "a system message before the input"),
    _MODEL,
    Field("max_output_tokens", HONOURED, "max_tokens", _integer("max_output_tokens", "max_tokens")),
    *_SAMPLING,
    Field("text", HONOURED, "text.format: text, json_object or json_schema", _text_format),
    Field(
        "truncation",
        HONOURED,
        'only "disabled": an over-long input is an error',
        _choice_checked("truncation", ("disabled",), "inputs are never truncated"),
    ),
    Field(
        "prompt_cache_options",
        HONOURED,
        "cache hints need nothing here; prewarm (no answer) is refused",
        _prompt_cache_options,
    ),
    Field(
        "background",
        IGNORED,
        "a batch runs in the background anyway",
    ),
    Field("background_options", IGNORED, "a completion window: the batch has its own"),
    Field("access_programs", IGNORED, "an OpenAI access program"),
    Field(
        "image",
        IGNORED,
        "image output options: answers are text (input images come as input_image parts)",
    ),
    *_SERVICE_IGNORED,
    _MODERATION,
    Field("context_management", REFUSED, "no context compaction: an over-long input is an error"),
    Field("tools", REFUSED, "tools are served on /v1/chat/completions"),
    Field("tool_choice", REFUSED, "tools are served on /v1/chat/completions"),
    Field("parallel_tool_calls", REFUSED, "tools are served on /v1/chat/completions"),
    Field("max_tool_calls", REFUSED, "tools are served on /v1/chat/completions"),
    Field("previous_response_id", REFUSED, "no stored responses: give the whole input"),
    Field("conversation", REFUSED, "no stored conversations: give the whole input"),
    Field("prompt", REFUSED, "no stored prompt templates"),
    Field("include", REFUSED, "no extra output items"),
    Field("reasoning", REFUSED, "no reasoning control"),
    Field("top_logprobs", REFUSED, "logprobs are served on /v1/chat/completions"),
)

EMBEDDINGS_FIELDS: tuple[Field, ...] = (
    Field("input", HONOURED, "a string or a list of strings: a row each"),
    _MODEL,
    Field("dimensions", HONOURED, "the embedding's size, where the model can shorten it"),
    Field("encoding_format", HONOURED, "float or base64: how the answer is written"),
    _USER,
)

FIELDS: dict[str, dict[str, Field]] = {
    url: {f.name: f for f in table}
    for url, table in (
        (CHAT_URL, CHAT_FIELDS),
        (COMPLETIONS_URL, COMPLETIONS_FIELDS),
        (RESPONSES_URL, RESPONSES_FIELDS),
    )
}

# The row columns of the sampling fields: named after the job options they override.
SAMPLING_COLUMNS: dict[str, pa.DataType] = {
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
    "logprobs": pa.int64(),
    "repetition_penalty": pa.float64(),
    "presence_penalty": pa.float64(),
    "frequency_penalty": pa.float64(),
    "logit_bias": pa.string(),  # the body's object as JSON text
    "allowed_token_ids": pa.list_(pa.int64()),
    "bad_words": pa.list_(pa.string()),
}


def body_columns(url: str, body: dict[str, Any], number: int) -> dict[str, Any]:
    """The columns a body's fields fill (sampling, response_format, tools...), every field
    checked against the endpoint's table. Null values count as absent.

    Raises:
        BadLine: a refused or unknown field, or an honoured one with a bad value; the
            message names the field.
    """
    table = FIELDS[url]
    columns: dict[str, Any] = {}
    for name, value in body.items():
        if value is None:
            continue
        spec = table.get(name)
        if spec is None:
            raise BadLine(number, f"body.{name} is refused: not a field tokenmill knows for {url}")
        if spec.fate == REFUSED:
            raise BadLine(number, f"body.{name} is refused: {spec.note}")
        if spec.convert is not None:
            columns.update(spec.convert(body, number))
    return columns


def fate_table() -> str:
    """The tables as Markdown (docs/openai-batch.md, "The field tables")."""
    lines = []
    tables = [*((url, tuple(t.values())) for url, t in FIELDS.items())]
    for url, table in [*tables, (EMBEDDINGS_URL, EMBEDDINGS_FIELDS)]:
        lines += [f"`{url}`", "", "| field | fate | meaning |", "|---|---|---|"]
        lines += [f"| `{f.name}` | {f.fate} | {f.note} |" for f in table]
        lines.append("")
    return "\n".join(lines)
