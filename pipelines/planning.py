"""Planning a job: read, template, tokenize and shard - everything before compute.

The model is described (`tokenmill.engine.describe_model`: its directory, context
length, chat template, tokenizer and weights hash), never loaded, so every input
problem - a bad file, a missing column, duplicate ids, a system prompt for a model
without a chat template, an input that changed under results being resumed (its
fingerprint, `connectors/fingerprint.py`) - fails here, before any weights are read. Each shard's rows
are written to `OUTPUT/_plan/<shard_id>.parquet` as its window is planned; a JobPlan
holds only shard names and sizes, so what a flow ships to its workers and what any
step keeps in memory is bounded by a planning window, not by the dataset.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow as pa

from tokenmill.connectors import open_source, redact_url
from tokenmill.connectors.batches import ReadCounts
from tokenmill.connectors.fingerprint import first_difference
from tokenmill.engine import (
    EngineConfig,
    ModelDescription,
    PoolingTokenizer,
    SamplingParams,
    describe_model,
    embedding_size,
    model_names,
    read_pooling_config,
)
from tokenmill.faults import fault_point
from tokenmill.pipelines import output as out
from tokenmill.pipelines.adapters import JobAdapter, describe_job_adapters, lora_requests
from tokenmill.pipelines.dedupe import Copy, Deduplicator, copy_shard
from tokenmill.pipelines.images import RowImageReader, image_reader, openai_image_reader
from tokenmill.pipelines.plan import Shard, job_id, plan_shards
from tokenmill.pipelines.pooling import (
    POOLING_JOB_TASKS,
    PoolingInputs,
    PoolingLayout,
)
from tokenmill.pipelines.prefix_cut import BALANCE, FILL, PREFIX
from tokenmill.pipelines.reading import Window, read_windows
from tokenmill.pipelines.reasoning import (
    check_reasoning_effort,
    job_reasoning_format,
    raw_lines,
    several_completions_refusal,
)
from tokenmill.pipelines.results import DUPLICATE_OF, extra_columns
from tokenmill.pipelines.spec import ConstraintCheck, JobSpec, ParamsTable
from tokenmill.pipelines.spill import shard_table
from tokenmill.pipelines.templating import required_columns, text_columns
from tokenmill.pipelines.tokenize import PromptRow

log = logging.getLogger(__name__)


@dataclass
class JobPlan:
    """A planned job: its shards' names and sizes. Each shard's rows (tokens, ids,
    passthrough columns) are in its plan file, `OUTPUT/_plan/<shard_id>.parquet`."""

    spec: JobSpec
    job_id: str
    model_name: str
    weights_hash: str
    params: list[SamplingParams]  # the job's distinct sampling params; rows index them
    shards: list[Shard]
    num_rows: int = 0
    num_failed: int = 0  # rows that failed before compute (bad prompt, too long, ...)
    # Every record the input's reader saw (within `limit`): the rows above and the blank
    # records it skipped (an empty CSV record, a JSON Lines line of whitespace). Planned
    # again from the input by every run, so a resumed job's ledger counts them too.
    rows_read: int = 0
    rows_skipped_blank: int = 0
    # The input files' URLs, sizes and versions when planned (connectors/fingerprint.py).
    input_fingerprint: list[dict[str, Any]] = field(default_factory=list)
    # The LoRA adapters rows may run with, in lora index order from 1 (pipelines/adapters.py).
    adapters: list[JobAdapter] = field(default_factory=list)
    # A pooling job's results layout: its embedding size and dtype, its label names.
    layout: PoolingLayout | None = None
    # Rows that take an identical earlier row's answer (pipelines/dedupe.py); they are in
    # the copy shards, which come after every compute shard in `shards`.
    rows_deduplicated: int = 0
    # Where the planner found the model's files (a forecast sizes the engine from them).
    model_dir: str | None = None
    min_shards: int = 1  # the fewest shards a window was cut into, rows allowing
    # How the weights run, as the ledger names it: the job's quantization option, or the
    # checkpoint's own (ModelDescription.quantization); None: float weights.
    quantization: str | None = None
    cut_rule: str = PREFIX  # how each window was cut (`prefix_cut.py`, `balance_cut.py`)
    # Rows run with images (an image column, or OpenAI batch lines with image parts): the
    # results then count each row's image tokens.
    has_images: bool = False
    # The id of an image's soft tokens in the rows' token ids (None: the model takes no
    # images): the planner expanded every image to them, so they count its image tokens.
    image_token_id: int | None = None
    # The rows' answers are split into reasoning and final text (`pipelines/reasoning.py`):
    # the model's reasoning format, or None.
    reasoning_format: str | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def empty_warning(self) -> str | None:
        """What to warn of when the input held no records, so the job has no rows (None
        when it has rows: an input that is not empty never plans no rows)."""
        if self.num_rows:
            return None
        blank = f", {self.rows_skipped_blank:,} blank" if self.rows_skipped_blank else ""
        return f"{redact_url(self.spec.input)} is empty (no records{blank}): the job has no rows"

    @property
    def lora_requests(self) -> list | None:
        """Each lora index's LoRARequest (None at 0: the base model); None without
        adapters."""
        return lora_requests(self.adapters) if self.adapters else None

    @property
    def result_extras(self) -> tuple[str, ...]:
        """The optional result columns every part of this job has (`results.py`)."""
        extras = extra_columns(
            self.params,
            has_adapters=bool(self.adapters),
            has_images=self.has_images,
            reasons_apart=self.reasoning_format is not None,
        )
        return (*extras, DUPLICATE_OF) if self.rows_deduplicated else extras


def plan_job(spec: JobSpec, *, llm: Any = None, min_shards: int = 1) -> JobPlan:
    """Read, template, tokenize and shard a job - everything before compute.

    The source is opened and validated first (missing file, corrupt file, bad URL,
    missing column -> `SourceError` naming the file), then the model is described (no
    weights are loaded), then the rows are read and tokenized window by window
    (`spec.plan_window_rows`); each window is cut into shards whose rows are written
    to `OUTPUT/_plan/` before the next window is read. If planning fails (e.g.
    duplicate ids, found after the last window), the plan files it added are removed.

    Args:
        spec: the job.
        llm: an already loaded LLM to plan for (its model, tokenizer and context
            length); default: `spec.model`, described from its files.
        min_shards: cut each window into at least this many shards where its rows allow
            (one per worker that will run them: a flow on N workers asks for N). A job
            resumed over parts of an earlier run keeps the cut that run recorded
            (`OUTPUT/_cut.json`), so it plans the same shards whatever runs it now.

    Returns:
        The JobPlan.

    Raises:
        ValueError: bad input (SourceError), duplicate or null ids, bad options.
    """
    inputs = prepare_planning(spec, llm=llm, min_shards=min_shards)
    return plan_windows(spec, inputs, read_job_windows(spec, inputs))


@dataclass
class PlanningInputs:
    """What every window of a job is planned with: the opened source, the model's
    description and tokenizer, and the job-level settings checked before any row."""

    source: Any
    fingerprint: list[dict[str, Any]]
    min_shards: int
    cut_rule: str
    model: ModelDescription
    tokenizer: Any
    max_model_len: int
    adapters: list[JobAdapter]
    pooling: PoolingInputs | None
    images: RowImageReader | None
    reasoning: str | None
    params: ParamsTable
    quantization: str | None  # JobPlan.quantization
    counts: ReadCounts = field(default_factory=ReadCounts)


def prepare_planning(
    spec: JobSpec, *, llm: Any = None, min_shards: int = 1, source: Any = None
) -> PlanningInputs:
    """Open and check the source, describe the model and check the job-level settings:
    every problem that is not a row's fails here, before any row is read (ValueError).

    `source`: the job's source as another process opened it (a part of a spread
    planning reads with the driver's, so it settles no column types again)."""
    if source is None:
        source = _open_job_source(spec)
    fingerprint = source.fingerprint()
    _check_input_unchanged(spec, fingerprint)
    min_shards, cut_rule = _cut(spec, min_shards)
    model, tokenizer, max_model_len = _model_for(spec, llm)
    # An adapter that is missing or does not fit the model fails the job here.
    adapters = _adapters_for(spec, model, llm)
    pooling = _pooling_for(spec, model, tokenizer, max_model_len, llm)
    images = _images_for(spec, model, tokenizer)
    # A job-level constraint that cannot be compiled fails the job here, before any rows.
    reasoning = job_reasoning_format(task=spec.task, raw=spec.raw, tokenizer=tokenizer)
    single_reason = several_completions_refusal(reasoning)
    if single_reason is not None and getattr(spec.sampling, "n", 1) > 1:
        raise ValueError(single_reason)  # the job's own n: a usage error before any row
    # A line's own n > 1 on such a job is that line's error row (ParamsTable.for_row).
    params = ParamsTable(
        spec.sampling,
        check=_constraint_check(model, tokenizer, llm),
        max_n=spec.max_n,
        single_reason=single_reason,
    )
    if spec.reasoning_effort is not None:  # the job's: a usage error before any row
        check_reasoning_effort(tokenizer, spec.reasoning_effort)
    return PlanningInputs(
        source=source,
        fingerprint=fingerprint,
        min_shards=min_shards,
        cut_rule=cut_rule,
        model=model,
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        adapters=adapters,
        pooling=pooling,
        images=images,
        reasoning=reasoning,
        params=params,
        quantization=_quantization(spec, model, llm),
    )


def _open_job_source(spec: JobSpec) -> Any:
    """The job's input, opened and checked (SourceError naming the file or column)."""
    template = spec.template_spec
    columns = None
    queries = [spec.query_column] if spec.query_column else []
    if not spec.is_openai_batch:
        columns = [*required_columns(template), *queries, *spec.passthrough]
        columns += [spec.json_schema_column] if spec.json_schema_column else []
        columns += [spec.lora_column] if spec.lora_column else []
        columns += [spec.image_column] if spec.image_column else []
    return open_source(
        spec.input,
        format=spec.format,
        storage_options=spec.storage_options,
        columns=list(dict.fromkeys(columns)) if columns is not None else None,
        on_bad_line="skip_row",
        text_columns=[*text_columns(template), *queries],
        encoding=spec.encoding,
        on_decode_error=spec.on_decode_error,
        decode_columns=[*required_columns(template), *queries],
        csv_delimiter=spec.csv_delimiter,
        csv_quote=spec.csv_quote,
        json_text_columns=[spec.json_schema_column] if spec.json_schema_column else [],
        limit=spec.limit,
    )


def read_job_windows(spec: JobSpec, inputs: PlanningInputs) -> Iterator[Window]:
    """The job's windows, read, templated and tokenized, every id checked
    (`reading.read_windows`); `inputs.counts` counts the reads."""
    return read_windows(
        inputs.source,
        spec,
        inputs.tokenizer,
        max_model_len=inputs.max_model_len,
        params=inputs.params,
        pooling=inputs.pooling,
        adapters=inputs.adapters,
        counts=inputs.counts,
        images=inputs.images,
    )


def plan_windows(
    spec: JobSpec, inputs: PlanningInputs, windows: Iterable[Window], *, deduplicator: Any = None
) -> JobPlan:
    """Dedupe, order and cut each tokenized window (in input order), write its shards'
    plan files, and make the JobPlan; the plan files added are removed if it fails.

    `inputs.counts` must hold the records read once `windows` is exhausted.
    `deduplicator`: finds a window's copies (`spec.dedupe`); default: a `Deduplicator`
    over the windows as they come (planning spread over workers found them in buckets:
    `dedupe_buckets.py`)."""
    shards: list[Shard] = []
    copy_shards: list[Shard] = []
    num_rows = num_failed = 0
    has_images = inputs.images is not None and spec.image_column is not None
    dedupe = (deduplicator or Deduplicator(inputs.params.params)) if spec.dedupe else None
    # Another plan's files may have our shard ids (same rows, same id): if this planning
    # fails, it removes only the files it added.
    existing = out.planned_shards(spec.output, spec.storage_options)
    try:
        for window in windows:
            cut, copies = cut_window(spec, inputs, window, dedupe, first_index=len(shards))
            shards += cut
            if copies:
                copy_shards.append(spill_copy_shard(spec, inputs, window, copies))
            has_images = has_images or any(r.images for r in window.rows)
            num_rows += len(window.rows)
            num_failed += sum(1 for r in window.rows if r.error is not None)
            fault_point("plan_window")
            # Let go of this window's rows before the next is read: the for statement
            # rebinds `window` only once the next one is made, and two windows' rows
            # were then the planner's peak.
            window = cut = copies = None
        check_rows_read(inputs.source, inputs.counts, num_rows)
    except BaseException:
        added = [s.shard_id for s in shards + copy_shards if s.shard_id not in existing]
        out.remove_plan(spec.output, spec.storage_options, shard_ids=added)
        raise
    return job_plan(
        spec,
        inputs,
        shards,
        copy_shards,
        num_rows=num_rows,
        num_failed=num_failed,
        has_images=has_images,
        rows_deduplicated=dedupe.num_copies if dedupe is not None else 0,
    )


def cut_window(
    spec: JobSpec,
    inputs: PlanningInputs,
    window: Window,
    dedupe: Any,
    *,
    first_index: int,
    write: Callable[[str, pa.Table], object] | None = None,
) -> tuple[list[Shard], list[Copy]]:
    """One window's compute shards (indexed from `first_index`), their plan files
    written, and its copies (`dedupe`: None where the job does not dedupe).

    `write(shard_id, table)` writes a shard's rows somewhere else than its plan file."""
    rows = (
        dedupe.split(window.rows, raw_lines(inputs.reasoning, window))
        if dedupe is not None
        else window.rows
    )
    planned_shards = plan_shards(
        rows,
        inputs.params.params,
        model_key=inputs.model.model_key,
        task=spec.task,
        shard_tokens=spec.shard_tokens,
        min_shards=inputs.min_shards,
        first_index=first_index,
        window=window.index,
        adapter_keys=[a.weights_hash for a in inputs.adapters],
        rule=inputs.cut_rule,
    )
    for planned in planned_shards:
        if write is None:
            _spill(spec, planned.shard.shard_id, planned.rows, window)
        else:
            write(planned.shard.shard_id, window_table(planned.rows, window))
    copies = dedupe.sources_cut(planned_shards) if dedupe is not None else []
    return [p.shard for p in planned_shards], copies


def spill_copy_shard(
    spec: JobSpec, inputs: PlanningInputs, window: Window, copies: Sequence[Copy]
) -> Shard:
    """A window's copy shard, its plan file written; every copy's source shard must be
    known."""
    shard = copy_shard_of(spec, inputs, window.index, copies)
    sources = [(c.source_row_index, c.source_shard) for c in copies]
    _spill(spec, shard.shard_id, [c.row for c in copies], window, sources)
    return shard


def copy_shard_of(
    spec: JobSpec, inputs: PlanningInputs, window: int, copies: Sequence[Copy]
) -> Shard:
    """The copy shard (`dedupe.copy_shard`) of a window's copies."""
    return copy_shard(
        copies,
        inputs.params.params,
        model_key=inputs.model.model_key,
        task=spec.task,
        window=window,
        adapter_keys=[a.weights_hash for a in inputs.adapters],
    )


def job_plan(
    spec: JobSpec,
    inputs: PlanningInputs,
    shards: Sequence[Shard],
    copy_shards: Sequence[Shard],
    *,
    num_rows: int,
    num_failed: int,
    has_images: bool,
    rows_deduplicated: int,
) -> JobPlan:
    """The JobPlan of the cut windows' shards (in input order) and copy shards (in their
    windows' order), which run after every compute shard: they read their sources' parts."""
    shards = list(shards) + [replace(s, index=len(shards) + i) for i, s in enumerate(copy_shards)]
    model, images, counts = inputs.model, inputs.images, inputs.counts
    plan = JobPlan(
        spec=spec,
        job_id=job_id(shards, output=_canonical_location(spec.output)),
        model_name=model.name,
        weights_hash=model.weights_hash,
        params=inputs.params.params,
        shards=shards,
        num_rows=num_rows,
        num_failed=num_failed,
        rows_read=counts.records,
        rows_skipped_blank=counts.blank,
        input_fingerprint=inputs.fingerprint,
        adapters=inputs.adapters,
        layout=_layout(spec, inputs.pooling),
        rows_deduplicated=rows_deduplicated,
        model_dir=str(model.model_dir),
        min_shards=inputs.min_shards,
        quantization=inputs.quantization,
        cut_rule=inputs.cut_rule,
        has_images=has_images,
        image_token_id=images.places.image_token_id if images is not None else None,
        reasoning_format=inputs.reasoning,
    )
    log.info(
        "planned job %s: %d rows (%d failed before compute, %d duplicates computed once), "
        "%d shards, ~%d tokens",
        plan.job_id,
        plan.num_rows,
        plan.num_failed,
        plan.rows_deduplicated,
        len(shards),
        plan.num_tokens,
    )
    return plan


def check_rows_read(source: Any, counts: ReadCounts, num_rows: int) -> None:
    """An input with no record at all is a job of no rows, with a warning (a scheduled
    flow on an empty drop succeeds); an input that is not empty but gave no rows fails,
    saying what was seen - it must never pass as an empty job."""
    if counts.rows != num_rows:  # every row read is planned as one row
        raise RuntimeError(f"{counts.rows} rows read from {source.uri}, {num_rows} planned")
    if num_rows:
        return
    if source.is_empty:
        return  # JobPlan.empty_warning says so
    files = "its file is" if len(source.files) == 1 else f"its {len(source.files)} files are"
    raise ValueError(
        f"{source.uri}: no rows were read, yet {files} not empty ({counts.blank:,} blank "
        f"records seen): the bytes are not what the {source.format} format expects - check "
        "--format, and for delimited text --csv-delimiter and --csv-quote"
    )


def _cut(spec: JobSpec, requested: int) -> tuple[int, str]:
    """(min_shards, cut rule) to plan with: those recorded with results being resumed,
    else `requested` and `new_cut_rule(requested)`. Results recorded without a rule
    were cut by filling (the only rule there was), and parts without any record keep
    `requested`; results cut by the prefix rule resume with it."""
    if requested < 1:
        raise ValueError(f"min_shards must be >= 1, got {requested}")
    fresh = requested, new_cut_rule(requested)
    if not spec.resume:
        return fresh
    recorded = out.read_cut(spec.output, spec.storage_options)
    if recorded == fresh:
        return fresh
    if not out.completed_shards(spec.output, spec.storage_options):
        return fresh
    if recorded is None:
        return requested, FILL
    min_shards, rule = recorded[0], recorded[1] or FILL
    if min_shards != requested:
        log.info(
            "resuming results cut into at least %d shards per window (asked for %d): the "
            "same shards as the first run",
            min_shards,
            requested,
        )
    return min_shards, rule


def new_cut_rule(min_shards: int) -> str:
    """The cut rule of a job planned afresh for `min_shards` engines. For one, the prefix
    cut: its shards run one after another on one engine, so how evenly they split the
    work does not matter, and contiguous shards split the fewest prefix groups. For
    several, the balance cut: shards run at once, and the job ends with its slowest."""
    return BALANCE if min_shards > 1 else PREFIX


def _check_input_unchanged(spec: JobSpec, fingerprint: list[dict[str, Any]]) -> None:
    """Refuse to resume results that came from a different input (ValueError).

    Only results matter: a run killed before any part was published left nothing to
    mix, so its fingerprint is simply replaced.
    """
    if not spec.resume:
        return
    stored = out.read_input_fingerprint(spec.output, spec.storage_options)
    if stored is None:
        return
    change = first_difference(stored, fingerprint)
    if change is None or not out.completed_shards(spec.output, spec.storage_options):
        return
    raise ValueError(
        f"the input changed since the results in {redact_url(spec.output)} were started "
        f"({change}): resuming would mix rows of the old and the new input. To start "
        "fresh, use a new output location, or rerun with --no-resume (resume=False) to "
        "replace the results there."
    )


def _model_for(spec: JobSpec, llm: Any) -> tuple[ModelDescription, Any, int]:
    """(description, tokenizer, context length) of the model the job runs on."""
    if llm is not None:
        model = describe_model(llm.model_dir)
        model = model.named(getattr(llm, "model_name", model.name))
        return model, llm.tokenizer, llm.max_model_len
    model = describe_model(spec.model, revision=spec.revision)
    limit = spec.engine_options.get("max_model_len") or model.max_context
    return model, model.load_tokenizer(), min(model.max_context, limit)


def _quantization(spec: JobSpec, model: ModelDescription, llm: Any) -> str | None:
    """How the job's weights run (JobPlan.quantization): the own mode the engine was
    given, else the checkpoint's own quantization (the two are never combined)."""
    config = getattr(llm, "engine_config", None)
    own = spec.quantization if config is None else config.quantization
    return own or model.quantization


def _adapters_for(spec: JobSpec, model: ModelDescription, llm: Any) -> list[JobAdapter]:
    """The job's LoRA adapters, each checked against the model (ValueError naming one that
    is missing or does not fit): by the loaded engine's settings when there is one."""
    if not spec.lora:
        return []
    if spec.task in POOLING_JOB_TASKS:
        raise ValueError(f"LoRA adapters serve generate and score jobs, not {spec.task}")
    if llm is not None:
        names, max_rank = llm.model_names, llm.engine_config.max_lora_rank
    else:
        names = model_names(spec.model)
        max_rank = spec.engine_options.get("max_lora_rank", EngineConfig.max_lora_rank)
    return describe_job_adapters(spec.lora, model.config, model_names=names, max_rank=max_rank)


def _images_for(spec: JobSpec, model: ModelDescription, tokenizer: Any) -> RowImageReader | None:
    """How the job reads its rows' images (None: it has no image column, or OpenAI batch
    input for a model without a vision tower); ValueError for one it cannot read them for."""
    # The engine's pan-and-scan setting decides how many image blocks an image is.
    pan_and_scan = spec.llm_options.get("pan_and_scan")
    if spec.is_openai_batch:
        if spec.image_column is not None:
            raise ValueError(
                "image_column is not read from OpenAI batch input (its lines carry their own "
                "image_url parts)"
            )
        return openai_image_reader(
            spec, model_dir=str(model.model_dir), tokenizer=tokenizer, pan_and_scan=pan_and_scan
        )
    return image_reader(
        spec,
        model_dir=str(model.model_dir),
        model_name=model.name,
        tokenizer=tokenizer,
        task=spec.task,
        pan_and_scan=pan_and_scan,
    )


def _pooling_for(
    spec: JobSpec, model: ModelDescription, tokenizer: Any, max_model_len: int, llm: Any
) -> PoolingInputs | None:
    """The model's pooling inputs (None when it serves no pooling task), from the loaded
    LLM or its files.

    Raises:
        ValueError: the job's task is one the model does not serve, its dimensions are
            more than the model's embedding, or its prompt_name is not the model's.
    """
    # An LLM-like object that says nothing of its tasks (a test double) serves the model's.
    tasks = tuple(getattr(llm, "tasks", model.tasks))
    if spec.task in POOLING_JOB_TASKS and spec.task not in tasks:
        raise ValueError(
            f"model {model.name} serves {', '.join(tasks)}, not {spec.task}: use an "
            "embedding, classification or cross-encoder model (a sentence-transformers "
            "directory, an encoder, or a *ForSequenceClassification checkpoint)"
        )
    if not set(tasks) & set(POOLING_JOB_TASKS):
        return None
    if llm is not None:
        config, pooling_tokenizer = llm.pooling_config, llm.pooling_tokenizer
    else:
        config = read_pooling_config(model.model_dir, is_encoder=model.is_encoder)
        limit = min(max_model_len, config.max_seq_length or max_model_len)
        pooling_tokenizer = PoolingTokenizer(
            tokenizer, max_length=limit, lowercase=config.lowercase
        )
    prefix = ""
    if spec.prompt_name is not None:
        if spec.prompt_name not in config.prompts:
            known = ", ".join(config.prompts) or "none"
            raise ValueError(
                f"model {model.name} has no prompt named {spec.prompt_name!r} (its prompts: {known})"
            )
        prefix = config.prompts[spec.prompt_name]
    inputs = PoolingInputs(
        pooling_tokenizer,
        tasks,
        embedding_size(model.model_dir, config) if "embed" in tasks else None,
        prefix=prefix,
        label_names=config.labels,
    )
    if spec.task in POOLING_JOB_TASKS:
        problem = inputs.check_dimensions(spec.dimensions)
        if problem is not None:
            raise ValueError(problem)
    return inputs


def _layout(spec: JobSpec, pooling: PoolingInputs | None) -> PoolingLayout | None:
    """A pooling job's results layout (None for other jobs)."""
    if spec.task not in POOLING_JOB_TASKS:
        return None
    return PoolingLayout(
        spec.task,
        embedding_size=spec.dimensions or pooling.embedding_size,
        embedding_dtype=spec.embedding_dtype,
        label_names=pooling.label_names,
    )


def _constraint_check(model: ModelDescription, tokenizer: Any, llm: Any) -> ConstraintCheck:
    """Compiles a structured outputs constraint for the job's model (ValueError if it is
    invalid): through the loaded engine when there is one - its compiled grammars are
    then ready - else from the model's files (nothing is loaded until a constraint is)."""
    engine = getattr(llm, "engine", None)
    if engine is not None:
        return engine.compile_structured_outputs
    return model.constraint_check(tokenizer)


def _canonical_location(uri: str) -> str:
    # "out", "./out" and "/abs/out" are one place, so they are one job.
    return uri if "://" in uri else os.path.abspath(uri)


def _spill(
    spec: JobSpec,
    shard_id: str,
    rows: Sequence[PromptRow],
    window: Window,
    sources: Sequence[tuple[int, str]] | None = None,
) -> None:
    """Write a shard's rows to its plan file (`window_table`)."""
    out.write_plan_shard(
        spec.output, shard_id, window_table(rows, window, sources), spec.storage_options
    )


def window_table(
    rows: Sequence[PromptRow],
    window: Window,
    sources: Sequence[tuple[int, str | None]] | None = None,
) -> pa.Table:
    """The table of some of a window's rows, with their passthrough columns and urls
    (and a copy shard's sources): `spill.shard_table`."""
    local = [r.row_index - window.start for r in rows]
    passthrough = None
    if window.passthrough is not None:
        passthrough = window.passthrough.take(pa.array(local, pa.int64()))
    endpoints = [window.endpoints[i] for i in local] if window.endpoints is not None else None
    tool_calls = [window.tool_calls[i] for i in local] if window.tool_calls is not None else None
    return shard_table(
        rows, passthrough=passthrough, endpoints=endpoints, tool_calls=tool_calls, sources=sources
    )


def load_shard(plan: JobPlan, shard: Shard, *, columns: list[str] | None = None) -> pa.Table:
    """A shard's plan file (only `columns`, if given), checked against the plan.

    Raises:
        RuntimeError: the file is gone (the job finished and dropped it, or it was
            deleted) or does not hold the shard's rows.
    """
    spec = plan.spec
    try:
        table = out.read_plan_shard(
            spec.output, shard.shard_id, spec.storage_options, columns=columns
        )
    except FileNotFoundError:
        raise RuntimeError(
            f"shard {shard.shard_id} of job {plan.job_id} has no plan file under "
            f"{out.plan_uri(spec.output)}: plan the job again (rerun it) to recreate it"
        ) from None
    if table.num_rows != shard.num_rows:
        raise RuntimeError(
            f"the plan file of shard {shard.shard_id} holds {table.num_rows} rows, "
            f"the plan {shard.num_rows}: plan the job again (rerun it)"
        )
    return table
