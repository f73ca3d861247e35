from __future__ import annotations

import random

import pytest

from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.pipelines.plan import Shard, cut_shards, job_id, order_rows, plan_shards, row_cost
from tokenmill.pipelines.prefix_cut import FILL
from tokenmill.pipelines.tokenize import PromptRow

PARAMS = [SamplingParams(max_tokens=10, temperature=0.0)]


def _row(i, ids, rid=None):
    return PromptRow(i, rid or f"r{i}", token_ids=list(ids))


def _rows():
    system_a = list(range(100, 140))
    system_b = list(range(200, 240))
    rows = []
    for i in range(30):
        prefix = system_a if i % 3 == 0 else system_b if i % 3 == 1 else []
        rows.append(_row(i, prefix + [i % 7] * (1 + i % 5) + [900 + i]))
    rows.append(PromptRow(30, "r30", error="prompt is null"))
    rows.append(PromptRow(31, "r31", error="prompt is empty"))
    random.Random(0).shuffle(rows)
    return rows


def test_shared_prefix_rows_are_adjacent():
    ordered = order_rows(_rows(), group_tokens=64)
    groups = [
        "a"
        if r.token_ids and r.token_ids[0] == 100
        else "b"
        if r.token_ids and r.token_ids[0] == 200
        else "err"
        if r.token_ids is None
        else "none"
        for r in ordered
    ]
    # each prefix group forms one contiguous run; error rows go last
    runs = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
    assert sorted(runs[:-1]) == ["a", "b", "none"] and runs[-1] == "err"


def test_within_a_group_rows_are_ordered_by_length():
    rows = [_row(0, [5, 5, 5, 1, 1, 1]), _row(1, [5, 5, 5, 9]), _row(2, [5, 5, 5, 2, 2])]
    assert [r.row_index for r in order_rows(rows, group_tokens=3)] == [1, 2, 0]
    # with a longer group key the next tokens decide first
    assert [r.row_index for r in order_rows(rows, group_tokens=8)] == [0, 2, 1]


@pytest.mark.parametrize("budget", [1, 60, 100, 250, 10_000])
def test_budgets_respected_and_every_row_in_exactly_one_shard(budget):
    rows = _rows()
    shards = plan_shards(rows, PARAMS, model_key="m", shard_tokens=budget)
    seen = [i for s in shards for i in s.row_indices]
    assert sorted(seen) == sorted(r.row_index for r in rows)
    by_index = {r.row_index: r for r in rows}
    for s in shards:
        cost = sum(row_cost(by_index[i], 10) for i in s.row_indices)
        assert s.shard.num_tokens == cost and s.shard.num_rows == len(s.rows)
        # over budget only when one row alone is bigger than the budget
        assert cost <= budget or sum(1 for i in s.row_indices if by_index[i].token_ids) == 1
    assert [s.shard.index for s in shards] == list(range(len(shards)))


def test_max_rows_cap():
    shards = plan_shards(_rows(), PARAMS, model_key="m", max_rows=7, rule=FILL)
    assert [s.shard.num_rows for s in shards] == [7, 7, 7, 7, 4]
    # the prefix cut keeps the count and the cap, and moves cuts between prefix groups
    shards = plan_shards(_rows(), PARAMS, model_key="m", max_rows=7)
    assert [s.shard.num_rows for s in shards] == [7, 7, 6, 6, 6]


def test_shard_ids_stable_across_runs_and_input_order():
    a = plan_shards(_rows(), PARAMS, model_key="m", shard_tokens=200)
    rows = _rows()
    rows.reverse()
    b = plan_shards(rows, PARAMS, model_key="m", shard_tokens=200)
    assert [s.shard for s in a] == [s.shard for s in b]
    assert len({s.shard.shard_id for s in a}) == len(a)
    assert a[0].shard.shard_id.startswith("00000-")


def test_shard_ids_change_with_content_params_and_model():
    def first_id(rows, params, key):
        return plan_shards(rows, params, model_key=key)[0].shard.shard_id

    base = first_id(_rows(), PARAMS, "m")
    assert first_id(_rows(), PARAMS, "other") != base
    other_params = [SamplingParams(max_tokens=10, temperature=0.5)]
    assert first_id(_rows(), other_params, "m") != base
    rows = _rows()
    rows[0] = PromptRow(rows[0].row_index, "renamed", token_ids=rows[0].token_ids or [1])
    assert first_id(rows, PARAMS, "m") != base


def test_job_id_depends_on_shards_and_output():
    shards = [s.shard for s in plan_shards(_rows(), PARAMS, model_key="m")]
    assert job_id(shards, output="out/") == job_id(shards, output="out")
    assert job_id(shards, output="out") != job_id(shards, output="out2")


def test_cut_shards_validates():
    with pytest.raises(ValueError, match="shard_tokens"):
        cut_shards([], PARAMS, shard_tokens=0, model_key="m")
    assert cut_shards([], PARAMS, model_key="m") == []
    with pytest.raises(ValueError, match="at least one row"):
        Shard("x", 0, num_rows=0, num_tokens=0)


def test_a_later_window_continues_the_shard_indices():
    first = plan_shards(_rows(), PARAMS, model_key="m", shard_tokens=100)
    later = plan_shards(_rows(), PARAMS, model_key="m", shard_tokens=100, first_index=7, window=3)
    assert [s.shard.index for s in later] == list(range(7, 7 + len(first)))
    assert {s.shard.window for s in later} == {3}
    # the index prefixes the id; the content hash after it is the same
    assert [s.shard.shard_id[6:] for s in later] == [s.shard.shard_id[6:] for s in first]
    assert later[0].shard.shard_id.startswith("00007-")


def test_budget_for_min_shards_lowers_the_budget_only_as_far_as_needed():
    from tokenmill.pipelines.plan import budget_for

    costs = [10] * 16
    assert budget_for(costs, 1000, 1) == 1000
    assert budget_for(costs, 1000, 2) == 80  # 8 + 8 rows
    assert budget_for(costs, 1000, 3) == 60  # 6 + 6 + 4 rows
    assert budget_for(costs, 50, 2) == 50  # already 4 shards
    assert budget_for([10, 1, 1], 1000, 3) == 1  # a shard per row
    assert budget_for([30, 1, 1, 1], 1000, 2) == 3  # [30] (a row over budget), [1, 1, 1]
    assert budget_for([5], 1000, 4) == 1  # one row: one shard, whatever the budget


def test_min_shards_cuts_a_small_window_for_every_worker():
    rows = [_row(i, [1, 2, 3 + i % 4] * (1 + i % 3)) for i in range(20)]
    params = [SamplingParams(max_tokens=4)]
    one = plan_shards(rows, params, model_key="m", shard_tokens=10_000)
    two = plan_shards(rows, params, model_key="m", shard_tokens=10_000, min_shards=2)
    assert len(one) == 1 and len(two) == 2
    assert sorted(r.row_index for p in two for r in p.rows) == list(range(20))
    assert abs(two[0].shard.num_rows - two[1].shard.num_rows) <= 4
