from __future__ import annotations

import pytest
from pipeline_fakes import CharTokenizer

from tokenmill.pipelines.option_types import JOB
from tokenmill.pipelines.options import check_options
from tokenmill.pipelines.templating import (
    RenderedRow,
    TemplateSpec,
    normalize_messages,
    render_rows,
    required_columns,
    row_ids,
    template_fields,
    validate_columns,
)
from tokenmill.pipelines.tokenize import chat_renderer


def test_prompt_column_goes_through_the_chat_template_by_default(tokenizer):
    rows = render_rows({"prompt": ["hi", "yo"]}, TemplateSpec(), chat=chat_renderer(tokenizer))
    assert rows == [
        RenderedRow(0, "row-000000000", text="<user>hi</><assistant>", is_chat=True),
        RenderedRow(1, "row-000000001", text="<user>yo</><assistant>", is_chat=True),
    ]


def test_raw_sends_text_as_it_is(tokenizer):
    spec = TemplateSpec(raw=True)
    [r] = render_rows({"prompt": ["hi"]}, spec, chat=chat_renderer(tokenizer))
    assert r == RenderedRow(0, "row-000000000", text="hi", is_chat=False)
    [r] = render_rows({"t": ["x"]}, TemplateSpec(template="Q: {t}", raw=True), chat=None)
    assert r.text == "Q: x" and not r.is_chat


def test_a_model_without_a_chat_template_runs_raw():
    no_template = CharTokenizer(chat_template=None)
    assert chat_renderer(no_template) is None
    [r] = render_rows({"prompt": ["hi"]}, TemplateSpec(), chat=chat_renderer(no_template))
    assert r.text == "hi" and not r.is_chat


def test_a_system_prompt_needs_the_chat_template(tokenizer):
    with pytest.raises(ValueError, match="no chat template, so a system prompt cannot be sent"):
        render_rows({"prompt": ["hi"]}, TemplateSpec(system="Be brief."), chat=None)
    with pytest.raises(ValueError, match="give one of system and raw"):
        TemplateSpec(system="Be brief.", raw=True)


def test_position_ids_use_global_start():
    rows = render_rows({"prompt": ["a"]}, TemplateSpec(), start=123)
    assert rows[0].id == "row-000000123" and rows[0].row_index == 123


def test_system_prompt_comes_first(tokenizer):
    chat = chat_renderer(tokenizer)
    [r] = render_rows({"prompt": ["hi"]}, TemplateSpec(system="Be brief."), chat=chat)
    assert r.text == "<system>Be brief.</><user>hi</><assistant>" and r.is_chat


def test_messages_column_with_shared_system(tokenizer):
    spec = TemplateSpec(messages_column="m", system="S")
    msgs = [
        [{"role": "user", "content": "q"}],
        [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}],
    ]
    a, b = render_rows({"m": msgs}, spec, chat=chat_renderer(tokenizer))
    assert a.text == "<system>S</><user>q</><assistant>"
    assert b.text == "<system>own</><user>q</><assistant>"  # the row's own system wins


def test_messages_as_json_string(tokenizer):
    spec = TemplateSpec(messages_column="m")
    [r] = render_rows(
        {"m": ['[{"role": "user", "content": "q"}]']}, spec, chat=chat_renderer(tokenizer)
    )
    assert r.text == "<user>q</><assistant>"


def test_template_over_columns():
    spec = TemplateSpec(template="Summarise: {text} ({n} words)", id_column="id")
    rows = render_rows({"text": ["abc", None], "n": [3, 1], "id": [7, 8]}, spec)
    assert rows[0] == RenderedRow(0, "7", text="Summarise: abc (3 words)")
    assert rows[1].error == "template column 'text' is null" and rows[1].id == "8"


def test_template_fields_and_errors():
    assert template_fields("{a} {b.x} {c[0]} {{lit}} {a}") == ["a", "b", "c"]
    with pytest.raises(ValueError, match="name columns"):
        template_fields("x {} y")
    with pytest.raises(ValueError, match="name columns"):
        template_fields("x {0}")
    with pytest.raises(ValueError, match="refers to no column"):
        template_fields("no fields")
    with pytest.raises(ValueError, match="invalid template"):
        template_fields("broken {")


def test_validate_columns_names_missing_and_available():
    spec = TemplateSpec(template="{text} {lang}", id_column="key")
    assert required_columns(spec) == ["text", "lang", "key"]
    with pytest.raises(
        ValueError, match=r"data.parquet: missing column\(s\) 'lang', 'key'; available: text, other"
    ):
        validate_columns(spec, ["text", "other"], source="data.parquet")


def test_spec_validation():
    with pytest.raises(ValueError, match="give either messages_column or template, not both"):
        check_options({"messages_column": "m", "template": "{x}"}, surface=JOB)
    with pytest.raises(ValueError, match="give a prompt column"):
        TemplateSpec(prompt_column=None)
    with pytest.raises(ValueError, match="system prompt must not be empty"):
        TemplateSpec(system="  ")


def test_bad_prompts_become_error_rows_and_good_rows_survive():
    rows = render_rows({"prompt": ["ok", None, "", "   ", 42, ["x"], "fine"]}, TemplateSpec())
    errors = [r.error for r in rows]
    assert errors == [
        None,
        "prompt is null",
        "prompt is empty",
        "prompt is empty",
        "prompt is not a string (got int)",
        "prompt is not a string (got list)",
        None,
    ]
    assert [r.text for r in rows if r.error is None] == ["ok", "fine"]


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        (None, "messages are null"),
        ([], "messages are empty"),
        ("not json", "messages are not valid JSON"),
        ({"role": "user"}, "messages must be a list, got dict"),
        (["hi"], "message 0 is not an object (got str)"),
        ([{"role": "wizard", "content": "x"}], "message 0 has invalid role 'wizard'"),
        ([{"role": "user", "content": None}], "message 0 content is not a string"),
        ([{"role": "system", "content": "x"}], "messages contain no user message"),
        (
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": "BOOM"}],
            "template rejects this conversation",
        ),
    ],
)
def test_malformed_messages_are_row_errors(tokenizer, messages, error):
    spec = TemplateSpec(messages_column="m")
    good = [{"role": "user", "content": "fine"}]
    bad, ok = render_rows({"m": [messages, good]}, spec, chat=chat_renderer(tokenizer))
    assert bad.error is not None and bad.error.startswith(error)
    assert bad.text is None
    assert ok.error is None and ok.text == "<user>fine</><assistant>"


def test_chat_template_exceptions_of_any_kind_are_row_errors():
    class Boom:
        chat_template = "{{ undefined_variable.x }}"

        def apply_chat_template(self, messages, **kw):
            raise RuntimeError("undefined variable")

    [r] = render_rows({"prompt": ["x"]}, TemplateSpec(), chat=chat_renderer(Boom()))
    assert r.error == "chat template failed: RuntimeError: undefined variable"


def test_openai_fallback_to_prompt(tokenizer):
    spec = TemplateSpec(messages_column="messages", prompt_column="prompt", fallback_prompt=True)
    rows = render_rows(
        {"messages": [None, [{"role": "user", "content": "q"}]], "prompt": ["raw", None]},
        spec,
        chat=chat_renderer(tokenizer),
    )
    assert rows[0].text == "raw" and not rows[0].is_chat
    assert rows[1].text == "<user>q</><assistant>" and rows[1].is_chat


def test_row_ids_from_column_keep_nulls():
    assert row_ids([1, "b", None], 0, 3) == ["1", "b", None]


def test_normalize_messages_drops_extra_keys():
    assert normalize_messages([{"role": "user", "content": "q", "name": "x"}]) == [
        {"role": "user", "content": "q"}
    ]


def test_normalize_messages_leaves_out_the_null_keys_of_tool_calls():
    # A struct column holds every key any row has; a row without one holds null there.
    call = {"id": None, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "q", "tool_call_id": None, "tool_calls": None},
        {"role": "assistant", "content": None, "tool_calls": [call], "tool_call_id": None},
    ]
    assert normalize_messages(messages)[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
