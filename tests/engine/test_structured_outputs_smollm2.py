"""Structured outputs end to end on the real default model, SmolLM2-135M-Instruct.

The model is loaded once for the module. Every finished row must parse and validate;
rows cut by max_tokens must say they are incomplete.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from model_fixtures import converted_smollm2_dir, smollm2_gguf_path

from tokenmill import LLM, SamplingParams, StructuredOutputs
from tokenmill.bench.extract import EXTRACT_SCHEMA, extract_prompts
from tokenmill.engine.loader.model_files import ModelFilesError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria Lopez, 34, moved to Madrid last spring.",
    "Our new hire is Kenji Sato from Osaka; he is 29.",
    "Paul (age unknown) lives in Lyon.",
    "Greta Berg, aged 61, runs a bakery in Oslo.",
]


@pytest.fixture(scope="module")
def llm():
    try:
        smollm2_gguf_path()
    except ModelFilesError as error:
        pytest.skip(str(error))
    return LLM(str(converted_smollm2_dir()), dtype="float32", device="cpu")


def chat(llm, message: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": message}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


def check_rows(outputs, schema: dict) -> int:
    """Every finished row validates; every cut row says so. Returns the finished count."""
    finished = 0
    for output in outputs:
        for completion in output.outputs:
            if completion.finish_reason == "stop":
                assert completion.structured_output_complete is True
                jsonschema.validate(json.loads(completion.text), schema)
                finished += 1
            else:
                assert completion.finish_reason == "length"
                assert completion.structured_output_complete is False
    return finished


def test_real_model_extracts_valid_json(llm):
    prompts = [chat(llm, f"Extract name, age and city as JSON: {t}") for t in TEXTS]
    so = StructuredOutputs(json=PERSON)
    greedy = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=48, structured_outputs=so)
    )
    assert check_rows(greedy, PERSON) == len(TEXTS)
    sampled = llm.generate(
        prompts,
        [
            SamplingParams(temperature=0.8, seed=i, max_tokens=48, structured_outputs=so)
            for i in range(len(TEXTS))
        ],
    )
    assert check_rows(sampled, PERSON) >= len(TEXTS) - 1
    # Constrained output is compact JSON: no whitespace between tokens.
    assert all(re.search(r"[{,:]\s", o.text) is None for o in greedy)


def test_real_model_choice_regex_and_json_object(llm):
    reviews = ["I loved it, best purchase ever!", "Broke after two days. Avoid."]
    labels = ["positive", "negative", "neutral"]
    label_prompts = [chat(llm, f"Is this review positive or negative? {r}") for r in reviews]
    choice = SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputs(choice=labels)
    )
    outputs = llm.generate(label_prompts, choice)
    assert all(o.finish_reason == "stop" and o.text in labels for o in outputs)

    date = StructuredOutputs(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
    out = llm.generate(
        [chat(llm, "Write the date of the first moon landing as YYYY-MM-DD.")],
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=date),
    )[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"\d{4}-\d{2}-\d{2}", out.text)

    obj = llm.generate(
        [chat(llm, "Describe a cat as a JSON object with two short fields.")],
        SamplingParams(
            temperature=0, max_tokens=64, structured_outputs=StructuredOutputs(json_object=True)
        ),
    )[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.structured_output_complete is False


def test_real_model_invalid_schema_fails_before_compute(llm):
    before = llm.stats().num_steps
    bad = StructuredOutputs(json={"type": "object", "if": {"required": ["a"]}})
    with pytest.raises(ValueError, match="if"):
        llm.generate(
            [chat(llm, "hi"), chat(llm, "hello")],
            [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, structured_outputs=bad)],
        )
    assert llm.stats().num_steps == before and not llm.engine.has_unfinished


@pytest.mark.slow
def test_real_model_extract_workload_greedy_and_sampled(llm):
    prompts = [chat(llm, p) for p in extract_prompts(16)]
    so = StructuredOutputs(json=EXTRACT_SCHEMA)
    params = [SamplingParams(temperature=0, max_tokens=128, structured_outputs=so)] * 8 + [
        SamplingParams(temperature=0.7, seed=i, max_tokens=128, structured_outputs=so)
        for i in range(8)
    ]
    outputs = llm.generate(prompts, params)
    assert check_rows(outputs, EXTRACT_SCHEMA) >= 12
    several = llm.generate(
        prompts[:2],
        SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=128, structured_outputs=so),
    )
    assert check_rows(several, EXTRACT_SCHEMA) >= 4
