"""Structured outputs on Gemma 3 270M: its 262,144-token SentencePiece vocabulary (rebuilt
as a byte-fallback BPE tokenizer.json) through llguidance, end to end."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenmill import LLM, SamplingParams, StructuredOutputs
from tokenmill.engine.loader.model_files import ModelFilesError

pytestmark = pytest.mark.slow

CLOSED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    try:
        return LLM("gemma3-270m", dtype="float32", device="cpu")
    except ModelFilesError as error:
        pytest.skip(str(error))


def test_gemma3_schema_choice_and_regex(llm):
    assert llm.model_config.vocab_size == 262_144
    prompts = ["The capital of France, as JSON: ", "Is the sky blue? Answer: ", "The year: "]
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(json=CLOSED)),
        SamplingParams(temperature=0, max_tokens=5, structured_outputs=StructuredOutputs(choice=["yes", "no"])),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(regex="[12][0-9]{3}")),
    ]  # fmt: skip
    schema, choice, year = llm.generate(prompts, params)
    assert schema.finish_reason == "stop" and schema.structured_output_complete
    jsonschema.validate(json.loads(schema.text), CLOSED)
    assert choice.text in ("yes", "no") and choice.finish_reason == "stop"
    assert len(year.text) == 4 and year.text.isdigit() and year.finish_reason == "stop"
