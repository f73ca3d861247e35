"""What a request's output must match: a JSON schema, a regex, a choice or a grammar.

Shaped like vLLM's `StructuredOutputsParams`, so vLLM code ports by renaming the import:
`SamplingParams(structured_outputs=StructuredOutputs(json=schema))`. The constraint is
checked here for shape only; compiling it (which also rejects schema features the
engine cannot enforce) happens once per distinct constraint in `engine/core/grammar.py`.

A constraint may come from one row of a dataset, so its size is bounded before anything
parses it: MAX_CONSTRAINT_BYTES of schema, regex, grammar or choices, and a schema's JSON
nested at most MAX_SCHEMA_DEPTH levels (Python's own parser gives up near 1,000, with a
RecursionError rather than an answer). Past a limit, a ValueError names it.
"""

from __future__ import annotations

import json as _json
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

# Far above what a real constraint needs: OpenAI's structured outputs allow 5 levels of
# nesting and a few thousand enum values.
MAX_CONSTRAINT_BYTES = 1 << 20
MAX_SCHEMA_DEPTH = 64
# What a depth scan of JSON text steps on: a whole string, or a bracket.
_JSON_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain a request's output; exactly one of json, regex, choice, grammar, json_object.

    Args:
        json: a JSON schema, as a dict or a JSON string; the output is one JSON value valid
            against it. Objects keep the schema's property order.
        regex: the whole output matches this regular expression (Rust `regex` syntax).
        choice: the output is exactly one of these strings.
        grammar: a context-free grammar in Lark syntax or llama.cpp GBNF.
        json_object: the output is any JSON object (OpenAI's `json_object` mode).
        disable_any_whitespace: JSON without whitespace between tokens (`{"a":1}`), the
            default here. vLLM defaults to any whitespace (False); small models then
            indent and run out of tokens: on SmolLM2 extracting a nested record in 128
            tokens, 9 of 16 outputs were cut off with any whitespace, none compact.
        disable_additional_properties: treat every object schema that does not say
            otherwise as `"additionalProperties": false` (as OpenAI's strict mode does).
        whitespace_pattern: a regex for the whitespace allowed between JSON tokens.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) if given else 'none'}"
            )
        if self.json is not None:
            object.__setattr__(self, "json", _checked_schema(self.json))
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"regex must be a string, got {type(self.regex).__name__}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise ValueError("grammar must be a non-empty string (Lark or GBNF)")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not all(isinstance(c, str) for c in choice):
                raise ValueError("choice must be a list of strings")
            if not choice:
                raise ValueError("choice must list at least one string")
            object.__setattr__(self, "choice", list(choice))
        for name in ("regex", "grammar", "choice"):
            value = getattr(self, name)
            if value is not None:
                text = value if isinstance(value, str) else "".join(value)
                _check_size(name, len(text.encode("utf-8", "surrogatepass")))

    @property
    def kind(self) -> str:
        """ "json", "regex", "choice", "grammar" or "json_object"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @cached_property
    def key(self) -> str:
        """The constraint's content serialized: equal keys compile to the same grammar.

        Schema keys keep their order - property order is part of what a schema produces.
        """
        return _json.dumps(
            {
                "kind": self.kind,
                "source": getattr(self, self.kind) if self.kind != "json_object" else True,
                "disable_any_whitespace": self.disable_any_whitespace,
                "disable_additional_properties": self.disable_additional_properties,
                "whitespace_pattern": self.whitespace_pattern,
            },
            separators=(",", ":"),
        )

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputs) and other.key == self.key


def _checked_schema(schema: Any) -> Any:
    """A JSON schema (a dict, a boolean, or its JSON text) parsed and within the limits."""
    if isinstance(schema, str):
        _check_size("json schema", len(schema.encode("utf-8", "surrogatepass")))
        _check_text_depth(schema)
        try:
            schema = _json.loads(schema)
        except _json.JSONDecodeError as error:
            raise ValueError(f"json schema is not valid JSON: {error}") from None
    elif isinstance(schema, (dict, list)):
        _check_value_depth(schema)
        _check_size("json schema", len(_json.dumps(schema, ensure_ascii=False).encode()))
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json schema must be a JSON object, got {type(schema).__name__}")
    return schema


def _check_size(what: str, num_bytes: int) -> None:
    if num_bytes > MAX_CONSTRAINT_BYTES:
        raise ValueError(
            f"{what} is {num_bytes:,} bytes, over the limit of {MAX_CONSTRAINT_BYTES:,}"
        )


def _too_deep() -> ValueError:
    return ValueError(f"json schema nests deeper than the limit of {MAX_SCHEMA_DEPTH} levels")


def _check_text_depth(text: str) -> None:
    """Refuse JSON text nested past MAX_SCHEMA_DEPTH, before a parser recurses into it."""
    if text.count("{") + text.count("[") <= MAX_SCHEMA_DEPTH:
        return
    depth = 0
    for match in _JSON_NESTING.finditer(text):
        token = match.group()
        if token in "{[":
            depth += 1
            if depth > MAX_SCHEMA_DEPTH:
                raise _too_deep()
        elif token in "}]":
            depth -= 1


def _check_value_depth(value: Any) -> None:
    """Refuse dicts and lists nested past MAX_SCHEMA_DEPTH (walked without recursion)."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _too_deep()
        children = item.values() if isinstance(item, dict) else item
        pending += [(c, depth + 1) for c in children if isinstance(c, (dict, list))]
