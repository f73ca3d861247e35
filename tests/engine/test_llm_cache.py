"""One shared engine per process: loaded once, replaced by another, reloaded after a fork,
keyed by every LLM(...) argument."""

from __future__ import annotations

import threading

import pytest
from tiny_model import build_tiny_model

from tokenmill.pipelines import shared_llm as llm_cache
from tokenmill.pipelines.shared_llm import call_key, get_llm

ENGINE = {"dtype": "float32", "kv_cache_memory": 8 << 20}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))  # weights digests
    llm_cache.clear()
    yield
    llm_cache.clear()


def test_loaded_once_and_reused(model):
    before = llm_cache.num_loads()
    first = get_llm(model, **ENGINE)
    # a default given explicitly is the same engine
    assert get_llm(model, **ENGINE, block_size=16) is first
    assert llm_cache.num_loads() == before + 1
    assert len(first.weights_hash) == 64


def test_concurrent_first_use_loads_once(model):
    before = llm_cache.num_loads()
    got = []
    threads = [
        threading.Thread(target=lambda: got.append(get_llm(model, **ENGINE))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 3 and len({id(e) for e in got}) == 1
    assert llm_cache.num_loads() == before + 1


def test_another_option_replaces_the_engine_and_only_one_is_kept(model):
    first = get_llm(model, **ENGINE)
    other = get_llm(model, **{**ENGINE, "kv_cache_memory": 4 << 20})
    assert other is not first and other.llm is not first.llm
    assert get_llm(model, **ENGINE) is not first  # the first was dropped, not kept aside


def test_a_forked_process_loads_its_own(model, monkeypatch):
    first = get_llm(model, **ENGINE)
    monkeypatch.setattr(llm_cache.os, "getpid", lambda: first.pid + 1)
    again = get_llm(model, **ENGINE)
    assert again is not first and again.pid == first.pid + 1


def test_an_unknown_argument_is_refused_before_loading(model):
    before = llm_cache.num_loads()
    with pytest.raises(TypeError, match="kv_cache_memroy"):
        get_llm(model, kv_cache_memroy=1)
    assert llm_cache.num_loads() == before


def test_keys_compare_dicts_lists_and_defaults_by_content():
    def make(model, *, dtype="auto", options=None, layers=(), tags=frozenset()):
        raise AssertionError("never called")

    key = call_key(make, "m", options={"a": 1, "b": [1, {"c": 2}]}, layers=[1, 2])
    same = call_key(make, "m", dtype="auto", options={"b": [1, {"c": 2}], "a": 1}, layers=(1, 2))
    assert key == same and hash(key) == hash(same)
    assert call_key(make, "m", options={"a": 1, "b": [1, {"c": 3}]}) != key
    assert call_key(make, "m", layers=[2, 1]) != call_key(make, "m", layers=[1, 2])
    assert call_key(make, "m", tags={"x", "y"}) == call_key(make, "m", tags={"y", "x"})
    with pytest.raises(TypeError):
        call_key(make, "m", unknown=1)


def test_a_preloaded_engine_counts_as_loaded_for_its_first_caller_only(model):
    before = llm_cache.num_loads()
    llm_cache.preload(model, **ENGINE)
    first, loaded = llm_cache.acquire_llm(model, **ENGINE)
    assert loaded and first.load_seconds > 0  # the shard that uses it reports the load
    again, loaded_again = llm_cache.acquire_llm(model, **ENGINE)
    assert again is first and not loaded_again
    llm_cache.preload(model, **ENGINE)  # already loaded: nothing happens
    assert llm_cache.acquire_llm(model, **ENGINE) == (first, False)
    assert llm_cache.num_loads() == before + 1


def test_a_caller_during_a_preload_waits_for_it_and_loads_nothing(model):
    before = llm_cache.num_loads()
    loader = threading.Thread(target=llm_cache.preload, args=(model,), kwargs=ENGINE)
    loader.start()
    shared, loaded = llm_cache.acquire_llm(model, **ENGINE)
    loader.join()
    assert loaded and llm_cache.num_loads() == before + 1
    assert llm_cache.acquire_llm(model, **ENGINE) == (shared, False)


def test_a_failed_preload_is_logged_and_the_caller_meets_the_error(model, caplog):
    missing = str(model) + "-missing"
    llm_cache.preload(missing, **ENGINE)
    assert "loading the engine ahead failed" in caplog.text and "no model" in caplog.text
    with pytest.raises(FileNotFoundError, match="no model"):
        llm_cache.acquire_llm(missing, **ENGINE)
