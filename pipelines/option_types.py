"""The vocabulary of the job definition (`pipelines/options.py`): surfaces, value types
and the `Option` record, with the check every option's values go through.

Kept apart from the definition's table so that the table reads as a list of options.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tokenmill.connectors.csv_records import csv_character
from tokenmill.connectors.decoding import check_encoding
from tokenmill.engine import token_bias

# Surfaces: where an option is shown.
CLI = "cli"  # a flag of `tokenmill run` (and of `tokenmill generate`, unless about input)
FLOW = "flow"  # a parameter of the batch_inference flow (and a flag of `flow run`, `serve`)
JOB = "job"  # a JobSpec field and a run_job keyword
NOTEBOOK = "notebook"  # a tokenmill.generate keyword (and tokenmill.score's, but sampling)
EVERYWHERE = frozenset({CLI, FLOW, JOB, NOTEBOOK})
BATCH = frozenset({CLI, FLOW, JOB})  # about files, shards and costs: not for generate
PYTHON = frozenset({JOB, NOTEBOOK})  # rarely needed: keywords only

# Destinations: the object an option's value is handed to, under its `field` name.
SAMPLING = "sampling"  # SamplingParams
PRICES = "prices"  # pipelines.pricing.Prices
PROMPT = "prompt"  # pipelines.templating.TemplateSpec
ENGINE = "engine"  # LLM(...)
STRUCTURED = "structured"  # engine StructuredOutputs, as SamplingParams.structured_outputs

# Sections: what an option is about (`tokenmill generate` shows no INPUT options, and
# `tokenmill.generate` no POOL ones: those are embed, classify and rerank options).
INPUT, PROMPTS, SAMPLE, COSTS, RUN, MODEL = "input", "prompts", "sampling", "costs", "run", "model"
POOL = "pooling"


@dataclass(frozen=True)
class ValueType:
    """One kind of value: its Python type, how the CLI parses it, how it is checked."""

    name: str  # in messages: "must be <name>"
    annotation: Any  # the Python type of one value (flow schema, JobSpec field)
    parse: Callable[[str], Any]  # one command-line string -> value; ValueError if bad
    accepts: Callable[[Any], bool]  # whether a value from Python or a flow is of this type
    metavar: str
    convert: Callable[[Any], Any] = lambda value: value  # an accepted value -> canonical
    choices: tuple[str, ...] = ()  # the only values there are, when listed
    # A mapping: KEY=VALUE pairs on the command line (repeated), a JSON object in a flow,
    # a dict in Python; None means empty.
    mapping: bool = False


def choice(*values: str) -> ValueType:
    """A value among `values` (the flow schema shows them as an enum)."""
    return ValueType(
        f"one of {', '.join(values)}",
        Literal[values],
        lambda text: text,
        lambda value: value in values,
        "[" + "|".join(values) + "]",
        choices=values,
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


TEXT = ValueType("text", str, str, lambda v: isinstance(v, str), "TEXT")
INT = ValueType("an integer", int, int, _is_int, "N")
FLOAT = ValueType(
    "a number", float, float, lambda v: _is_int(v) or isinstance(v, float), "X", convert=float
)
BOOL = ValueType("true or false", bool, bool, lambda v: isinstance(v, bool), "BOOL")
# KEY=VALUE pairs on the command line (repeated), a JSON object in a flow, a dict in Python.
KEY_VALUES = ValueType(
    "a mapping",
    dict[str, Any],
    lambda text: text,  # pairs are parsed together: tokenmill/cli/options.py
    lambda v: isinstance(v, Mapping),
    "KEY=VALUE",
    convert=dict,
    mapping=True,
)


def _token_bias(value: Any) -> dict[int, float]:
    return token_bias(_json_value(value))


# token id -> logit bias: TOKEN_ID=BIAS pairs on the command line, a JSON object (or its
# text, as an OpenAI batch line's logit_bias column holds it) in a flow or in Python.
TOKEN_BIAS = ValueType(
    "a mapping of token ids to biases in [-100, 100]",
    dict[int, float],
    lambda text: text,  # pairs are parsed together: tokenmill/cli/options.py
    lambda v: isinstance(v, (Mapping, str)),
    "TOKEN_ID=BIAS",
    convert=_token_bias,
    mapping=True,
)


def _json_inline_or_file(text: str) -> Any:
    """The CLI's FILE_OR_JSON: inline JSON when it looks like it, else a file holding it."""
    source = text
    if not text.lstrip().startswith(("{", "[")) and text.strip() not in ("true", "false"):
        try:
            source = Path(text).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(
                f"{text!r} is neither inline JSON nor a readable file: {exc.strerror}"
            ) from None
    return _json_value(source)


def _json_value(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
    return dict(value) if isinstance(value, Mapping) else value


def _read_text_file(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {path!r}: {exc.strerror}") from None


# A JSON document (a schema): a dict (or its JSON text) in Python and flows; on the
# command line inline JSON or the path of a file holding it.
JSON = ValueType(
    "a JSON object or its text",
    dict[str, Any] | str,
    _json_inline_or_file,
    lambda v: isinstance(v, (Mapping, str, bool)),
    "FILE_OR_JSON",
    convert=_json_value,
)
# A Python text codec name (utf-8, latin-1, utf-16...): an unknown one is refused anywhere.
ENCODING = ValueType(
    "a text encoding", str, str, lambda v: isinstance(v, str), "ENCODING", convert=check_encoding
)
# One ASCII character of delimited text (a delimiter, a quote); `\t` as written is a tab.
CHARACTER = ValueType(
    "one character",
    str,
    csv_character,
    lambda v: isinstance(v, str),
    "CHAR",
    convert=csv_character,
)
# Text that the command line reads from a file (a grammar); Python and flows give the text.
FILE_TEXT = ValueType("text", str, _read_text_file, lambda v: isinstance(v, str), "FILE")


@dataclass(frozen=True)
class Option:
    """One job option (`pipelines/options.py` says what is derived from it)."""

    name: str  # the Python keyword, flow parameter and JobSpec field
    type: ValueType
    default: Any
    help: str  # one sentence or two; shown by `--help`, the flow's docs and Prefect's UI
    section: str
    surfaces: frozenset[str] = EVERYWHERE
    to: str | None = None  # SAMPLING, PRICES, PROMPT, ENGINE: where the value goes
    field: str | None = None  # its name there, when not `name`
    per_row: bool = False  # an OpenAI batch line's body may override it for that row
    repeatable: bool = False  # many values (a tuple; a flag given several times)
    nullable: bool = False  # None is a value (implied by a None default)
    ge: float | None = None  # bounds on a number
    gt: float | None = None
    le: float | None = None
    exclusive: str | None = None  # at most one option of this group may be given
    flag: str | None = None  # the CLI flag(s) when not --name (e.g. "--raw/--chat")
    metavar: str | None = None
    envvar: str | None = None  # the CLI reads the value from this variable when unset
    # A location: flows make a local one absolute ("if_exists": only when it exists, else it
    # may be a name, like a model alias), and fill in {date} in an "always" one.
    path: Literal["always", "if_exists"] | None = None
    repr: bool = True  # False: kept out of repr() (it may hold credentials)

    @property
    def target(self) -> str:
        return self.field or self.name

    @property
    def accepts_none(self) -> bool:
        return self.nullable or self.default is None

    def check(self, value: Any) -> Any:
        """`value` checked against this option and made canonical.

        Repeatable options become tuples (None and a single value included), mappings
        dicts (None: empty); numbers are checked against the bounds.

        Raises:
            ValueError: the value is of the wrong type or out of bounds.
        """
        if self.repeatable:
            if value is None:
                return ()
            if isinstance(value, (str, Mapping)) or not isinstance(value, Iterable):
                value = [value]
            return tuple(self._check_one(v) for v in value)
        if self.type.mapping and value is None:
            return {}
        if value is None:
            if self.accepts_none:
                return None
            raise ValueError(f"{self.name} must be {self.type.name}, not None")
        return self._check_one(value)

    def _check_one(self, value: Any) -> Any:
        if not self.type.accepts(value):
            scalar = isinstance(value, (str, int, float)) and len(str(value)) <= 40
            shown = repr(value) if scalar else type(value).__name__
            raise ValueError(f"{self.name} must be {self.type.name}, got {shown}")
        try:
            value = self.type.convert(value)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None
        if self.type in (INT, FLOAT) and not self._in_bounds(value):
            raise ValueError(f"{self.name} must be {self.bounds}, got {value}")
        return value

    def _in_bounds(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )

    @property
    def bounds(self) -> str:
        """The bounds in words: ">= 0", "in (0, 1]", "1"."""
        low = self.ge if self.ge is not None else self.gt
        if self.le is None:
            return f"{'>=' if self.ge is not None else '>'} {low:g}"
        if self.ge is not None and self.ge == self.le:
            return f"{self.le:g}"
        if low is None:
            return f"<= {self.le:g}"
        return f"in {'[' if self.ge is not None else '('}{low:g}, {self.le:g}]"
