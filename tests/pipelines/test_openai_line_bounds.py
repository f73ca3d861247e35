"""An OpenAI batch line's work is bounded as OpenAI bounds it: `n` up to `max_n` (128),
max_tokens capped at the context the prompt leaves (stated in the usage), and a tool call
cut by max_tokens still returned as a call - on the tiny model, end to end through run_job."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletion
from tiny_model import build_tiny_model

from tokenmill.pipelines.job import run_job

CONTEXT = 64  # a short context: a budget capped to it is generated in a moment


@pytest.fixture(scope="module")
def short_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("short"), max_position_embeddings=CONTEXT)


WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}},
}


def _chat(custom_id: str, question: str | None = None, **body) -> dict:
    # By default each line asks its own question: identical lines are computed once.
    question = question or f"What is the weather in Paris? ({custom_id})"
    messages = [{"role": "user", "content": question}]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": messages, **body},
    }


def _run(tmp_path, lines: list[dict], model_dir, **options) -> dict[str, dict]:
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    run_job(
        str(src),
        str(out),
        model=str(model_dir),
        format="openai-batch",
        output_format="openai-batch",
        **options,
    )
    answers = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {a["custom_id"]: a for a in answers}


def test_n_over_the_limit_is_an_error_line_naming_n_and_the_limit(tmp_path, tiny_model_dir):
    lines = [_chat("huge", n=100_000, max_tokens=2), _chat("two", n=2, max_tokens=2)]
    answers = _run(tmp_path, lines, tiny_model_dir)
    assert answers["huge"]["response"] is None
    assert answers["huge"]["error"]["message"] == (
        "n=100000 is over the limit of 128 completions (max_n)"
    )
    assert len(answers["two"]["response"]["body"]["choices"]) == 2


def test_the_n_limit_is_an_option(tmp_path, tiny_model_dir):
    lines = [_chat("three", n=3, max_tokens=2), _chat("two", n=2, max_tokens=2)]
    answers = _run(tmp_path, lines, tiny_model_dir, max_n=2)
    assert answers["three"]["error"]["message"] == "n=3 is over the limit of 2 completions (max_n)"
    assert answers["two"]["error"] is None
    with pytest.raises(ValueError, match=r"n=3 is over the limit of 2 \(max_n\)"):
        run_job(str(tmp_path / "batch.jsonl"), str(tmp_path / "o2"), n=3, max_n=2)


def test_max_tokens_past_the_context_is_capped_and_the_usage_says_so(tmp_path, short_model_dir):
    lines = [
        _chat("huge", max_tokens=100_000),
        _chat("newer-name", max_completion_tokens=5_000),
        _chat("fits", max_tokens=3),
    ]
    answers = _run(tmp_path, lines, short_model_dir)
    for custom_id, requested in (("huge", 100_000), ("newer-name", 5_000)):
        body = ChatCompletion.model_validate(answers[custom_id]["response"]["body"])
        usage = answers[custom_id]["response"]["body"]["usage"]
        left = CONTEXT - body.usage.prompt_tokens
        assert usage["max_tokens_capped"] == {"requested": requested, "applied": left}
        # The random model never stops on its own: it runs to the capped budget.
        assert body.choices[0].finish_reason == "length"
        assert body.usage.completion_tokens == left
    fits = answers["fits"]["response"]["body"]
    assert "max_tokens_capped" not in fits["usage"] and fits["usage"]["completion_tokens"] == 3


def test_a_plain_jobs_budget_past_the_context_is_still_an_error_row(tmp_path, tiny_model_dir):
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"prompt": "hello"}) + "\n")
    ledger = run_job(str(src), str(tmp_path / "out"), model=str(tiny_model_dir), max_tokens=1000)
    assert (ledger.rows_ok, ledger.rows_failed) == (0, 1)


def test_a_tool_call_cut_by_max_tokens_is_returned_as_the_partial_call(tmp_path, tiny_model_dir):
    # As a new user tries it: tool_choice "required" and a permissive parameters schema.
    budgets = (30, 34, 36)
    ask = {"question": "Weather?", "tools": [WEATHER], "tool_choice": "required"}
    lines = [_chat("whole", max_tokens=60, **ask)]
    lines += [_chat(f"cut-{b}", max_tokens=b, **ask) for b in budgets]
    answers = _run(tmp_path, lines, tiny_model_dir)
    whole = ChatCompletion.model_validate(answers["whole"]["response"]["body"]).choices[0]
    assert whole.finish_reason == "tool_calls"
    (complete,) = whole.message.tool_calls
    for budget in budgets:
        body = ChatCompletion.model_validate(answers[f"cut-{budget}"]["response"]["body"])
        choice = body.choices[0]
        assert choice.finish_reason == "length" and body.usage.completion_tokens == budget
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        # The arguments generated so far: the start of the whole answer's arguments.
        assert complete.function.arguments.startswith(call.function.arguments)
