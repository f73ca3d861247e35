"""`LLM.plan`, the forecast's one way into the engine: on the class it sizes the engine
from the model's files as a loaded LLM sizes itself, its replay is what the engine bills
while nothing is evicted, and its simulation runs the engine's own loop."""

from __future__ import annotations

import pytest
from tiny_model import build_tiny_model

from tokenmill.engine import LLM, PlannedRequest, SamplingParams

SETTINGS = {"dtype": "float32", "device": "cpu", "block_size": 4, "kv_cache_memory": 8 << 20}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def llm(model_dir):
    """A fresh LLM: its prefix cache starts empty, as a plan assumes."""
    return LLM(str(model_dir), **SETTINGS)


def _prompts() -> list[list[int]]:
    shared = [7, 8, 9, 10, 11, 12, 13, 14]  # two blocks of 4
    return [shared + [20 + i] * (i + 1) for i in range(6)]


def test_the_class_and_a_loaded_llm_plan_the_same_engine(model_dir, llm):
    params = SamplingParams(temperature=0, max_tokens=3)
    batches = [[PlannedRequest(p, params) for p in _prompts()]]
    loaded = llm.plan(batches)
    unloaded = LLM.plan(batches, model=str(model_dir), **SETTINGS)
    sized = ("config", "num_blocks", "max_model_len", "vocab_size", "device", "is_encoder")
    assert [getattr(loaded.shape, f) for f in sized] == [getattr(unloaded.shape, f) for f in sized]
    assert loaded.shape.num_blocks == llm.engine.block_manager.num_blocks
    assert loaded.block_size == 4 and not loaded.shape.is_encoder
    # The first prompt computes the shared two blocks; each later one is served them.
    assert loaded.cached_tokens == unloaded.cached_tokens == [0, 8, 8, 8, 8, 8]
    assert loaded.cached_tokens_exact and loaded.simulation is None
    outputs = llm.generate(_prompts(), params)
    assert [o.cached_tokens for o in outputs] == loaded.cached_tokens


def test_the_simulation_bills_what_the_engine_bills(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = _prompts()
    outputs = llm.generate(prompts, params)
    scripted = [[PlannedRequest(p, params, o.completion_tokens) for p, o in zip(prompts, outputs)]]
    plan = llm.plan(scripted, simulate=True)
    assert plan.simulation.cached_tokens == [o.cached_tokens for o in outputs]
    assert plan.simulation.completion_tokens == [5] * 6
    assert sum(s.sampled_tokens for s in plan.simulation.steps) == 30
    assert sum(s.prompt_tokens for s in plan.simulation.steps) == sum(
        len(p) - o.cached_tokens for p, o in zip(prompts, outputs)
    )


def test_a_loaded_llm_plans_only_with_its_own_settings(llm, model_dir):
    with pytest.raises(TypeError, match="its own model and settings"):
        llm.plan([], block_size=8)
    with pytest.raises(TypeError, match="unknown engine settings blocksize"):
        LLM.plan([], model=str(model_dir), blocksize=8)
