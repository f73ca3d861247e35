"""A constraint is bounded: its bytes and nesting before anything parses it, llguidance's
deterministic limits (fuel, items) at compile, at its first step and while generating -
each refusal a ValueError (or a request's error) naming the limit."""

from __future__ import annotations

import json

import pytest
from tiny_model import build_tiny_model

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.core.grammar import LIMITS, GrammarCompiler
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.types.structured_outputs import (
    MAX_CONSTRAINT_BYTES,
    MAX_SCHEMA_DEPTH,
    StructuredOutputs,
)

DEPTH_ERROR = "json schema nests deeper than the limit of 64 levels"
FUEL = "(limit: compile fuel, in lexer expressions built, 1,000,000)"


def nested(levels: int) -> dict:
    """A schema whose JSON nests `levels` deep (each object level is two: it and its
    properties), built without recursion."""
    schema: dict = {"type": "string"}
    for _ in range((levels - 1) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_text(levels: int) -> str:
    """The same as JSON text, written without a recursive encoder (900 levels is past
    Python's own)."""
    pairs = (levels - 1) // 2
    head = '{"type": "object", "properties": {"a": ' * pairs
    return head + '{"type": "string"}' + "}}" * pairs


def test_schema_nesting_is_bounded_as_text_and_as_a_value():
    assert MAX_SCHEMA_DEPTH == 64
    assert StructuredOutputs(json=nested_text(63)).json == nested(63)
    StructuredOutputs(json=nested(63))
    for schema in (nested_text(65), nested_text(1801), nested(65), nested(1801)):
        with pytest.raises(ValueError) as error:
            StructuredOutputs(json=schema)
        assert str(error.value) == DEPTH_ERROR
    # Brackets inside strings are text, not nesting.
    quoted = {"description": "[" * 200 + '{"' * 50}
    assert StructuredOutputs(json=json.dumps(quoted)).json == quoted


def test_constraint_bytes_are_bounded():
    enum = {"enum": [f"v{i}" for i in range(200_000)]}
    size = len(json.dumps(enum).encode())
    for schema in (enum, json.dumps(enum)):
        with pytest.raises(ValueError) as error:
            StructuredOutputs(json=schema)
        assert str(error.value) == (
            f"json schema is {size:,} bytes, over the limit of {MAX_CONSTRAINT_BYTES:,}"
        )
    big = "a" * (MAX_CONSTRAINT_BYTES + 1)
    for kind, value in (("regex", big), ("grammar", big), ("choice", [big[:-1], "é"])):
        with pytest.raises(ValueError, match=f"^{kind} is 1,048,57[78] bytes, over the limit"):
            StructuredOutputs(**{kind: value})
    StructuredOutputs(regex="a" * MAX_CONSTRAINT_BYTES)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def compiler(tiny_model_dir) -> GrammarCompiler:
    return GrammarCompiler.for_model(Tokenizer.from_dir(tiny_model_dir), 512, [2])


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (
            StructuredOutputs(regex="(a{1000}){1000}"),
            "structured outputs regex: cannot start: lexer error: too many expressions "
            f"constructed {FUEL}",
        ),
        (
            StructuredOutputs(json={"type": "string", "pattern": "^(a{1000}){1000}$"}),
            "structured outputs json schema: cannot start: lexer error: too many expressions "
            f"constructed {FUEL}",
        ),
        (
            StructuredOutputs(json={"$ref": "#"}),
            "structured outputs json schema: cannot start: no token can begin a value it accepts",
        ),
    ],
    ids=["catastrophic-regex", "catastrophic-pattern", "self-ref"],
)
def test_constraints_past_a_limit_are_refused_with_it_named(compiler, constraint, message):
    with pytest.raises(ValueError) as error:
        compiler.compile(constraint)
    assert str(error.value) == message


def test_an_endless_required_ref_is_refused_by_the_item_limit(compiler):
    endless = {
        "$defs": {
            "n": {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "required": ["n"]}
        },
        "$ref": "#/$defs/n",
    }
    with pytest.raises(ValueError) as error:
        compiler.compile(StructuredOutputs(json=endless))
    value, what = LIMITS["step_max_items"]
    assert str(error.value).startswith("structured outputs json schema: cannot start: ")
    assert str(error.value).endswith(f"(limit: {what}, {value:,})")


def test_recursion_with_a_way_out_compiles(compiler):
    tree = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "kids": {"type": "array", "items": {"$ref": "#"}},
        },
        "required": ["name"],
    }
    compiler.compile(StructuredOutputs(json=tree))


def test_a_limit_passed_while_generating_fails_that_request_only(tiny_model_dir):
    """Eight free characters, then a part whose lexer is past the compile fuel: the
    request stops there with an error naming the limit; the other is answered."""
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=8 << 20)
    late = SamplingParams(
        temperature=0,
        max_tokens=30,
        structured_outputs=StructuredOutputs(regex="[xy]{8}(a{1000}){1000}"),
    )
    fine = SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=StructuredOutputs(regex="[xy]{8}")
    )
    stopped, answered = llm.generate(["hi", "hi"], [late, fine])
    assert stopped.error == (
        "structured outputs: the constraint stopped: lexer error: too many expressions "
        f"constructed {FUEL}"
    )
    assert stopped.outputs[0].finish_reason == "error"
    assert answered.error is None and answered.outputs[0].finish_reason == "stop"
    assert len(answered.text) == 8 and set(answered.text) <= {"x", "y"}
