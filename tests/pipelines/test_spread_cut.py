"""The workers' cut of a deduping spread planning, piece by piece (`spread_cut.py`);
tests/pipelines/test_spread_planning.py checks the whole plan against the local one."""

from __future__ import annotations

import pyarrow as pa
import pytest

from tokenmill.pipelines import output as out
from tokenmill.pipelines.spread_cut import window_runs


def test_runs_hold_whole_windows_of_about_equal_rows():
    # windows of 10 rows, window 1 staged by two parts, the last window short
    pieces = [(0, 0, 10), (1, 10, 4), (1, 14, 6), (2, 20, 10), (3, 30, 10), (4, 40, 3)]
    assert window_runs(pieces, 2) == [pieces[:3], pieces[3:]]  # 20 and 23 rows
    # more runs than windows: a window a run
    assert window_runs(pieces, 8) == [pieces[:1], pieces[1:3], *([p] for p in pieces[3:])]
    assert window_runs([], 4) == []


def test_a_staged_shard_placed_twice_is_placed_once(tmp_path):
    # A place_windows task run again after its worker died finds its first moves done.
    output = str(tmp_path / "out")
    table = pa.table({"row_index": [3, 1]})
    out.write_staged_window(output, "cut-000000-00000-abc", table)
    for _ in range(2):
        out.place_staged_shard(output, "cut-000000-00000-abc", "00007-abc")
    assert out.read_plan_shard(output, "00007-abc") == table
    assert not (tmp_path / "out" / out.WINDOWS_DIR / "cut-000000-00000-abc.parquet").exists()
    with pytest.raises(FileNotFoundError):  # neither staged nor placed: lost, said so
        out.place_staged_shard(output, "cut-000001-00000-def", "00008-def")
