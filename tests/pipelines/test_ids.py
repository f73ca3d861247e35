"""IdCheck: nulls and duplicates found over a stream, exactly, in 8 bytes a row."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.pipelines import ids as ids_mod
from tokenmill.pipelines.ids import IdCheck, hash_ids
from tokenmill.pipelines.reading import check_ids
from tokenmill.pipelines.tokenize import PromptRow


def _check(batches, **kw):
    check = IdCheck()
    for batch in batches:
        check.add(batch)
    rescans = []

    def again():
        rescans.append(1)
        return batches

    check.check(id_column="id", source="in.parquet", id_batches=again, **kw)
    return len(rescans)


def test_unique_ids_pass_without_a_second_pass():
    assert _check([[f"id-{i}" for i in range(1000)], [f"id-{i}" for i in range(1000, 1500)]]) == 0


def test_duplicates_across_batches_listed_in_order_of_recurrence():
    batches = [["a", "b", "c"], ["d", "c", "e"], ["a", "f", "c"]]
    with pytest.raises(
        ValueError,
        match=r"^in\.parquet: 2 duplicate id\(s\) in column 'id': 'c', 'a'; ids must be unique",
    ):
        _check(batches)


def test_long_duplicate_lists_are_cut():
    batches = [[str(i) for i in range(10)], [str(i) for i in range(10)]]
    with pytest.raises(
        ValueError, match=r"10 duplicate id\(s\) .*'0', '1', '2', '3', '4' and 5 more"
    ):
        _check(batches)


def test_nulls_counted_over_all_batches_with_the_first_row():
    with pytest.raises(ValueError, match=r"null in 3 row\(s\) \(first at row 4\); every row"):
        _check([["a", "b", "c"], ["d", None], [None, "a", None]])  # nulls win over duplicates


def test_a_hash_collision_never_rejects_a_job(monkeypatch):
    # every id hashes alike: each one is a suspect, and the exact pass clears them all
    monkeypatch.setattr(ids_mod, "hash_ids", lambda ids: np.zeros(len(ids), np.uint64))
    assert _check([["a", "b"], ["c", "d"]]) == 1
    with pytest.raises(ValueError, match=r"1 duplicate id\(s\) in column 'id': 'b'"):
        _check([["a", "b"], ["c", "b"]])


def test_hashes_are_8_bytes_a_row_and_equal_for_equal_ids():
    hashes = hash_ids(["x", "y", "x"])
    assert hashes.dtype == np.uint64 and hashes.nbytes == 24
    assert hashes[0] == hashes[2] != hashes[1]


def test_check_ids_on_rows_keeps_its_messages():
    rows = [PromptRow(i, rid, error="e") for i, rid in enumerate(["a", "b", "a"])]
    with pytest.raises(ValueError, match=r"data: 1 duplicate id\(s\) in column 'k': 'a'"):
        check_ids(rows, id_column="k", source="data")
    check_ids(rows[:2], id_column="k", source="data")
