"""Where a window's ordered rows are cut into shards: full shards, or prefix-affine ones.

Two contiguous rules, both over the rows in run order (`plan.order_rows`) and a token
budget (a third, `balance`, deals the run order out to shards that do equal work when
engines run them at once: `balance_cut.py`):

    fill    each shard takes rows until the next would pass the budget (the first
            rule; kept so that results cut with it resume with the same shards)
    prefix  the same number of shards, each within the same budget, but each cut is
            moved to where the rows on either side share the shortest prompt prefix

Why `prefix`: a shard runs on one worker, and the rows on the two sides of a cut may
run on two. A cut through a group of rows that share a long prefix (a system prompt, a
few-shot block, one document asked many questions) makes a second engine compute that
prefix again; a cut between two groups costs nothing. Keeping the shard count and the
budget is what keeps every worker busy: the budget is the smallest that cuts the
window into one shard per worker (`plan.budget_for`), so a group larger than a
worker's share is still split across workers, never given to one while another idles.

How: `fill`'s shard count is the fewest shards of at most the budget each (a greedy
cut is optimal for consecutive rows), and `fewest[j]`, the count for the rows from j
on, never grows with j. A shard starting at row `start` may therefore end at any row e
up to where `fill` would end it, as long as the rows from e on still fit in the
shards left; among those ends, the one with the shortest shared prefix wins (the
latest on a tie: fuller shards first, as `fill` does). Each cut is chosen on its
own, so the cut as a whole falls back to `fill`'s where that would split less shared
prefix. O(n log n) in the rows, plus one prefix comparison per candidate end.
"""

from __future__ import annotations

import functools
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np

from tokenmill.pipelines.tokenize import PromptRow

FILL = "fill"
PREFIX = "prefix"
BALANCE = "balance"  # not contiguous: `balance_cut.py`
CUT_RULES = (FILL, PREFIX, BALANCE)


def shared_prefix(a: PromptRow, b: PromptRow) -> int:
    """Prompt tokens two rows share from their start (0 across adapters or for an error
    row: an engine never serves one's cached prefix to the other)."""
    if a.token_ids is None or b.token_ids is None or a.lora_index != b.lora_index:
        return 0
    x, y = _tokens(a.token_ids), _tokens(b.token_ids)
    length = min(len(x), len(y))
    differ = np.flatnonzero(x[:length] != y[:length])
    return int(differ[0]) if len(differ) else length


def _tokens(ids: Sequence[int]) -> np.ndarray:
    if isinstance(ids, array) and ids.typecode == "i":
        return np.frombuffer(ids, dtype=np.int32)  # no copy
    return np.asarray(ids, dtype=np.int64)


def cut_ends(
    costs: Sequence[int],
    budget: int,
    *,
    max_rows: int | None = None,
    rule: str = FILL,
    shared_at: Callable[[int], int] | None = None,
) -> list[int]:
    """Where shards end: the index after each shard's last row.

    Args:
        costs: each row's cost in run order (0 for an error row: it rides along and
            never opens a shard of its own).
        budget: the most a shard may cost (a single row above it gets its own shard).
        max_rows: optional cap on rows per shard.
        rule: FILL or PREFIX (the module docstring).
        shared_at: for PREFIX, the prompt tokens rows e - 1 and e share.

    Returns:
        Increasing end indices, the last one len(costs) (none for no rows).
    """
    if rule not in CUT_RULES:
        raise ValueError(f"unknown cut rule {rule!r}: one of {', '.join(CUT_RULES)}")
    if rule == BALANCE:
        raise ValueError("the balance cut is not contiguous: balance_cut.balanced_shards")
    if rule == PREFIX and shared_at is None:
        raise ValueError("the prefix cut needs shared_at")
    greedy_end = _greedy_ends(costs, budget, max_rows)
    if rule == FILL:
        return _fill_ends(greedy_end)
    return _prefix_ends(costs, greedy_end, shared_at)


def _prefix_ends(
    costs: Sequence[int], greedy_end: list[int], shared_at: Callable[[int], int]
) -> list[int]:
    num_rows = len(costs)
    shared_at = functools.cache(shared_at)  # compared once per boundary
    ends: list[int] = []
    start = 0
    fewest = [0] * (num_rows + 1)  # fewest[j]: shards the rows from j on need at least
    for j in range(num_rows - 1, -1, -1):
        fewest[j] = 1 + fewest[greedy_end[j]]
    while start < num_rows:
        latest = greedy_end[start]
        end = latest
        if latest < num_rows:
            shards_left = fewest[start] - 1
            best = shared_at(latest)
            e = latest - 1
            while best and e > start and fewest[e] <= shards_left:
                if costs[e]:  # a shard never starts with a row that rides along
                    shared = shared_at(e)
                    if shared < best:
                        best, end = shared, e
                e -= 1
        ends.append(end)
        start = end
    # Each cut is chosen on its own, and moving one forward can force a later one into a
    # group: where that splits more shared prefix than filling would, fill.
    fill = _fill_ends(greedy_end)
    if sum(map(shared_at, ends[:-1])) > sum(map(shared_at, fill[:-1])):
        return fill
    return ends


def _fill_ends(greedy_end: list[int]) -> list[int]:
    ends: list[int] = []
    start = 0
    while start < len(greedy_end):
        start = greedy_end[start]
        ends.append(start)
    return ends


def _greedy_ends(costs: Sequence[int], budget: int, max_rows: int | None) -> list[int]:
    """For each row j, where a shard starting at j ends when filled to the budget."""
    num_rows = len(costs)
    sums = list(accumulate(costs, initial=0))  # sums[i]: cost of rows before i
    next_paid = [num_rows] * (num_rows + 1)  # the first row from i on that costs anything
    for i in range(num_rows - 1, -1, -1):
        next_paid[i] = i if costs[i] else next_paid[i + 1]
    ends = []
    for j in range(num_rows):
        fits = bisect_right(sums, sums[j] + budget) - 1  # rows j..fits-1 fit the budget
        # Past the budget: the row that overflows starts the next shard; a lone row over
        # the budget keeps the free rows after it, up to the next row that costs.
        end = fits if fits > j else next_paid[j + 1]
        if max_rows is not None:
            end = min(end, j + max_rows)
        ends.append(end)
    return ends
