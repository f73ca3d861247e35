"""Finding the decoding sequences that share leading cache blocks.

Sequences whose prompts start with the same text (a system prompt, a few-shot header,
one document asked several questions) hold the same physical blocks for that prefix,
thanks to the prefix cache. Decode attention is bound by reading the cache, so the
native kernel reads such blocks once per step for a whole group instead of once per
sequence; this module picks the groups.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np


@dataclass
class SharedPrefixGroup:
    members: list[int]  # indices into the tables given to group_shared_prefixes
    shared_blocks: int  # leading blocks all members hold, each fully visible to all


def group_shared_prefixes(
    tables: list[np.ndarray], context_lens: list[int], block_size: int, max_members: int
) -> tuple[list[SharedPrefixGroup], list[int]]:
    """Split decoding sequences into groups of 2..max_members that share at least their
    first block, and the rest.

    Args:
        tables: each sequence's block table.
        context_lens: positions each sequence's query token sees, itself included; only
            blocks it sees in full can be shared.
    Returns:
        (groups, indices of the sequences in no group)
    """
    by_first_block: dict[int, list[int]] = defaultdict(list)
    alone: list[int] = []
    for index, (table, length) in enumerate(zip(tables, context_lens)):
        if length >= block_size:
            by_first_block[int(table[0])].append(index)
        else:
            alone.append(index)
    groups: list[SharedPrefixGroup] = []
    for members in by_first_block.values():
        # Sequences sharing more blocks sit next to each other, so cutting the list into
        # groups of max_members keeps each group's common prefix long.
        members.sort(key=lambda i: tuple(tables[i][: context_lens[i] // block_size]))
        for first in range(0, len(members), max_members):
            part = members[first : first + max_members]
            if len(part) == 1:
                alone.extend(part)
                continue
            full = min(context_lens[i] // block_size for i in part)
            leading = np.stack([tables[i][:full] for i in part])
            same = (leading == leading[0]).all(axis=0)
            shared = full if same.all() else int(np.argmin(same))
            groups.append(SharedPrefixGroup(part, shared))
    return groups, alone
