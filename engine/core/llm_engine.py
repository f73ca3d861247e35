"""The engine loop: requests in, scheduled steps through the model, finished outputs out."""

from __future__ import annotations

import hashlib
import itertools
import time
from dataclasses import dataclass, field

import torch

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.core.block_manager import BlockManager
from tokenmill.engine.core.detokenizer import IncrementalDetokenizer
from tokenmill.engine.core.scheduler import Scheduler
from tokenmill.engine.core.step import (
    PLACEHOLDER_TOKEN_ID,
    PendingStep,
    PoolingState,
    SamplerOutput,
    Sequence,
    StepRunner,
)
from tokenmill.engine.grammar import CompiledGrammar, GrammarCompiler
from tokenmill.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from tokenmill.engine.pooling_outputs import PoolingOutput
from tokenmill.engine.profiling import NO_PROFILER, StepProfiler
from tokenmill.engine.sampling_params import SamplingParams
from tokenmill.engine.structured_outputs import StructuredOutputs


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    pooling: PoolingState | None = None  # a pooling request: it ends with a PoolingOutput
    # SamplingParams.bad_words as token sequences (`bad_words_token_ids`).
    bad_words: list[list[int]] = field(default_factory=list)


class LLMEngine:
    """Owns the scheduler and block manager for one model, and drives a runner with them.

    The runner executes steps (`worker.ModelRunner`; `tokenmill.engine.llm.build_engine`
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
    ) -> None:
        self.runner = runner
        self.config = engine_config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.stats = EngineStats()
        self.block_manager = BlockManager(
            num_blocks,
            engine_config.block_size,
            enable_prefix_caching=engine_config.enable_prefix_caching,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_batched_tokens=engine_config.max_num_batched_tokens,
            max_num_seqs=engine_config.max_num_seqs,
            stats=self.stats,
            max_loras=engine_config.max_loras,
        )
        # A sequence never outgrows the context or the whole cache.
        self.max_seq_len = min(max_model_len, num_blocks * engine_config.block_size)
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
        self._pending: PendingStep | None = None
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._finished_early: list[RequestOutput] = []
        self._grammar_compiler: GrammarCompiler | None = None  # built on first use
        self.profiler: StepProfiler = NO_PROFILER  # tools install one: engine/profiling.py

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
    ) -> None:
        """Queue a request.

        With `pooling` the request samples nothing: it ends once its prompt is computed,
        with a PoolingOutput holding the runner's pooled result (`params` is then unused).

        Args:
            lora_id: the LoRA adapter it runs with, as registered with the runner
                (`worker.lora.LoRAManager.register`); 0 = the base model.

        Raises:
            ValueError: its structured outputs constraint is invalid or cannot be enforced,
                or it has bad words and the engine no tokenizer (raised before anything is
                queued).
        """
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.compile_structured_outputs(params.structured_outputs)
        metrics = RequestMetrics(arrival_time=arrival_time or time.perf_counter())
        request = _Request(request_id, prompt, list(prompt_token_ids), params, [], metrics, pooling)
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need the model's tokenizer")
            request.bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
        error = self._validate(request.prompt_token_ids, params, pooling is not None)
        if error is not None:
            metrics.finish_time = time.perf_counter()
            self.stats.num_errors += 1
            self._finished_early.append(self._error_output(request, error))
            return
        for index in range(1 if pooling is not None else params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                index=index,
                token_ids=list(request.prompt_token_ids),
                num_prompt_tokens=len(request.prompt_token_ids),
                params=params,
                lora_id=lora_id,
                generator=_seeded_generator(params.seed, index, self.runner.device),
                detokenizer=IncrementalDetokenizer(self.tokenizer) if params.stop else None,
                grammar=grammar.new_matcher() if grammar is not None else None,
                pooling=pooling,
            )
            if params.prompt_logprobs is not None and index == 0:
                seq.prompt_logprobs = [None]
            request.seqs.append(seq)
            self.scheduler.add(seq)
        self._requests[request_id] = request
        self.stats.num_requests += 1

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
            out = self.scheduler.schedule()
        if out.is_empty:
            return finished + self._resolve()
        now = time.perf_counter()
        for chunk in out.chunks:
            if chunk.seq.first_scheduled_time is None:
                chunk.seq.first_scheduled_time = now
        sampling_seqs = [c.seq for c in out.chunks if c.samples]
        bans = [self._bans(seq) for seq in sampling_seqs]
        out.banned_token_ids = [banned for banned, _ in bans]
        out.conditional_bans = [conditional for _, conditional in bans]
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
        if sampled is not None:
            self._pending = PendingStep.launch(sampling_seqs, sampled)
            self._hold_places(self._pending)
            if not self.overlap_steps:
                finished += self._resolve()
        return finished

    def _finish_prompt_only(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """End prompt-only requests (max_tokens=0) whose prompt this step completed: their
        prompt log-probabilities are recorded, and there is nothing to sample."""
        finished = []
        now = time.perf_counter()
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "length")
                finished.append(self._complete(self._requests[seq.request_id], now))
        return finished

    def _bans(self, seq: Sequence) -> tuple[list[int], list[tuple[int, int]]]:
        """What seq may not sample next: token ids, and (token id, pending token id)
        pairs banned only if its pending token turns out to be that one."""
        banned = self._banned_token_ids(seq)
        words = self._requests[seq.request_id].bad_words
        if not words:
            return banned, []
        word_bans, conditional = _bad_word_bans(seq, words)
        return sorted(set(banned) | set(word_bans)), conditional

    def _banned_token_ids(self, seq: Sequence) -> list[int]:
        """Tokens seq may not sample next: stop tokens and EOS before min_tokens.

        A constrained sequence's EOS is banned while its grammar can continue, before
        min_tokens and under ignore_eos alike; once the grammar is complete EOS is all it
        allows, so nothing is banned - min_tokens and ignore_eos never outlast a grammar.
        """
        p = seq.params
        grammar = seq.grammar
        if grammar is not None and grammar.is_complete:
            return []
        if seq.num_completion_tokens < p.min_tokens:
            bans_eos = grammar is not None or not p.ignore_eos
            return sorted(set(p.stop_token_ids) | (self.eos_token_ids if bans_eos else set()))
        if grammar is not None and p.ignore_eos:
            return sorted(self.eos_token_ids)
        return []

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
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.params.logprobs is not None:
                seq.logprobs = seq.logprobs or []
                seq.logprobs.append(_logprob_entry(sampled, row, token_id, seq.params.logprobs))
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                request = self._requests[seq.request_id]
                if all(s.is_finished for s in request.seqs):
                    finished.append(self._complete(request, now))
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        p = seq.params
        is_eos = token_id in self.eos_token_ids
        if seq.grammar is not None and is_eos:
            return "stop"  # the grammar allowed EOS: the constrained output ends here
        can_stop = seq.num_completion_tokens > p.min_tokens
        if can_stop and (token_id in p.stop_token_ids or (not p.ignore_eos and is_eos)):
            return "stop"
        if seq.detokenizer is not None and self._hits_stop_string(seq, token_id, can_stop):
            return "stop"
        if seq.num_completion_tokens >= p.max_tokens or seq.num_tokens >= self.max_seq_len:
            return "length"
        return None

    def _hits_stop_string(self, seq: Sequence, token_id: int, can_stop: bool) -> bool:
        """Feed the token to seq's detokenizer; True when its new text completes a stop string.

        Only a short window of tokens is decoded per step, and only a match ending in the
        new text is new, so the check costs the same at token 5 and at token 5,000.
        """
        new = seq.detokenizer.add(token_id)
        if not new or not can_stop:
            return False
        text = seq.detokenizer.text
        longest = max(len(s) for s in seq.params.stop)
        window_start = max(0, len(text) - len(new) - longest + 1)
        hits = [
            (at, stop) for stop in seq.params.stop if (at := text.find(stop, window_start)) >= 0
        ]
        if not hits:
            return False
        at, stop = min(hits)
        seq.stop_text = (
            text[: at + len(stop)] if seq.params.include_stop_str_in_output else text[:at]
        )
        return True

    # -- outputs ------------------------------------------------------------------------------

    def _complete(self, request: _Request, now: float) -> RequestOutput | PoolingOutput:
        del self._requests[request.request_id]
        if request.pooling is not None:
            return self._pooling_output(request, now)
        completions = []
        errors = []
        for seq in request.seqs:
            if seq.stop_text is not None:
                text = seq.stop_text
            else:
                text = self.tokenizer.decode(seq.completion_token_ids) if self.tokenizer else ""
            # A constraint that passed a limit mid-output ended it: the output is not an
            # answer, and the request says why rather than pass for a short one.
            error = seq.grammar.error if seq.grammar is not None else None
            if error is not None:
                errors.append(error)
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=seq.completion_token_ids,
                    finish_reason="error" if error is not None else seq.finish_reason,
                    logprobs=seq.logprobs,
                    structured_output_complete=_is_complete(seq),
                )
            )
        first = request.seqs[0]
        metrics = request.metrics
        metrics.first_scheduled_time = first.first_scheduled_time
        # None for a prompt-only request: it has no first token.
        metrics.first_token_time = min(
            (s.first_token_time for s in request.seqs if s.first_token_time is not None),
            default=None,
        )
        metrics.finish_time = now
        num_prompt = len(request.prompt_token_ids)
        num_cached = first.num_cached_prompt_tokens or 0
        self.stats.prompt_tokens += num_prompt
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            prompt_tokens=num_prompt,
            cached_tokens=num_cached,
            completion_tokens=sum(len(c.token_ids) for c in completions),
            metrics=metrics,
            prompt_logprobs=first.prompt_logprobs,
            error=errors[0] if errors else None,
        )

    def _pooling_output(self, request: _Request, now: float) -> PoolingOutput:
        seq = request.seqs[0]
        request.metrics.first_scheduled_time = seq.first_scheduled_time
        request.metrics.finish_time = now
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        return PoolingOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            task=request.pooling.params.task,
            data=request.pooling.result,
            prompt_tokens=len(request.prompt_token_ids),
            cached_tokens=seq.num_cached_prompt_tokens or 0,
            metrics=request.metrics,
        )

    def _error_output(self, request: _Request, error: str) -> RequestOutput | PoolingOutput:
        if request.pooling is not None:
            return PoolingOutput(
                request_id=request.request_id,
                prompt=request.prompt,
                prompt_token_ids=request.prompt_token_ids,
                task=request.pooling.params.task,
                data=None,
                prompt_tokens=len(request.prompt_token_ids),
                cached_tokens=0,
                metrics=request.metrics,
                error=error,
            )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[CompletionOutput(index=0, text="", token_ids=[], finish_reason="error")],
            prompt_tokens=len(request.prompt_token_ids),
            cached_tokens=0,
            completion_tokens=0,
            metrics=request.metrics,
            error=error,
        )


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token sequences, as vLLM forms them: the word as written (leading
    spaces stripped) and, where it tokenizes to a different first token of the same
    count, with one leading space - a word at the start of the text and in its middle."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if bare:
            out.append(bare)
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def _bad_word_bans(
    seq: Sequence, words: list[list[int]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Bad words' last tokens seq may not sample next: a one-token word always; a longer
    one when the output ends with the word's other tokens. While the output's last token
    is pending, a word whose earlier tokens match up to it is banned on condition that
    the pending token is the one it needs."""
    output_len = seq.num_completion_tokens
    pending = seq.num_pending_tokens > 0
    banned: list[int] = []
    conditional: list[tuple[int, int]] = []
    for word in words:
        *prefix, last = word
        if not prefix:
            banned.append(last)
            continue
        if len(prefix) > output_len:
            continue
        tail = seq.token_ids[len(seq.token_ids) - len(prefix) :]
        if not pending:
            if tail == prefix:
                banned.append(last)
        elif tail[:-1] == prefix[:-1]:
            conditional.append((last, prefix[-1]))
    return banned, conditional


def _is_complete(seq: Sequence) -> bool | None:
    """Whether a constrained sequence's text is a whole match (None: unconstrained)."""
    if seq.grammar is None:
        return None
    # A stop string cuts the text short of what the grammar matched.
    return seq.grammar.is_accepting and seq.stop_text is None


def _seeded_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    # Each of the n completions gets its own stream, derived from the request's seed.
    if index:
        digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
        seed = int.from_bytes(digest, "little") & ((1 << 63) - 1)
    # Drawn where the logits are: CUDA and CPU streams differ, each is reproducible.
    return torch.Generator(device).manual_seed(seed)


def _logprob_entry(sampled: SamplerOutput, row: int, token_id: int, k: int) -> dict[int, float]:
    entry = {token_id: float(sampled.sampled_logprobs[row])}
    if k and sampled.top_token_ids is not None:
        ids = sampled.top_token_ids[row, :k].tolist()
        values = sampled.top_logprobs[row, :k].tolist()
        for alt_id, alt_logprob in zip(ids, values):
            # A banned or grammar-masked token (-inf) was never an alternative.
            if alt_logprob > float("-inf"):
                entry.setdefault(alt_id, alt_logprob)
    return entry
