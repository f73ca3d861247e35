"""Job-level id checks over a stream of rows, in 8 bytes a row.

Ids key the results and resume, so a null or repeated id fails the whole job before
any compute. Keeping every id string to find repeats would make planning memory grow
with the dataset; `IdCheck` keeps one 64-bit hash per row instead. Equal ids always
hash equal, so no repeat is missed. A hash seen twice only makes its ids suspects:
they are compared exactly in a second pass over the ids, so a hash collision never
rejects a job, and the error lists the real duplicates in the order they recur.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import polars as pl

MAX_LISTED = 5  # ids quoted in a duplicate-id error

# id batches in input order; called again for the exact second pass
IdBatches = Callable[[], Iterable[Sequence[str | None]]]


def hash_ids(ids: Sequence[str | None]) -> np.ndarray:
    """One uint64 per id (stable within a process, which is all one check needs)."""
    return pl.Series(values=ids, dtype=pl.String).hash(seed=0).to_numpy()


class IdCheck:
    """Counts null ids and hashes the rest, batch by batch, for `check` at the end."""

    def __init__(self) -> None:
        self.num_rows = 0
        self.num_nulls = 0
        self.first_null: int | None = None  # row index
        self._hashes: list[np.ndarray] = []

    def add(self, ids: Sequence[str | None], first_row: int | None = None) -> None:
        """The ids of the next rows, in input order (`first_row`: the first one's row
        index, which is the rows added so far: they come in order)."""
        nulls = [i for i, x in enumerate(ids) if x is None]
        if nulls and self.first_null is None:
            self.first_null = self.num_rows + nulls[0]
        self.num_nulls += len(nulls)
        self.num_rows += len(ids)
        if not self.num_nulls and ids:  # with a null the job fails anyway
            self._hashes.append(hash_ids(ids))

    def check(self, *, id_column: str | None, source: str, id_batches: IdBatches) -> None:
        """Raise ValueError if any id was null or repeats.

        Args:
            id_column: the id column's name (for the message).
            source: the input's URL (for the message).
            id_batches: the same ids again, batch by batch; read only when two hashes
                are equal, to compare the ids themselves.
        """
        if self.num_nulls:
            raise ValueError(null_ids_message(source, id_column, self.num_nulls, self.first_null))
        suspects = self._repeated_hashes()
        if suspects.size == 0:
            return
        duplicates = _exact_duplicates(suspects, id_batches())
        if duplicates:
            raise ValueError(
                duplicate_ids_message(source, id_column, len(duplicates), duplicates[:MAX_LISTED])
            )

    def _repeated_hashes(self) -> np.ndarray:
        if not self._hashes:
            return np.empty(0, np.uint64)
        hashes = np.sort(np.concatenate(self._hashes))
        self._hashes = [hashes]
        return np.unique(hashes[1:][hashes[1:] == hashes[:-1]])


def null_ids_message(source: str, id_column: str | None, num_nulls: int, first: int) -> str:
    """The error for null ids: how many, and the row index of the first."""
    return (
        f"{source}: id column {id_column!r} is null in {num_nulls} row(s) "
        f"(first at row {first}); every row needs an id"
    )


def duplicate_ids_message(
    source: str, id_column: str | None, num_duplicates: int, listed: Sequence[str]
) -> str:
    """The error for repeated ids: how many ids repeat, the first MAX_LISTED of them in
    the order they first recur (`listed`)."""
    more = f" and {num_duplicates - MAX_LISTED} more" if num_duplicates > MAX_LISTED else ""
    return (
        f"{source}: {num_duplicates} duplicate id(s) in column {id_column!r}: "
        f"{', '.join(repr(d) for d in listed)}{more}; ids must be unique (each id gets "
        "exactly one result row)"
    )


def _exact_duplicates(suspects: np.ndarray, id_batches: Iterable[Sequence[str | None]]) -> list:
    """The ids among the suspects that really repeat, in the order they first recur."""
    seen: set[str] = set()
    duplicates: dict[str, None] = {}
    for ids in id_batches:
        if not len(ids):
            continue
        for i in np.flatnonzero(np.isin(hash_ids(ids), suspects)):
            rid = ids[i]
            if rid in seen:
                duplicates[rid] = None
            seen.add(rid)
    return list(duplicates)
