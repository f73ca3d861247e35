"""The extract64 preset: real extraction prompts, run constrained then unconstrained."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tiny_model import build_tiny_model

from tokenmill.bench.child import run_job
from tokenmill.bench.extract import (
    EXTRACT_SCHEMA,
    build_extract_workload,
    extract_instance,
    extract_prompts,
)
from tokenmill.bench.systems import Job, tokenmill_systems
from tokenmill.bench.workload import Workload, load_preset
from tokenmill.engine.loader.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The prompts spell the schema out: long in a tiny BPE vocabulary.
    return build_tiny_model(tmp_path_factory.mktemp("extract"), max_position_embeddings=2048)


def test_records_and_prompts():
    for seed in range(20):
        jsonschema.validate(extract_instance(seed), EXTRACT_SCHEMA)
    prompts = extract_prompts(64)
    assert len(set(prompts)) == 64 and prompts == extract_prompts(64)
    assert all(p.startswith("Extract the company record") for p in prompts)


def test_workload_shares_the_instruction_prefix(model_dir, tmp_path):
    workload = load_preset("extract64", model_dir)
    assert workload.name == "extract64" and workload.num_requests == 64
    assert workload.output_lens == [128] * 64 and workload.json_schema == EXTRACT_SCHEMA
    shared = workload.shared_len[0]
    assert shared > 50 and all(
        p[:shared] == workload.prompt_ids[0][:shared] for p in workload.prompt_ids
    )
    assert len({tuple(p[shared : shared + 1]) for p in workload.prompt_ids}) > 1
    workload.to_json(tmp_path / "w.json")
    assert Workload.from_json(tmp_path / "w.json") == workload


def test_structured_systems_pair_each_dtype():
    specs = tokenmill_systems(["float32", "bfloat16"], {"seed": 1}, structured=True)
    assert [s.label for s in specs] == [
        "tokenmill-fp32-json",
        "tokenmill-fp32",
        "tokenmill-bf16-json",
        "tokenmill-bf16",
    ]
    assert [s.is_baseline for s in specs] == [False, True, False, True]
    assert specs[0].options == {"engine_args": {"seed": 1}, "structured": True}
    assert specs[1].options["output_lens_from"] == "tokenmill-fp32-json"


def test_constrained_then_unconstrained_generate_the_same_counts(model_dir, tmp_path):
    workload = build_extract_workload(model_dir, num_prompts=3, output_len=40)
    workload.to_json(tmp_path / "w.json")
    constrained, free = tokenmill_systems(
        ["float32"], {"kv_cache_memory": 32 << 20}, structured=True
    )
    first = run_job(Job(constrained, str(model_dir), str(tmp_path / "w.json")))
    assert first.extra["num_constrained_tokens"] == first.num_generated_tokens
    assert first.extra["mask_fill_us_per_token"] > 0
    for ids, n in zip(first.output_ids, first.generated):
        assert len(ids) == n <= 40
    second = run_job(
        Job(free, str(model_dir), str(tmp_path / "w.json"), output_lens=first.generated)
    )
    assert second.generated == first.generated
    assert "mask_fill_us_per_token" not in second.extra
    # Whatever the random model wrote, every output that ended at EOS is a valid record.
    tokenizer = Tokenizer.from_dir(model_dir)
    ended = [ids for ids in first.output_ids if ids[-1] in tokenizer.eos_token_ids]
    for ids in ended:
        jsonschema.validate(json.loads(tokenizer.decode(ids)), EXTRACT_SCHEMA)
    assert first.extra["num_complete"] == len(ended)
