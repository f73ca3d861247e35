"""What the prefix cache will serve, and the steps the engine will take, before any compute
(`LLM.plan`'s machinery, api/plan.py).

A job's rows reach the engine in the plan's order (shard by shard, each shard one
`generate` call on one engine whose cache lives on between calls), and the engine bills
a request's cached tokens once, at its first admission (`Scheduler._admit_waiting`):
the leading full blocks of its prompt already in the prefix cache, at most
`num_tokens - 1` tokens. A waiting request whose next block a running one is computing
waits for it, so a shared prefix is computed once and every later request sharing it
gets it from the cache. Two ways to know the count beforehand:

`replay_prefix_cache` - the rule above over the plan's order, with a cache that never
    forgets: each request is served the leading blocks of its prompt that any earlier
    request's prompt filled. It is exact whenever the cache never has to evict a block
    (`never_evicts`: every block the job could ever take fits the engine's cache at
    once - then no block is evicted and no request is preempted), and an upper bound
    otherwise (eviction only removes hits). It costs one hash per 16 prompt tokens.

`simulate_engine` - the engine's own loop (`LLMEngine`, its Scheduler and BlockManager,
    which import no model code) driving a stand-in for the model that ends each request
    after a given number of tokens. Its cached counts are what the engine bills whenever
    the completions have those lengths - eviction and preemption included - and its
    steps (tokens computed and sampled per step) are what `pipelines/calibration.py`
    prices in seconds.

`simulate_encoder` - the same for an encoder (`EncoderEngine`): no KV cache, so nothing
    is ever cached; its steps are the loop's own length-sorted batches of each call.

Pooling requests on a decoder run through the decode loop prompt-only: one whose pooling
reads only the last row (last-token) shares cached prefixes as a generation does; one
that reads every row (mean, CLS ...) is served nothing at its first admission, as a
scoring request (`PlannedRequest.reads_every_token`, the scheduler's `num_cacheable_tokens`).

What neither can see: a prompt block equal to tokens another request *generated* (a
prompt that continues an earlier answer word for word) is served from the cache by the
engine and counted by neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from tokenmill.engine.core.block_manager import hash_block_tokens
from tokenmill.engine.core.encoder_engine import EncoderEngine
from tokenmill.engine.core.llm_engine import LLMEngine
from tokenmill.engine.core.step import PoolingState, SamplerOutput, SchedulerOutput, StepResult
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.pooling_params import PoolingParams
from tokenmill.engine.types.sampling_params import SamplingParams


@dataclass(frozen=True)
class PlannedRequest:
    """One request as the engine will see it: prompt, params, and (to simulate) how many
    tokens each of its completions will have."""

    token_ids: Sequence[int]
    params: SamplingParams | PoolingParams
    completion_tokens: int = 1  # per completion; ignored by `replay_prefix_cache`
    # A pooling request whose pooling reads every prompt row (see the module docstring).
    reads_every_token: bool = False

    @property
    def is_pooling(self) -> bool:
        return isinstance(self.params, PoolingParams)

    @property
    def is_prompt_only(self) -> bool:
        """It ends once its prompt is computed: it scores or pools the prompt."""
        return self.is_pooling or self.params.is_prompt_only

    @property
    def served_from_cache(self) -> bool:
        """Whether the prefix cache may serve it at its first admission: not a request
        that records prompt log-probabilities (scoring) or folds every row into a
        pooling - each must compute the rows it reads."""
        if self.is_pooling:
            return not self.reads_every_token
        return not self.params.is_prompt_only


def replay_prefix_cache(requests: Sequence[PlannedRequest], block_size: int) -> list[int]:
    """Each request's cached prompt tokens when run in this order on one engine whose
    prefix cache starts empty and never evicts (see the module docstring).

    Returns:
        One count per request, in order.
    """
    filled: set[bytes] = set()
    cached = []
    for request in requests:
        ids = request.token_ids
        num_full = len(ids) // block_size
        hashes: list[bytes] = []
        parent = None
        for i in range(num_full):
            parent = hash_block_tokens(parent, tuple(ids[i * block_size : (i + 1) * block_size]))
            hashes.append(parent)
        hits = 0
        # Scoring requests record prompt log-probabilities as they compute them, and a
        # pooling over every row folds each in: the engine serves neither from the cache.
        if request.served_from_cache:
            for block_hash in hashes[: (len(ids) - 1) // block_size]:
                if block_hash not in filled:
                    break
                hits += 1
        cached.append(hits * block_size)
        filled.update(hashes)
    return cached


def blocks_needed(requests: Sequence[PlannedRequest], block_size: int) -> int:
    """The most KV blocks the requests could take if none shared a block and every
    completion ran to max_tokens."""
    return sum(
        r.params.n * -(-(len(r.token_ids) + r.params.max_tokens) // block_size) for r in requests
    )


def never_evicts(requests: Sequence[PlannedRequest], block_size: int, num_blocks: int) -> bool:
    """Whether the engine's cache holds every block these requests could take at once.

    Then no cached block is ever evicted (the pool hands out a block that still holds
    a hash only once every never-used block is gone) and no request is preempted, so
    `replay_prefix_cache` is exact.
    """
    return blocks_needed(requests, block_size) <= num_blocks


@dataclass
class StepLoad:
    """One engine step's work, as the engine's counters see it."""

    prompt_tokens: int  # prompt tokens computed (not served from the cache)
    sampled_tokens: int  # tokens generated

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.sampled_tokens


@dataclass
class Simulation:
    """What `simulate_engine` saw: billed cached tokens per request, and every step."""

    cached_tokens: list[int]
    completion_tokens: list[int]
    steps: list[StepLoad] = field(default_factory=list)
    num_preemptions: int = 0


class _ScriptedRunner:
    """Stands in for the model: each sampling chunk gets a token, the end-of-sequence
    token once its sequence has its scripted number of completion tokens."""

    FILLER, EOS = 1, 0

    def __init__(self, lengths: dict[str, int]) -> None:
        self.device = torch.device("cpu")
        self.lengths = lengths  # request id -> completion tokens

    def execute(self, out: SchedulerOutput, previous) -> StepResult:
        for c in out.chunks:
            # What the worker's pooler records of a chunk (`Pooler.record_step`): the
            # scheduler lets the cache serve such a sequence only rows folded in.
            state = c.seq.pooling
            if state is not None and state.reads_every_token:
                end = c.seq.num_computed_tokens + c.num_new_tokens
                state.num_pooled = max(state.num_pooled, end)
        token_ids = [
            self.EOS
            if c.seq.num_completion_tokens + 1 >= self.lengths[c.seq.request_id]
            else self.FILLER
            for c in out.chunks
            if c.samples
        ]
        if not token_ids:
            return StepResult(None)
        return StepResult(SamplerOutput(torch.tensor(token_ids, dtype=torch.long)))


def simulate_engine(
    batches: Sequence[Sequence[PlannedRequest]],
    engine_config: EngineConfig,
    *,
    num_blocks: int,
    max_model_len: int,
    vocab_size: int,
) -> Simulation:
    """Run the engine's loop over `batches` (one `generate` call each, in order, on one
    engine) with a stand-in model that ends each completion after its scripted length.

    Args:
        batches: the requests of each call, in order (a job: its shards' rows).
        engine_config: the engine's settings (block size, token budget, max_num_seqs,
            prefix caching).
        num_blocks: the KV cache's blocks.
        max_model_len: the engine's context length.
        vocab_size: the model's vocabulary (prompt ids are checked against it).

    Returns:
        The Simulation: cached and completion tokens per request (all batches, in
        order) and the load of every step.
    """
    lengths: dict[str, int] = {}
    runner = _ScriptedRunner(lengths)
    config = replace(engine_config, overlap_steps=False, cuda_graphs=False)
    engine = LLMEngine(
        runner,
        config,
        None,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        eos_token_ids=[_ScriptedRunner.EOS],
    )
    sim = Simulation([], [])
    stats = engine.stats
    next_id = 0
    for batch in batches:
        ids = []
        for request in batch:
            rid = str(next_id)
            next_id += 1
            lengths[rid] = max(1, request.completion_tokens)
            if request.is_pooling:
                state = PoolingState(request.params, request.reads_every_token)
                engine.add_request(rid, list(request.token_ids), SamplingParams(), pooling=state)
            else:
                engine.add_request(rid, list(request.token_ids), _plain(request.params))
            ids.append(rid)
        done = {}
        while engine.has_unfinished:
            computed, generated = stats.computed_prompt_tokens, stats.generated_tokens
            for output in engine.step():
                done[output.request_id] = output
            sim.steps.append(
                StepLoad(
                    stats.computed_prompt_tokens - computed, stats.generated_tokens - generated
                )
            )
        sim.cached_tokens += [done[rid].cached_tokens for rid in ids]
        sim.completion_tokens += [done[rid].completion_tokens for rid in ids]
    sim.num_preemptions = stats.num_preemptions
    return sim


class _PooledNothing:
    """Stands in for an encoder: every batch pools to nothing (only steps are counted)."""

    device = torch.device("cpu")

    def unsupported(self, params: PoolingParams) -> str | None:
        return None

    def run(self, token_ids: list[list[int]], params: list[PoolingParams]) -> list:
        return [None] * len(token_ids)


def simulate_encoder(
    batches: Sequence[Sequence[PlannedRequest]],
    engine_config: EngineConfig,
    *,
    max_model_len: int,
    vocab_size: int,
) -> Simulation:
    """Run an encoder's loop (`EncoderEngine`) over `batches` (one `encode` call each, in
    order) with a stand-in model: the steps it takes, and nothing cached.

    Args:
        batches: the requests of each call, in order.
        engine_config: the engine's settings (max_num_batched_tokens, max_num_seqs).
        max_model_len: the longest sequence the encoder serves.
        vocab_size: the model's vocabulary (prompt ids are checked against it).

    Returns:
        The Simulation: zero cached and completion tokens per request, every step.
    """
    engine = EncoderEngine(
        _PooledNothing(), engine_config, max_model_len=max_model_len, vocab_size=vocab_size
    )
    sim = Simulation([], [])
    stats = engine.stats
    next_id = 0
    for batch in batches:
        for request in batch:
            engine.add_request(str(next_id), list(request.token_ids), request.params)
            next_id += 1
        while engine.has_unfinished:
            computed = stats.computed_prompt_tokens
            engine.step()
            sim.steps.append(StepLoad(stats.computed_prompt_tokens - computed, 0))
        sim.cached_tokens += [0] * len(batch)
        sim.completion_tokens += [0] * len(batch)
    return sim


def _plain(params: SamplingParams) -> SamplingParams:
    """What the engine's scheduling needs of a request's params: how many completions,
    how long at most, whether it only scores its prompt. Stop strings, grammars and
    penalties only decide where a completion ends - the script decides that here."""
    if params.is_prompt_only:
        return SamplingParams(max_tokens=0, prompt_logprobs=0)
    return SamplingParams(n=params.n, temperature=0, max_tokens=params.max_tokens)
