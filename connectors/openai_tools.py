"""Function tools on chat lines: what a request's `tools`, `tool_choice` and
`parallel_tool_calls` ask for, the constraint that makes the answer a call, and reading
the answer back as `message.tool_calls`.

    tool_choice            the answer                          constrained to (vLLM's shapes)
    "none"                 text                                nothing
    "required"             [{"name", "parameters"}, ...]       one of the functions' calls,
                                                               each with valid arguments; at
                                                               most one without parallel calls
    {"type": "function",   that function's arguments           its parameters schema
     "function": {name}}
    "auto" (the default    text, or <tool_call>{"name",        nothing: where the chat template
    with tools)            "arguments"}</tool_call> blocks     renders tools in the Hermes /
                                                               Qwen 2.5 / Qwen 3 format only

The tool definitions reach the model through the chat template's `tools` variable, as
transformers passes them; a template that does not render tools (SmolLM2's) leaves the
model the constraint alone to go by: the functions' names and argument shapes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from tokenmill.connectors.lines import BadLine

NONE, AUTO, REQUIRED, FUNCTION = "none", "auto", "required", "function"
# The one format of unconstrained tool calls read back (Hermes, Qwen 2.5, Qwen 3).
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolRequest:
    """A chat line's function tools and how it wants them used."""

    functions: tuple[dict[str, Any], ...]  # {"name", "description"?, "parameters", "strict"?}
    choice: str  # NONE, AUTO, REQUIRED or FUNCTION
    function_name: str | None  # with FUNCTION: which one
    parallel: bool

    @classmethod
    def from_body(cls, body: dict[str, Any], number: int) -> ToolRequest:
        """Read `tools`, `tool_choice` and `parallel_tool_calls`.

        Raises:
            BadLine: a malformed tool, a choice naming no given function, a kind of tool
                other than function, or response_format beside a constrained choice.
        """
        tools = body.get("tools")
        if not isinstance(tools, list) or not tools:
            raise BadLine(number, "body.tools must be a non-empty list")
        functions = tuple(_function(tool, i, number) for i, tool in enumerate(tools))
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise BadLine(number, "body.tools: function names must be distinct")
        parallel = body.get("parallel_tool_calls")
        if parallel is None:
            parallel = True
        if not isinstance(parallel, bool):
            raise BadLine(number, "body.parallel_tool_calls must be a boolean")
        choice, name = _choice(body.get("tool_choice"), names, number)
        if choice in (REQUIRED, FUNCTION) and body.get("response_format") is not None:
            raise BadLine(
                number,
                "body.response_format is refused beside tool_choice "
                f"{json.dumps(body.get('tool_choice'))}: the answer is a tool call",
            )
        return cls(functions, choice, name, parallel)

    def columns(self) -> dict[str, Any]:
        """The row's `tools` (for the chat template), `tool_calls` (how to read the
        answer; null with tool_choice none) and, for a constrained choice, the
        `response_format` that makes the answer a call."""
        tools = [{"type": "function", "function": f} for f in self.functions]
        columns: dict[str, Any] = {"tools": json.dumps(tools, ensure_ascii=False)}
        if self.choice == NONE:
            return columns
        columns["tool_calls"] = json.dumps(
            {
                "choice": self.choice,
                "function": self.function_name,
                "names": [f["name"] for f in self.functions],
                "parallel": self.parallel,
            }
        )
        schema = self.constraint()
        if schema is not None:
            columns["response_format"] = json.dumps(
                {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": schema}},
                ensure_ascii=False,
            )
        return columns

    def constraint(self) -> dict[str, Any] | None:
        """The JSON schema a constrained choice's answer follows (None: unconstrained)."""
        if self.choice == FUNCTION:
            return _arguments_schema(self._named(self.function_name))
        if self.choice != REQUIRED:
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [f["name"]]},
                    "parameters": _arguments_schema(f),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def _named(self, name: str | None) -> dict[str, Any]:
        return next(f for f in self.functions if f["name"] == name)


def _function(tool: Any, index: int, number: int) -> dict[str, Any]:
    where = f"body.tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise BadLine(number, f"{where} is refused: only function tools are served")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise BadLine(number, f"{where}.function must be an object with a string name")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise BadLine(number, f"{where}.function.{unknown[0]} is refused: not a function field")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise BadLine(number, f"{where}.function.parameters must be a JSON schema object")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise BadLine(number, f"{where}.function.strict must be a boolean")
    return {**function, "parameters": parameters}


def _choice(value: Any, names: list[str], number: int) -> tuple[str, str | None]:
    if value is None:
        return AUTO, None  # OpenAI's default when tools are given
    if value in (NONE, AUTO, REQUIRED):
        return value, None
    if not (isinstance(value, dict) and value.get("type") == "function"):
        raise BadLine(
            number,
            'body.tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
        )
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if name not in names:
        raise BadLine(number, f"body.tool_choice names no function of body.tools: {name!r}")
    return FUNCTION, name


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; with strict, every object closed (as OpenAI's
    strict mode has it)."""
    schema = function["parameters"]
    return _closed(schema) if function.get("strict") else schema


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) and (
        "additionalProperties" not in schema
    ):
        closed["additionalProperties"] = False
    return closed


# -- reading answers back ----------------------------------------------------------------------


def read_tool_calls(
    text: str, spec_text: str, call_id_seed: str, *, cut: bool = False
) -> tuple[str | None, list]:
    """An answer as (content, tool_calls) for `message`.

    Args:
        text: the completion's text.
        spec_text: the row's `tool_calls` column (JSON).
        call_id_seed: makes the call ids (a pure function of it and the call's position,
            so rewriting an output gives the same bytes).
        cut: max_tokens ended the answer (finish_reason "length"). A constrained call cut
            short is still a call, as OpenAI returns it: its name, and its arguments as
            the partial JSON text generated so far.

    Returns:
        (content, calls): calls in OpenAI's shape ({id, type, function: {name,
        arguments}}), arguments as JSON text; ([] and the text as content when the answer
        holds no call - a free answer, or a cut one that has not yet named a function).
    """
    spec = json.loads(spec_text)
    calls: list[tuple[str, Any]] = []
    content: str | None = None
    if spec["choice"] == FUNCTION:
        arguments = _parse(text)
        if arguments is not None:
            calls = [(spec["function"], arguments)]
        elif cut:
            calls = [(spec["function"], _Partial(text))]
    elif spec["choice"] == REQUIRED:
        parsed = _parse(text)
        if isinstance(parsed, list):
            calls = [(c["name"], c["parameters"]) for c in parsed if _is_call(c, "parameters")]
        elif cut:
            calls = _cut_calls(text, spec["names"])
    else:
        for block in HERMES_CALL.findall(text):
            call = _parse(block)
            if _is_call(call, "arguments") and call["name"] in spec["names"]:
                calls.append((call["name"], call["arguments"]))
        if calls:
            content = text[: text.find("<tool_call>")].strip() or None
        if not spec["parallel"]:
            calls = calls[:1]
    if not calls:
        return text, []
    return content, [
        {
            "id": "call_" + hashlib.sha256(f"{call_id_seed}\x00{i}".encode()).hexdigest()[:24],
            "type": "function",
            "function": {"name": name, "arguments": _arguments_text(arguments)},
        }
        for i, (name, arguments) in enumerate(calls)
    ]


@dataclass(frozen=True)
class _Partial:
    """Arguments cut short: the JSON text as generated, returned as it is."""

    text: str


def _arguments_text(arguments: Any) -> str:
    if isinstance(arguments, _Partial):
        return arguments.text
    return json.dumps(arguments, ensure_ascii=False)


# A "required" answer's call, cut inside its parameters (the constraint writes `name`
# before `parameters`) or inside its name.
_CUT_IN_PARAMETERS = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:\s*(.*)\Z', re.DOTALL
)
_CUT_AFTER_NAME = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")', re.DOTALL)
_CUT_IN_NAME = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)\Z', re.DOTALL)


def _cut_calls(text: str, names: list[str]) -> list[tuple[str, Any]]:
    """The calls of a "required" answer (a JSON array of {name, parameters}) cut short by
    max_tokens: the complete ones parsed, then the one being written when the answer
    was cut - whose name is known once it is complete, or once its prefix fits exactly
    one function - with its partial arguments."""
    decoder = json.JSONDecoder()
    position = text.find("[") + 1
    if position == 0:
        return []
    calls: list[tuple[str, Any]] = []
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        rest = text[position:]
        if not rest:
            return calls
        try:
            call, used = decoder.raw_decode(rest)
        except json.JSONDecodeError:
            break
        if _is_call(call, "parameters"):
            calls.append((call["name"], call["parameters"]))
        position += used
    in_parameters = _CUT_IN_PARAMETERS.match(rest)
    after_name = in_parameters or _CUT_AFTER_NAME.match(rest)  # cut before its arguments
    if after_name:
        name = _parse(after_name.group(1))
        if name in names:
            calls.append((name, _Partial(in_parameters.group(2) if in_parameters else "")))
        return calls
    in_name = _CUT_IN_NAME.match(rest)
    if in_name:
        fitting = [n for n in names if n.startswith(in_name.group(1))]
        if len(fitting) == 1:
            calls.append((fitting[0], _Partial("")))
    return calls


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _is_call(value: Any, arguments_key: str) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and isinstance(value.get(arguments_key), dict)
    )


def renders_hermes_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` and has its model answer with Hermes-style
    <tool_call> blocks (Hermes 2/3, Qwen 2.5, Qwen 3): the one format tool_choice "auto"
    is served in."""
    return bool(chat_template) and "tools" in chat_template and "<tool_call>" in chat_template
