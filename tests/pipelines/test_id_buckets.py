"""Ids checked in hash buckets by parts that each saw some rows give IdCheck's verdict
on all of them: the same count of repeated ids, the same first ones in the same order,
the same nulls; buffers are written as they fill."""

from __future__ import annotations

import random

import pytest

from tokenmill.pipelines import id_buckets
from tokenmill.pipelines.id_buckets import IdBuckets, bucket_duplicates, merge_answers
from tokenmill.pipelines.ids import IdCheck, duplicate_ids_message, null_ids_message


def _ids(num_rows: int, repeats: dict[int, int]) -> list[str | None]:
    """Unique ids, but row `r` takes row `repeats[r]`'s id."""
    ids = [f"id-{i}" for i in range(num_rows)]
    for row, earlier in repeats.items():
        ids[row] = ids[earlier]
    return ids


def _local_message(ids: list[str | None]) -> str | None:
    check = IdCheck()
    check.add(ids, 0)
    try:
        check.check(id_column="key", source="in.jsonl", id_batches=lambda: [ids])
    except ValueError as e:
        return str(e)
    return None


def _bucketed_message(tmp_path, ids, cuts, num_buckets) -> str | None:
    """Parts read rows [cuts[k], cuts[k + 1]), in batches of 10, out of order."""
    parts = []
    for part, (begin, end) in enumerate(zip(cuts, cuts[1:])):
        buckets = IdBuckets(str(tmp_path), None, part=part, num_buckets=num_buckets)
        for start in range(begin, end, 10):
            buckets.add(ids[start : min(end, start + 10)], start)
        buckets.close()
        parts.append(buckets)
    nulls = sum(p.num_nulls for p in parts)
    if nulls:
        first = min(p.first_null for p in parts if p.first_null is not None)
        return null_ids_message("in.jsonl", "key", nulls, first)
    answers = [bucket_duplicates(str(tmp_path), None, b) for b in range(num_buckets)]
    count, listed = merge_answers(answers)
    return duplicate_ids_message("in.jsonl", "key", count, listed) if count else None


@pytest.mark.parametrize("num_buckets", [1, 3, 8])
def test_repeats_are_found_as_idcheck_finds_them(tmp_path, monkeypatch, num_buckets):
    monkeypatch.setattr(id_buckets, "FLUSH_ROWS", 16)  # several files per bucket
    randomly = random.Random(num_buckets)
    repeats = {row: randomly.randrange(row) for row in randomly.sample(range(1, 400), 9)}
    repeats[399] = repeats[398] = 5  # an id three times
    ids = _ids(400, repeats)
    local = _local_message(ids)
    assert local is not None and " and " in local  # more repeated ids than are listed
    cuts = [0, 137, 138, 290, 400]
    assert _bucketed_message(tmp_path / "a", ids, cuts, num_buckets) == local
    assert _bucketed_message(tmp_path / "b", _ids(400, {}), cuts, num_buckets) is None


def test_nulls_are_counted_with_the_first(tmp_path):
    ids = _ids(100, {})
    ids[71] = ids[33] = ids[34] = None
    local = _local_message(ids)
    assert "is null in 3 row(s) (first at row 33)" in local
    assert _bucketed_message(tmp_path, ids, [0, 50, 100], 2) == local
    assert not (tmp_path / "_windows").exists() or not any((tmp_path / "_windows").rglob("*"))
