from __future__ import annotations

import random
from array import array

import pytest

from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.pipelines.plan import plan_shards
from tokenmill.pipelines.prefix_cut import FILL, PREFIX, cut_ends, shared_prefix
from tokenmill.pipelines.tokenize import PromptRow

# One completion token: a row costs its 23 prompt tokens + 1.
PARAMS = [SamplingParams(max_tokens=1, temperature=0.0)]
ROW_COST = 24


def _documents(sizes: list[int]) -> list[PromptRow]:
    """Rows asking questions of documents: document d's rows share its 20 tokens, then
    each asks its own 3-token question."""
    rows = []
    for d, size in enumerate(sizes):
        document = [1000 + d] + [d] * 19
        for q in range(size):
            i = len(rows)
            rows.append(PromptRow(i, f"d{d}q{q}", token_ids=array("i", document + [7, q, 9])))
    return rows


def _documents_of(shards) -> list[list[int]]:
    return [sorted({r.token_ids[0] - 1000 for r in s.rows}) for s in shards]


def test_shared_prefix_counts_common_leading_tokens():
    a = PromptRow(0, "a", token_ids=array("i", [1, 2, 3, 4]))
    assert shared_prefix(a, PromptRow(1, "b", token_ids=[1, 2, 9])) == 2
    assert shared_prefix(a, PromptRow(2, "c", token_ids=[1, 2])) == 2
    assert shared_prefix(a, PromptRow(3, "d", token_ids=[5])) == 0
    # another adapter's rows and an error row share nothing an engine could reuse
    assert shared_prefix(a, PromptRow(4, "e", token_ids=[1, 2, 3, 4], lora_index=1)) == 0
    assert shared_prefix(a, PromptRow(5, "f", error="prompt is null")) == 0


def test_cuts_fall_between_documents():
    rows = _documents([4, 4, 4, 4])
    # 9 rows a shard: filling cuts through document 2; the prefix cut keeps it whole
    fill = plan_shards(rows, PARAMS, model_key="m", shard_tokens=9 * ROW_COST, rule=FILL)
    assert [s.shard.num_rows for s in fill] == [9, 7]
    assert _documents_of(fill) == [[0, 1, 2], [2, 3]]
    prefix = plan_shards(rows, PARAMS, model_key="m", shard_tokens=9 * ROW_COST, rule=PREFIX)
    assert [s.shard.num_rows for s in prefix] == [8, 8]
    assert _documents_of(prefix) == [[0, 1], [2, 3]]


def test_a_document_larger_than_a_workers_share_is_split_across_workers():
    rows = _documents([12, 4])
    shards = plan_shards(rows, PARAMS, model_key="m", shard_tokens=10**6, min_shards=2)
    assert [s.shard.num_rows for s in shards] == [8, 8]
    assert _documents_of(shards) == [[0], [0, 1]]


def test_the_prefix_cut_never_idles_a_worker():
    # Three documents for two workers: whole documents would be three shards, and one
    # worker would run two while the other idles; the cut keeps two even shards.
    rows = _documents([4, 4, 4])
    shards = plan_shards(rows, PARAMS, model_key="m", shard_tokens=10**6, min_shards=2)
    assert [s.shard.num_rows for s in shards] == [6, 6]


def test_the_fill_rule_keeps_the_shard_ids_it_gave():
    rows = _documents([4, 4, 4, 4])
    fill = plan_shards(rows, PARAMS, model_key="m", shard_tokens=9 * ROW_COST, rule=FILL)
    prefix = plan_shards(rows, PARAMS, model_key="m", shard_tokens=9 * ROW_COST)
    again = plan_shards(rows[::-1], PARAMS, model_key="m", shard_tokens=9 * ROW_COST, rule=FILL)
    assert [s.shard.shard_id for s in again] == [s.shard.shard_id for s in fill]
    assert [s.shard.shard_id for s in prefix] != [s.shard.shard_id for s in fill]


def test_unknown_rule_refused():
    with pytest.raises(ValueError, match="unknown cut rule 'nearest'"):
        cut_ends([1, 2], 3, rule="nearest")


@pytest.mark.parametrize("seed", range(5))
def test_prefix_cut_keeps_count_and_budget_and_never_splits_more_prefix(seed):
    r = random.Random(seed)
    for _ in range(400):
        costs = [r.choice([1, 2, 3, 5, 8, 13, 40]) for _ in range(r.randint(0, 30))]
        costs += [0] * r.randint(0, 2)  # error rows ride along at the end
        budget, max_rows = r.randint(1, 50), r.choice([None, None, 2, 7])
        shared = [r.randint(0, 5) for _ in range(len(costs) + 1)]
        fill = cut_ends(costs, budget, max_rows=max_rows)
        prefix = cut_ends(
            costs, budget, max_rows=max_rows, rule=PREFIX, shared_at=shared.__getitem__
        )
        assert len(prefix) == len(fill)
        assert sum(shared[e] for e in prefix[:-1]) <= sum(shared[e] for e in fill[:-1])
        for start, end in zip([0, *prefix], prefix):
            shard = costs[start:end]
            assert shard
            assert sum(shard) <= budget or sum(1 for c in shard if c) == 1
            assert max_rows is None or len(shard) <= max_rows
