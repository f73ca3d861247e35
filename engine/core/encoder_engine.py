"""The loop for encoders: pooling requests in, token-budget batches through the runner,
PoolingOutputs out.

An encoder needs none of the decode loop's machinery - no KV cache, no scheduler
preemption, no sampling - so this loop is small. Each step takes the next batch of
the queued requests: when the queue is planned, its requests are sorted by length
(a stable sort, so equal lengths keep their order) and cut into batches of at most
`max_num_batched_tokens` tokens and `max_num_seqs` sequences - a sequence longer than
the budget runs alone. Sorting keeps each batch's lengths close, so its attention is a
few dense calls (`worker/encoder_attention.py`), and packing needs no padding at all.

It speaks the same protocol as `LLMEngine` to `LLM` and the pipelines: `add_request`,
`step`, `has_unfinished`, `abort_all`, `stats`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.memory import MemoryPlan
from tokenmill.engine.types.outputs import EngineStats, RequestMetrics
from tokenmill.engine.types.pooling_outputs import PoolingOutput
from tokenmill.engine.types.pooling_params import PoolingParams
from tokenmill.engine.types.profiling import NO_PROFILER, StepProfiler


class EncoderBatchRunner(Protocol):
    """What the loop needs of whatever runs its batches (`worker.EncoderRunner`)."""

    device: torch.device

    def unsupported(self, params: PoolingParams) -> str | None:
        """Why the model cannot serve params, or None."""
        ...

    def run(self, token_ids: list[list[int]], params: list[PoolingParams]) -> list[torch.Tensor]:
        """Pool a batch (equal lengths adjacent); one fp32 CPU tensor per sequence."""
        ...


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    token_ids: list[int]
    params: PoolingParams
    metrics: RequestMetrics


class EncoderEngine:
    """Drives an encoder runner over queued pooling requests.

    Args:
        runner: runs each batch.
        engine_config: the engine's settings (`max_num_batched_tokens`, `max_num_seqs`).
        max_model_len: the longest sequence served (the model's positions, or its
            sentence-transformers max_seq_length).
        vocab_size: prompt ids are checked against it.
    """

    def __init__(
        self,
        runner: EncoderBatchRunner,
        engine_config: EngineConfig,
        *,
        max_model_len: int,
        vocab_size: int,
        memory: MemoryPlan | None = None,
    ) -> None:
        self.runner = runner
        self.config = engine_config
        self.memory = memory  # what the load was planned to take (None: not built by LLM)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.stats = EngineStats()
        self.profiler: StepProfiler = NO_PROFILER  # tools install one: engine/types/profiling.py
        self._waiting: list[_Request] = []
        self._batches: deque[list[_Request]] = deque()
        self._finished_early: list[PoolingOutput] = []

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a pooling request; one the model cannot serve ends with an error output."""
        metrics = RequestMetrics(arrival_time=arrival_time or time.perf_counter())
        request = _Request(request_id, prompt, list(prompt_token_ids), params, metrics)
        error = self._validate(request)
        if error is not None:
            metrics.finish_time = time.perf_counter()
            self.stats.num_errors += 1
            self._finished_early.append(self._output(request, None, error))
            return
        self._waiting.append(request)
        self.stats.num_requests += 1

    def _validate(self, request: _Request) -> str | None:
        num = len(request.token_ids)
        if num == 0:
            return "prompt is empty (0 tokens)"
        if num > self.max_model_len:
            return f"prompt has {num} tokens; the model takes at most {self.max_model_len}"
        if any(t < 0 or t >= self.vocab_size for t in request.token_ids):
            return f"prompt contains token ids outside the vocabulary [0, {self.vocab_size})"
        return self.runner.unsupported(request.params)

    def compile_structured_outputs(self, constraint) -> None:
        raise ValueError("an encoder generates no text, so it takes no structured outputs")

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._batches or self._finished_early)

    def abort_all(self) -> int:
        """Drop every queued request (e.g. after a step raised); returns how many."""
        num = len(self._waiting) + sum(len(b) for b in self._batches)
        self._waiting.clear()
        self._batches.clear()
        self._finished_early.clear()
        return num

    def reset_prefix_cache(self) -> None:
        """Nothing to forget: an encoder keeps no KV cache between requests."""

    def step(self) -> list[PoolingOutput]:
        """Run the next batch; return the requests it finished (and any refused ones)."""
        finished, self._finished_early = self._finished_early, []
        if not self._batches and self._waiting:
            with self.profiler.stage("schedule"):
                self._plan()
        if not self._batches:
            return finished
        batch = self._batches.popleft()
        started = time.perf_counter()
        for request in batch:
            request.metrics.first_scheduled_time = started
        results = self.runner.run([r.token_ids for r in batch], [r.params for r in batch])
        now = time.perf_counter()
        for request, data in zip(batch, results):
            request.metrics.finish_time = now
            finished.append(self._output(request, data, None))
            self.stats.prompt_tokens += len(request.token_ids)
            self.stats.computed_prompt_tokens += len(request.token_ids)
        self.stats.num_steps += 1
        return finished

    def _plan(self) -> None:
        """Sort the queue by length and cut it into batches under the budgets."""
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.seq_cap
        batch: list[_Request] = []
        num_tokens = 0
        for request in sorted(self._waiting, key=lambda r: len(r.token_ids)):
            length = len(request.token_ids)
            if batch and (num_tokens + length > budget or len(batch) >= max_seqs):
                self._batches.append(batch)
                batch, num_tokens = [], 0
            batch.append(request)
            num_tokens += length
        if batch:
            self._batches.append(batch)
        self._waiting = []

    @staticmethod
    def _output(request: _Request, data: torch.Tensor | None, error: str | None) -> PoolingOutput:
        return PoolingOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.token_ids,
            task=request.params.task,
            data=data,
            prompt_tokens=len(request.token_ids),
            cached_tokens=0,
            metrics=request.metrics,
            error=error,
        )
