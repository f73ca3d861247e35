"""The driver of a spread plan keeps shard metadata only: while the staged windows are
cut (by the driver as the parts stage, or by the workers where the job dedupes), what
it holds grows by a few objects per shard, never by the rows cut (a kept row is several
objects: its PromptRow, token ids, id). That is what keeps its RSS flat from one to ten
million rows; `benchmarks/planner_scale.py` measures the RSS. Here the workers' tasks
run in the driver's process, so they are held to the same."""

from __future__ import annotations

import gc
import json

import pytest

from tokenmill.pipelines import spread_cut, spread_planning
from tokenmill.pipelines.spec import JobSpec

NUM_ROWS = 4000
WINDOW = 200


class InProcessFanOut:
    """The parts run one after another in this process (the driver is the subject)."""

    num_parts = 2

    def map(self, fn, args):
        return [fn(*a) for a in args]

    def imap(self, fn, args):
        for a in args:
            yield fn(*a)


# deduped: cut by the workers after every part; not: cut while the parts stage
@pytest.mark.parametrize("dedupe", [True, False])
def test_the_driver_holds_no_rows_of_the_windows_it_has_cut(
    tmp_path, tiny_model_dir, monkeypatch, dedupe
):
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "prompt": f"question {i} on topic {i % 13}"}) + "\n"
            for i in range(NUM_ROWS)
        )
    )
    live: list[int] = []  # objects alive each time the driver asks for the next window
    staged_windows = spread_cut.staged_windows

    def counted(*args):
        for window in staged_windows(*args):
            yield window
            del window
            gc.collect()
            live.append(len(gc.get_objects()))

    monkeypatch.setattr(spread_planning, "staged_windows", counted)
    monkeypatch.setattr(spread_cut, "staged_windows", counted)
    spec = JobSpec(
        str(src),
        str(tmp_path / "out"),
        model=str(tiny_model_dir),
        id_column="id",
        plan_window_rows=WINDOW,
        shard_tokens=2000,
        max_tokens=4,
        dedupe=dedupe,
    )
    plan = spread_planning.plan_job_spread(spec, fan_out=InProcessFanOut(), min_range_bytes=1)
    assert plan.num_rows == NUM_ROWS
    assert len(live) == NUM_ROWS // WINDOW
    # From the fifth window on (imports and caches settled), 15 windows of 200 rows cut:
    # a row kept would add 3,000 objects at least; each shard's metadata adds a few.
    cut_rows = (len(live) - 5) * WINDOW
    grown = live[-1] - live[4]
    assert grown < cut_rows // 10, (grown, len(plan.shards), live)
