"""Copies decided in hash buckets by parts that each saw some windows are
`Deduplicator`'s copies, window by window: the same rows kept, the same copies in the
same order with the same sources and source shards (same window, earlier windows,
windows of another decision group), sampled rows and error rows never copied."""

from __future__ import annotations

import random
from array import array

import pytest

from tokenmill.engine import SamplingParams
from tokenmill.pipelines import dedupe_buckets
from tokenmill.pipelines.dedupe import Deduplicator
from tokenmill.pipelines.dedupe_buckets import BucketedDeduplicator, DigestBuckets, bucket_copies
from tokenmill.pipelines.plan import PlannedShard, Shard
from tokenmill.pipelines.tokenize import PromptRow

PARAMS = [SamplingParams(temperature=0.0, max_tokens=4), SamplingParams(temperature=1.0)]
WINDOW = 10


def _rows(num_rows: int, seed: int) -> list[PromptRow]:
    """Prompts drawn from 40 (many repeats, near and far); every 9th row sampled without
    a seed, every 13th an error."""
    draw = random.Random(seed)
    rows = []
    for i in range(num_rows):
        prompt = draw.randrange(40)
        tokens = None if i % 13 == 5 else array("i", [1, 2, prompt, prompt % 7])
        error = "bad" if tokens is None else None
        rows.append(
            PromptRow(i, f"k{i}", token_ids=tokens, error=error, params_index=int(i % 9 == 4))
        )
    return rows


def _cut(rows: list[PromptRow], window: int) -> list[PlannedShard]:
    """Two shards per window: even and odd rows (any cut will do: only where the
    sources land matters)."""
    halves = [tuple(r for r in rows if r.row_index % 2 == k) for k in (0, 1)]
    return [
        PlannedShard(Shard(f"w{window}-{k}", 0, len(half), 1, window), half)
        for k, half in enumerate(halves)
        if half
    ]


def _plan(dedupe, rows: list[PromptRow]) -> list[tuple]:
    seen = []
    for window in range(0, len(rows), WINDOW):
        kept = dedupe.split(rows[window : window + WINDOW])
        copies = dedupe.sources_cut(_cut(kept, window // WINDOW))
        seen.append(
            (
                [r.row_index for r in kept],
                [(c.row.row_index, c.source_row_index, c.source_shard) for c in copies],
            )
        )
    return seen


@pytest.mark.parametrize("num_buckets", [1, 4])
def test_bucketed_copies_are_the_deduplicators(tmp_path, monkeypatch, num_buckets):
    monkeypatch.setattr(dedupe_buckets, "GROUP_WINDOWS", 3)  # decisions in 7 groups
    monkeypatch.setattr(dedupe_buckets, "FLUSH_ROWS", 8)
    rows = _rows(200, num_buckets)
    # two parts, the second starting mid-window
    for part, (begin, end) in enumerate([(0, 95), (95, 200)]):
        digests = DigestBuckets(
            str(tmp_path), None, part=part, num_buckets=num_buckets, params=PARAMS
        )
        for start in range(begin, end, 7):
            digests.add(rows[start : min(end, start + 7)])
        digests.close()
    found = sum(bucket_copies(str(tmp_path), None, b, WINDOW) for b in range(num_buckets))
    local = Deduplicator(PARAMS)
    expected = _plan(local, rows)
    bucketed = BucketedDeduplicator(str(tmp_path), None, window_rows=WINDOW)
    assert _plan(bucketed, rows) == expected
    assert bucketed.num_copies == local.num_copies == found > 100
    assert any(src // WINDOW < row // WINDOW - 3 for _, c in expected for row, src, _ in c)
    assert not bucketed._source_shards  # every source forgotten once its last copy ran
