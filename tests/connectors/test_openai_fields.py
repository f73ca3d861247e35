"""The one table of OpenAI batch fields and their fate, tested line by line: every field
of every endpoint has a sample here (a new field in the table fails the coverage test
until it gets one), and each sample line is honoured into the columns it should fill,
ignored (the row is the line without it), or refused by name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tokenmill.connectors.lines import BadLine
from tokenmill.connectors.openai_batch import request_rows, request_to_row
from tokenmill.connectors.openai_fields import (
    CHAT_URL,
    COMPLETIONS_URL,
    FIELDS,
    HONOURED,
    IGNORED,
    REFUSED,
    RESPONSES_URL,
    SAMPLING_COLUMNS,
    fate_table,
)
from tokenmill.pipelines.options import per_row_fields

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
BASE_BODIES = {
    CHAT_URL: {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
    COMPLETIONS_URL: {"model": "m", "prompt": "Once"},
    RESPONSES_URL: {"model": "m", "input": "Hi"},
}
# Per endpoint, per field: (what the sample line adds to the base body, the columns the
# row gains). Ignored and refused fields need only the body.
SHARED_SAMPLING = {
    "temperature": ({"temperature": 0.5}, {"temperature": 0.5}),
    "top_p": ({"top_p": 0.5}, {"top_p": 0.5}),
    "n": ({"n": 2}, {"n": 2}),
    "seed": ({"seed": 3}, {"seed": 3}),
    "stop": ({"stop": "END"}, {"stop": ["END"]}),
    "frequency_penalty": ({"frequency_penalty": 1.5}, {"frequency_penalty": 1.5}),
    "presence_penalty": ({"presence_penalty": -1.0}, {"presence_penalty": -1.0}),
    "logit_bias": ({"logit_bias": {"28": -100}}, {"logit_bias": '{"28": -100}'}),
    "top_k": ({"top_k": 5}, {"top_k": 5}),
    "min_p": ({"min_p": 0.1}, {"min_p": 0.1}),
    "min_tokens": ({"min_tokens": 2}, {"min_tokens": 2}),
    "stop_token_ids": ({"stop_token_ids": [5, 6]}, {"stop_token_ids": [5, 6]}),
    "repetition_penalty": ({"repetition_penalty": 1.2}, {"repetition_penalty": 1.2}),
    "allowed_token_ids": ({"allowed_token_ids": [1, 2]}, {"allowed_token_ids": [1, 2]}),
    "bad_words": ({"bad_words": "no"}, {"bad_words": ["no"]}),
}
SHARED_IGNORED = {
    name: ({name: value}, {})
    for name, value in (
        ("user", "u-1"),
        ("stream", True),
        ("stream_options", {"include_usage": True}),
    )
}
# The chat and Responses APIs' fields for OpenAI's storage, billing and routing.
SERVICE_IGNORED = {
    **SHARED_IGNORED,
    **{
        name: ({name: value}, {})
        for name, value in (
            ("metadata", {"k": "v"}),
            ("store", True),
            ("service_tier", "flex"),
            ("safety_identifier", "s"),
            ("prompt_cache_key", "k"),
            ("prompt_cache_retention", "24h"),
        )
    },
}
MODERATION = {"moderation": ({"moderation": {"model": "omni-moderation-latest"}}, None)}
TOOL_CALLS_AUTO = {"choice": "auto", "function": None, "names": ["get_weather"], "parallel": True}
SAMPLES = {
    CHAT_URL: {
        "messages": ({}, {}),
        "model": ({"model": "other"}, {"model": "other"}),
        "max_tokens": ({"max_tokens": 5}, {"max_tokens": 5}),
        "max_completion_tokens": (
            {"max_completion_tokens": 6, "max_tokens": 5},
            {"max_tokens": 6},
        ),
        **SHARED_SAMPLING,
        "logprobs": ({"logprobs": True}, {"logprobs": 0}),
        "top_logprobs": ({"logprobs": True, "top_logprobs": 3}, {"logprobs": 3}),
        "response_format": (
            {"response_format": {"type": "json_object"}},
            {"response_format": '{"type": "json_object"}'},
        ),
        "tools": (
            {"tools": [WEATHER]},
            {
                "tools": json.dumps([WEATHER]),
                "tool_calls": json.dumps(TOOL_CALLS_AUTO),
            },
        ),
        "tool_choice": (
            {"tools": [WEATHER], "tool_choice": "none"},
            {"tools": json.dumps([WEATHER])},
        ),
        "parallel_tool_calls": ({"parallel_tool_calls": False}, {}),
        "modalities": ({"modalities": ["text"]}, {}),
        "prediction": ({"prediction": {"type": "content", "content": "x"}}, {}),
        **SERVICE_IGNORED,
        "prompt_cache_options": ({"prompt_cache_options": {"ttl": "30m"}}, {}),
        **MODERATION,
        "audio": ({"audio": {"voice": "alloy", "format": "mp3"}}, None),
        "functions": ({"functions": [WEATHER["function"]]}, None),
        "function_call": ({"function_call": "auto"}, None),
        "reasoning_effort": ({"reasoning_effort": "low"}, {"reasoning_effort": "low"}),
        "verbosity": ({"verbosity": "low"}, None),
        "web_search_options": ({"web_search_options": {}}, None),
    },
    COMPLETIONS_URL: {
        "prompt": ({}, {}),
        "model": ({"model": "other"}, {"model": "other"}),
        "max_tokens": ({"max_tokens": 5}, {"max_tokens": 5}),
        **SHARED_SAMPLING,
        "logprobs": ({"logprobs": 2}, {"logprobs": 2}),
        "echo": ({"echo": False}, {}),
        "best_of": ({"best_of": 2, "n": 2}, {"n": 2}),
        **SHARED_IGNORED,
        "suffix": ({"suffix": "end"}, None),
    },
    RESPONSES_URL: {
        "input": ({}, {}),
        "instructions": (
            {"instructions": "Be brief."},
            {
                "messages": [
                    {
                        "role": "system",
                        "content": "Be brief.",
                        "tool_calls": None,
                        "tool_call_id": None,
                        "parts": None,
                    },
                    {
                        "role": "user",
                        "content": "Hi",
                        "tool_calls": None,
                        "tool_call_id": None,
                        "parts": None,
                    },
                ]
            },
        ),
        "model": ({"model": "other"}, {"model": "other"}),
        "max_output_tokens": ({"max_output_tokens": 7}, {"max_tokens": 7}),
        "temperature": ({"temperature": 0.5}, {"temperature": 0.5}),
        "top_p": ({"top_p": 0.5}, {"top_p": 0.5}),
        "text": (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "x",
                        "schema": {"type": "object"},
                        "strict": True,
                    }
                }
            },
            {
                "response_format": json.dumps(
                    {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True},
                    }
                )
            },
        ),
        "truncation": ({"truncation": "disabled"}, {}),
        "prompt_cache_options": ({"prompt_cache_options": {"mode": "implicit", "ttl": "12h"}}, {}),
        "background": ({"background": True}, {}),
        "background_options": ({"background_options": {"completion_window": "2h"}}, {}),
        "access_programs": ({"access_programs": {"cyber": "standard"}}, {}),
        "image": ({"image": {"context_compression": "auto"}}, {}),
        **SERVICE_IGNORED,
        **MODERATION,
        "context_management": ({"context_management": [{"type": "compaction"}]}, None),
        "tools": ({"tools": [WEATHER]}, None),
        "tool_choice": ({"tool_choice": "auto"}, None),
        "parallel_tool_calls": ({"parallel_tool_calls": True}, None),
        "max_tool_calls": ({"max_tool_calls": 2}, None),
        "previous_response_id": ({"previous_response_id": "resp_1"}, None),
        "conversation": ({"conversation": "conv_1"}, None),
        "prompt": ({"prompt": {"id": "pmpt_1"}}, None),
        "include": ({"include": ["reasoning.encrypted_content"]}, None),
        "reasoning": ({"reasoning": {"effort": "low"}}, None),
        "top_logprobs": ({"top_logprobs": 2}, None),
    },
}


def _row(url: str, body: dict) -> dict:
    return request_to_row({"custom_id": "c", "method": "POST", "url": url, "body": body}, 1)


def _cases():
    for url, table in FIELDS.items():
        for name, field in table.items():
            yield pytest.param(url, name, field.fate, id=f"{url}:{name}")


def test_every_field_of_the_table_has_a_sample_and_no_sample_is_stale():
    for url, table in FIELDS.items():
        assert set(SAMPLES[url]) == set(table), url


@pytest.mark.parametrize("url, name, fate", list(_cases()))
def test_each_field_has_its_fate(url, name, fate):
    body, gained = SAMPLES[url][name]
    base = _row(url, BASE_BODIES[url])
    line_body = {**BASE_BODIES[url], **body}
    if fate == REFUSED:
        with pytest.raises(BadLine, match=rf"body\.{name} is refused: "):
            _row(url, line_body)
        return
    row = _row(url, line_body)
    changed = {k: v for k, v in row.items() if base.get(k) != v}
    assert changed == gained
    if fate == IGNORED:
        assert changed == ({"model": "other"} if name == "model" else {})


def test_unknown_fields_are_refused_by_name():
    for url, body in BASE_BODIES.items():
        with pytest.raises(BadLine, match=rf"body\.frobnicate is refused: not a field .* {url}"):
            _row(url, {**body, "frobnicate": 1})


@pytest.mark.parametrize(
    "url, body", [*BASE_BODIES.items(), ("/v1/embeddings", {"input": "a text"})]
)
def test_keys_beside_body_are_refused_by_name(url, body):
    line = {"custom_id": "c", "method": "POST", "url": url, "body": body}
    assert request_rows(line, 1)  # the line itself is good

    with pytest.raises(BadLine, match=r"line 1: temperature is refused: a batch line holds"):
        request_rows({**line, "temperature": 0}, 1)


def test_null_means_absent():
    body = {**BASE_BODIES[CHAT_URL], "audio": None, "temperature": None}
    assert _row(CHAT_URL, body) == _row(CHAT_URL, BASE_BODIES[CHAT_URL])


@pytest.mark.parametrize(
    "url, body, message",
    [
        (CHAT_URL, {"top_logprobs": 2}, r"body\.top_logprobs is refused without body\.logprobs"),
        (CHAT_URL, {"logprobs": True, "top_logprobs": 21}, r"body\.top_logprobs must be 0-20"),
        (
            CHAT_URL,
            {"tool_choice": "required"},
            r"body\.tool_choice is refused without body\.tools",
        ),
        (CHAT_URL, {"modalities": ["text", "audio"]}, r"body\.modalities is refused"),
        (CHAT_URL, {"logit_bias": {"28": "x"}}, r"body\.logit_bias must be"),
        (COMPLETIONS_URL, {"echo": True}, r"body\.echo=true is refused"),
        (COMPLETIONS_URL, {"best_of": 3}, r"body\.best_of is refused unless it equals n"),
        (COMPLETIONS_URL, {"logprobs": 6}, r"body\.logprobs must be an integer in 0-5"),
        (RESPONSES_URL, {"truncation": "auto"}, r"body\.truncation=\"auto\" is refused"),
        (
            RESPONSES_URL,
            {"prompt_cache_options": {"prewarm": True}},
            r"body\.prompt_cache_options\.prewarm is refused: every line is answered",
        ),
        (COMPLETIONS_URL, {"store": True}, r"body\.store is refused: not a field"),
        (RESPONSES_URL, {"text": {"verbosity": "low"}}, r"body\.text\.verbosity is not supported"),
        (RESPONSES_URL, {"input": [{"type": "function_call_output"}]}, r"only message items"),
        (
            CHAT_URL,
            {"messages": [{"role": "user", "content": "Hi", "name": "ann"}]},
            r"body\.messages\[0\]\.name is refused",
        ),
        (
            CHAT_URL,
            {"tools": [{"type": "custom", "custom": {"name": "x"}}]},
            r"body\.tools\[0\] is refused: only function tools",
        ),
        (
            CHAT_URL,
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "names no function",
        ),
        (
            CHAT_URL,
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            r"body\.response_format is refused beside tool_choice",
        ),
    ],
)
def test_bad_values_name_the_field(url, body, message):
    with pytest.raises(BadLine, match=message):
        _row(url, {**BASE_BODIES[url], **body})


def test_a_tool_choice_is_a_constraint_on_the_answer():
    body = {**BASE_BODIES[CHAT_URL], "tools": [WEATHER], "tool_choice": "required"}
    row = _row(CHAT_URL, {**body, "parallel_tool_calls": False})
    schema = json.loads(row["response_format"])["json_schema"]["schema"]
    assert schema["type"] == "array" and schema["maxItems"] == 1
    call = schema["items"]["anyOf"][0]
    assert call["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert call["properties"]["parameters"] == WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    row = _row(CHAT_URL, {**body, "tool_choice": named})
    schema = json.loads(row["response_format"])["json_schema"]["schema"]
    assert schema == WEATHER["function"]["parameters"]
    assert json.loads(row["tool_calls"])["choice"] == "function"


def test_the_sampling_columns_are_the_per_row_job_options():
    assert set(SAMPLING_COLUMNS) == set(per_row_fields())


def test_the_docs_table_is_the_code_table():
    docs = Path(__file__).resolve().parents[2] / "docs"
    spec = importlib.util.spec_from_file_location("docs_hooks", docs / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert fate_table() in hooks.render("openai-batch.md")


def test_fates_are_the_three_and_only_honoured_fields_fill_columns():
    prompt_fields = {"messages", "prompt", "input", "instructions"}  # read with the prompt
    for table in FIELDS.values():
        for field in table.values():
            assert field.fate in (HONOURED, IGNORED, REFUSED)
            fills = field.fate == HONOURED and field.name not in prompt_fields
            assert (field.convert is not None) == fills, field.name


def test_image_parts_keep_their_place_among_the_text_parts():
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": "what is it?"}, part, {"type": "text", "text": "!"}]
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    line = {"custom_id": "c", "method": "POST", "url": CHAT_URL, "body": body}
    (row,) = request_rows(line, 1)
    (message,) = row["messages"]
    assert message["content"] == "what is it?\n!"
    assert json.loads(message["parts"]) == [
        {"type": "text", "text": "what is it?"},
        {"type": "image", "url": "data:image/png;base64,AAAA"},
        {"type": "text", "text": "!"},
    ]
    responses = {
        "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": "s3://b/k.png"}]}
        ]
    }
    (row,) = request_rows({**line, "url": "/v1/responses", "body": responses}, 1)
    assert json.loads(row["messages"][0]["parts"]) == [{"type": "image", "url": "s3://b/k.png"}]
