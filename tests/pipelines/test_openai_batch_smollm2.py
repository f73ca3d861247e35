"""An OpenAI batch file exercising every field of the fate table, through a whole job on
the real default model (SmolLM2-135M-Instruct, fp32): each honoured field changes the
answer as documented, each ignored one changes nothing, each refused one is an error
line naming it; every body validates with the `openai` package's types, and tool calls
parse with arguments valid against their function's schema."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import jsonschema
import pytest
from model_fixtures import converted_smollm2_dir, smollm2_gguf_path
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from tokenmill.connectors.openai_fields import (
    CHAT_URL,
    COMPLETIONS_URL,
    FIELDS,
    IGNORED,
    REFUSED,
    RESPONSES_URL,
)
from tokenmill.engine.loader.model_files import ModelFilesError
from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.job import run_job

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France? Answer in one sentence."
# An answer that repeats itself, for the penalties to change.
LIST_QUESTION = "Write a short poem about the sea."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
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
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
        "strict": True,
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
SAMPLED = {"temperature": 1.0, "seed": 7}
# Ignored and refused fields: a value each (the fate table's own samples).
OTHER_VALUES = {
    "model": "gpt-4o",
    "user": "u-1",
    "metadata": {"k": "v"},
    "store": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "service_tier": "flex",
    "safety_identifier": "s",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "30m"},
    "background_options": {"completion_window": "2h"},
    "access_programs": {"cyber": "standard"},
    "image": {"context_compression": "auto"},
    "moderation": {"model": "omni-moderation-latest"},
    "context_management": [{"type": "compaction"}],
    "prediction": {"type": "content", "content": "Paris"},
    "background": True,
    "audio": {"voice": "alloy", "format": "mp3"},
    "functions": [WEATHER["function"]],
    "function_call": "auto",
    "verbosity": "low",
    "web_search_options": {},
    "suffix": "end",
    "tools": [WEATHER],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "max_tool_calls": 2,
    "previous_response_id": "resp_1",
    "conversation": "conv_1",
    "prompt": {"id": "pmpt_1"},
    "include": ["reasoning.encrypted_content"],
    "reasoning": {"effort": "low"},
    "top_logprobs": 2,
}


def chat(**body) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": QUESTION}], **body}


def listing(**body) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": LIST_QUESTION}], **body}


def completion(**body) -> dict:
    return {"model": "m", "prompt": "The capital of France is", **body}


def response(**body) -> dict:
    return {"model": "m", "input": QUESTION, **body}


BASES = {CHAT_URL: chat, COMPLETIONS_URL: completion, RESPONSES_URL: response}


def honoured_lines(baseline_ids: list[int], words: list[str]) -> dict[str, tuple[str, dict]]:
    """custom_id -> (url, body) for the honoured fields, built from the greedy baseline
    answer (its token ids and words) so that each control has something to change."""
    first, third = baseline_ids[0], baseline_ids[2]
    return {
        "chat:messages": (CHAT_URL, chat()),
        "chat:max_tokens": (CHAT_URL, chat(max_tokens=5)),
        "chat:max_completion_tokens": (CHAT_URL, chat(max_tokens=20, max_completion_tokens=6)),
        "chat:temperature": (CHAT_URL, chat(**SAMPLED)),
        "chat:top_p": (CHAT_URL, chat(**SAMPLED, top_p=0.01)),
        "chat:top_k": (CHAT_URL, chat(**SAMPLED, top_k=1)),
        "chat:min_p": (CHAT_URL, chat(**SAMPLED, min_p=1.0)),
        "chat:seed": (CHAT_URL, chat(**SAMPLED)),
        "chat:seed-other": (CHAT_URL, chat(temperature=1.0, seed=8)),
        "chat:n": (CHAT_URL, chat(**SAMPLED, n=2)),
        "chat:stop": (CHAT_URL, chat(stop=[words[2]])),
        "chat:stop_token_ids": (CHAT_URL, chat(stop_token_ids=[third])),
        "chat:min_tokens": (CHAT_URL, chat(min_tokens=40, max_tokens=48)),
        "chat:list": (CHAT_URL, listing()),
        # 48 tokens at 0.6: long enough for a token to come a third time, where the two
        # penalties part (in 24 tokens none does, and any swap of them would pass).
        "chat:frequency_penalty": (CHAT_URL, listing(frequency_penalty=0.6, max_tokens=48)),
        "chat:presence_penalty": (CHAT_URL, listing(presence_penalty=0.6, max_tokens=48)),
        "chat:repetition_penalty": (CHAT_URL, listing(repetition_penalty=1.5)),
        "chat:logit_bias": (CHAT_URL, chat(logit_bias={str(first): -100})),
        "chat:allowed_token_ids": (CHAT_URL, chat(allowed_token_ids=ALLOWED)),
        "chat:bad_words": (CHAT_URL, chat(bad_words=["Paris"])),
        "chat:logprobs": (CHAT_URL, chat(logprobs=True)),
        "chat:top_logprobs": (CHAT_URL, chat(logprobs=True, top_logprobs=2)),
        "chat:response_format": (
            CHAT_URL,
            chat(
                max_tokens=40,
                response_format={"type": "json_schema", "json_schema": {"schema": PERSON}},
            ),
        ),
        "chat:tools": (CHAT_URL, chat(tools=[WEATHER])),
        "chat:tool_choice": (
            CHAT_URL,
            chat(tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=60),
        ),
        "chat:tool_choice-named": (
            CHAT_URL,
            chat(
                tools=[WEATHER, CLOCK],
                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                max_tokens=40,
            ),
        ),
        "chat:tool_choice-none": (CHAT_URL, chat(tools=[WEATHER], tool_choice="none")),
        "chat:parallel_tool_calls": (
            CHAT_URL,
            chat(
                tools=[WEATHER, CLOCK],
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=60,
            ),
        ),
        "chat:modalities": (CHAT_URL, chat(modalities=["text"])),
        "completions:prompt": (COMPLETIONS_URL, completion()),
        "completions:max_tokens": (COMPLETIONS_URL, completion(max_tokens=4)),
        "completions:logprobs": (COMPLETIONS_URL, completion(logprobs=2)),
        "completions:echo": (COMPLETIONS_URL, completion(echo=False)),
        "completions:best_of": (COMPLETIONS_URL, completion(**SAMPLED, n=2, best_of=2)),
        "completions:frequency_penalty": (COMPLETIONS_URL, completion(frequency_penalty=2.0)),
        "responses:input": (RESPONSES_URL, response()),
        "responses:input-messages": (
            RESPONSES_URL,
            response(
                input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
            ),
        ),
        "responses:instructions": (
            RESPONSES_URL,
            response(instructions="Answer in French only."),
        ),
        "responses:max_output_tokens": (RESPONSES_URL, response(max_output_tokens=7)),
        # The Responses API has no seed: a hot temperature makes a different answer sure.
        "responses:temperature": (RESPONSES_URL, response(temperature=2.0)),
        "responses:top_p": (RESPONSES_URL, response(temperature=2.0, top_p=0.01)),
        "responses:text": (
            RESPONSES_URL,
            response(
                max_output_tokens=40,
                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
            ),
        ),
        "responses:truncation": (RESPONSES_URL, response(truncation="disabled")),
    }


ALLOWED: list[int] = []  # filled in from the tokenizer: " yes", "yes", " no", "no", EOS


@pytest.fixture(scope="module")
def llm():
    try:
        smollm2_gguf_path()
    except ModelFilesError as error:
        pytest.skip(str(error))
    return llm_cache.get_llm(str(converted_smollm2_dir()), dtype="float32", device="cpu").llm


@pytest.fixture(scope="module")
def answers(llm, tmp_path_factory):
    """Every line's output line, by custom_id, from one job."""
    tokenizer = llm.tokenizer
    ALLOWED[:] = sorted(
        {tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", " yes", "no", " no")}
        | set(tokenizer.eos_token_ids)
    )
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    prompt = tokenizer.encode(text, add_special_tokens=False)
    from tokenmill import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=24)
    baseline = llm.generate([prompt], greedy)[0]
    lines = honoured_lines(baseline.token_ids, baseline.text.split())
    # The engine's own answers under each penalty and the bias, asked for directly: what
    # those lines must equal (the engine's controls are held to transformers elsewhere).
    poem = tokenizer.apply_chat_template([{"role": "user", "content": LIST_QUESTION}])
    poem = tokenizer.encode(poem, add_special_tokens=False)
    controls = {
        "chat:frequency_penalty": (poem, {"frequency_penalty": 0.6, "max_tokens": 48}),
        "chat:presence_penalty": (poem, {"presence_penalty": 0.6, "max_tokens": 48}),
        "unpenalised": (poem, {"max_tokens": 48}),
        "chat:repetition_penalty": (poem, {"repetition_penalty": 1.5}),
        "chat:logit_bias": (prompt, {"logit_bias": {baseline.token_ids[0]: -100.0}}),
    }
    outputs = llm.generate(
        [p for p, _ in controls.values()], [replace(greedy, **c) for _, c in controls.values()]
    )
    direct = {cid: o.text for cid, o in zip(controls, outputs)}
    for url, table in FIELDS.items():
        prefix = {CHAT_URL: "chat", COMPLETIONS_URL: "completions", RESPONSES_URL: "responses"}[url]
        for name, field in table.items():
            if field.fate in (IGNORED, REFUSED):
                lines[f"{prefix}:{name}"] = (url, BASES[url](**{name: OTHER_VALUES[name]}))
    path = tmp_path_factory.mktemp("batch") / "batch.jsonl"
    path.write_text(
        "".join(
            json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n"
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
        max_tokens=24,
    )
    written = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    return {w["custom_id"]: w for w in written}, baseline, direct


def _body(answers, cid):
    line = answers[cid]
    assert line["error"] is None, (cid, line["error"])
    return line["response"]["body"]


def _text(answers, cid) -> str:
    body = _body(answers, cid)
    if body["object"] == "response":
        return body["output"][0]["content"][0]["text"]
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_every_body_validates_with_the_openai_types(answers):
    lines, *_ = answers
    for line in lines.values():
        if line["response"] is None:
            continue
        body = line["response"]["body"]
        kind = {"chat.completion": ChatCompletion, "text_completion": Completion}
        kind.setdefault("response", Response)
        kind[body["object"]].model_validate(body)


def test_refused_fields_are_error_lines_naming_them(answers):
    lines, *_ = answers
    for url, table in FIELDS.items():
        prefix = {CHAT_URL: "chat", COMPLETIONS_URL: "completions", RESPONSES_URL: "responses"}[url]
        for name, field in table.items():
            if field.fate == REFUSED:
                line = lines[f"{prefix}:{name}"]
                assert line["response"] is None
                assert f"body.{name} is refused" in line["error"]["message"], line
    # tool_choice "auto" (the default with tools) is refused for SmolLM2's template.
    assert 'tool_choice "auto" is refused' in lines["chat:tools"]["error"]["message"]


def test_ignored_fields_change_nothing(answers):
    lines, *_ = answers
    for url, table in FIELDS.items():
        prefix = {CHAT_URL: "chat", COMPLETIONS_URL: "completions", RESPONSES_URL: "responses"}[url]
        base = {CHAT_URL: "chat:messages", COMPLETIONS_URL: "completions:prompt"}.get(
            url, "responses:input"
        )
        for name, field in table.items():
            if field.fate == IGNORED:
                assert _text(lines, f"{prefix}:{name}") == _text(lines, base), name


def test_honoured_sampling_fields_change_the_answer_as_documented(answers):
    lines, baseline, direct = answers
    greedy = _text(lines, "chat:messages")
    assert greedy == baseline.text
    tokens = lambda cid: _body(lines, cid)["usage"]["completion_tokens"]  # noqa: E731
    assert tokens("chat:max_tokens") == 5 and tokens("chat:max_completion_tokens") == 6
    sampled = _text(lines, "chat:temperature")
    assert sampled != greedy
    # Nucleus, top-k and min-p narrowed to the likeliest token: the greedy answer.
    for cid in ("chat:top_p", "chat:top_k", "chat:min_p"):
        assert _text(lines, cid) == greedy, cid
    assert _text(lines, "chat:seed") == sampled and _text(lines, "chat:seed-other") != sampled
    assert len(_body(lines, "chat:n")["choices"]) == 2
    stop = baseline.text.split()[2]
    assert _text(lines, "chat:stop") == greedy[: greedy.index(stop)]
    assert tokens("chat:stop_token_ids") == 3
    assert tokens("chat:min_tokens") >= 40
    listed = _text(lines, "chat:list")
    penalties = ("chat:frequency_penalty", "chat:presence_penalty", "chat:repetition_penalty")
    for cid in penalties:
        assert _text(lines, cid) == direct[cid], cid
    # Each penalty changes the answer, the two OpenAI ones differently.
    assert len({direct[penalties[0]], direct[penalties[1]], direct["unpenalised"]}) == 3
    assert direct["chat:repetition_penalty"] != listed
    assert _text(lines, "chat:logit_bias") == direct["chat:logit_bias"] != greedy
    assert re.fullmatch(r"(\s?(yes|no))*", _text(lines, "chat:allowed_token_ids"))
    assert "Paris" in greedy and "Paris" not in _text(lines, "chat:bad_words")
    assert _text(lines, "chat:modalities") == greedy
    assert _text(lines, "chat:tool_choice-none") == greedy  # SmolLM2's template shows no tools


def test_logprobs_come_back_in_both_shapes(answers):
    lines, *_ = answers
    for cid, k in (("chat:logprobs", 0), ("chat:top_logprobs", 2)):
        body = _body(lines, cid)
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == body["usage"]["completion_tokens"]
        assert all(len(t["top_logprobs"]) == k for t in content)
        text = b"".join(bytes(t["bytes"]) for t in content).decode()
        assert text.startswith(body["choices"][0]["message"]["content"])
    legacy = _body(lines, "completions:logprobs")["choices"][0]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(legacy["top_logprobs"])
    assert all(len(top) <= 2 for top in legacy["top_logprobs"])
    assert _body(lines, "completions:max_tokens")["usage"]["completion_tokens"] == 4
    assert len(_body(lines, "completions:best_of")["choices"]) == 2
    assert _text(lines, "completions:echo") == _text(lines, "completions:prompt")
    assert _text(lines, "completions:frequency_penalty") != _text(lines, "completions:prompt")


def test_tool_calls_parse_and_validate_against_their_schemas(answers):
    lines, *_ = answers
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for cid in ("chat:tool_choice", "chat:tool_choice-named", "chat:parallel_tool_calls"):
        choice = _body(lines, cid)["choices"][0]
        assert choice["finish_reason"] == "tool_calls", (cid, choice)
        calls = choice["message"]["tool_calls"]
        assert calls and choice["message"]["content"] is None
        for call in calls:
            assert call["type"] == "function" and call["id"].startswith("call_")
            arguments = json.loads(call["function"]["arguments"])
            jsonschema.validate(arguments, schemas[call["function"]["name"]])
    named = _body(lines, "chat:tool_choice-named")["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in named] == ["get_weather"]
    single = _body(lines, "chat:parallel_tool_calls")["choices"][0]["message"]["tool_calls"]
    assert len(single) == 1


def test_structured_answers_and_responses(answers):
    lines, *_ = answers
    chat_json = json.loads(_text(lines, "chat:response_format"))
    jsonschema.validate(chat_json, PERSON)
    jsonschema.validate(json.loads(_text(lines, "responses:text")), PERSON)
    plain = _text(lines, "responses:input")
    assert _text(lines, "responses:input-messages") == plain
    assert _text(lines, "responses:instructions") != plain
    assert _text(lines, "responses:truncation") == plain
    cut = _body(lines, "responses:max_output_tokens")
    assert cut["status"] == "incomplete" and cut["usage"]["output_tokens"] == 7
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert _text(lines, "responses:temperature") != plain
    assert _text(lines, "responses:top_p") == plain
