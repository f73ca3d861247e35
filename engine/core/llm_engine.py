"""The engine loop: requests in, scheduled steps through the model, finished outputs out.

The loop schedules, launches each step on the runner and puts the sampled tokens in
place; what a token means for its request - a stop, a length, an output to build - is
the output processor's (`output_processor.py`).
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Callable

import torch

from tokenmill.engine.core.block_manager import BlockManager
from tokenmill.engine.core.detokenizer import IncrementalDetokenizer
from tokenmill.engine.core.grammar import CompiledGrammar, GrammarCompiler
from tokenmill.engine.core.image_prefetch import ImagePrefetcher, LazyPixels
from tokenmill.engine.core.images import ImageSpan, check_spans
from tokenmill.engine.core.output_processor import OutputProcessor, RequestState
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.core.step import (
    PLACEHOLDER_TOKEN_ID,
    PendingStep,
    PoolingState,
    SchedulerOutput,
    Sequence,
    SequenceStatus,
    StepRunner,
)
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.memory import MemoryPlan
from tokenmill.engine.types.outputs import EngineStats, RequestOutput
from tokenmill.engine.types.pooling_outputs import PoolingOutput
from tokenmill.engine.types.profiling import NO_PROFILER, StepProfiler
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.types.structured_outputs import StructuredOutputs


class LLMEngine:
    """Owns the scheduler and block manager for one model, and drives a runner with them.

    The runner executes steps (`worker.ModelRunner`; `tokenmill.engine.api.llm.build_engine`
    puts the two together); the loop knows it only through the step types
    (`core/step.py`).

    Args:
        runner: executes each scheduled step.
        engine_config: the engine's settings.
        tokenizer: decodes outputs and stop strings (None: token ids only).
        num_blocks: KV cache blocks the runner's cache holds.
        max_model_len: the longest sequence served.
        vocab_size: the model's vocabulary (prompt ids are checked against it).
        eos_token_ids: the model's end-of-sequence ids (the tokenizer's are added).
        rope_variant: the rope variant a sequence of at most n tokens runs with, for a
            model whose rotary frequencies depend on the sequence's length
            (models/rope.py); None where they do not.
    """

    def __init__(
        self,
        runner: StepRunner,
        engine_config: EngineConfig,
        tokenizer,
        *,
        num_blocks: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: list[int],
        memory: MemoryPlan | None = None,
        rope_variant: Callable[[int], int] | None = None,
    ) -> None:
        self.runner = runner
        self.rope_variant = rope_variant
        self.config = engine_config
        self.memory = memory  # what the load was planned to take (None: not built by LLM)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.stats = EngineStats()
        self.block_manager = BlockManager(
            num_blocks,
            engine_config.block_size,
            enable_prefix_caching=engine_config.enable_prefix_caching,
        )
        # A sequence never outgrows the context or the whole cache.
        self.max_seq_len = min(max_model_len, num_blocks * engine_config.block_size)
        self.scheduler = Scheduler(
            self.block_manager, engine_config, stats=self.stats, max_seq_len=self.max_seq_len
        )
        self.eos_token_ids = set(eos_token_ids)
        if tokenizer is not None:
            self.eos_token_ids |= set(tokenizer.eos_token_ids)
        # Overlap each step with resolving the previous one (default: on CUDA, where the
        # device runs ahead of the host; on the CPU the host computes the step itself).
        self.overlap_steps = (
            runner.device.type == "cuda"
            if engine_config.overlap_steps is None
            else engine_config.overlap_steps
        )
        self.output_processor = OutputProcessor(
            tokenizer, self.eos_token_ids, self.max_seq_len, self.stats
        )
        self._pending: PendingStep | None = None
        self._requests: dict[str, RequestState] = {}
        self._image_prefetcher: ImagePrefetcher | None = None  # made with the first lazy image
        self._held_back: list[Sequence] = []  # waiting, behind an image still decoding
        self._seq_ids = itertools.count()
        self._finished_early: list[RequestOutput | PoolingOutput] = []
        self._grammar_compiler: GrammarCompiler | None = None  # built on first use
        self.profiler: StepProfiler = NO_PROFILER  # tools install one: engine/types/profiling.py

    # -- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora_id: int = 0,
        pooling: PoolingState | None = None,
        images: tuple[ImageSpan, ...] = (),
        input_error: str | None = None,
    ) -> None:
        """Queue a request.

        With `pooling` the request samples nothing: it ends once its prompt is computed,
        with a PoolingOutput holding the runner's pooled result (`params` is then unused).

        Args:
            lora_id: the LoRA adapter it runs with, as registered with the runner
                (`lora.manager.LoRAManager.register`); 0 = the base model.
            images: the prompt's images (core/images.py), for a model with a vision tower.
            input_error: why the request's input cannot run (a bad image): it is answered
                at once as an error, and nothing is computed for it.

        Raises:
            ValueError: its structured outputs constraint is invalid or cannot be enforced,
                or it has bad words and the engine no tokenizer (raised before anything is
                queued).
        """
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.compile_structured_outputs(params.structured_outputs)
        request = self.output_processor.new_request(
            request_id,
            prompt_token_ids,
            params,
            prompt=prompt,
            arrival_time=arrival_time,
            pooling=pooling,
        )
        error = input_error or self._validate(request.prompt_token_ids, params, pooling is not None)
        if error is None and images:
            error = self._validate_images(images, len(request.prompt_token_ids))
        if error is not None:
            self._finished_early.append(self.output_processor.error_output(request, error))
            return
        if self._image_prefetcher is None and any(isinstance(i.pixels, LazyPixels) for i in images):
            self._image_prefetcher = ImagePrefetcher(
                image_decode_threads=self.config.image_decode_threads,
                max_images_ahead=self.config.max_images_ahead,
            )
        rope_variant = 0
        if self.rope_variant is not None:
            num_prompt = len(request.prompt_token_ids)
            rope_variant = self.rope_variant(self._longest(num_prompt, params, pooling is not None))
        for index in range(1 if pooling is not None else params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                index=index,
                token_ids=list(request.prompt_token_ids),
                num_prompt_tokens=len(request.prompt_token_ids),
                params=params,
                lora_id=lora_id,
                rope_variant=rope_variant,
                generator=_seeded_generator(params.seed, index, self.runner.device),
                detokenizer=IncrementalDetokenizer(self.tokenizer) if params.stop else None,
                grammar=grammar.new_matcher() if grammar is not None else None,
                pooling=pooling,
                images=images,
            )
            if params.prompt_logprobs is not None and index == 0:
                seq.prompt_logprobs = [None]
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self._requests[request_id] = request
        self.stats.num_requests += 1

    def _longest(self, num_prompt_tokens: int, params: SamplingParams, pools: bool) -> int:
        """The most tokens a request's sequences can reach: prompt plus max_tokens, within
        the context (its prompt alone when it generates nothing)."""
        if params.is_prompt_only or pools:
            return num_prompt_tokens
        return min(num_prompt_tokens + params.max_tokens, self.max_seq_len)

    def compile_structured_outputs(self, constraint: StructuredOutputs) -> CompiledGrammar:
        """Compile a constraint for this model's tokenizer (cached per process by content).

        Calling it before add_request checks a constraint without queueing anything.

        Raises:
            ValueError: the schema, regex or grammar is invalid or uses a feature the
                engine cannot enforce; the message names it.
        """
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer")
            self._grammar_compiler = GrammarCompiler.for_model(
                self.tokenizer, self.vocab_size, sorted(self.eos_token_ids)
            )
        return self._grammar_compiler.compile(constraint)

    def _validate(
        self, prompt_token_ids: list[int], params: SamplingParams, pools: bool = False
    ) -> str | None:
        num = len(prompt_token_ids)
        # A generating request needs room for one token more; a prompt-only one does not.
        room = 0 if params.is_prompt_only or pools else 1
        if num == 0:
            return "prompt is empty (0 tokens)"
        if num + room > self.max_model_len:
            return (
                f"prompt has {num} tokens; the model's context is {self.max_model_len} tokens"
                + (", leaving no room to generate" if room else "")
            )
        if num + room > self.max_seq_len:
            return (
                f"prompt has {num} tokens but the whole KV cache holds {self.max_seq_len}; "
                "raise kv_cache_memory"
            )
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_token_ids):
            return f"prompt contains token ids outside the vocabulary [0, {vocab})"
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name) or ()
            if any(t >= vocab for t in ids):
                return f"{name} names token ids outside the vocabulary [0, {vocab})"
        return None

    def _validate_images(self, images: tuple[ImageSpan, ...], num_tokens: int) -> str | None:
        if getattr(self.runner, "vision", None) is None:
            return "this model has no vision tower: it cannot take images"
        return check_spans(images, num_tokens, self.scheduler.max_num_batched_tokens)

    @property
    def has_unfinished(self) -> bool:
        return (
            self.scheduler.has_unfinished or bool(self._finished_early) or self._pending is not None
        )

    def abort_all(self) -> int:
        """Drop every queued and running request, e.g. after a step raised.

        Their blocks are freed and the prefix cache is forgotten: a step that failed
        midway may have left blocks whose contents were never written, and a cache
        miss only costs recompute. The engine is then as good as new for the next
        requests.

        Returns:
            How many requests were dropped.
        """
        num = len(self._requests)
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.finish(seq, "abort")
        self.scheduler.inflight.clear()
        self.block_manager.forget_cache()
        self._requests.clear()
        self._finished_early.clear()
        self._pending = None
        return num

    def reset_prefix_cache(self) -> None:
        """Forget every cached block: later requests compute their prompts in full."""
        self.block_manager.forget_cache()

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the requests that finished in it.

        With overlapped steps the step is launched and the previous one resolved while it
        runs, so the requests returned are those its predecessor finished. A step after
        one that sampled under a grammar is not overlapped: the next mask needs the token.
        """
        finished, self._finished_early = self._finished_early, []
        if self._pending is not None and any(s.grammar is not None for s in self._pending.seqs):
            finished += self._resolve()
        with self.profiler.stage("schedule"):
            finished += self._decode_images_ahead()
            out = self._schedule()
        if out.is_empty:
            return finished + self._resolve()
        now = time.perf_counter()
        for chunk in out.chunks:
            if chunk.seq.first_scheduled_time is None:
                chunk.seq.first_scheduled_time = now
        sampling_seqs = [c.seq for c in out.chunks if c.samples]
        self._set_bans(out, sampling_seqs)
        result = self.runner.execute(out, self._pending)
        sampled = result.sampled
        finished += self._resolve()  # the previous step's tokens, while this one runs
        scored = [c.seq for c in out.chunks if c.reaches_end and c.seq.is_prompt_only]
        self.scheduler.record_computed(out)
        finished += self._finish_prompt_only(scored)
        self.stats.num_steps += 1
        self.stats.num_constrained_tokens += result.num_constrained_tokens
        self.stats.grammar_fill_s += result.grammar_fill_s
        self.stats.grammar_blocking_s += result.grammar_blocking_s
        self.stats.moe_experts_used += result.num_experts_used
        if sampled is not None:
            self._pending = PendingStep.launch(sampling_seqs, sampled)
            self._hold_places(self._pending)
            if not self.overlap_steps:
                finished += self._resolve()
        return finished

    def _decode_images_ahead(self) -> list[RequestOutput]:
        """Start decoding waiting requests' images ahead (core/image_prefetch.py); answer
        those whose image failed to decode as errors. Leaves the scheduler's queue as the
        head it may admit now; `_schedule` puts the rest back after it."""
        waiting = self.scheduler.waiting
        if self._image_prefetcher is None or not waiting:
            return []
        ready, held, failed = self._image_prefetcher.prepare(waiting, bool(self.scheduler.running))
        errors = []
        for seq, error in failed:
            request = self._requests.pop(seq.request_id, None)
            if request is None:  # another of its sequences failed first
                continue
            for other in request.seqs:
                self.scheduler.finish(other, "abort")
            errors.append(self.output_processor.error_output(request, f"image: {error}"))
        alive = [s for s in ready if s.status != SequenceStatus.FINISHED]
        self._held_back = [s for s in held if s.status != SequenceStatus.FINISHED]
        waiting.clear()
        waiting.extend(alive)
        return errors

    def _schedule(self) -> SchedulerOutput:
        try:
            return self.scheduler.schedule()
        finally:  # after any the schedule preempted back into the queue
            self.scheduler.waiting.extend(self._held_back)
            self._held_back = []

    def _set_bans(self, out: SchedulerOutput, sampling_seqs: list[Sequence]) -> None:
        """Tell the runner what each sampling sequence may not sample this step."""
        rules = self.output_processor
        bans = [rules.bans(seq, self._requests[seq.request_id]) for seq in sampling_seqs]
        out.banned_token_ids = [banned for banned, _ in bans]
        out.conditional_bans = [conditional for _, conditional in bans]

    def _finish_prompt_only(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """End prompt-only requests (max_tokens=0) whose prompt this step completed: their
        prompt log-probabilities are recorded, and there is nothing to sample."""
        finished = []
        now = time.perf_counter()
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "length")
                finished.append(self._complete(seq.request_id, now))
        return finished

    def _hold_places(self, step: PendingStep) -> None:
        """Give each sampling sequence of a launched step a placeholder for its token, so
        the next schedule counts it; a token that must be the last ends the sequence."""
        for row, seq in enumerate(step.seqs):
            if seq.is_finished:  # finished by the step resolved meanwhile: row discarded
                continue
            seq.token_ids.append(PLACEHOLDER_TOKEN_ID)
            seq.num_pending_tokens = 1
            seq.pending_row = row
            seq.is_finishing = (
                seq.num_completion_tokens >= seq.params.max_tokens
                or seq.num_tokens >= self.max_seq_len
            )

    def _resolve(self) -> list[RequestOutput]:
        """Put the pending step's sampled tokens in place of their placeholders and
        finish the sequences they end; returns the requests that finished."""
        step, self._pending = self._pending, None
        if step is None:
            return []
        with self.profiler.stage("resolve"):
            return self._resolve_step(step)

    def _resolve_step(self, step: PendingStep) -> list[RequestOutput]:
        sampled = step.host_sampled()  # waits for this step's copies only
        token_ids = sampled.token_ids.tolist()
        now = time.perf_counter()
        finished = []
        for row, (seq, token_id) in enumerate(zip(step.seqs, token_ids)):
            if not seq.num_pending_tokens:  # finished before this step could be resolved
                continue
            seq.token_ids[-1] = token_id
            seq.num_pending_tokens = 0
            seq.is_finishing = False
            if seq.grammar is not None:
                # The one place a grammar advances. The mask allowed only tokens it
                # accepts, so a refusal would be an engine bug; the matcher then allows
                # nothing but EOS and the output is reported incomplete.
                seq.grammar.accept(token_id)
            self.stats.generated_tokens += 1
            reason = self.output_processor.add_token(seq, token_id, sampled, row, now)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                if self._requests[seq.request_id].is_finished:
                    finished.append(self._complete(seq.request_id, now))
        return finished

    def _complete(self, request_id: str, now: float) -> RequestOutput | PoolingOutput:
        """The output of a request whose sequences have all finished; it is forgotten."""
        return self.output_processor.output(self._requests.pop(request_id), now)


def _seeded_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    # Each of the n completions gets its own stream, derived from the request's seed.
    if index:
        digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") & ((1 << 63) - 1)
    # Drawn where the logits are: CUDA and CPU streams differ, each is reproducible.
    return torch.Generator(device).manual_seed(seed)
