"""Engine behaviour on a random-weight model: prefix caching, preemption, sampling controls."""

from __future__ import annotations

import random

import pytest
from hf_models import build_hf_model, make_engine, run_all, save_char_tokenizer

from tokenmill.engine.types.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_hf_model("llama", path)
    save_char_tokenizer(path)
    return path


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_shared_prefix_is_computed_once(model_dir):
    prefix = random_tokens(40, seed=1)  # 10 full blocks
    prompts = [prefix + random_tokens(6, seed=100 + i) for i in range(6)]
    cached = make_engine(model_dir)
    with_cache = run_all(cached, prompts, GREEDY)
    # The first prompt computes all 46 tokens; the other five only their 6-token tails.
    assert cached.stats.computed_prompt_tokens == 46 + 5 * 6
    assert cached.stats.cached_prompt_tokens == 5 * 40
    assert [o.cached_tokens for o in with_cache] == [0] + [40] * 5
    assert all(o.prompt_tokens == 46 for o in with_cache)

    uncached = make_engine(model_dir, enable_prefix_caching=False)
    without_cache = run_all(uncached, prompts, GREEDY)
    assert uncached.stats.computed_prompt_tokens == 6 * 46
    assert uncached.stats.cached_prompt_tokens == 0
    assert [o.token_ids for o in with_cache] == [o.token_ids for o in without_cache]


def test_reset_prefix_cache_makes_the_next_call_compute_its_prompts(model_dir):
    from tokenmill.engine import LLM

    llm = LLM(str(model_dir), dtype="float32", block_size=4, kv_cache_memory=8 << 20)
    prompt = [random_tokens(42, seed=3)]  # 10 full blocks, then 2 tokens
    llm.generate(prompt, GREEDY)
    assert llm.generate(prompt, GREEDY)[0].cached_tokens == 40
    llm.reset_prefix_cache()
    assert llm.generate(prompt, GREEDY)[0].cached_tokens == 0
    assert llm.generate(prompt, GREEDY)[0].cached_tokens == 40  # cached again from here


def test_preemption_finishes_everything_with_identical_outputs(model_dir):
    prompts = [random_tokens(n, seed=n) for n in (9, 14, 21, 30, 5, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = make_engine(model_dir)
    expected = run_all(roomy, prompts, params)
    assert roomy.stats.num_preemptions == 0

    # 16 blocks of 4 tokens = 64 tokens of cache for ~220 tokens of sequences.
    block_bytes = 2 * 2 * 2 * 16 * 4 * 4  # k+v, layers, kv heads, head_dim, block, fp32
    # max_num_seqs set: sequences are admitted by their prompt alone, so decode preempts.
    tight = make_engine(model_dir, kv_cache_memory=16 * block_bytes, max_num_seqs=8)
    assert tight.block_manager.num_blocks == 16
    got = run_all(tight, prompts, params)
    assert tight.stats.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert all(o.finish_reason == "length" for o in got)


def test_prompt_longer_than_cache_or_context_is_a_request_error(model_dir):
    engine = make_engine(model_dir, kv_cache_memory=4 * 1024)  # 2 blocks = 8 tokens
    outputs = run_all(engine, [random_tokens(5, 1), random_tokens(20, 2)], GREEDY)
    assert outputs[0].error is None and outputs[0].completion_tokens > 0
    assert outputs[1].finish_reason == "error"
    assert "KV cache" in outputs[1].error

    engine = make_engine(model_dir, max_model_len=32)
    outputs = run_all(engine, [random_tokens(40, 3), random_tokens(4, 4)], GREEDY)
    assert outputs[0].finish_reason == "error" and "context" in outputs[0].error
    assert outputs[1].error is None


def test_seeded_sampling_is_independent_of_batch(model_dir):
    prompt = random_tokens(12, seed=5)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=1234, max_tokens=20)
    alone = run_all(make_engine(model_dir), [prompt], params)[0]

    others = [random_tokens(n, seed=50 + n) for n in (3, 30, 17, 8)]
    mixed_params = [SamplingParams(temperature=1.0, max_tokens=25)] * 2 + [
        SamplingParams(temperature=0.7, seed=99, max_tokens=10),
        SamplingParams(temperature=0, max_tokens=5),
        params,
    ]
    batch = run_all(
        make_engine(model_dir, max_num_batched_tokens=16), others + [prompt], mixed_params
    )
    assert batch[-1].token_ids == alone.token_ids

    different_seed = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=4321, max_tokens=20)
    assert run_all(make_engine(model_dir), [prompt], different_seed)[0].token_ids != alone.token_ids


def test_n_completions_share_the_prompt(model_dir):
    prompt = random_tokens(26, seed=7)  # 6 full blocks + 2 tokens
    engine = make_engine(model_dir)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    out = run_all(engine, [prompt], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    assert out.completion_tokens == 30 and out.prompt_tokens == 26
    # The prompt's full blocks are computed once; each sibling recomputes only the tail.
    assert engine.stats.computed_prompt_tokens == 26 + 2 * 2
    assert engine.stats.cached_prompt_tokens == 2 * 24


def test_stop_string_truncates_text(model_dir):
    prompt = random_tokens(10, seed=9)
    engine = make_engine(model_dir)
    free = run_all(engine, [prompt], GREEDY)[0]
    stop = free.text[6:8]
    cut = free.text.find(stop)
    stopped = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=16, stop=[stop]))[
        0
    ]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[:cut]
    kept = SamplingParams(
        temperature=0, max_tokens=16, stop=[stop], include_stop_str_in_output=True
    )
    assert run_all(engine, [prompt], kept)[0].text == free.text[: cut + 2]


def test_stop_token_ids_min_tokens_and_max_tokens(model_dir):
    prompt = random_tokens(10, seed=11)
    engine = make_engine(model_dir)
    free = run_all(engine, [prompt], GREEDY)[0].token_ids
    stop_id = free[3]
    first = free.index(stop_id)
    out = run_all(
        engine, [prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id])
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free[: first + 1]

    # With min_tokens the stop id is masked until enough tokens exist.
    later = SamplingParams(
        temperature=0, max_tokens=16, stop_token_ids=[stop_id], min_tokens=first + 2
    )
    out = run_all(engine, [prompt], later)[0]
    assert len(out.token_ids) >= first + 2
    assert stop_id not in out.token_ids[: first + 2]

    out = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == free[:5]


def test_logprobs_on_request(model_dir):
    engine = make_engine(model_dir)
    out = run_all(
        engine, [random_tokens(8, 12)], SamplingParams(temperature=0, max_tokens=4, logprobs=3)
    )[0]
    assert len(out.outputs[0].logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.outputs[0].logprobs):
        assert token_id in entry and len(entry) == 3  # greedy token is also the top-1
        assert max(entry.values()) == entry[token_id]
    no_logprobs = run_all(engine, [random_tokens(8, 12)], GREEDY)[0]
    assert no_logprobs.outputs[0].logprobs is None


def test_top_k_one_is_greedy(model_dir):
    prompt = random_tokens(10, seed=13)
    engine = make_engine(model_dir)
    greedy = run_all(engine, [prompt], GREEDY)[0]
    top1 = SamplingParams(temperature=1.5, top_k=1, seed=1, max_tokens=16, ignore_eos=True)
    assert run_all(engine, [prompt], top1)[0].token_ids == greedy.token_ids
    tiny_p = SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=16, ignore_eos=True)
    assert run_all(engine, [prompt], tiny_p)[0].token_ids == greedy.token_ids
    full_min_p = SamplingParams(temperature=1.5, min_p=1.0, max_tokens=16, ignore_eos=True)
    assert run_all(engine, [prompt], full_min_p)[0].token_ids == greedy.token_ids


def _madvised_huge(ptr: int) -> bool:
    """Whether the mapping holding ptr was madvised for huge pages (smaps VmFlags 'hg')."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError("no mapping holds the KV cache")


def test_huge_pages_setting_reaches_the_kv_cache(model_dir):
    from tokenmill.engine.worker.host_memory import asks_for_huge_pages

    if not asks_for_huge_pages():
        pytest.skip("this kernel cannot be asked for huge pages (not Linux, or THP off)")
    for asked in (False, True):
        cache = make_engine(model_dir, kv_cache_memory=64 << 20, huge_pages=asked).runner.kv_cache
        assert _madvised_huge(cache.k.data_ptr()) is asked
        assert _madvised_huge(cache.v.data_ptr()) is asked
