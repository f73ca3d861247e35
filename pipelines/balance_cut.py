"""The balance cut: shards that do equal work when engines run them at once.

Why not a contiguous cut: the run order (`plan.order_rows`) puts similar rows next to
each other, and similar rows stop at similar lengths (a classification row after a
word, an explanation at max_tokens). Contiguous shards equal by budget (prompt tokens +
max_tokens) then differ in what rows really generate: one worker gets the rows that
stop early and idles while the other runs the long ones. A row's real length is not
known when planning (no engine is loaded; a dry run's calibration is a sample of the
whole job, not a per-row forecast), so this cut does not predict it: it deals the run
order out in small pieces, so that each shard gets its share of every stretch of
similar rows, whatever those turn out to generate.

Pieces are prefix groups, taken from the tree of runs of rows that share a prefix (a
run split where its rows share the least; `shared[i]` is what rows i - 1 and i share):

    a group costlier than a shard's share      is split (no worker idles while another
                                               runs one large group alone; a share is
                                               at most the budget)
    a group costlier than 1/PIECES of a share  is split when computing its shared prefix
                                               once more on every shard its subgroups may
                                               reach costs at most 1/PIECES of its work
    any other group                            is one piece

So a document asked many questions is split where that costs a few hundred prompt
tokens against tens of thousands of work, and a long document asked a few questions
stays on one worker; small groups are never split.

Dealing: pieces larger than 1/PIECES of a share (groups kept whole for their prefix, a
row that alone costs that much) go first, largest first, each to the shard that costs
least so far. The other pieces are dealt in run order, each to the shard that has
taken the least part of its room (what it lacked of an equal share after the large
pieces), so every stretch of similar rows is split among the shards in proportion to
their room (evenly, when no piece was large), and the shards' costs end within about
one piece of each other. Each shard's rows stay in run order, so its engine still sees
its prefix groups adjacent and sorted by length, and its batches are as large as a
contiguous shard's (about the same rows per shard).

The shard count is the caller's (`plan.cut_shards`: the one the fill and prefix rules
cut), one more while a shard of more than one piece would pass the budget or
`max_rows`. Dealing is O(n log k) in the rows and shards; splitting scans a group once
per level of the prefix tree it is split through (vectorised), after one prefix
comparison per pair of neighbours.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from itertools import accumulate

import numpy as np

# A share is dealt in pieces of at most about 1/PIECES of it (where the prefixes allow):
# fine enough that the shards' costs, and their mix of rows, differ by a few percent;
# coarse enough that groups of a few dozen short rows stay whole.
PIECES = 16


def balanced_shards(
    costs: Sequence[int],
    shared: Sequence[int],
    *,
    num_shards: int,
    budget: int,
    max_rows: int | None = None,
) -> list[list[int]]:
    """The rows (positions in run order) of each shard of the balance cut.

    Args:
        costs: each row's cost in run order (0 for an error row: it rides along).
        shared: for i >= 1, the prompt tokens rows i - 1 and i share (shared[0] unused).
        num_shards: how many shards to deal to (at least one).
        budget: the most a shard of more than one piece may cost; more shards are cut
            while one would pass it.
        max_rows: optional cap on rows per shard.

    Returns:
        Each shard's row positions, increasing; shards ordered by their first row.
    """
    if len(shared) != len(costs):
        raise ValueError(f"{len(costs)} costs but {len(shared)} shared prefixes")
    if not costs:
        return []
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    share = min(sum(costs) / num_shards, budget)
    pieces = _pieces(costs, shared, share, fanout=num_shards, max_rows=max_rows)
    while True:
        dealt = _deal(pieces, num_shards, budget, max_rows, share / PIECES)
        if dealt is not None:
            break
        num_shards += 1  # ends by one piece a shard: a piece is within both limits
    shards = [sorted(i for start, end, _ in group for i in range(start, end)) for group in dealt]
    return sorted((s for s in shards if s), key=lambda s: s[0])


def _pieces(
    costs: Sequence[int],
    shared: Sequence[int],
    share: float,
    *,
    fanout: int,
    max_rows: int | None,
) -> list[tuple[int, int, int]]:
    """(start, end, cost) of each piece, in run order (the module docstring's rules)."""
    sums = list(accumulate(costs, initial=0))
    prefix = np.asarray(shared, dtype=np.int64)
    granule = share / PIECES
    pieces = []
    runs = [(0, len(costs))]
    while runs:
        start, end = runs.pop()
        cost = sums[end] - sums[start]
        if end - start == 1:
            pieces.append((start, end, cost))
            continue
        inner = prefix[start + 1 : end]
        least = int(inner.min())  # every row of the run shares this much
        cuts = (start + 1 + np.flatnonzero(inner == least)).tolist()
        subgroups = list(zip([start, *cuts], [*cuts, end]))
        must = cost > share or (max_rows is not None and end - start > max_rows)
        # Split apart, the subgroups may each reach another shard, which computes the
        # shared prefix again: worth it only while that is small against the group.
        recompute = (min(len(subgroups), fanout) - 1) * least
        worth = cost > granule and recompute * PIECES <= cost
        if must or worth:
            runs.extend(reversed(subgroups))
        else:
            pieces.append((start, end, cost))
    return sorted(pieces)


def _deal(
    pieces: list[tuple[int, int, int]],
    num_shards: int,
    budget: int,
    max_rows: int | None,
    granule: float,
) -> list[list[tuple[int, int, int]]] | None:
    """Pieces dealt to `num_shards` shards (the module docstring), each to the next shard
    in order of preference where the first would pass the budget or max_rows; None when
    a piece fits in none."""
    shards: list[list[tuple[int, int, int]]] = [[] for _ in range(num_shards)]
    costs, rows = [0] * num_shards, [0] * num_shards

    def fits(i: int, piece: tuple[int, int, int]) -> bool:
        start, end, cost = piece
        over_budget = cost and costs[i] + cost > budget  # a row that costs nothing rides along
        over_rows = max_rows is not None and rows[i] + end - start > max_rows
        return not shards[i] or not (over_budget or over_rows)

    def give(i: int, piece: tuple[int, int, int]) -> None:
        shards[i].append(piece)
        costs[i], rows[i] = costs[i] + piece[2], rows[i] + piece[1] - piece[0]

    large = sorted((p for p in pieces if p[2] > granule), key=lambda p: (-p[2], p[0]))
    for piece in large:  # largest first, each to the shard that costs least so far
        by_cost = sorted(range(num_shards), key=lambda i: (costs[i], rows[i], i))
        i = next((i for i in by_cost if fits(i, piece)), None)
        if i is None:
            return None
        give(i, piece)
    # What each shard still takes to reach an equal share: its part of every stretch of
    # the run order (all equal when no piece was large).
    target = sum(p[2] for p in pieces) / num_shards
    room = [max(target - c, 0.0) for c in costs]
    if not any(room):
        room = [1.0] * num_shards
    taken = [0] * num_shards
    # The shard furthest behind is the one that has taken the least part of its room.
    behind = [(0.0 if room[i] else math.inf, 0, i) for i in range(num_shards)]
    heapq.heapify(behind)
    for piece in (p for p in pieces if p[2] <= granule):  # in run order
        passed = []
        while behind and not fits(behind[0][2], piece):
            passed.append(heapq.heappop(behind))
        if not behind:
            return None
        i = heapq.heappop(behind)[2]
        give(i, piece)
        taken[i] += piece[2]
        heapq.heappush(behind, (taken[i] / room[i] if room[i] else math.inf, rows[i], i))
        for entry in passed:
            heapq.heappush(behind, entry)
    return shards
