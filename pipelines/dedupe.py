"""Exact duplicates computed once: which rows share an answer, and their copy shards.

The rule, in full:

1. Two rows are duplicates when their prompt token ids and their sampling parameters
   are identical (the same entry of the job's params table) and the answer is
   deterministic: greedy (temperature 0), a seed, a prompt-only request (scoring), or a
   pooling one (embed, classify, rerank).
   Sampled rows without a seed are never duplicates: each copy must be its own draw.
2. The first such row in input order is the *source*; it is computed as any row is.
   Every later one is a *copy*: it is not sent to the engine.
3. A copy's result row holds its source's answer (output, finish_reason, completions,
   scores...), its own id and passthrough columns, `duplicate_of` = the source's id, and
   zero prompt, cached and completion tokens: nothing was computed for it. The ledger
   sums the rows as they are, so it bills each distinct computation once and "the
   ledger equals the rows" holds; `rows_deduplicated` counts the copies.

Copies do not ride in their source's shard - the source may sit in another shard or
another planning window. Each window's copies form a *copy shard*, planned after every
compute shard; it names its sources' shards (`Shard.sources`) and runs once they are
published (in a flow, right after the last of them, by the task that published it):
it reads its sources' parts and writes its own part. So a copy shard is resumable like
any shard (done iff its part exists), and each copy's row is written exactly once. Its id hashes the copies, their prompts and
params, and their sources' rows and shards, so a changed source is a different shard.

Memory: within a window a dict of the window's rows; across windows 28 bytes per
distinct row (a 16-byte digest, the source's row index and shard), in sorted numpy
arrays, so a job of millions of rows is planned in tens of MB.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill.engine import PoolingParams, SamplingParams
from tokenmill.pipelines.plan import PlannedShard, Shard, shard_id
from tokenmill.pipelines.scoring import GENERATE
from tokenmill.pipelines.tokenize import PromptRow

_KEY = np.dtype([("hi", "<u8"), ("lo", "<u8")])


def is_deterministic(params: SamplingParams | PoolingParams) -> bool:
    """Whether a row's answer is fixed by its prompt and params (rule 1)."""
    if isinstance(params, PoolingParams):  # embed, classify, rerank: nothing is sampled
        return True
    return params.temperature == 0 or params.seed is not None or params.is_prompt_only


def row_digest(row: PromptRow) -> bytes:
    """16 bytes naming what a row computes: its params entry, its LoRA adapter, its
    prompt tokens and its images' content hashes (rows of different adapters, or of
    different images under the same tokens, answer differently)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(row.params_index.to_bytes(4, "little"))
    if row.lora_index:  # base-model rows keep the digests they had before adapters
        h.update(b"lora" + row.lora_index.to_bytes(4, "little"))
    ids = row.token_ids
    h.update((ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)).tobytes())
    for image in row.image_hashes:  # text rows keep the digests they had before images
        h.update(b"image" + image)
    return h.digest()


@dataclass(frozen=True)
class Copy:
    """A row answered by an earlier identical row."""

    row: PromptRow
    source_row_index: int
    source_shard: str | None  # None until the source's (same-window) shard is cut


def find_copies(rows: Sequence[PromptRow], params: Sequence[SamplingParams]) -> dict[int, int]:
    """Copies among `rows` (given in input order): copy row index -> source row index."""
    first: dict[bytes, int] = {}
    copies = {}
    for row in rows:
        if row.token_ids is None or not is_deterministic(params[row.params_index]):
            continue
        source = first.setdefault(row_digest(row), row.row_index)
        if source != row.row_index:
            copies[row.row_index] = source
    return copies


class DuplicateIndex:
    """The sources of earlier windows: digest -> (source row index, source shard)."""

    def __init__(self) -> None:
        self._keys = np.empty(0, _KEY)  # sorted
        self._rows = np.empty(0, np.int64)
        self._shards = np.empty(0, np.int32)
        self.shard_ids: list[str] = []

    def __len__(self) -> int:
        return len(self._keys)

    def lookup(self, digests: Sequence[bytes]) -> list[tuple[int, str] | None]:
        """(source row index, source shard id) per digest, None where it is new."""
        if not len(self._keys) or not digests:
            return [None] * len(digests)
        keys = _keys(digests)
        at = np.searchsorted(self._keys, keys)
        found = (at < len(self._keys)) & (self._keys[np.minimum(at, len(self._keys) - 1)] == keys)
        return [
            (int(self._rows[i]), self.shard_ids[self._shards[i]]) if hit else None
            for i, hit in zip(at.tolist(), found.tolist())
        ]

    def add(self, digests: Sequence[bytes], row_indices: Sequence[int], shards: Sequence[str]):
        """Record sources (digests not already present)."""
        if not digests:
            return
        numbers = {}
        for sid in dict.fromkeys(shards):
            numbers[sid] = len(self.shard_ids)
            self.shard_ids.append(sid)
        keys = np.concatenate([self._keys, _keys(digests)])
        rows = np.concatenate([self._rows, np.asarray(row_indices, np.int64)])
        shard_numbers = np.asarray([numbers[s] for s in shards], np.int32)
        order = np.argsort(keys, kind="stable")
        self._keys = keys[order]
        self._rows = rows[order]
        self._shards = np.concatenate([self._shards, shard_numbers])[order]


def _keys(digests: Sequence[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(digests), dtype=_KEY)


class Deduplicator:
    """Splits each planning window into rows to compute and copies (rules 1 and 2).

    Call `split(rows)` on a window, cut the rows to compute into shards, then
    `sources_cut(shards)` to record where this window's sources landed; `copies` of
    the window are then complete.

    Args:
        params: the job's distinct SamplingParams (rows index them).
    """

    def __init__(self, params: Sequence[SamplingParams]) -> None:
        self.params = params
        self.index = DuplicateIndex()
        self.num_copies = 0
        self._window_sources: dict[int, bytes] = {}  # row index -> digest
        self._pending: list[Copy] = []

    def split(self, rows: Sequence[PromptRow], apart: Collection[int] = ()) -> list[PromptRow]:
        """The rows of a window to compute (input order kept); its copies are kept here.
        Rows whose index is in `apart` are computed themselves, never copied nor copied
        from (their answer is read otherwise than their twins': a raw line in a job that
        splits chat answers' reasoning)."""
        candidates = [
            i
            for i, r in enumerate(rows)
            if r.token_ids is not None
            and is_deterministic(self.params[r.params_index])
            and r.row_index not in apart
        ]
        digests = {i: row_digest(rows[i]) for i in candidates}
        earlier = dict(zip(candidates, self.index.lookup([digests[i] for i in candidates])))
        first_in_window: dict[bytes, int] = {}
        self._window_sources, self._pending = {}, []
        keep = []
        for i, row in enumerate(rows):
            digest = digests.get(i)
            if digest is None:
                keep.append(row)
            elif earlier[i] is not None:
                self._pending.append(Copy(row, *earlier[i]))
            elif digest in first_in_window:
                self._pending.append(Copy(row, first_in_window[digest], None))
            else:
                first_in_window[digest] = row.row_index
                self._window_sources[row.row_index] = digest
                keep.append(row)
        self.num_copies += len(self._pending)
        return keep

    def sources_cut(self, planned: Sequence[PlannedShard]) -> list[Copy]:
        """Record the shards this window's sources landed in; return the window's copies,
        each with its source's shard."""
        where = {r.row_index: p.shard.shard_id for p in planned for r in p.rows}
        sources = list(self._window_sources)
        self.index.add(
            [self._window_sources[i] for i in sources], sources, [where[i] for i in sources]
        )
        copies = [
            c
            if c.source_shard is not None
            else Copy(c.row, c.source_row_index, where[c.source_row_index])
            for c in self._pending
        ]
        self._window_sources, self._pending = {}, []
        return copies


def copy_shard(
    copies: Sequence[Copy],
    params: Sequence[SamplingParams],
    *,
    model_key: str,
    task: str = GENERATE,
    window: int,
    adapter_keys: Sequence[str] = (),
) -> Shard:
    """The copy shard of one window's copies (its index is set once all are planned);
    `adapter_keys` as for `plan.shard_id`."""
    h = hashlib.sha256(b"copies\x00")
    rows = [c.row for c in copies]
    h.update(
        shard_id(rows, params, model_key=model_key, task=task, adapter_keys=adapter_keys).encode()
    )
    for c in copies:
        h.update(f"\x00{c.source_row_index}:{c.source_shard}".encode())
    return Shard(
        shard_id=f"copies-{window:05d}-{h.hexdigest()[:20]}",
        index=0,
        num_rows=len(copies),
        num_tokens=0,
        window=window,
        is_copy=True,
        sources=tuple(dict.fromkeys(c.source_shard for c in copies if c.source_shard)),
    )
