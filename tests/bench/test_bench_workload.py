"""The workload generator: seeded, shaped as its spec says, preset totals fixed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tokenmill.bench.workload import (
    PRESETS,
    Workload,
    WorkloadSpec,
    build_workload,
    cap_workload,
    load_preset,
    ordinary_token_ids,
    warmup_prompts,
)

POOL = list(range(100, 1100))


def test_same_spec_same_workload_every_time():
    first = build_workload(PRESETS["mixed64"], POOL)
    again = build_workload(PRESETS["mixed64"], POOL)
    assert first == again


def test_seed_changes_the_prompts():
    base = build_workload(PRESETS["mixed64"], POOL)
    other = build_workload(replace(PRESETS["mixed64"], seed=1), POOL)
    assert base.prompt_ids != other.prompt_ids


def test_changing_output_lengths_keeps_the_prompts():
    base = build_workload(PRESETS["mixed64"], POOL)
    longer = build_workload(replace(PRESETS["mixed64"], output_len=(128, 128)), POOL)
    assert longer.prompt_ids == base.prompt_ids
    assert longer.output_lens == [128] * 64


# Lengths never depend on the token pool, so these totals hold for every model.
@pytest.mark.parametrize(
    ("preset", "num_prompt", "num_output", "num_unique"),
    [
        ("mixed64", 22_697, 4_096, 14_761),
        ("prefix-heavy", 35_389, 4_096, 4_669),
        ("long16", 63_685, 512, 51_397),
        ("smoke", 192, 48, 128),
    ],
)
def test_preset_totals(preset, num_prompt, num_output, num_unique):
    workload = build_workload(PRESETS[preset], POOL)
    assert workload.num_prompt_tokens == num_prompt
    assert workload.num_output_tokens == num_output
    assert workload.num_unique_prompt_tokens == num_unique


def test_mixed64_shape():
    spec = PRESETS["mixed64"]
    workload = build_workload(spec, POOL)
    shared = [i for i, g in enumerate(workload.prefix_group) if g is not None]
    unique = [i for i, g in enumerate(workload.prefix_group) if g is None]
    assert len(shared) == len(unique) == 32
    prefix = workload.prompt_ids[shared[0]][:256]
    for i in shared:
        ids = workload.prompt_ids[i]
        assert ids[:256] == prefix and 64 <= len(ids) - 256 <= 256
        assert workload.shared_len[i] == 256
    for i in unique:
        assert 64 <= len(workload.prompt_ids[i]) <= 512
        assert workload.shared_len[i] == 0
    assert shared != list(range(32))  # shuffled: shared and unique requests interleave
    assert all(t in set(POOL) for ids in workload.prompt_ids for t in ids)


def test_prefix_heavy_has_four_distinct_prefixes():
    workload = build_workload(PRESETS["prefix-heavy"], POOL)
    prefixes = {}
    for ids, group in zip(workload.prompt_ids, workload.prefix_group):
        prefixes.setdefault(group, set()).add(tuple(ids[:512]))
    assert sorted(prefixes) == [0, 1, 2, 3]
    assert all(len(p) == 1 for p in prefixes.values())
    assert len({next(iter(p)) for p in prefixes.values()}) == 4


def test_chat_spec_wraps_every_prompt():
    spec = WorkloadSpec("c", num_prompts=4, shared_fraction=0.5, prefix_len=8, suffix_len=(2, 4),
                        unique_len=(3, 5), chat=True)  # fmt: skip
    workload = build_workload(spec, POOL, chat_wrap=([1, 2], [3]))
    for ids, group, shared in zip(workload.prompt_ids, workload.prefix_group, workload.shared_len):
        assert ids[:2] == [1, 2] and ids[-1] == 3
        assert shared == (10 if group is not None else 0)
    with pytest.raises(ValueError, match="chat_wrap"):
        build_workload(spec, POOL)


def test_spec_validation():
    with pytest.raises(ValueError, match="shared_fraction"):
        WorkloadSpec("x", num_prompts=4, shared_fraction=1.5)
    with pytest.raises(ValueError, match="output_len"):
        WorkloadSpec("x", num_prompts=4, output_len=(0, 4))
    with pytest.raises(ValueError, match="suffix_len"):
        WorkloadSpec("x", num_prompts=4, suffix_len=(5, 2))


def test_json_round_trip(tmp_path):
    workload = build_workload(PRESETS["smoke"], POOL)
    workload.to_json(tmp_path / "w.json")
    loaded = Workload.from_json(tmp_path / "w.json")
    assert loaded.prompt_ids == workload.prompt_ids
    assert loaded.output_lens == workload.output_lens
    assert loaded.prefix_group == workload.prefix_group
    assert loaded.shared_len == workload.shared_len


def test_warmup_prompts_cannot_hit_the_prefix_cache():
    workload = build_workload(PRESETS["mixed64"], POOL)
    blocks = {tuple(ids[:16]) for ids in workload.prompt_ids}
    for prompt in warmup_prompts(workload):
        assert tuple(prompt[:16]) not in blocks


def test_real_vocabulary_without_special_tokens(bench_model_dir):
    pool = ordinary_token_ids(bench_model_dir / "tokenizer.json")
    assert 0 not in pool and 1 not in pool and 2 not in pool  # the tiny model's specials
    assert len(pool) > 100
    workload = load_preset("smoke", bench_model_dir)
    assert workload == load_preset("smoke", bench_model_dir)
    assert all(t in set(pool) for ids in workload.prompt_ids for t in ids)
    with pytest.raises(ValueError, match="unknown preset"):
        load_preset("nope", bench_model_dir)


def test_a_capped_workload_is_the_first_rows_of_the_whole_with_outputs_cut():
    whole = build_workload(PRESETS["lora8"], POOL)  # mixed64's rows, with adapters
    capped = cap_workload(whole, rows=10, output_tokens=24)
    assert capped.prompt_ids == whole.prompt_ids[:10]
    assert capped.prefix_group == whole.prefix_group[:10]
    assert capped.shared_len == whole.shared_len[:10]
    assert capped.adapters == whole.adapters[:10] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert whole.output_lens[:10] == [64] * 10 and capped.output_lens == [24] * 10
    assert (capped.num_requests, capped.num_output_tokens) == (10, 240)
    assert capped.spec["rows_cap"] == 10 and capped.spec["output_tokens_cap"] == 24
    assert whole.num_requests == 64 and "rows_cap" not in whole.spec  # the whole is untouched

    longer = cap_workload(whole, output_tokens=100)  # a cap above every output cuts none
    assert longer.output_lens == whole.output_lens and longer.num_requests == 64
    assert cap_workload(whole, rows=500).prompt_ids == whole.prompt_ids
    assert cap_workload(whole) is whole


@pytest.mark.parametrize("caps", [{"rows": 0}, {"output_tokens": -1}])
def test_a_cap_below_one_is_refused_by_name(caps):
    with pytest.raises(ValueError, match=f"{next(iter(caps))} cap must be >= 1"):
        cap_workload(build_workload(PRESETS["smoke"], POOL), **caps)
