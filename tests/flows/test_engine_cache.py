"""One engine per worker process, shared by its shard tasks."""

from __future__ import annotations

import threading

import pytest

from tokenmill.flows import engine_cache
from tokenmill.pipelines.spec import JobSpec

ENGINE = {"dtype": "float32", "engine_options": {"kv_cache_memory": 16 << 20}}


@pytest.fixture(autouse=True)
def fresh_cache():
    engine_cache.clear()
    yield
    engine_cache.clear()


def spec(model, **extra):
    return JobSpec("in.jsonl", "out", model=model, **{**ENGINE, **extra})


def test_loaded_once_and_reused(tiny_model):
    before = engine_cache.num_loads()
    first = engine_cache.get_engine(spec(tiny_model))
    again = engine_cache.get_engine(spec(tiny_model, limit=3))  # not an engine setting
    assert again is first
    assert engine_cache.num_loads() == before + 1
    assert len(first.weights_hash) == 64


def test_concurrent_first_use_loads_once(tiny_model):
    before = engine_cache.num_loads()
    got = []
    threads = [
        threading.Thread(target=lambda: got.append(engine_cache.get_engine(spec(tiny_model))))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(e) for e in got}) == 1
    assert engine_cache.num_loads() == before + 1


def test_another_model_or_option_replaces_the_engine(tiny_model):
    first = engine_cache.get_engine(spec(tiny_model))
    other = engine_cache.get_engine(spec(tiny_model, engine_options={"kv_cache_memory": 8 << 20}))
    assert other is not first
    assert engine_cache.get_engine(spec(tiny_model)) is not first  # only one is kept
