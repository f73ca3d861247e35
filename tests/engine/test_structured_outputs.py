"""Structured outputs through the engine on a random-weight model with a byte-level BPE.

Random weights pick among whatever the grammar allows, so every output is a hard test of
the masks: it must parse and validate (jsonschema) whatever the model would have said.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hf_models import make_engine, run_all
from tiny_model import build_tiny_model

from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.types.structured_outputs import StructuredOutputs

# Strings are bounded: a random model closes an unbounded string almost never.
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "address": {
                        "type": "object",
                        "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 5},
        },
        "required": ["age", "score", "count"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {
            "note": {"type": ["string", "null"], "maxLength": 6},
            "rank": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3}, {"type": "null"}]},
            "kind": {"enum": ["a", "b", None]},
        },
        "required": ["note", "rank", "kind"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,3}$"},
            "flag": {"type": "boolean"},
        },
        "required": ["code", "flag"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def prompts(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    return [tokenizer.encode(f"Question {i}: the quick brown fox?") for i in range(4)]


def constrained(max_tokens: int = 120, **kwargs) -> dict:
    """SamplingParams keywords: seeded sampling by default."""
    return {"max_tokens": max_tokens, "temperature": 1.0} | kwargs


def assert_valid_json(output, schema: dict) -> dict:
    completion = output.outputs[0] if hasattr(output, "outputs") else output
    assert completion.finish_reason == "stop", completion.text
    assert completion.structured_output_complete is True
    value = json.loads(completion.text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_outputs_are_valid_against_the_schema_greedy_and_sampled(model_dir, prompts, name):
    schema = SCHEMAS[name]
    so = StructuredOutputs(json=schema)
    engine = make_engine(model_dir)
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=so)] + [
        SamplingParams(**constrained(seed=seed), structured_outputs=so) for seed in range(3)
    ]
    outputs = run_all(engine, prompts, params)
    values = [assert_valid_json(o, schema) for o in outputs]
    # Sampling explores: not every output is the same document.
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 1


def test_regex_choice_and_grammars(model_dir, prompts):
    engine = make_engine(model_dir)
    regex = r"[0-9]{3}-[a-z]{2,4}(!|\?)"
    choices = ["yes", "no", "maybe so"]
    lark = 'start: color " " vehicle\ncolor: "red" | "green"\nvehicle: "car" | "bike"'
    gbnf = 'root ::= ("up" | "down") "-" ("left" | "right")'
    params = [
        SamplingParams(**constrained(seed=s), structured_outputs=StructuredOutputs(**kw))
        for kw in ({"regex": regex}, {"choice": choices}, {"grammar": lark}, {"grammar": gbnf})
        for s in range(3)
    ]
    outputs = run_all(engine, prompts[:1] * len(params), params)
    assert all(o.finish_reason == "stop" and o.structured_output_complete for o in outputs)
    texts = [o.text for o in outputs]
    assert all(re.fullmatch(regex, t) for t in texts[0:3]), texts[0:3]
    assert all(t in choices for t in texts[3:6]), texts[3:6]
    assert all(re.fullmatch(r"(red|green) (car|bike)", t) for t in texts[6:9]), texts[6:9]
    assert all(re.fullmatch(r"(up|down)-(left|right)", t) for t in texts[9:12]), texts[9:12]
    # The grammar's end is EOS, sampled like any token and kept in the token ids.
    assert all(o.token_ids[-1] in engine.eos_token_ids for o in outputs)


def test_json_object_and_disable_additional_properties(model_dir, prompts):
    engine = make_engine(model_dir)
    open_schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"],
    }
    closed = StructuredOutputs(json=open_schema, disable_additional_properties=True)
    outputs = run_all(
        engine,
        prompts[:1] * 3,
        [SamplingParams(**constrained(seed=s), structured_outputs=closed) for s in range(3)],
    )
    for output in outputs:
        assert list(assert_valid_json(output, open_schema)) == ["a"]  # no extra keys


def test_seeded_constrained_sampling_is_independent_of_batch(model_dir, prompts):
    so = StructuredOutputs(json=SCHEMAS["numbers"])
    params = SamplingParams(**constrained(seed=1234, top_p=0.9), structured_outputs=so)
    alone = run_all(make_engine(model_dir), [prompts[0]], params)[0]
    others = [
        SamplingParams(temperature=1.0, max_tokens=30),
        SamplingParams(
            **constrained(seed=7), structured_outputs=StructuredOutputs(regex="[a-z]+!")
        ),
        SamplingParams(temperature=0, max_tokens=9, structured_outputs=so),
    ]
    batch = run_all(
        make_engine(model_dir, max_num_batched_tokens=16),
        prompts[1:] + [prompts[0]],
        others + [params],
    )
    assert batch[-1].token_ids == alone.token_ids
    assert_valid_json(batch[-1], SCHEMAS["numbers"])


def test_grammar_state_survives_preemption(model_dir, prompts):
    schema = SCHEMAS["array"]
    so = StructuredOutputs(json=schema)
    params = [SamplingParams(**constrained(seed=s), structured_outputs=so) for s in range(6)]
    roomy = make_engine(model_dir)
    expected = run_all(roomy, prompts + prompts[:2], params)
    assert roomy.stats.num_preemptions == 0

    # 12 blocks of 4 tokens for six sequences of ~30 tokens: preemption by recompute.
    block_bytes = 2 * 2 * 2 * 16 * 4 * 4  # k+v, layers, kv heads, head_dim, block, fp32
    tight = make_engine(model_dir, kv_cache_memory=12 * block_bytes, max_num_seqs=8)
    got = run_all(tight, prompts + prompts[:2], params)
    assert tight.stats.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for output in got:
        assert_valid_json(output, schema)


def test_prefix_caching_and_chunked_prefill_do_not_change_constrained_outputs(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    shared = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    prompts = [shared + tokenizer.encode(f" item {i}") for i in range(4)]
    so = StructuredOutputs(json=SCHEMAS["nullable"])
    params = [SamplingParams(**constrained(seed=s), structured_outputs=so) for s in range(4)]
    cached = make_engine(model_dir, max_num_batched_tokens=8)  # prompts chunked over steps
    got = run_all(cached, prompts, params)
    assert cached.stats.cached_prompt_tokens > 0
    plain = run_all(make_engine(model_dir, enable_prefix_caching=False), prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    for output in got:
        assert_valid_json(output, SCHEMAS["nullable"])


def test_n_completions_each_follow_the_grammar(model_dir, prompts):
    schema = SCHEMAS["pattern"]
    params = SamplingParams(
        **constrained(seed=5), n=3, structured_outputs=StructuredOutputs(json=schema)
    )
    output = run_all(make_engine(model_dir), prompts[:1], params)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    values = [assert_valid_json(c, schema) for c in output.outputs]
    assert len({json.dumps(v) for v in values}) == 3


def test_cut_by_max_tokens_is_length_and_says_incomplete(model_dir, prompts):
    engine = make_engine(model_dir)
    so = StructuredOutputs(json=SCHEMAS["nested"])
    cut, free = run_all(
        engine,
        prompts[:2],
        [
            SamplingParams(temperature=0, max_tokens=6, structured_outputs=so),
            SamplingParams(temperature=0, max_tokens=6),
        ],
    )
    assert cut.finish_reason == "length" and len(cut.token_ids) == 6
    assert cut.structured_output_complete is False and cut.text.startswith('{"user":')
    assert free.structured_output_complete is None
    # A stop string cuts the text short of the grammar: finished, but not a whole match.
    stopped = run_all(
        engine,
        prompts[:1],
        SamplingParams(temperature=0, max_tokens=60, stop=['"address"'], structured_outputs=so),
    )[0]
    assert stopped.finish_reason == "stop" and stopped.text.startswith('{"user":')
    assert stopped.structured_output_complete is False


def test_min_tokens_and_ignore_eos_wait_for_the_grammar_but_never_outlast_it(model_dir, prompts):
    engine = make_engine(model_dir)
    eos = engine.eos_token_ids
    # x(,x)* may end after any x; greedy, this model ends it after "x,x".
    items = StructuredOutputs(regex="x(,x)*")

    def run(**kwargs):
        params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=items, **kwargs)
        return run_all(engine, prompts[:1], params)[0]

    free = run()
    assert free.text == "x,x" and free.finish_reason == "stop"
    # min_tokens bans EOS for 8 tokens; the grammar still decides where the output ends.
    out = run(min_tokens=8)
    assert out.finish_reason == "stop" and out.structured_output_complete
    assert len(out.token_ids) > 8 and not eos & set(out.token_ids[:8])
    assert re.fullmatch("x(,x)*", out.text)
    # ignore_eos: EOS stays banned while the grammar can continue - up to max_tokens.
    for max_tokens in (11, 12):
        params = SamplingParams(
            temperature=0, ignore_eos=True, max_tokens=max_tokens, structured_outputs=items
        )
        out = run_all(engine, prompts[:1], params)[0]
        assert out.finish_reason == "length" and len(out.token_ids) == max_tokens
        # Cut after an "x" the text is still a whole match; after a "," it is not.
        assert out.structured_output_complete == bool(re.fullmatch("x(,x)*", out.text))
    # A choice is complete after its word: only EOS is left, min_tokens and ignore_eos or not.
    choice = StructuredOutputs(choice=["yes", "no"])
    for extra in ({"min_tokens": 20}, {"ignore_eos": True}):
        out = run_all(
            engine,
            prompts[:1],
            SamplingParams(temperature=0, max_tokens=30, structured_outputs=choice, **extra),
        )[0]
        assert out.finish_reason == "stop" and out.text in ("yes", "no")
        assert out.token_ids[-1] in eos and len(out.token_ids) < 20


def test_logprobs_are_of_the_constrained_distribution(model_dir, prompts):
    engine = make_engine(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    choices = ["red", "green", "blue"]
    params = SamplingParams(
        temperature=0,
        max_tokens=10,
        logprobs=20,
        structured_outputs=StructuredOutputs(choice=choices),
    )
    out = run_all(engine, prompts[:1], params)[0]
    first = out.outputs[0].logprobs[0]
    # Only tokens that start a choice are alternatives, and they carry all the mass.
    for token_id in first:
        assert any(c.startswith(tokenizer.decode([token_id])) for c in choices)
    assert sum(2.718281828459045**lp for lp in first.values()) == pytest.approx(1.0, abs=1e-4)


def test_invalid_constraints_fail_before_anything_is_queued(model_dir, prompts):
    engine = make_engine(model_dir)
    bad = {
        "regex": StructuredOutputs(regex="[a-z"),
        "uniqueItems": StructuredOutputs(json={"type": "array", "uniqueItems": True}),
        "grammar": StructuredOutputs(grammar="start: undefined_rule"),
        "Unknown format": StructuredOutputs(json={"type": "string", "format": "uri-reference"}),
    }
    for needle, so in bad.items():
        with pytest.raises(ValueError, match=re.escape(needle)):
            engine.add_request("bad", prompts[0], SamplingParams(structured_outputs=so))
    assert not engine.has_unfinished
    with pytest.raises(ValueError, match="exactly one of json, regex"):
        StructuredOutputs(json={"type": "object"}, regex="x")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="json schema is not valid JSON"):
        StructuredOutputs(json='{"type": ')
    with pytest.raises(ValueError, match="choice must"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs={"json": {}})


def test_overlapped_steps_give_the_same_constrained_outputs(model_dir, prompts):
    """With overlapped steps (the CUDA default, here on the CPU), a step after one that
    sampled under a grammar waits for its tokens; unconstrained rows still overlap."""
    so = StructuredOutputs(json=SCHEMAS["numbers"])
    params = [SamplingParams(**constrained(seed=s), structured_outputs=so) for s in range(2)] + [
        SamplingParams(temperature=1.0, seed=9, max_tokens=100, ignore_eos=True)
    ] * 2
    plain = run_all(make_engine(model_dir, overlap_steps=False), prompts, params)
    overlapped = make_engine(model_dir, overlap_steps=True)
    read_placeholders = []
    step_tokens = overlapped.runner.step_tokens

    def recording(out):
        step = step_tokens(out)
        constrained_rows = [c for c in out.chunks if c.seq.grammar is not None]
        read_placeholders.append((bool(step.placeholder_rows), bool(constrained_rows)))
        return step

    overlapped.runner.step_tokens = recording
    got = run_all(overlapped, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    for output in got[:2]:
        assert_valid_json(output, SCHEMAS["numbers"])
    # No step with a constrained row ran on unresolved tokens; once the constrained
    # requests were done, the unconstrained ones overlapped again.
    assert not any(placeholders and has_grammar for placeholders, has_grammar in read_placeholders)
    assert any(placeholders for placeholders, _ in read_placeholders)
