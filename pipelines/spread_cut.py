"""The cut of a spread planning that dedupes, run on the workers: windows cut side by
side, the running shard index and the copies across windows settled after.

Where a job dedupes, a window's copies are decided over the whole input
(`dedupe_buckets.py`), so no window is cut before every part has staged. Cut on the
driver one window after another, that cut would be the one step of planning that does
not scale with the workers. Here `fan_out` tasks cut it, each a run of consecutive
windows, with the code the local planner cuts with (`planning.cut_window`), in two
rounds:

1. `cut_windows`, a task per run: each window is read back from the staging, its copies
   split off by the buckets' decisions, its rows ordered and cut. A compute shard's id
   carries its index in the job's run order, which depends on how many shards the
   windows before cut into; so its shards are indexed from 0 within the window and
   their rows are written to the staging, not yet to plan files. A source that a later
   window copies from has its shard written to the staging too (`sources-<window>`),
   and a window's copies wait there with their sources' shards as far as this task
   knows them (`pending-<window>`). It answers with its shards and copy counts.
2. `place_windows`, a task per run, once the driver has added up where each window's
   shards begin: each shard's rows are moved to its plan file under its id in the run
   order, and each window's copies take their sources' shards (from the `sources-`
   files) and make its copy shard.

The plan is the local planner's, file for file: the same windows cut by the same code,
the same shard ids, each copy given the same source shard. The driver holds the
shards' names and sizes only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from tokenmill.faults import fault_point
from tokenmill.pipelines import output as out
from tokenmill.pipelines.dedupe import Copy
from tokenmill.pipelines.dedupe_buckets import BucketedDeduplicator
from tokenmill.pipelines.plan import Shard, moved_shard_id, reindexed
from tokenmill.pipelines.planning import (
    JobPlan,
    PlanningInputs,
    check_rows_read,
    copy_shard_of,
    cut_window,
    job_plan,
    prepare_planning,
    window_table,
)
from tokenmill.pipelines.reading import Window
from tokenmill.pipelines.spec import JobSpec
from tokenmill.pipelines.spill import shard_rows, shard_table

Piece = tuple[int, int, int]  # (window index, first row, rows) as a part staged it

# Cutting tasks per worker: runs of windows differ in how long they take to cut, so a
# worker that finishes early takes another run.
RUNS_PER_WORKER = 2


@dataclass(frozen=True)
class WindowCut:
    """What `cut_windows` made of one window."""

    index: int
    shards: tuple[Shard, ...]  # its compute shards, indexed from 0 within the window
    num_copies: int  # its copies wait in the staging when there are any
    num_rows: int
    num_failed: int


def cut_spread(
    spec: JobSpec,
    inputs: PlanningInputs,
    fan_out: Any,
    pieces: Sequence[Piece],
    num_workers: int,
) -> JobPlan:
    """Cut the staged windows of `pieces` (every part's, sorted) as `fan_out` tasks and
    make the JobPlan `planning.plan_windows` makes of them; the plan files added are
    removed if it fails."""
    runs = window_runs(pieces, num_workers * RUNS_PER_WORKER)
    starts = [0] + [run[0][1] for run in runs[1:]]
    ends = starts[1:] + [inputs.counts.rows]
    settings = (inputs.min_shards, inputs.cut_rule)
    # Another plan's files may have our shard ids (same rows, same id): if this planning
    # fails, it removes only the files it added.
    existing = out.planned_shards(spec.output, spec.storage_options)
    try:
        answers = _map(
            fan_out,
            cut_windows,
            [(spec, inputs.source, *a, *settings) for a in zip(runs, starts, ends)],
        )
        cuts = [cut for answer in answers for cut in answer]  # in window order
        first_index, shards = [], []  # by window: where its shards begin in the run order
        for cut in cuts:
            if cut.index != len(first_index):
                raise RuntimeError(f"planning window {len(first_index)} was not cut")
            first_index.append(len(shards))
            shards += [reindexed(s, len(shards) + s.index) for s in cut.shards]
        num_rows = sum(cut.num_rows for cut in cuts)
        check_rows_read(inputs.source, inputs.counts, num_rows)
        copy_shards = _map(
            fan_out,
            place_windows,
            [(spec, inputs.source, answer, first_index, *settings) for answer in answers],
        )
    except BaseException:
        added = out.planned_shards(spec.output, spec.storage_options) - existing
        out.remove_plan(spec.output, spec.storage_options, shard_ids=added)
        raise
    return job_plan(
        spec,
        inputs,
        shards,
        [shard for placed in copy_shards for shard in placed],  # in their windows' order
        num_rows=num_rows,
        num_failed=sum(cut.num_failed for cut in cuts),
        has_images=False,  # a job reading images is planned on one process
        rows_deduplicated=sum(cut.num_copies for cut in cuts),
    )


def _map(fan_out: Any, fn, args: list[tuple]) -> list:
    return fan_out.map(fn, args) if args else []  # an input of no rows has no windows


def window_runs(pieces: Sequence[Piece], num_runs: int) -> list[list[Piece]]:
    """`pieces` split into at most `num_runs` runs of whole consecutive windows, of
    about equal rows (a window goes to the run whose share holds its middle row)."""
    windows: dict[int, list[Piece]] = {}
    for piece in pieces:
        windows.setdefault(piece[0], []).append(piece)
    total = max(1, sum(rows for _, _, rows in pieces))
    runs: dict[int, list[Piece]] = {}
    for window in windows.values():
        first, rows = window[0][1], sum(p[2] for p in window)
        run = min(num_runs - 1, (2 * first + rows) * num_runs // (2 * total))
        runs.setdefault(run, []).extend(window)
    return [runs[k] for k in sorted(runs)]


def cut_windows(
    spec: JobSpec,
    source: Any,
    pieces: Sequence[Piece],
    first_row: int,
    end_row: int,
    min_shards: int,
    cut_rule: str,
) -> list[WindowCut]:
    """Cut the staged windows of `pieces` (a run of whole windows, rows `first_row` to
    `end_row`), their shards' rows written to the staging (a task on a worker; the
    driver's `min_shards` and cut rule)."""
    inputs = _inputs(spec, source, min_shards, cut_rule)
    dedupe = BucketedDeduplicator(
        spec.output, spec.storage_options, window_rows=spec.plan_window_rows, cut_elsewhere=True
    )
    cuts = []
    for window in staged_windows(spec, pieces, first_row, end_row):

        def stage(shard_id: str, table: pa.Table, index: int = window.index) -> None:
            name = _cut_name(index, shard_id)
            out.write_staged_window(spec.output, name, table, spec.storage_options)

        shards, copies = cut_window(spec, inputs, window, dedupe, first_index=0, write=stage)
        if dedupe.sources_for_later:
            _write_sources(spec, window.index, dedupe.sources_for_later)
        if copies:
            sources = [(c.source_row_index, c.source_shard) for c in copies]
            table = window_table([c.row for c in copies], window, sources)
            out.write_staged_window(
                spec.output, _pending(window.index), table, spec.storage_options
            )
        cuts.append(
            WindowCut(
                index=window.index,
                shards=tuple(shards),
                num_copies=len(copies),
                num_rows=len(window.rows),
                num_failed=sum(1 for r in window.rows if r.error is not None),
            )
        )
        fault_point("plan_window")
        window = shards = copies = None  # not held while the next window is read
    return cuts


def place_windows(
    spec: JobSpec,
    source: Any,
    cuts: Sequence[WindowCut],
    first_index: Sequence[int],
    min_shards: int,
    cut_rule: str,
) -> list[Shard]:
    """Move the staged shards of `cuts` to their plan files, `first_index[w]` the index
    of window w's first shard, and make their windows' copy shards (a task on a
    worker). Returns the copy shards, in their windows' order."""
    inputs = None  # the model is described for copy shards only
    found: dict[int, dict[int, str]] = {}  # window -> its sources for later windows

    def placed(row: int, shard: str | None) -> str:
        """A source's shard id in the run order, from its window's cut."""
        window = row // spec.plan_window_rows
        if shard is None:  # cut by another task
            if window not in found:
                found[window] = _read_sources(spec, window)
            shard = found[window][row]
        return moved_shard_id(shard, first_index[window])

    copy_shards = []
    for cut in cuts:
        for shard in cut.shards:
            out.place_staged_shard(
                spec.output,
                _cut_name(cut.index, shard.shard_id),
                moved_shard_id(shard.shard_id, first_index[cut.index]),
                spec.storage_options,
            )
        if not cut.num_copies:
            continue
        waiting = shard_rows(
            out.read_staged_window(spec.output, _pending(cut.index), spec.storage_options)
        )
        copies = [
            Copy(row, source_row, placed(source_row, shard))
            for row, (source_row, shard) in zip(waiting.rows, waiting.sources)
        ]
        inputs = inputs or _inputs(spec, source, min_shards, cut_rule)
        shard = copy_shard_of(spec, inputs, cut.index, copies)
        # the table `planning` writes for a copy shard: the copies' rows and passthrough
        # as staged, with their sources' shards
        table = shard_table(
            waiting.rows,
            passthrough=waiting.passthrough,
            sources=[(c.source_row_index, c.source_shard) for c in copies],
        )
        out.write_plan_shard(spec.output, shard.shard_id, table, spec.storage_options)
        copy_shards.append(shard)
    return copy_shards


def staged_windows(
    spec: JobSpec, pieces: Iterable[Piece], first_row: int, end_row: int
) -> Iterator[Window]:
    """The staged windows of `pieces` (in input order) read back, each as soon as its
    last piece comes, checked to cover the rows from `first_row` to `end_row` once (the
    input's rows, or a run of whole windows)."""
    window_rows = spec.plan_window_rows
    expected, window, tables = first_row, None, []
    for index, first, rows in pieces:
        if first != expected:
            raise RuntimeError(f"rows {expected}..{first - 1} were not staged")
        if window is None:
            window, tables = Window(index, expected), []
        elif index != window.index:
            raise RuntimeError(f"planning window {window.index} ends at row {first}, not whole")
        read = shard_rows(
            out.read_staged_window(
                spec.output, out.staged_piece_name(index, first), spec.storage_options
            )
        )
        if len(read.rows) != rows:
            raise RuntimeError(
                f"planning window {index} holds {len(read.rows)} rows from row {first}, not {rows}"
            )
        window.rows += read.rows
        if read.passthrough is not None:
            tables.append(read.passthrough)
        expected += rows
        del read  # not kept while the next window's first piece is read
        if expected == min((index + 1) * window_rows, end_row):
            if tables:
                window.passthrough = pa.concat_tables(tables)
            # rebound only once the next window is made: dropped here, not held with it
            complete, window, tables = window, None, []
            yield complete
            del complete
    if window is not None or expected != end_row:
        raise RuntimeError(f"rows {first_row}..{expected - 1} staged, not to row {end_row - 1}")


def _inputs(spec: JobSpec, source: Any, min_shards: int, cut_rule: str) -> PlanningInputs:
    """The model described on this worker, with the driver's cut settings (a worker's
    own `_cut.json` reading could see another planning's)."""
    return replace(prepare_planning(spec, source=source), min_shards=min_shards, cut_rule=cut_rule)


def _cut_name(window: int, shard_id: str) -> str:
    return f"cut-{window:06d}-{shard_id}"


def _pending(window: int) -> str:
    return f"pending-{window:06d}"


def _sources_name(window: int) -> str:
    return f"sources-{window:06d}"


_SOURCES = pa.schema([("row", pa.int64()), ("shard", pa.string())])


def _write_sources(spec: JobSpec, window: int, sources: dict[int, str]) -> None:
    table = pa.table([list(sources), list(sources.values())], schema=_SOURCES)
    out.write_staged_window(spec.output, _sources_name(window), table, spec.storage_options)


def _read_sources(spec: JobSpec, window: int) -> dict[int, str]:
    table = out.read_staged_window(spec.output, _sources_name(window), spec.storage_options)
    return dict(zip(table["row"].to_pylist(), table["shard"].to_pylist()))
