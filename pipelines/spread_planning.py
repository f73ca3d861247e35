"""Planning spread over a cluster's workers: the same plan as `plan_job`, read in parts.

Where planning's time goes: reading, templating and tokenizing every row. Where its
state crosses rows: a row's index (its position id, the window it is planned in), the
ids that must be unique over the input (`ids.py`), duplicates found across windows
(`dedupe.py`) and a shard's running index over the job. The parts do the first and
keep none of the state; what crosses rows is settled from small answers, and the rest
is the very loop the local planner runs, so the plan is exactly the local one, file
for file, by construction:

1. The driver opens the source and describes the model (`prepare_planning`): a bad
   file, a missing column or a bad option fails here, before any task starts. It
   splits the input (`connectors/partitions.py`): Parquet into runs of row groups,
   JSON Lines into byte ranges, other files whole (delimited text may quote newlines).
2. Counting, one task per part: a partition's rows are numbered once the rows before it
   are known. Parquet footers say; text partitions are counted (JSON Lines ranges by
   their non-blank lines, without parsing). The driver adds them up: each partition's
   first row index, and its first line in its file (for bad lines' messages).
3. Reading, one task per part (`read_part`): a part reads only its partitions, then
   templates and tokenizes their rows as the local planner does (`reading.
   tokenized_windows`), and stages them by planning window - a window crossing a
   partition's end is staged in pieces, `OUTPUT/_windows/<window>-<first row>.parquet`.
   Its ids go to hash buckets (`id_buckets.py`); it returns its pieces' sizes and its
   nulls' count.
4. Ids and copies, one task per bucket: the repeated ids of a bucket, compared exactly
   (a null or a repeated id fails planning with the local planner's message: the
   driver never holds an id), then the bucket's duplicate rows, decided as `dedupe.py`
   decides (`dedupe_buckets.py`); the parts wrote their rows' digests to buckets too.
5. The cut: the local planner's window loop (`plan_windows`) over the staged windows
   in input order, a window's pieces read back together: order, cut, plan files, copy
   shards, running shard index. Where the job dedupes, the workers cut it (a run of
   windows a task, the running index and the copies across runs settled after:
   `spread_cut.py`), a window's copies read from the buckets' decisions. Where no row
   can be a copy (no dedupe, or answers sampled without a seed), the driver cuts it
   while the parts still stage: one window in memory at a time, and across windows
   the shards' names.

Planned here instead, saying why in a log line: per-row sampling params (an OpenAI
batch file, a `json_schema_column`: the job's params table grows in input order and its
indices are in the shard ids), image rows (a staged row does not carry its images'
content hashes), a `limit` (the first rows of the input in order), and a job planned
for an already loaded LLM.

Where no row can be a copy, the cut does not wait for step 4: the input is read in
`PARTS_PER_WORKER` parts a worker, answered in input order (`FanOut.imap`), and a window
is cut as soon as the parts holding its rows are in, while later parts still stage, so
what is left to cut after the last part is a part's share. The ids are checked once the
last part is in, and a null or repeated id then removes the plan files cut, as the local
planner does. A job that may copy rows waits for every part and its buckets (a window's
copies are decided over the whole input), then the workers cut.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pyarrow as pa

from tokenmill.connectors import redact_url
from tokenmill.connectors.batches import BlankTally
from tokenmill.connectors.fingerprint import first_difference
from tokenmill.connectors.partitions import (
    MIN_RANGE_BYTES,
    Partition,
    PartitionCount,
    count_partition,
    iter_partition,
    split_source,
)
from tokenmill.pipelines import output as out
from tokenmill.pipelines.dedupe import is_deterministic
from tokenmill.pipelines.dedupe_buckets import DigestBuckets, bucket_copies
from tokenmill.pipelines.id_buckets import (
    BucketAnswer,
    IdBuckets,
    bucket_duplicates,
    merge_answers,
    probe_hash,
)
from tokenmill.pipelines.ids import duplicate_ids_message, null_ids_message
from tokenmill.pipelines.planning import (
    JobPlan,
    PlanningInputs,
    plan_windows,
    prepare_planning,
    read_job_windows,
)
from tokenmill.pipelines.reading import Window, tokenized_windows, window_batches
from tokenmill.pipelines.reasoning import raw_lines
from tokenmill.pipelines.spec import JobSpec
from tokenmill.pipelines.spill import shard_table
from tokenmill.pipelines.spread_cut import cut_spread, staged_windows

log = logging.getLogger(__name__)

T = TypeVar("T")

# Ids per hash bucket, about: one bucket task holds its ids as a table.
BUCKET_ROWS = 1 << 20
# Reading parts per worker where the driver cuts while the parts stage: it cuts a part's
# windows while later parts run, so what it cuts after the last part is about
# 1 / (workers x this) of the input (each part also describes the model once).
PARTS_PER_WORKER = 4


class FanOut(Protocol):
    """Runs calls on a cluster's workers (`flows/runners.py` has Dask's)."""

    num_parts: int  # how many parts to split the reading into: one per worker

    def map(self, fn: Callable[..., T], args: Sequence[tuple]) -> list[T]:
        """`[fn(*a) for a in args]`, each call a task; the first error raised, as raised."""
        ...

    def imap(self, fn: Callable[..., T], args: Sequence[tuple]) -> Generator[T, None, None]:
        """`map`'s answers in order, each as soon as it and those before it are done;
        the first error raised as soon as any call fails; closed, it cancels the calls
        not yet answered."""
        ...


@dataclass(frozen=True)
class Slice:
    """A partition with where its rows begin: its first row index in the input, and
    the lines of its file before it."""

    partition: Partition
    first_row: int
    first_line: int
    num_rows: int  # as counted before reading


@dataclass(frozen=True)
class PartSummary:
    """What a part read: the pieces it staged, and what it met in its partitions."""

    part: int
    pieces: tuple[tuple[int, int, int], ...]  # (window index, first row, rows) staged
    slice_rows: tuple[int, ...]  # rows read per slice given (the input changed if not counted)
    rows_skipped_blank: int
    num_nulls: int
    first_null: int | None
    fingerprint: list[dict[str, Any]]  # the input's files as the part found them
    probe_hash: int  # `id_buckets.probe_hash`: parts that disagree would bucket apart


def spread_refusal(spec: JobSpec, inputs: PlanningInputs) -> str | None:
    """Why this job cannot be planned spread over workers (None: it can)."""
    if spec.is_openai_batch:
        return "an OpenAI batch file's lines carry their own sampling params"
    if spec.json_schema_column is not None:
        return f"rows carry their own JSON schema ({spec.json_schema_column!r})"
    if inputs.images is not None:
        return "the job reads images"
    if spec.limit is not None:
        return f"a limit ({spec.limit}) takes the input's first rows in order"
    return None


def plan_job_spread(
    spec: JobSpec,
    *,
    fan_out: FanOut,
    min_shards: int = 1,
    min_range_bytes: int = MIN_RANGE_BYTES,
) -> JobPlan:
    """`plan_job`, with reading, templating, tokenizing and the id checks run as
    `fan_out` tasks over partitions of the input.

    Args:
        spec: the job.
        fan_out: runs the parts on the workers; `fan_out.num_parts` parts.
        min_shards: as for `plan_job`.
        min_range_bytes: the shortest byte range a JSON Lines file is split into.

    Returns:
        The JobPlan `plan_job(spec, min_shards=min_shards)` returns, with the same plan
        files.

    Raises:
        ValueError: bad input, as `plan_job` raises it (a part's error is raised as is).
    """
    inputs = prepare_planning(spec, min_shards=min_shards)
    refusal = spread_refusal(spec, inputs)
    if refusal is not None:
        log.info("planning on this process, not spread over workers: %s", refusal)
        return plan_windows(spec, inputs, read_job_windows(spec, inputs))
    num_parts = max(1, fan_out.num_parts)
    waits = _cut_waits(spec, inputs)
    if waits is not None:
        log.info("the cut waits for every reading part: %s", waits)
    read_parts = num_parts if waits is not None else num_parts * PARTS_PER_WORKER
    source = inputs.source
    partitions, whole = split_source(source, read_parts, min_range_bytes=min_range_bytes)
    if whole is not None:
        log.info("planning spread over workers by file: %s", whole)
    out.remove_staged_windows(spec.output, spec.storage_options)  # a killed run's
    try:
        slices = _slices(fan_out, source, partitions, num_parts)
        num_rows = sum(s.num_rows for s in slices)
        num_buckets = max(num_parts, -(-num_rows // BUCKET_ROWS))
        inputs.counts.rows = num_rows
        if waits is None:
            work = _assign(slices, read_parts)
            windows = _streamed_windows(spec, inputs, work, fan_out, num_buckets)
            try:
                plan = plan_windows(spec, inputs, windows)
            finally:
                windows.close()  # the parts not yet run are cancelled before the staging goes
        else:
            plan = _plan_after_every_part(spec, inputs, fan_out, slices, num_parts, num_buckets)
    except BaseException:
        _remove_staging_after_failure(spec)
        raise
    out.remove_staged_windows(spec.output, spec.storage_options)
    return plan


def _plan_after_every_part(
    spec: JobSpec,
    inputs: PlanningInputs,
    fan_out: FanOut,
    slices: list[Slice],
    num_parts: int,
    num_buckets: int,
) -> JobPlan:
    """Every part staged, the ids and copies decided in buckets, then the cut on the
    workers."""
    source = inputs.source
    work = _assign(slices, num_parts)
    summaries = fan_out.map(
        read_part, [(spec, source, part, given, num_buckets) for part, given in work]
    )
    _check_parts(summaries, [given for _, given in work], inputs.fingerprint)
    _check_ids(spec, source.uri, summaries, fan_out, num_buckets)
    inputs.counts.blank = sum(s.rows_skipped_blank for s in summaries)
    pieces = sorted(p for s in summaries for p in s.pieces)
    return cut_spread(spec, inputs, fan_out, pieces, num_parts)


def _remove_staging_after_failure(spec: JobSpec) -> None:
    """The staging removed, where it can be: a part cancelled while it ran goes on
    writing there (Dask does not stop a running task), so its files may outlive this
    planning; the next planning of the output removes them before it reads. The error
    that failed planning is the one raised, not this."""
    try:
        out.remove_staged_windows(spec.output, spec.storage_options)
    except OSError as err:
        log.warning(
            "staged windows under %s left for the next planning to remove (a part still "
            "writes there): %s",
            redact_url(spec.output),
            err,
        )


def _cut_waits(spec: JobSpec, inputs: PlanningInputs) -> str | None:
    """Why the cut cannot start before every part has staged (None: it can): a window's
    copies are decided over the whole input (its rows' sources may be staged by any
    part), so a job that may copy rows waits for every part and its buckets."""
    if spec.dedupe and any(is_deterministic(p) for p in inputs.params.params):
        return "rows that repeat are computed once (dedupe), decided over the whole input"
    return None


def _streamed_windows(
    spec: JobSpec,
    inputs: PlanningInputs,
    work: Sequence[tuple[int, Sequence[Slice]]],
    fan_out: FanOut,
    num_buckets: int,
) -> Iterator[Window]:
    """The staged windows in input order, each as soon as the parts holding its rows
    have staged it, while later parts still run; the ids are checked once the last part
    is in (a failure there removes the plan files cut, as `plan_windows` does)."""
    uri, given = inputs.source.uri, [slices for _, slices in work]
    totals = _PartTotals()

    def pieces() -> Iterator[tuple[int, int, int]]:
        answers = fan_out.imap(
            read_part,
            [(spec, inputs.source, part, slices, num_buckets) for part, slices in work],
        )
        try:
            for summary, slices in zip(answers, given):
                _check_parts([summary], [slices], inputs.fingerprint)
                totals.add(summary)
                if not totals.num_nulls:  # a row of a null id is not staged: cut no more
                    yield from summary.pieces
        finally:
            answers.close()
        totals.check_nulls(spec, uri)  # all parts in: the local planner's count

    yield from staged_windows(spec, pieces(), 0, inputs.counts.rows)
    totals.check(spec, uri, fan_out, num_buckets)
    inputs.counts.blank = totals.blank


@dataclass
class _PartTotals:
    """What the driver keeps of the parts' answers as they come: sums, not lists."""

    blank: int = 0
    num_nulls: int = 0
    first_null: int | None = None
    probe_hashes: frozenset[int] = frozenset()

    def add(self, summary: PartSummary) -> None:
        self.blank += summary.rows_skipped_blank
        self.num_nulls += summary.num_nulls
        if summary.first_null is not None and (
            self.first_null is None or summary.first_null < self.first_null
        ):
            self.first_null = summary.first_null
        self.probe_hashes |= {summary.probe_hash}

    def check_nulls(self, spec: JobSpec, uri: str) -> None:
        if self.num_nulls:
            raise ValueError(null_ids_message(uri, spec.id_column, self.num_nulls, self.first_null))

    def check(self, spec: JobSpec, uri: str, fan_out: FanOut, num_buckets: int) -> None:
        """`_check_parts`' hash check and `_check_ids`, on the sums."""
        if len(self.probe_hashes) > 1:
            raise RuntimeError(_HASHES_DIFFER)
        _check_duplicate_ids(spec, uri, fan_out, num_buckets)


def _slices(fan_out: FanOut, source: Any, partitions: list[Partition], num_parts: int):
    """The partitions with their first rows and lines, counting those that need it as
    `fan_out` tasks (none for Parquet)."""
    to_count = [i for i, p in enumerate(partitions) if p.num_rows is None]
    counts: dict[int, PartitionCount] = {
        i: PartitionCount(p.num_rows, 0) for i, p in enumerate(partitions) if i not in to_count
    }
    if to_count:
        groups = [g for g in (to_count[k::num_parts] for k in range(num_parts)) if g]
        answers = fan_out.map(
            count_partitions, [(source, [partitions[i] for i in g]) for g in groups]
        )
        for group, answer in zip(groups, answers):
            counts.update(zip(group, answer))
    slices, first_row, first_line, file = [], 0, 0, None
    for i, partition in enumerate(partitions):
        if partition.file != file:
            first_line, file = 0, partition.file
        slices.append(Slice(partition, first_row, first_line, counts[i].rows))
        first_row += counts[i].rows
        first_line += counts[i].lines
    return slices


def count_partitions(source: Any, partitions: Sequence[Partition]) -> list[PartitionCount]:
    """Each partition's rows, blank records and lines (a task on a worker)."""
    return [count_partition(source, p) for p in partitions]


def _assign(slices: list[Slice], num_parts: int) -> list[tuple[int, list[Slice]]]:
    """(part, its slices): runs of consecutive slices of about equal rows (a slice goes
    to the part whose share holds its middle row), so a part stages few pieces; parts
    with nothing to read are not run."""
    total = max(1, sum(s.num_rows for s in slices))
    work: dict[int, list[Slice]] = {}
    for s in slices:
        part = min(num_parts - 1, (2 * s.first_row + s.num_rows) * num_parts // (2 * total))
        work.setdefault(part, []).append(s)
    return sorted(work.items())


def read_part(
    spec: JobSpec, source: Any, part: int, slices: Sequence[Slice], num_buckets: int
) -> PartSummary:
    """Read, template and tokenize the rows of `slices` and stage them by window; put
    their ids in hash buckets (a task on a worker: the model is described, not loaded)."""
    inputs = prepare_planning(spec, source=source)
    ids = IdBuckets(spec.output, spec.storage_options, part=part, num_buckets=num_buckets)
    digests = DigestBuckets(
        spec.output,
        spec.storage_options,
        part=part,
        num_buckets=num_buckets,
        params=inputs.params.params,
    )
    pieces, slice_rows, blank = [], [], 0
    for given in slices:
        blanks = BlankTally()
        read = [0]
        batches = _counted(
            iter_partition(source, given.partition, first_line=given.first_line, blanks=blanks),
            read,
        )
        windows = tokenized_windows(
            window_batches(batches, first_row=given.first_row, window_rows=spec.plan_window_rows),
            spec,
            inputs.tokenizer,
            ids=ids,
            max_model_len=inputs.max_model_len,
            params=inputs.params,
            pooling=inputs.pooling,
            adapters=inputs.adapters,
            images=inputs.images,
        )
        for window in windows:
            table = shard_table(window.rows, passthrough=window.passthrough)
            name = out.staged_piece_name(window.index, window.start)
            out.write_staged_window(spec.output, name, table, spec.storage_options)
            pieces.append((window.index, window.start, len(window.rows)))
            if spec.dedupe:
                digests.add(window.rows, raw_lines(inputs.reasoning, window))
        slice_rows.append(read[0])
        blank += blanks.take_all()
    ids.close()
    digests.close()
    return PartSummary(
        part,
        tuple(pieces),
        tuple(slice_rows),
        blank,
        ids.num_nulls,
        ids.first_null,
        inputs.fingerprint,
        probe_hash(),
    )


def _counted(batches: Iterator[pa.RecordBatch], read: list[int]) -> Iterator[pa.RecordBatch]:
    for batch in batches:
        read[0] += batch.num_rows
        yield batch


def _check_parts(
    summaries: Sequence[PartSummary],
    work: Sequence[Sequence[Slice]],
    fingerprint: list[dict[str, Any]],
) -> None:
    """The parts must have read the input the driver opened and counted: a file that
    changed under them fails (RuntimeError), as do parts that would bucket ids apart."""
    for summary, slices in zip(summaries, work):
        change = first_difference(fingerprint, summary.fingerprint)
        if change is not None:
            raise RuntimeError(
                f"the input changed while it was planned ({change}): plan the job again"
            )
        counted = tuple(s.num_rows for s in slices)
        if summary.slice_rows != counted:
            raise RuntimeError(
                f"part {summary.part} read {sum(summary.slice_rows)} rows where "
                f"{sum(counted)} were counted: the input changed while it was planned"
            )
    if len({s.probe_hash for s in summaries}) > 1:
        raise RuntimeError(_HASHES_DIFFER)


_HASHES_DIFFER = (
    "the workers hash ids differently (another polars version on some): the ids "
    "cannot be checked in buckets; give every worker the same environment"
)


def _check_ids(
    spec: JobSpec,
    uri: str,
    summaries: Sequence[PartSummary],
    fan_out: FanOut,
    num_buckets: int,
) -> None:
    """Null and repeated ids fail planning with the local planner's message; with ids
    that pass, each bucket's copies are decided (`dedupe_buckets.py`)."""
    num_nulls = sum(s.num_nulls for s in summaries)
    if num_nulls:
        first = min(s.first_null for s in summaries if s.first_null is not None)
        raise ValueError(null_ids_message(uri, spec.id_column, num_nulls, first))
    _check_duplicate_ids(spec, uri, fan_out, num_buckets)


def _check_duplicate_ids(spec: JobSpec, uri: str, fan_out: FanOut, num_buckets: int) -> None:
    """Repeated ids fail planning with the local planner's message (one task per
    bucket), and where they pass each bucket's copies are decided."""
    answers = fan_out.map(
        check_bucket,
        [
            (spec.output, spec.storage_options, bucket, spec.plan_window_rows, spec.dedupe)
            for bucket in range(num_buckets)
        ],
    )
    num_duplicates, listed = merge_answers([ids for ids, _ in answers])
    if num_duplicates:
        raise ValueError(duplicate_ids_message(uri, spec.id_column, num_duplicates, listed))


def check_bucket(
    output: str, storage_options: Any, bucket: int, window_rows: int, dedupe: bool
) -> tuple[BucketAnswer, int]:
    """One bucket's repeated ids, and its copies decided when the job dedupes (a task on
    a worker; the copies are not decided where ids repeat: planning fails)."""
    answer = bucket_duplicates(output, storage_options, bucket)
    if answer.num_duplicates or not dedupe:
        return answer, 0
    return answer, bucket_copies(output, storage_options, bucket, window_rows)
