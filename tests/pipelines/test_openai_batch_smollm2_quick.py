"""One small OpenAI batch job on the real default model (SmolLM2-135M-Instruct, fp32) in
the default suite: an engine-generated tool call, a `/v1/responses` line and a penalised
line, each held to what the engine answers for the same prompt and controls when called
directly (whose penalties and logit bias are held to transformers in
`tests/engine/test_logit_controls_smollm2.py`). The slow `test_openai_batch_smollm2.py`
keeps every field of the fate table."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest
from model_fixtures import converted_smollm2_dir, smollm2_gguf_path
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from tokenmill import SamplingParams
from tokenmill.connectors.openai_fields import CHAT_URL, RESPONSES_URL
from tokenmill.engine.loader.model_files import ModelFilesError
from tokenmill.pipelines import shared_llm
from tokenmill.pipelines.job import run_job

QUESTION = "What is the capital of France? Answer in one sentence."
LIST_QUESTION = "Write a short poem about the sea."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
MAX_TOKENS = 12
PENALTIES = {"frequency_penalty": 1.5, "presence_penalty": 0.5}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(output lines by custom_id, the engine's own answers by name)."""
    try:
        smollm2_gguf_path()
    except ModelFilesError as error:
        pytest.skip(str(error))
    llm = shared_llm.get_llm(str(converted_smollm2_dir()), dtype="float32", device="cpu").llm
    poem, question = _chat_prompt(llm, LIST_QUESTION), _chat_prompt(llm, QUESTION)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    (plain,) = llm.generate([poem], greedy)
    bias = {plain.token_ids[0]: -100.0}  # ban the unpenalised answer's first token
    # The engine's own answers, in one call: what each line must equal, and the answers
    # under part of the controls, which it must not.
    names = ["response", "penalised", "bias only", "penalties only"]
    params = [
        replace(greedy, max_tokens=7),
        replace(greedy, **PENALTIES, logit_bias=bias),
        replace(greedy, logit_bias=bias),
        replace(greedy, **PENALTIES),
    ]
    direct = llm.generate([question, poem, poem, poem], params)
    engine = {name: o.token_ids for name, o in zip(names, direct)}
    lines = {
        "tool": (
            CHAT_URL,
            {
                "messages": _user(QUESTION),
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "max_tokens": 40,
            },
        ),
        "response": (RESPONSES_URL, {"input": QUESTION, "max_output_tokens": 7}),
        "penalised": (
            CHAT_URL,
            {
                "messages": _user(LIST_QUESTION),
                **PENALTIES,
                "logit_bias": {str(t): v for t, v in bias.items()},
            },
        ),
    }
    path = tmp_path_factory.mktemp("batch") / "batch.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "m", **body}}
            )
            + "\n"
            for cid, (url, body) in lines.items()
        )
    )
    out = tmp_path_factory.mktemp("out")
    run_job(
        str(path),
        str(out),
        llm=llm,
        format="openai-batch",
        output_format="openai-batch",
        max_tokens=MAX_TOKENS,
    )
    written = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    return {w["custom_id"]: w for w in written}, llm.tokenizer, engine


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _chat_prompt(llm, question: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template(_user(question))
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _body(lines, cid) -> dict:
    assert lines[cid]["error"] is None, lines[cid]["error"]
    return lines[cid]["response"]["body"]


def test_a_named_tool_call_comes_back_valid(job):
    lines, _, _ = job
    body = _body(lines, "tool")
    ChatCompletion.model_validate(body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    arguments = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_a_responses_line_is_the_engines_answer_cut_at_max_output_tokens(job):
    lines, tokenizer, engine = job
    body = _body(lines, "response")
    Response.model_validate(body)
    assert body["output"][0]["content"][0]["text"] == tokenizer.decode(engine["response"])
    assert body["status"] == "incomplete" and body["usage"]["output_tokens"] == 7
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_penalised_line_is_the_engines_answer_under_the_same_controls(job):
    lines, tokenizer, engine = job
    body = _body(lines, "penalised")
    ChatCompletion.model_validate(body)
    expected = engine["penalised"]
    # Each control changes this answer: a line that lost either would not equal it.
    assert expected != engine["bias only"] and expected != engine["penalties only"]
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(expected)
    assert body["usage"]["completion_tokens"] == len(expected)
