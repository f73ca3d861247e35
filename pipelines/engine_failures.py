"""What a job does when the engine raises in the middle of a shard - the one rule.

    1. The shard's requests are generated again, once, all together (a transient
       fault - a device hiccup, a one-off allocation failure - is gone by then).
    2. If that fails too, each request is generated alone: a request that fails alone
       becomes an error row (`finish_reason` "error", `error` "engine error: ..."),
       the others get their answers.
    3. If no request of the shard succeeds alone, the engine itself is broken, not a
       request: the job fails, nothing of the shard is written, and rerunning the job
       resumes at this shard.

Parts of other shards are never touched: they were published before and stay.
The engine resets itself after a failed step (`LLM.generate` aborts the call's
requests), so each attempt starts clean. Interrupts (KeyboardInterrupt, SystemExit,
and `ShardInterrupted`, which a caller's hook raises to stop a shard: a cancelled batch)
are not engine failures and pass straight through. Prompts never reach the logs;
only counts and the exception's type and message do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from tokenmill.engine import (
    EngineStats,
    PoolingOutput,
    PoolingParams,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from tokenmill.pipelines.tokenize import PromptRow

log = logging.getLogger(__name__)

OnOutput = Callable[[RequestOutput], None]
OnStep = Callable[[EngineStats], None]


class EngineBrokenError(RuntimeError):
    """Every request of a shard failed, alone as well as together (rule 3)."""


class ShardInterrupted(Exception):
    """Raised by an `on_step` or `on_output` hook to stop the shard now (its work is
    dropped, nothing of it is written); not an engine failure, so never retried."""


def generate_with_rule(
    llm: Any,
    rows: list[PromptRow],
    params: list[SamplingParams],
    *,
    shard_id: str,
    on_output: OnOutput | None = None,
    loras: list | None = None,
    on_step: OnStep | None = None,
) -> dict[int, RequestOutput]:
    """Generate `rows` (all with prompts) under the engine-failure rule above.

    Args:
        llm: a loaded LLM (anything with its `generate`).
        rows: prompt rows, none of them error rows.
        params: the job's distinct SamplingParams, indexed by `PromptRow.params_index`.
        shard_id: the shard's id, for messages.
        on_output: called with each RequestOutput as it finishes.
        loras: the job's LoRARequests, indexed by `PromptRow.lora_index` (None: no
            adapters).
        on_step: called after each engine step with the engine's cumulative stats.

    Returns:
        The engine's output per row index; a request that failed alone has an output
        with no completions, zero tokens and `error` set.

    Raises:
        EngineBrokenError: no request succeeded alone.
    """
    if not rows:
        return {}
    error: Exception | None = None
    for attempt in (1, 2):
        try:
            return generate_rows(
                llm, rows, params, on_output=on_output, on_step=on_step, loras=loras
            )
        except ShardInterrupted:
            raise
        except Exception as exc:
            error = exc
            log.warning(
                "shard %s: the engine failed on attempt %d of %d requests (%s: %s)",
                shard_id,
                attempt,
                len(rows),
                type(exc).__name__,
                exc,
            )
    results: dict[int, RequestOutput] = {}
    num_failed = 0
    for row in rows:
        try:
            results.update(
                generate_rows(llm, [row], params, on_output=on_output, on_step=on_step, loras=loras)
            )
        except ShardInterrupted:
            raise
        except Exception as exc:
            results[row.row_index] = _failed(row, f"engine error: {type(exc).__name__}: {exc}")
            num_failed += 1
    if num_failed == len(rows):
        raise EngineBrokenError(
            f"shard {shard_id}: the engine failed on each of its {len(rows)} requests, alone "
            f"and together (last error {type(error).__name__}: {error}); nothing of this shard "
            "was written. Fix the cause and rerun the job: it resumes at this shard."
        ) from error
    log.warning(
        "shard %s: %d of %d requests failed alone and become error rows",
        shard_id,
        num_failed,
        len(rows),
    )
    return results


def generate_rows(
    llm: Any,
    rows: list[PromptRow],
    params: list[SamplingParams],
    *,
    on_output: OnOutput | None = None,
    on_step: OnStep | None = None,
    loras: list | None = None,
) -> dict[int, RequestOutput | PoolingOutput]:
    """Generate every row that has a prompt, in the given order, each with its params -
    one `LLM.generate` call, no rule (notebooks call it directly; jobs through
    `generate_with_rule`).

    Args:
        llm: a loaded LLM (anything with its `generate`).
        rows: prompt rows; error rows are left out.
        params: the job's distinct SamplingParams, indexed by `PromptRow.params_index`.
        on_output: called with each RequestOutput as it finishes.
        loras: the job's LoRARequests, indexed by `PromptRow.lora_index` (None: no
            adapters, and `generate` is called without lora_request).
        on_step: called after each engine step with the engine's cumulative stats
            (passed on only when given, so an LLM stand-in without it still works).

    Returns:
        The engine's output per row index (a PoolingOutput for a pooling row).
    """
    good = [r for r in rows if r.token_ids is not None]
    # Pooling rows (embed, classify, rerank: an OpenAI batch file may mix them with
    # generation rows) go through `LLM.encode`, the rest through `LLM.generate`.
    pooled = [r for r in good if isinstance(params[r.params_index], PoolingParams)]
    generating = [r for r in good if not isinstance(params[r.params_index], PoolingParams)]
    hooks: dict[str, Any] = {"on_output": on_output}
    if on_step is not None:
        hooks["on_step"] = on_step
    outputs: dict[int, RequestOutput | PoolingOutput] = {}
    if generating:
        adapters = {}
        if loras is not None:
            adapters["lora_request"] = [loras[r.lora_index] for r in generating]
        generated = llm.generate(
            [_prompt(r) for r in generating],
            [params[r.params_index] for r in generating],
            **hooks,
            **adapters,
        )
        outputs.update((r.row_index, o) for r, o in zip(generating, generated))
    if pooled:
        encoded = llm.encode(
            [r.token_ids for r in pooled], [params[r.params_index] for r in pooled], **hooks
        )
        outputs.update((r.row_index, o) for r, o in zip(pooled, encoded))
    return outputs


def _prompt(row: PromptRow) -> Any:
    """A row as `LLM.generate` takes it: its token ids, with its images as vLLM's prompt
    dict (the ids already hold each image's expanded tokens: `templating.py`)."""
    if not row.images:
        return row.token_ids
    return {
        "prompt_token_ids": list(row.token_ids),
        "multi_modal_data": {"image": list(row.images)},
    }


def _failed(row: PromptRow, message: str) -> RequestOutput:
    """The output of a request that failed alone: nothing computed, nothing billed."""
    return RequestOutput(
        request_id=str(row.row_index),
        prompt=None,
        prompt_token_ids=list(row.token_ids or []),
        outputs=[],
        prompt_tokens=0,
        cached_tokens=0,
        completion_tokens=0,
        metrics=RequestMetrics(arrival_time=time.perf_counter()),
        error=message,
    )
