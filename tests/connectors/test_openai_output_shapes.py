"""OpenAI batch output bodies - logprobs, tool calls, Responses - validate with the
`openai` package's own types."""

from __future__ import annotations

import json

import pyarrow as pa
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from tokenmill.connectors import openai_batch_output_lines
from tokenmill.connectors.openai_fields import CHAT_URL, COMPLETIONS_URL, RESPONSES_URL
from tokenmill.pipelines.logprobs import LOGPROBS_TYPE


def _entry(token: str, logprob: float, top: list[tuple[str, float]]) -> dict:
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top],
    }


LOGPROBS = [
    _entry("Hel", -0.1, [("Hel", -0.1), ("Hi", -2.5)]),
    _entry("lo", -0.3, [("lo", -0.3), ("p", -1.9)]),
]
REQUIRED = json.dumps(
    {"choice": "required", "function": None, "names": ["get_weather"], "parallel": True}
)
AUTO = json.dumps({"choice": "auto", "function": None, "names": ["get_weather"], "parallel": False})


def _lines(rows: list[dict]) -> list[dict]:
    table = pa.Table.from_pylist(
        rows,
        schema=pa.schema(
            [
                ("id", pa.string()),
                ("output", pa.string()),
                ("finish_reason", pa.string()),
                ("prompt_tokens", pa.int64()),
                ("cached_tokens", pa.int64()),
                ("completion_tokens", pa.int64()),
                ("error", pa.string()),
                ("logprobs", LOGPROBS_TYPE),
                ("url", pa.string()),
                ("tool_calls", pa.string()),
            ]
        ),
    )
    lines = openai_batch_output_lines(table, model_name="smollm2", created=1_700_000_000)
    return [json.loads(line) for line in lines]


def _row(cid: str, url: str, output: str, **extra) -> dict:
    return {
        "id": cid,
        "output": output,
        "finish_reason": "stop",
        "prompt_tokens": 10,
        "cached_tokens": 4,
        "completion_tokens": 2,
        "error": None,
        "url": url,
        **extra,
    }


def test_chat_logprobs_validate_as_a_chat_completion():
    (line,) = _lines([_row("a", CHAT_URL, "Hello", logprobs=LOGPROBS)])
    body = ChatCompletion.model_validate(line["response"]["body"])
    content = body.choices[0].logprobs.content
    assert [t.token for t in content] == ["Hel", "lo"]
    assert content[0].bytes == list(b"Hel") and content[0].logprob == -0.1
    assert [t.token for t in content[1].top_logprobs] == ["lo", "p"]


def test_completion_logprobs_have_the_legacy_shape():
    (line,) = _lines([_row("b", COMPLETIONS_URL, "Hello", logprobs=LOGPROBS)])
    body = Completion.model_validate(line["response"]["body"])
    logprobs = body.choices[0].logprobs
    assert logprobs.tokens == ["Hel", "lo"] and logprobs.token_logprobs == [-0.1, -0.3]
    assert logprobs.top_logprobs == [{"Hel": -0.1, "Hi": -2.5}, {"lo": -0.3, "p": -1.9}]
    assert logprobs.text_offset == [0, 3]


def test_required_tool_calls_become_message_tool_calls():
    answer = '[{"name":"get_weather","parameters":{"city":"Paris"}}]'
    cut = '[{"name":"get_weather","parameters":{"ci'
    lines = _lines(
        [
            _row("c", CHAT_URL, answer, tool_calls=REQUIRED),
            {**_row("d", CHAT_URL, cut, tool_calls=REQUIRED), "finish_reason": "length"},
        ]
    )
    done, cut_short = (ChatCompletion.model_validate(x["response"]["body"]) for x in lines)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # Cut by max_tokens: the partial call is still the call, as OpenAI returns it - in
    # tool_calls, its arguments the JSON text generated so far, finish_reason "length".
    assert cut_short.choices[0].finish_reason == "length"
    assert cut_short.choices[0].message.content is None
    (partial,) = cut_short.choices[0].message.tool_calls
    assert partial.function.name == "get_weather" and partial.function.arguments == '{"ci'


TWO_FUNCTIONS = json.dumps(
    {"choice": "required", "function": None, "names": ["get_weather", "get_time"], "parallel": True}
)


def test_a_required_answer_cut_after_one_call_keeps_it_and_the_cut_one():
    cases = {
        # (answer cut by max_tokens, the calls expected: (name, arguments text))
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_ti': [
            ("get_weather", '{"city": "Paris"}'),
            ("get_time", ""),  # the prefix fits one function only
        ],
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_': [
            ("get_weather", '{"city": "Paris"}'),  # "get_" fits both: not a call yet
        ],
        '[{"name": "get_time", "parameters": {"zone": "UT': [("get_time", '{"zone": "UT')],
    }
    rows = [
        {**_row(f"r{i}", CHAT_URL, text, tool_calls=TWO_FUNCTIONS), "finish_reason": "length"}
        for i, text in enumerate(cases)
    ]
    for line, expected in zip(_lines(rows), cases.values()):
        choice = ChatCompletion.model_validate(line["response"]["body"]).choices[0]
        assert choice.finish_reason == "length"
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls == expected


def test_a_named_function_cut_short_is_that_call_with_partial_arguments():
    named = json.dumps(
        {
            "choice": "function",
            "function": "get_weather",
            "names": ["get_weather"],
            "parallel": True,
        }
    )
    cut = '{"city": "Par'
    rows = [
        {**_row("n", CHAT_URL, cut, tool_calls=named), "finish_reason": "length"},
        _row("m", CHAT_URL, '{"city": "Paris"}', tool_calls=named),
    ]
    cut_short, done = (ChatCompletion.model_validate(x["response"]["body"]) for x in _lines(rows))
    (call,) = cut_short.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", cut)
    assert cut_short.choices[0].finish_reason == "length"
    assert cut_short.choices[0].message.content is None
    assert done.choices[0].finish_reason == "tool_calls"
    assert json.loads(done.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_auto_tool_calls_are_read_from_hermes_blocks():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
        "</tool_call>"
    )
    plain = "It is sunny."
    lines = _lines(
        [_row("e", CHAT_URL, text, tool_calls=AUTO), _row("f", CHAT_URL, plain, tool_calls=AUTO)]
    )
    called, answered = (ChatCompletion.model_validate(x["response"]["body"]) for x in lines)
    # parallel_tool_calls false: the first call only.
    assert [c.function.name for c in called.choices[0].message.tool_calls] == ["get_weather"]
    assert json.loads(called.choices[0].message.tool_calls[0].function.arguments) == {
        "city": "Oslo"
    }
    assert called.choices[0].message.content == "Let me look."
    assert answered.choices[0].finish_reason == "stop"
    assert answered.choices[0].message.content == plain


def test_responses_lines_validate_as_a_response():
    lines = _lines(
        [
            _row("g", RESPONSES_URL, "Hello there"),
            {**_row("h", RESPONSES_URL, "Hello th"), "finish_reason": "length"},
        ]
    )
    done, cut = (Response.model_validate(x["response"]["body"]) for x in lines)
    assert done.output_text == "Hello there" and done.status == "completed"
    assert done.usage.input_tokens == 10 and done.usage.output_tokens == 2
    assert done.usage.input_tokens_details.cached_tokens == 4
    assert done.usage.total_tokens == 12
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
