"""Where max_num_seqs is not set, the KV cache decides how many sequences run at once:
each is admitted only while the cache holds it at its prompt + max_tokens beside what
the running ones may still grow into, so none is preempted (recomputed); a user's
max_num_seqs is kept, admission by prompt alone, as before."""

from __future__ import annotations

import random

import pytest
from hf_models import build_hf_model, make_engine

from tokenmill.engine.types.sampling_params import SamplingParams

# k + v, layers, kv heads, head_dim, tokens a block, fp32: the tiny llama's block bytes.
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4
# 16 rows of 24-token prompts and 24 generated tokens: 12 blocks of 4 tokens a row.
NUM_ROWS, PROMPT, GENERATED = 16, 24, 24
ROW_BLOCKS = (PROMPT + GENERATED) // 4
PARAMS = SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("running-cap")
    build_hf_model("llama", path)
    return path


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(256) for _ in range(PROMPT)] for _ in range(NUM_ROWS)]


def _run(engine) -> tuple[list[list[int]], int]:
    """Every row's token ids, and the most sequences that ran at once."""
    for i, prompt in enumerate(_prompts()):
        engine.add_request(str(i), prompt, PARAMS)
    outputs, most = {}, 0
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        most = max(most, len(engine.scheduler.running))
    return [outputs[str(i)] for i in range(NUM_ROWS)], most


def test_a_derived_cap_never_preempts_and_answers_as_a_roomy_cache(model_dir):
    roomy = make_engine(model_dir)
    expected, _ = _run(roomy)
    assert roomy.stats.num_preemptions == 0

    # A cache for 4 rows and 2 blocks: with max_num_seqs set, all 16 are admitted on
    # their prompt's blocks and decode preempts; unset, 4 run at once and none is.
    budget = (4 * ROW_BLOCKS + 2) * BLOCK_BYTES
    set_cap = make_engine(model_dir, kv_cache_memory=budget, max_num_seqs=NUM_ROWS)
    assert set_cap.block_manager.num_blocks == 4 * ROW_BLOCKS + 2
    got_set, most_set = _run(set_cap)
    assert set_cap.stats.num_preemptions > 0 and most_set > 4

    derived = make_engine(model_dir, kv_cache_memory=budget)
    got, most = _run(derived)
    assert derived.stats.num_preemptions == 0
    assert most == 4
    assert got == expected == got_set
    # The rows that waited computed their prompts once; the preempted ones again.
    assert derived.stats.computed_prompt_tokens == NUM_ROWS * PROMPT
    assert set_cap.stats.computed_prompt_tokens > NUM_ROWS * PROMPT


def test_a_row_longer_than_its_share_runs_alone_rather_than_waiting_forever(model_dir):
    # 13 blocks: one row of 12 at a time, the 13th block never enough for a second.
    engine = make_engine(model_dir, kv_cache_memory=(ROW_BLOCKS + 1) * BLOCK_BYTES)
    got, most = _run(engine)
    assert most == 1 and engine.stats.num_preemptions == 0
    assert all(len(ids) == GENERATED for ids in got)
