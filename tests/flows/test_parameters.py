"""Flow parameters: schema validation, credential checks, placeholders, JobSpec building."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from prefect.exceptions import ParameterTypeError

from tokenmill.flows import batch_inference
from tokenmill.flows.parameters import (
    build_spec,
    check_storage_options,
    expand_placeholders,
    merge_storage_options,
)
from tokenmill.pipelines.options import get_option

WHEN = datetime(2026, 3, 4, 23, 30, tzinfo=timezone.utc)


def test_schema_has_every_job_option_typed():
    schema = batch_inference.parameters.model_dump()
    props = schema["properties"]
    assert schema["required"] == ["input", "output"]
    assert props["max_tokens"]["minimum"] == 1
    assert props["shard_tokens"]["minimum"] == 1
    assert props["plan_window_rows"]["minimum"] == 1
    assert props["plan_window_rows"]["default"] == 32_768
    # not set unless given (a price of 0 is a price)
    assert props["price_input"]["default"] is None
    assert {"minimum": 0, "type": "number"} in props["price_input"]["anyOf"]
    assert props["output_format"]["enum"] == ["parquet", "jsonl", "openai-batch"]
    # documented with the job definition's help text
    assert props["max_tokens"]["description"] == get_option("max_tokens").help
    # unset: the task's default (chat to generate, raw to score)
    assert props["raw"]["default"] is None
    tasks = ["generate", "score", "embed", "classify", "rerank"]
    assert props["task"]["enum"] == tasks and props["task"]["default"] == "generate"
    assert {"type": "array", "items": {"type": "string"}} in props["passthrough"]["anyOf"]
    assert props["storage_secret"]["default"] is None


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"price_output": -2.0},
        {"shard_tokens": "many"},
        {"plan_window_rows": 0},
        {"output_format": "xlsx"},
        {"task": "summarize"},
    ],
)
def test_schema_rejects_bad_values_before_the_run(bad):
    with pytest.raises(ParameterTypeError):
        batch_inference.validate_parameters({"input": "in.jsonl", "output": "out", **bad})


def test_schema_coerces_cli_style_values():
    params = batch_inference.validate_parameters(
        {"input": "in", "output": "out", "max_tokens": "8", "resume": "false"}
    )
    assert params["max_tokens"] == 8 and params["resume"] is False


@pytest.mark.parametrize(
    "options",
    [
        {"key": "hunter2"},
        {"secret": "hunter2"},
        {"token": "hunter2"},
        {"aws_secret_access_key": "hunter2"},
        {"account_key": "hunter2"},
        {"client_kwargs": {"aws_session_token": "hunter2"}},
        {"password": "hunter2"},
    ],
)
def test_credentials_are_refused_as_parameters(options):
    with pytest.raises(ValueError, match="storage_secret") as info:
        check_storage_options(options)
    assert "hunter2" not in str(info.value)


def test_plain_storage_options_pass():
    check_storage_options({"endpoint_url": "http://127.0.0.1:9000", "anon": False})
    check_storage_options({"client_kwargs": {"region_name": "eu-west-1"}})


def test_secret_options_win_over_parameters():
    merged = merge_storage_options({"endpoint_url": "a", "anon": True}, {"anon": False, "key": "k"})
    assert merged == {"endpoint_url": "a", "anon": False, "key": "k"}
    assert merge_storage_options(None, None) is None


def test_placeholders_take_the_scheduled_time_in_utc():
    when = datetime(2026, 3, 4, 23, 30, tzinfo=timezone.utc)
    assert expand_placeholders("s3://b/out/{date}", when) == "s3://b/out/2026-03-04"
    assert expand_placeholders("/x/{datetime}/y", when) == "/x/20260304T233000Z/y"
    assert expand_placeholders("/x/{other}", when) == "/x/{other}"
    assert expand_placeholders(None, when) is None


def test_build_spec_maps_sampling_and_prices():
    spec = build_spec(
        "in.jsonl",
        "out-{date}/",
        scheduled=WHEN,
        max_tokens=9,
        temperature=0.0,
        stop=["\n"],
        price_input=1.0,
        price_output=3.0,
        storage_options={"endpoint_url": "http://e"},
        storage_secret=None,
        passthrough=["topic"],
        ledger_dataset="ledgers/{date}",
    )
    assert spec.sampling.max_tokens == 9 and spec.sampling.stop == ["\n"]
    assert spec.prices.output_per_1m == 3.0 and spec.prices.cached_input == 1.0
    assert spec.storage_options == {"endpoint_url": "http://e"}
    assert spec.output == "out-2026-03-04" and spec.ledger_dataset == "ledgers/2026-03-04"
    assert spec.passthrough == ("topic",)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"messages_column": "m", "template": "{a}"}, "not both"),
        ({"passthrough": ("id",)}, "clash"),
        ({"output_format": "openai-batch"}, "OpenAI batch input"),
    ],
)
def test_build_spec_rejects_conflicting_options(fields, message):
    with pytest.raises(ValueError, match=message):
        build_spec("in.jsonl", "out", scheduled=WHEN, **fields)
