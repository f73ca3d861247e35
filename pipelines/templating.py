"""Rows -> prompts: a prompt column, a messages column, or a template over columns.

Pure functions. A bad row (null, empty, not a string, malformed messages, a template
field that is null) becomes a `RenderedRow` with `error` set; it never raises, so one
bad row cannot lose the others. Problems with the *job* (a column that is not in the
schema, a template that names no column) raise ValueError before any compute.

Chat or raw, one rule for every surface (`tokenmill run`, `tokenmill generate`,
notebooks, flows): when the model has a chat template, prompt-column or template text
is sent as a user message through it, after the `system` prompt if one is given;
`raw=True` (CLI `--raw`) sends the text as it is; a model without a chat template
runs raw. A messages column is always rendered with the chat template. Instruct models
answer chat-formatted prompts; raw text can end at once with an end-of-sequence token.

Data stays data: a special-token string (`<|im_start|>`) inside a row's prompt, messages,
tools or template field values - or the system prompt - is marked before rendering
(`SpecialText.marks`, engine/loader/special_text.py) and comes out as a span of the
rendered text (`RenderedRow.data_spans`), which the tokenizer encodes as plain text. Only
the chat template's own markup and the template's own text become control tokens, unless
the job allows special tokens (`allow_special_tokens`).

Images (a row's `image_column` cells, `pipelines/images.py`) are placed where the prompt
puts the model's begin-of-image marker: chat-rendered rows get one image part per image
before their text (in a messages column, before the first user message's text), which
the chat template writes as the marker; raw text and templates may write the marker
themselves (as the template's own text: a marker in a row's data stays data), else the
markers go before the text. A row whose text places another number of images than it
has is an error row. Each marker is then expanded to the image's soft tokens
(`ImagePlaces.expand`), so a row's token count is exact before any image is decoded.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

# messages (and template variables such as tools=) -> prompt text; raises ValueError on
# malformed messages.
ChatRenderer = Callable[..., str]
Spans = tuple[tuple[int, int], ...]  # [start, end) character spans of a prompt's text


class DataMarks(Protocol):
    """One prompt's data, its special-token strings marked until the prompt is rendered."""

    def mark(self, value: Any) -> Any: ...

    def restore(self, text: str) -> tuple[str, Spans]: ...


class SpecialStrings(Protocol):
    """The model's special-token strings (the tokenizer's `special_text`)."""

    def marks(self) -> DataMarks: ...


class ImagePlaces(Protocol):
    """Where a vision model's images sit in prompt text (`tokenmill.engine.ImageLayout`)."""

    marker: str  # what places an image in text (and is expanded)
    placeholder: str  # what is written before raw text that places no image itself
    image_token_id: int

    def count(self, text: str, data_spans: Spans = ()) -> int: ...

    def expand(
        self, text: str, data_spans: Spans = (), sizes: Sequence[tuple[int, int]] = ()
    ) -> tuple[str, Spans]: ...


VALID_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


@dataclass(frozen=True)
class TemplateSpec:
    """How a row becomes a prompt.

    One source is used, in this order: `messages_column`, `template`, `prompt_column`
    (the job definition lets a job give a messages column or a template, not both).
    With `fallback_prompt` (OpenAI batch input) a row whose messages are null falls
    back to its prompt column, sent raw: that is a completions request. `tools_column`
    holds a row's function tools (a list, or its JSON text), handed to the chat template
    as its `tools` variable, as transformers does.
    """

    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    template: str | None = None
    system: str | None = None
    raw: bool = False
    id_column: str | None = None
    fallback_prompt: bool = False
    tools_column: str | None = None
    allow_special_tokens: bool = False
    # For the chat template (gpt-oss's reads it); an OpenAI batch line's own wins.
    reasoning_effort: str | None = None

    def __post_init__(self) -> None:
        if self.messages_column is None and self.template is None and not self.prompt_column:
            raise ValueError("give a prompt column, a messages column or a template")
        if self.template is not None:
            template_fields(self.template)  # raises on an unusable template
        if self.system is not None and not self.system.strip():
            raise ValueError("system prompt must not be empty")
        if self.system is not None and self.raw and self.messages_column is None:
            raise ValueError(
                "a system prompt is sent through the chat template, and raw text is not: "
                "give one of system and raw"
            )
        if self.reasoning_effort is not None and self.raw and self.messages_column is None:
            raise ValueError(
                "reasoning_effort is read by the chat template, and raw text is not sent "
                "through it: give one of reasoning_effort and raw"
            )

    @property
    def mode(self) -> str:
        if self.messages_column is not None:
            return "messages"
        return "template" if self.template is not None else "prompt"


@dataclass(frozen=True)
class RenderedRow:
    """One row after templating: prompt text ready to tokenize, or an error."""

    row_index: int
    id: str
    text: str | None = None
    is_chat: bool = False  # chat-rendered text carries its own special tokens
    error: str | None = None
    # Special-token strings of the text that came from the row's data: encoded as text.
    data_spans: Spans = ()


def template_fields(template: str) -> list[str]:
    """The column names a `str.format`-style template refers to.

    Args:
        template: e.g. "Summarise: {text}" (`{{` and `}}` are literal braces).

    Returns:
        Distinct base field names in order of appearance ("{a.b}" and "{a[0]}" -> "a").
    """
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"invalid template: {exc}") from exc
    for _, field, _, _ in parsed:
        if field is None:
            continue
        base = field.split(".", 1)[0].split("[", 1)[0]
        if not base or base.isdigit():
            raise ValueError(
                f"template fields must name columns, got {{{field}}}; write e.g. {{text}}"
            )
        if base not in names:
            names.append(base)
    if not names:
        raise ValueError("template refers to no column; use e.g. 'Summarise: {text}'")
    return names


def required_columns(spec: TemplateSpec) -> list[str]:
    """Columns the source must have for `spec` (id column included)."""
    if spec.mode == "messages":
        cols = [spec.messages_column]
        if spec.fallback_prompt and spec.prompt_column:
            cols.append(spec.prompt_column)
    elif spec.mode == "template":
        cols = template_fields(spec.template)
    else:
        cols = [spec.prompt_column]
    if spec.id_column is not None:
        cols.append(spec.id_column)
    return list(dict.fromkeys(cols))


def text_columns(spec: TemplateSpec) -> list[str]:
    """Columns whose every value must be text: a prompt of 42 is an error row, not "42".

    Template fields are not among them; formatting a number into a template is fine.
    """
    if spec.mode == "prompt" or (spec.mode == "messages" and spec.fallback_prompt):
        return [spec.prompt_column] if spec.prompt_column else []
    return []


def validate_columns(
    spec: TemplateSpec, column_names: Sequence[str], *, source: str = "input"
) -> None:
    """Raise ValueError naming every column `spec` needs that `source` lacks."""
    missing = [c for c in required_columns(spec) if c not in column_names]
    if missing:
        raise ValueError(
            f"{source}: missing column(s) {', '.join(repr(c) for c in missing)}; "
            f"available: {', '.join(column_names) or '(none)'}"
        )


def row_ids(id_values: Sequence[Any] | None, start: int, count: int) -> list[str]:
    """Ids for `count` rows starting at global position `start`.

    Args:
        id_values: the id column's values, or None to derive ids from row position.
        start: the global index of the first row (across batches and files).
        count: how many rows.

    Returns:
        String ids; position ids look like "row-000000123" so they sort in input order.
        A null id stays None - the caller reports it as a job-level error.
    """
    if id_values is None:
        return [f"row-{i:09d}" for i in range(start, start + count)]
    return [None if v is None else str(v) for v in id_values]


def check_text(value: Any, what: str) -> str | None:
    """The error message for an unusable prompt value, or None when it is fine."""
    if value is None:
        return f"{what} is null"
    if not isinstance(value, str):
        return f"{what} is not a string (got {type(value).__name__})"
    if not value.strip():
        return f"{what} is empty"
    return None


def normalize_messages(value: Any, *, system: str | None = None) -> list[dict[str, Any]]:
    """Validate a row's messages and return them as plain dicts.

    Accepts a list of {role, content} mappings or a JSON string holding one. A message
    may also carry `tool_call_id` and `tool_calls` (a list, or its JSON text), which
    reach the chat template as given, less the keys of a tool call that are null (a key
    null there is a key the row does not have); other keys are dropped. An assistant message that
    only calls tools may have a null content (the template sees ""). The shared `system` prompt is
    prepended unless the row starts with its own system message (a row's own
    instructions win).

    Raises:
        ValueError: with a message that names the problem but not the content.
    """
    if value is None:
        raise ValueError("messages are null")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"messages are not valid JSON ({exc.msg})") from None
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise ValueError(f"messages must be a list, got {type(value).__name__}")
    if len(value) == 0:
        raise ValueError("messages are empty")
    messages = []
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping):
            raise ValueError(f"message {i} is not an object (got {type(msg).__name__})")
        role, content = msg.get("role"), msg.get("content")
        if role not in VALID_ROLES:
            raise ValueError(f"message {i} has invalid role {role!r}")
        calls = _tool_calls(msg.get("tool_calls"), i)
        if content is None and calls:
            content = ""
        if msg.get("parts") is not None:  # an OpenAI batch line's text and image parts
            content = _placed_parts(msg["parts"])
        elif not isinstance(content, str):
            raise ValueError(f"message {i} content is not a string")
        message: dict[str, Any] = {"role": role, "content": content}
        if msg.get("tool_call_id") is not None:
            message["tool_call_id"] = str(msg["tool_call_id"])
        if calls:
            message["tool_calls"] = calls
        messages.append(message)
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("messages contain no user message")
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _placed_parts(parts: str) -> list[dict[str, Any]]:
    """A message's parts (JSON text, `connectors/openai_batch.py`) as multimodal chat
    templates take them: text parts, and an image part where each image sits."""
    return [
        {"type": "image"} if part["type"] == "image" else {"type": "text", "text": part["text"]}
        for part in json.loads(parts)
    ]


def message_image_urls(value: Any) -> list[str] | None:
    """The image URLs of a row's messages, in the order they are placed (None: none)."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        return None
    urls = [
        part["url"]
        for message in value
        if isinstance(message, Mapping) and message.get("parts") is not None
        for part in json.loads(message["parts"])
        if part["type"] == "image"
    ]
    return urls or None


def _tool_calls(value: Any, index: int) -> list | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"message {index} tool_calls are not valid JSON") from None
    if value is not None and not isinstance(value, list):
        raise ValueError(f"message {index} tool_calls must be a list")
    return _without_null_keys(value) or None


def _without_null_keys(value: Any) -> Any:
    """`value` with every null-valued key of its objects left out, at any depth.

    A column of objects read from a file is a struct holding every key any row has, null
    in the rows without it: a template must see the keys a row has, not `"id": None`
    (which it would render as "None")."""
    if isinstance(value, Mapping):
        return {k: _without_null_keys(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_null_keys(v) for v in value]
    return value


def _tools(value: Any) -> dict[str, Any]:
    """A row's tools as the chat template's variables ({} when it has none)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError("tools are not valid JSON") from None
    if not isinstance(value, list):
        raise ValueError("tools must be a list")
    return {"tools": value}


class _NoMarks:
    """Marks nothing: special strings in data become control tokens (allowed, or a
    tokenizer that has none)."""

    def mark(self, value: Any) -> Any:
        return value

    def restore(self, text: str) -> tuple[str, Spans]:
        return text, ()


def _render_one(
    row: Mapping[str, Any],
    spec: TemplateSpec,
    chat: ChatRenderer | None,
    marks: DataMarks,
    sizes: Sequence[tuple[int, int]] = (),
    places: ImagePlaces | None = None,
) -> tuple[str, bool, Spans]:
    """(prompt text, is_chat, data spans) for one row, its images of `sizes` placed;
    raises ValueError on a bad row."""
    num_images = len(sizes)
    if num_images:
        text, is_chat, spans = _render_plain(row, spec, _with_image_parts(chat, num_images), marks)
        if not is_chat and places.count(text, spans) == 0:
            # Raw text that does not place its images: they go before it.
            shift = len(places.placeholder) * num_images
            text = places.placeholder * num_images + text
            spans = tuple((start + shift, end + shift) for start, end in spans)
        placed = places.count(text, spans)
        if placed != num_images:
            raise ValueError(
                f"the prompt places {placed} image(s) (begin-of-image markers), the row has "
                f"{num_images}"
            )
        text, spans = places.expand(text, spans, sizes)
        return text, is_chat, spans
    return _render_plain(row, spec, chat, marks)


def _with_image_parts(chat: ChatRenderer | None, num_images: int) -> ChatRenderer | None:
    """`chat` rendering the user's first message with `num_images` image parts before its
    text, as multimodal chat templates take them - or the messages' own image parts, where
    they have them (an OpenAI batch line's)."""
    if chat is None:
        return None

    def render(messages: list[dict[str, Any]], **variables: Any) -> str:
        if any(isinstance(m["content"], list) for m in messages):
            return chat(messages, image_parts=True, **variables)  # the row placed them
        messages = list(messages)
        for i, message in enumerate(messages):
            if message["role"] == "user":
                parts = [{"type": "image"}] * num_images
                parts.append({"type": "text", "text": message["content"]})
                messages[i] = {**message, "content": parts}
                break
        return chat(messages, image_parts=True, **variables)

    return render


def _render_plain(
    row: Mapping[str, Any], spec: TemplateSpec, chat: ChatRenderer | None, marks: DataMarks
) -> tuple[str, bool, Spans]:
    if spec.mode == "messages":
        value = row.get(spec.messages_column)
        if value is None and spec.fallback_prompt:
            return _render_text(row.get(spec.prompt_column), None, None, "prompt", marks)
        if chat is None:
            raise ValueError("a messages column needs a tokenizer with a chat template")
        tools = _tools(row.get(spec.tools_column)) if spec.tools_column else {}
        messages = normalize_messages(value, system=spec.system)
        variables = {**marks.mark(tools), **_effort(row, spec)}
        text, spans = marks.restore(chat(marks.mark(messages), **variables))
        return text, True, spans
    if spec.mode == "template":
        fields = template_fields(spec.template)
        for name in fields:
            if row.get(name) is None:
                raise ValueError(f"template column {name!r} is null")
        # The template's own text is markup; the values filled into it are data.
        values = {**row, **{name: marks.mark(row[name]) for name in fields}}
        try:
            text = string.Formatter().vformat(spec.template, (), values)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"template could not be filled ({type(exc).__name__})") from None
        return _render_text(
            text, _text_renderer(spec, chat), spec.system, "templated prompt", marks, marked=True
        )
    return _render_text(
        row.get(spec.prompt_column), _text_renderer(spec, chat), spec.system, "prompt", marks
    )


def _effort(row: Mapping[str, Any], spec: TemplateSpec) -> dict[str, Any]:
    """The chat template's `reasoning_effort` variable, if the row or the job gives one."""
    effort = row.get("reasoning_effort") if spec.tools_column else None
    effort = effort if effort is not None else spec.reasoning_effort
    return {} if effort is None else {"reasoning_effort": effort}


def _text_renderer(spec: TemplateSpec, chat: ChatRenderer | None) -> ChatRenderer | None:
    """The chat template for prompt/template text, or None when it is sent raw."""
    if spec.raw or chat is None:
        return None
    if spec.reasoning_effort is None:
        return chat
    return partial(chat, reasoning_effort=spec.reasoning_effort)


def _render_text(
    value: Any,
    chat: ChatRenderer | None,
    system: str | None,
    what: str,
    marks: DataMarks,
    *,
    marked: bool = False,
) -> tuple[str, bool, Spans]:
    """(text, is_chat, data spans): `value` as a user message through `chat`, or as it is
    without one. `marked`: the value holds its data's marks already (a filled template)."""
    problem = check_text(value, what)
    if problem is not None:
        raise ValueError(problem)
    content = value if marked else marks.mark(value)
    if chat is None:
        text, spans = marks.restore(content)
        return text, False, spans
    messages = [{"role": "user", "content": content}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": marks.mark(system)})
    text, spans = marks.restore(chat(messages))
    return text, True, spans


def render_rows(
    columns: Mapping[str, Sequence[Any]],
    spec: TemplateSpec,
    *,
    start: int = 0,
    chat: ChatRenderer | None = None,
    special: SpecialStrings | None = None,
    image_sizes: Sequence[Sequence[tuple[int, int]]] | None = None,
    places: ImagePlaces | None = None,
) -> list[RenderedRow]:
    """Render a batch of rows into prompts.

    Args:
        columns: column name -> values (e.g. `RecordBatch.to_pydict()`); must hold
            `required_columns(spec)`.
        spec: how rows become prompts.
        start: global index of the batch's first row (for position ids).
        chat: renders a list of messages with the model's chat template
            (`tokenize.chat_renderer(tokenizer)`); None: the model has none, so prompt
            and template text are sent raw.
        special: the model's special-token strings (the tokenizer's `special_text`), kept
            as data where rows hold them (each row's `data_spans`); None: not kept (the
            tokenizer has none), as with `spec.allow_special_tokens`.
        image_sizes: each row's images' (width, height) (None: no row has any).
        places: where the model's images sit in its prompts; needed with images.

    Returns:
        One RenderedRow per input row, in order; bad rows carry `error`.

    Raises:
        ValueError: a system prompt for a model without a chat template (every row would
            fail alike: the job fails, before any compute).
    """
    if image_sizes is not None and any(image_sizes) and places is None:
        raise ValueError("rows with images need a vision model (it has no image markers)")
    if spec.system is not None and chat is None:
        raise ValueError(
            "the model has no chat template, so a system prompt cannot be sent; drop the "
            "system prompt (without one, prompts are sent as they are)"
        )
    num_rows = len(next(iter(columns.values()))) if columns else 0
    ids = row_ids(columns[spec.id_column] if spec.id_column else None, start, num_rows)
    names = list(columns)
    keeps_data = special is not None and not spec.allow_special_tokens
    rendered = []
    for i in range(num_rows):
        row = {name: columns[name][i] for name in names}
        marks = special.marks() if keeps_data else _NoMarks()
        try:
            sizes = image_sizes[i] if image_sizes is not None else ()
            text, is_chat, spans = _render_one(row, spec, chat, marks, sizes, places)
        except ValueError as exc:
            rendered.append(RenderedRow(start + i, ids[i], error=str(exc)))
            continue
        rendered.append(
            RenderedRow(start + i, ids[i], text=text, is_chat=is_chat, data_spans=spans)
        )
    return rendered
