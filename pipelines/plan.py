"""Ordering and packing: which rows run together, and in which shard.

Pure functions. Rows are sorted by their first `group_tokens` prompt tokens (so every
row sharing a prefix is adjacent and the prefix stays resident in the engine's prefix
cache while its group runs) and then by length (so a group's requests finish close
together and batches stay full). The ordered rows are cut into shards under a token
budget: for one engine, each cut where the rows on its two sides share the least
prefix (`prefix_cut.py`); for several, the run order dealt out in prefix groups so that
the shards engines run at once do equal work (`balance_cut.py`). Either way rows
sharing a long prefix run on one worker; a shard is one `LLM.generate` call and the
unit of progress, retry and resume.

A job is planned in windows of consecutive input rows (`JobSpec.plan_window_rows`),
each ordered and cut on its own, so planning memory is bounded by the window, not the
dataset. The price: prefix groups form within a window only. Rows that share a prefix
but sit in different windows land in different shards, and reuse each other's prefix
only if the engine's prefix cache still holds it when the later shard runs (likely for
adjacent windows on one worker, not otherwise). Shards never span windows.

A shard's id is a hash of what it computes - model, task (scoring; a generation
job's ids are what they were before there were tasks), sampling params, the LoRA
adapters its rows use (their weights hashes), row ids and prompt token ids - so
planning the same job twice yields the same shards, and a changed job cannot mistake
another job's finished shard for its own: a scoring job and a generation job over the
same rows never share a shard or a job id, nor do rows run with different adapters.

Rows of a LoRA adapter are planned together (the adapter is the first sort key): only
rows of one adapter can share cached prefixes, and an engine with fewer adapter slots
than the job has adapters then serves one group after another.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from tokenmill.engine import SamplingParams
from tokenmill.pipelines.balance_cut import balanced_shards
from tokenmill.pipelines.prefix_cut import BALANCE, PREFIX, cut_ends, shared_prefix
from tokenmill.pipelines.scoring import GENERATE
from tokenmill.pipelines.tokenize import PromptRow

# Long enough to cover a typical shared system prompt, short enough that sort keys
# stay cheap; rows sharing more than this are still adjacent, ordered by length.
DEFAULT_GROUP_TOKENS = 256
# One shard is one generate() call: big enough to keep a GPU's batch full past the
# shard's tail, small enough that a killed job loses little work.
DEFAULT_SHARD_TOKENS = 131_072
# Rows planned together: enough for prefix groups to form in real datasets, few enough
# that a window's tokens, templates and sort keys take tens of MB, not the dataset's.
DEFAULT_PLAN_WINDOW_ROWS = 32_768


@dataclass(frozen=True)
class Shard:
    """A resumable unit of work, as a job plan carries it: its name and size.

    Its rows are not here: planning writes them to the shard's plan file, which the
    shard's task reads, so a plan is small however large the job.
    """

    shard_id: str
    index: int
    num_rows: int
    num_tokens: int  # estimated work: prompt tokens + max completion tokens
    window: int = 0  # the planning window the shard was cut from
    # A copy shard (pipelines/dedupe.py): its rows take earlier identical rows' answers
    # from their published parts; nothing is computed, and it runs once they are published.
    is_copy: bool = False
    num_prompt_tokens: int = 0  # of num_tokens, the prompts' (the rest: completion budget)
    # A copy shard's sources: the shards whose parts hold its rows' answers. Once they are
    # all published it can be written, whatever other shards still run.
    sources: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise ValueError("a shard must hold at least one row")
        if self.num_tokens < 0:
            raise ValueError("num_tokens must be >= 0")


@dataclass(frozen=True)
class PlannedShard:
    """A shard just cut, with its rows in the order they run."""

    shard: Shard
    rows: tuple[PromptRow, ...]

    @property
    def row_indices(self) -> tuple[int, ...]:
        return tuple(r.row_index for r in self.rows)


def row_cost(row: PromptRow, max_tokens: int) -> int:
    """Estimated tokens a row costs the engine; error rows cost nothing."""
    return 0 if row.token_ids is None else row.num_prompt_tokens + max_tokens


def order_rows(
    rows: Sequence[PromptRow], *, group_tokens: int = DEFAULT_GROUP_TOKENS
) -> list[PromptRow]:
    """Rows in run order: prefix groups together, by length within a group, errors last.

    Args:
        rows: tokenized rows (any order).
        group_tokens: how many leading tokens define a prefix group.

    Returns:
        A new list; ties break on row index so the order is deterministic.
    """
    good = [r for r in rows if r.token_ids is not None]
    bad = [r for r in rows if r.token_ids is None]
    good.sort(
        key=lambda r: (r.lora_index, r.token_ids[:group_tokens], len(r.token_ids), r.row_index)
    )
    bad.sort(key=lambda r: r.row_index)
    return good + bad


# SamplingParams fields left out of a params key while at their default: a job that does
# not use them keeps the shard ids it had before they existed, so its results resume.
_KEYED_WHEN_SET = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "allowed_token_ids": None,
    "bad_words": [],
}


def params_key(params: SamplingParams) -> str:
    """A string equal for equal SamplingParams. A structured outputs constraint enters by
    its own key, which keeps a schema's property order (part of what it produces); an
    unconstrained params' key is what it was before constraints existed."""
    values = asdict(params)
    constraint = values.pop("structured_outputs", None)  # PoolingParams have none
    for name, default in _KEYED_WHEN_SET.items():
        if name in values and values[name] == default:
            del values[name]
    key = json.dumps(values, sort_keys=True)
    if constraint is not None:
        key += "\x00" + params.structured_outputs.key
    return key


def shard_id(
    rows: Sequence[PromptRow],
    params: Sequence[SamplingParams],
    *,
    model_key: str,
    task: str = GENERATE,
    adapter_keys: Sequence[str] = (),
) -> str:
    """A content hash naming a shard: same rows, prompts, images, params, adapters, task
    and model -> same id. `adapter_keys[i - 1]` identifies lora index i (its weights hash)."""
    h = hashlib.sha256()
    h.update(model_key.encode())
    if task != GENERATE:
        h.update(f"\x00t{task}".encode())
    used = sorted({r.params_index for r in rows})
    for i in used:
        h.update(f"\x00p{i}:".encode())
        h.update(params_key(params[i]).encode())
    for i in sorted({r.lora_index for r in rows} - {0}):
        h.update(f"\x00a{i}:{adapter_keys[i - 1]}".encode())
    for r in rows:
        if r.lora_index:
            h.update(f"\x00l{r.lora_index}".encode())
        h.update(b"\x00r")
        h.update(r.id.encode())
        h.update(b"\x01")
        h.update(r.error.encode() if r.token_ids is None else array("i", r.token_ids).tobytes())
        for image in r.image_hashes:
            h.update(b"\x00i" + image)
    return h.hexdigest()[:20]


def indexed_shard_id(index: int, digest: str) -> str:
    """A compute shard's id: its index in the run order (so the plan files and parts
    list in that order), then its rows' digest (`shard_id`)."""
    return f"{index:05d}-{digest}"


def moved_shard_id(shard_id: str, by: int) -> str:
    """A compute shard's id once the shard is moved `by` places later in the run order."""
    index, digest = shard_id.split("-", 1)
    return indexed_shard_id(int(index) + by, digest)


def reindexed(shard: Shard, index: int) -> Shard:
    """A compute shard moved to `index` in the run order (its id carries its index)."""
    return replace(shard, index=index, shard_id=moved_shard_id(shard.shard_id, index - shard.index))


def budget_for(costs: Sequence[int], shard_tokens: int, min_shards: int) -> int:
    """The budget that cuts rows of these costs (in order) into `min_shards` shards as
    even as the order allows - the smallest budget that needs no more than that many -
    or `shard_tokens` when that already cuts at least as many. When no budget gives
    exactly `min_shards` (a few rows far costlier than the rest), the next one that
    gives more."""
    if min_shards <= 1 or len(cut_ends(costs, shard_tokens)) >= min_shards:
        return shard_tokens
    low, high = 1, shard_tokens
    while low < high:  # the filled cut's shard count never grows with the budget
        middle = (low + high) // 2
        if len(cut_ends(costs, middle)) <= min_shards:
            high = middle
        else:
            low = middle + 1
    if len(cut_ends(costs, low)) < min_shards and low > 1:
        return low - 1
    return low


def cut_shards(
    ordered: Sequence[PromptRow],
    params: Sequence[SamplingParams],
    *,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    max_rows: int | None = None,
    min_shards: int = 1,
    model_key: str,
    task: str = GENERATE,
    first_index: int = 0,
    window: int = 0,
    adapter_keys: Sequence[str] = (),
    rule: str = PREFIX,
) -> list[PlannedShard]:
    """Cut ordered rows into shards of at most `shard_tokens` each (consecutive rows,
    but for the BALANCE rule).

    A single row costlier than the budget gets a shard of its own. Error rows cost
    nothing and ride along in whichever shard they fall into (they still need a
    result row), so every row lands in exactly one shard.

    Args:
        ordered: rows in run order (`order_rows`).
        params: the job's distinct SamplingParams, indexed by `PromptRow.params_index`.
        shard_tokens: the token budget per shard (prompt + max completion tokens).
        max_rows: optional cap on rows per shard.
        min_shards: cut at least this many shards where the rows allow (one per worker
            that will run them), by lowering the budget as little as that takes.
        model_key: identifies the model (e.g. its weights hash) for the shard ids.
        task: the job's task (`pipelines/scoring.py`), also in the shard ids.
        first_index: the first shard's `index` (the shards of earlier windows come first).
        window: the planning window these rows belong to.
        adapter_keys: the job's LoRA adapters' weights hashes, by lora index - 1.
        rule: where the cuts fall (`pipelines/prefix_cut.py`): PREFIX, between rows
            that share the least prefix, or FILL, where each shard is full; or BALANCE,
            the run order dealt out in prefix groups to shards of equal work
            (`pipelines/balance_cut.py`; each shard's rows still in run order).

    Returns:
        Shards in run order, `index` first_index, first_index + 1, ...
    """
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    row_costs = [
        row_cost(r, params[r.params_index].max_tokens * params[r.params_index].n) for r in ordered
    ]
    budget = budget_for(row_costs, shard_tokens, min_shards)
    if rule == BALANCE:
        shared = [shared_prefix(a, b) for a, b in zip(ordered, ordered[1:])]
        # As many shards as the other rules cut, but dealt: each ends near an equal
        # share, not under the budget that min_shards lowered to cut that many - only
        # shard_tokens, the job's own limit, bounds a shard of the balance cut.
        num_shards = len(cut_ends(row_costs, budget, max_rows=max_rows))
        dealt = balanced_shards(
            row_costs,
            [0, *shared] if ordered else [],  # a window may have no rows left to compute
            num_shards=num_shards,
            budget=shard_tokens,
            max_rows=max_rows,
        )
    else:
        ends = cut_ends(
            row_costs,
            budget,
            max_rows=max_rows,
            rule=rule,
            shared_at=lambda e: shared_prefix(ordered[e - 1], ordered[e]),
        )
        dealt = [range(a, b) for a, b in zip([0, *ends[:-1]], ends)]
    groups = [[ordered[i] for i in positions] for positions in dealt]
    costs = [sum(row_costs[i] for i in positions) for positions in dealt]
    return [
        PlannedShard(
            Shard(
                shard_id=indexed_shard_id(
                    i,
                    shard_id(g, params, model_key=model_key, task=task, adapter_keys=adapter_keys),
                ),
                index=i,
                num_rows=len(g),
                num_tokens=c,
                window=window,
                num_prompt_tokens=sum(r.num_prompt_tokens for r in g),
            ),
            tuple(g),
        )
        for i, (g, c) in enumerate(zip(groups, costs), start=first_index)
    ]


def plan_shards(
    rows: Sequence[PromptRow],
    params: Sequence[SamplingParams],
    *,
    model_key: str,
    task: str = GENERATE,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    group_tokens: int = DEFAULT_GROUP_TOKENS,
    max_rows: int | None = None,
    min_shards: int = 1,
    first_index: int = 0,
    window: int = 0,
    adapter_keys: Sequence[str] = (),
    rule: str = PREFIX,
) -> list[PlannedShard]:
    """`order_rows` then `cut_shards`: the whole packing step for one window."""
    ordered = order_rows(rows, group_tokens=group_tokens)
    return cut_shards(
        ordered,
        params,
        shard_tokens=shard_tokens,
        max_rows=max_rows,
        min_shards=min_shards,
        model_key=model_key,
        task=task,
        first_index=first_index,
        window=window,
        adapter_keys=adapter_keys,
        rule=rule,
    )


def job_id(shards: Sequence[Shard], *, output: str) -> str:
    """A job's id: its shards plus where it writes. Rerunning it into the same place
    gives the same id; the same data written elsewhere is a different job."""
    h = hashlib.sha256(output.rstrip("/").encode())
    for s in shards:
        h.update(b"\x00" + s.shard_id.encode())
    return h.hexdigest()[:16]
