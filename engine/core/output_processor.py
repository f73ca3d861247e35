"""From sampled tokens to what the caller gets back: each request's rules for ending
(stop tokens and strings, end-of-sequence, lengths), the tokens it may not sample next,
detokenizing, and the finished RequestOutput or PoolingOutput.

The engine loop (`llm_engine.py`) schedules and steps; for every token a resolved step
sampled it asks the processor whether the sequence ends there and why, and once all of
a request's sequences have ended it asks for the request's output. Nothing here touches
the scheduler, the cache or the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenmill.engine.core.bans import bad_word_bans, bad_words_token_ids, banned_token_ids
from tokenmill.engine.core.step import PoolingState, SamplerOutput, Sequence
from tokenmill.engine.types.outputs import (
    CompletionOutput,
    EngineStats,
    RequestMetrics,
    RequestOutput,
)
from tokenmill.engine.types.pooling_outputs import PoolingOutput
from tokenmill.engine.types.sampling_params import SamplingParams


@dataclass
class RequestState:
    """A request from the moment it is added until its output is built."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    pooling: PoolingState | None = None  # a pooling request: it ends with a PoolingOutput
    # SamplingParams.bad_words as token sequences (`bans.bad_words_token_ids`).
    bad_words: list[list[int]] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class OutputProcessor:
    """Turns a request's resolved tokens into its ending and its output.

    Args:
        tokenizer: decodes outputs and stop strings (None: token ids only).
        eos_token_ids: the model's end-of-sequence ids and the tokenizer's.
        max_seq_len: the longest a sequence may grow (the context, or the whole cache).
        stats: the engine's counters (prompt tokens are counted as requests finish).
    """

    def __init__(
        self, tokenizer, eos_token_ids: set[int], max_seq_len: int, stats: EngineStats
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_seq_len = max_seq_len
        self.stats = stats

    def new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None,
        arrival_time: float | None,
        pooling: PoolingState | None,
    ) -> RequestState:
        """A request's state, its bad words tokenized.

        Raises:
            ValueError: it has bad words and the engine no tokenizer.
        """
        metrics = RequestMetrics(arrival_time=arrival_time or time.perf_counter())
        request = RequestState(
            request_id, prompt, list(prompt_token_ids), params, [], metrics, pooling
        )
        if params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words need the model's tokenizer")
            request.bad_words = bad_words_token_ids(self.tokenizer, params.bad_words)
        return request

    # -- before a step: what each sampling sequence may not sample -------------------------

    def bans(self, seq: Sequence, request: RequestState) -> tuple[list[int], list[tuple[int, int]]]:
        """What seq may not sample next: token ids, and (token id, pending token id)
        pairs banned only if its pending token turns out to be that one."""
        banned = banned_token_ids(seq, self.eos_token_ids)
        if not request.bad_words:
            return banned, []
        word_bans, conditional = bad_word_bans(seq, request.bad_words)
        return sorted(set(banned) | set(word_bans)), conditional

    # -- after a step: each resolved token ------------------------------------------------

    def add_token(
        self, seq: Sequence, token_id: int, sampled: SamplerOutput, row: int, now: float
    ) -> str | None:
        """Record a token that has just replaced seq's placeholder (row `row` of the step
        that sampled it): its time and log-probabilities; return why seq ends with it
        ("stop" or "length"), or None."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.params.logprobs is not None:
            seq.logprobs = seq.logprobs or []
            seq.logprobs.append(_logprob_entry(sampled, row, token_id, seq.params.logprobs))
        return self._finish_reason(seq, token_id)

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

    # -- a finished request's output --------------------------------------------------------

    def output(self, request: RequestState, now: float) -> RequestOutput | PoolingOutput:
        """The output of a request whose sequences have all finished."""
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
            image_tokens=sum(image.length for image in first.images),
        )

    def _pooling_output(self, request: RequestState, now: float) -> PoolingOutput:
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

    def error_output(self, request: RequestState, error: str) -> RequestOutput | PoolingOutput:
        """The output of a request refused before it was queued."""
        request.metrics.finish_time = time.perf_counter()
        self.stats.num_errors += 1
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


def _is_complete(seq: Sequence) -> bool | None:
    """Whether a constrained sequence's text is a whole match (None: unconstrained)."""
    if seq.grammar is None:
        return None
    # A stop string cuts the text short of what the grammar matched.
    return seq.grammar.is_accepting and seq.stop_text is None


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
