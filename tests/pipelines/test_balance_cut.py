from __future__ import annotations

import random
from array import array

import pytest

from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.pipelines.balance_cut import PIECES, balanced_shards
from tokenmill.pipelines.plan import plan_shards, row_cost
from tokenmill.pipelines.prefix_cut import BALANCE, PREFIX, cut_ends
from tokenmill.pipelines.tokenize import PromptRow

MAX_TOKENS = 48
PARAMS = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)]
SYSTEM = list(range(1, 25))  # a chat template's system prompt: every row starts with it
FEW_SHOT = list(range(100, 172))  # a few-shot block the classification rows share
ANSWER = 2  # a classification row generates its label and stops


def _fanout_rows(num_rows: int = 412, seed: int = 7) -> list[PromptRow]:
    """A stand-in for benchmarks/dask_fanout.py's job, as token ids: one row in three
    classifies a review after a shared few-shot block (and stops after ANSWER tokens),
    one summarises a passage of 15 to 160 words, one explains a topic (both run to
    max_tokens). The run order puts each kind together, so the rows that stop early
    are one stretch of it."""
    r = random.Random(seed)
    rows = []
    for i in range(num_rows):
        kind = i % 3
        if kind == 0:
            review = [200 + r.randrange(6)] * 6
            body = [*FEW_SHOT, *review, 300 + i, 301]
        elif kind == 1:
            body = [400, 401, 402, *(500 + r.randrange(36) for _ in range(r.randrange(15, 160)))]
        else:
            body = [600, 700 + r.randrange(8), *[601, 602] * r.randrange(3), 300 + i]
        rows.append(PromptRow(i, f"r{i:04d}", token_ids=array("i", [*SYSTEM, *body])))
    return rows


def _generated(shard) -> int:
    """The tokens a shard's rows generate under the stand-in's stop pattern."""
    return sum(
        ANSWER if r.token_ids[24:96] == array("i", FEW_SHOT) else MAX_TOKENS for r in shard.rows
    )


def test_two_shards_generate_within_15_percent_where_the_prefix_cut_differs_3x():
    rows = _fanout_rows()
    prefix = plan_shards(rows, PARAMS, model_key="m", min_shards=2, rule=PREFIX)
    balance = plan_shards(rows, PARAMS, model_key="m", min_shards=2, rule=BALANCE)
    assert len(prefix) == len(balance) == 2
    # the prefix cut's shards are equal by budget, not by what their rows generate
    low, high = sorted(_generated(s) for s in prefix)
    assert high > 3 * low
    costs = [s.shard.num_tokens for s in prefix]
    assert max(costs) - min(costs) < 0.02 * sum(costs)
    low, high = sorted(_generated(s) for s in balance)
    assert high - low <= 0.15 * high
    # each shard's batch is about as large as the prefix cut's: near half the rows each
    assert sum(s.shard.num_rows for s in balance) == 412
    assert min(s.shard.num_rows for s in balance) >= 0.45 * 412
    costs = [s.shard.num_tokens for s in balance]
    assert max(costs) - min(costs) <= sum(costs) / 2 / PIECES


def test_each_shard_runs_its_rows_in_run_order():
    rows = _fanout_rows()
    shards = plan_shards(rows, PARAMS, model_key="m", min_shards=2, rule=BALANCE)
    order = {r.row_index: i for i, r in enumerate(plan_shards(rows, PARAMS, model_key="m")[0].rows)}
    for s in shards:
        positions = [order[i] for i in s.row_indices]
        assert positions == sorted(positions)
    assert sorted(i for s in shards for i in s.row_indices) == list(range(len(rows)))


def _documents(sizes: list[int], length: int = 20) -> list[PromptRow]:
    """Rows asking questions of documents: document d's rows share its `length` tokens,
    then each asks its own 3-token question."""
    rows = []
    for d, size in enumerate(sizes):
        document = [1000 + d] + [d] * (length - 1)
        for q in range(size):
            i = len(rows)
            rows.append(PromptRow(i, f"d{d}q{q}", token_ids=array("i", document + [7, q, 9])))
    return rows


def _documents_of(shards) -> list[list[int]]:
    return [sorted({r.token_ids[0] - 1000 for r in s.rows}) for s in shards]


def test_documents_stay_whole_and_shards_even():
    # 40 documents x 50 questions on two workers: every document on one worker
    rows = _documents([50] * 40, length=400)
    shards = plan_shards(
        rows, PARAMS, model_key="m", shard_tokens=10**7, min_shards=2, rule=BALANCE
    )
    documents = _documents_of(shards)
    assert len(shards) == 2 and not set(documents[0]) & set(documents[1])
    assert sorted(map(len, documents)) == [20, 20]


def test_a_document_larger_than_a_workers_share_is_split_across_workers():
    rows = _documents([30, 4, 4, 4])
    shards = plan_shards(rows, PARAMS, model_key="m", min_shards=2, rule=BALANCE)
    assert [s.shard.num_rows for s in shards] == [21, 21]
    assert _documents_of(shards)[0][0] == _documents_of(shards)[1][0] == 0


def test_a_long_document_asked_a_few_questions_stays_on_one_worker():
    # Split, its 3,000 tokens would be computed again on the other worker: more than
    # the imbalance that would remove; the short documents are dealt around it.
    long = [PromptRow(q, f"long{q}", token_ids=array("i", [5] * 3000 + [7, q])) for q in range(3)]
    rows = long + [
        PromptRow(3 + r.row_index, r.id, token_ids=r.token_ids) for r in _documents([2] * 100)
    ]
    shards = plan_shards(rows, PARAMS, model_key="m", min_shards=2, rule=BALANCE)
    assert len(shards) == 2
    assert sorted(sum(r.id.startswith("long") for r in s.rows) for s in shards) == [0, 3]
    costs = [s.shard.num_tokens for s in shards]
    assert max(costs) - min(costs) <= 2 * row_cost(rows[-1], MAX_TOKENS)


def test_the_budget_and_row_cap_hold():
    rows = _fanout_rows(200)
    for s in plan_shards(rows, PARAMS, model_key="m", shard_tokens=4_000, rule=BALANCE):
        assert s.shard.num_tokens <= 4_000
    capped = plan_shards(rows, PARAMS, model_key="m", max_rows=30, rule=BALANCE)
    assert max(s.shard.num_rows for s in capped) <= 30
    assert sum(s.shard.num_rows for s in capped) == 200


def test_the_balance_cut_is_the_same_for_any_input_order():
    rows = _fanout_rows(120)
    again = [PromptRow(r.row_index, r.id, token_ids=r.token_ids) for r in reversed(rows)]
    a = plan_shards(rows, PARAMS, model_key="m", min_shards=3, rule=BALANCE)
    b = plan_shards(again, PARAMS, model_key="m", min_shards=3, rule=BALANCE)
    assert [s.shard for s in a] == [s.shard for s in b]
    prefix = plan_shards(rows, PARAMS, model_key="m", min_shards=3)
    assert {s.shard.shard_id for s in a}.isdisjoint(s.shard.shard_id for s in prefix)


def test_a_window_with_no_rows_to_compute_has_no_shards():
    # e.g. every row of a window is a copy of an earlier window's (pipelines/dedupe.py)
    assert plan_shards([], PARAMS, model_key="m", min_shards=2, rule=BALANCE) == []
    assert balanced_shards([], [], num_shards=0, budget=5) == []


def test_the_balance_cut_is_not_a_contiguous_rule():
    with pytest.raises(ValueError, match="not contiguous"):
        cut_ends([1, 2], 3, rule=BALANCE)
    with pytest.raises(ValueError, match="num_shards"):
        balanced_shards([1], [0], num_shards=0, budget=5)
    with pytest.raises(ValueError, match="2 costs but 1 shared"):
        balanced_shards([1, 1], [0], num_shards=1, budget=5)


@pytest.mark.parametrize("seed", range(5))
def test_every_row_once_in_run_order_within_limits(seed):
    r = random.Random(seed)
    for _ in range(300):
        n = r.randint(1, 40)
        costs = [r.choice([1, 2, 3, 5, 8, 13, 40]) for _ in range(n)] + [0] * r.randint(0, 2)
        shared = [0] + [r.randint(0, 30) for _ in range(len(costs) - 1)]
        budget, max_rows = r.randint(40, 120), r.choice([None, None, 3, 9])
        num_shards = len(cut_ends(costs, budget, max_rows=max_rows))
        shards = balanced_shards(
            costs, shared, num_shards=num_shards, budget=budget, max_rows=max_rows
        )
        assert sorted(i for s in shards for i in s) == list(range(len(costs)))
        assert len(shards) >= min(num_shards, sum(1 for c in costs if c))
        for s in shards:
            assert s == sorted(s)
            assert max_rows is None or len(s) <= max_rows
            assert sum(costs[i] for i in s) <= budget or sum(1 for i in s if costs[i]) == 1
