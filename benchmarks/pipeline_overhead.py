"""What the batch pipeline adds on top of the engine, on a real job.

    python benchmarks/pipeline_overhead.py                 # 2,000 rows, bf16 where fast
    python benchmarks/pipeline_overhead.py --rows 500 --dtype float32

Writes a Parquet dataset of chat-style rows (a shared instruction plus a record of
varying length), loads the model once, then times `run_job` end to end: reading,
templating, tokenizing, planning and spilling shards, generating, writing the parts and
the ledger. Engine time is the time spent inside `LLM.generate` (the shards' device
seconds, summed); everything else is the pipeline's. Model loading is reported apart:
it is paid once per worker, not per row.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill import LLM
from tokenmill.pipelines.job import JobProgress, ShardResult, run_job

_WORDS = [
    "order",
    "shipped",
    "delayed",
    "refund",
    "customer",
    "invoice",
    "warehouse",
    "priority",
    "account",
    "balance",
    "payment",
    "pending",
    "address",
    "update",
    "request",
    "ticket",
    "support",
    "product",
    "quality",
    "return",
    "label",
]


def write_dataset(path: Path, rows: int, seed: int) -> None:
    rng = random.Random(seed)
    records = [" ".join(rng.choices(_WORDS, k=rng.randint(20, 160))) for _ in range(rows)]
    table = pa.table({"id": [f"r{i}" for i in range(rows)], "record": records})
    pq.write_table(table, path, row_group_size=512)


class EngineClock(JobProgress):
    def __init__(self) -> None:
        self.engine_seconds = 0.0
        self.shards = 0

    def shard_done(self, result: ShardResult) -> None:
        self.engine_seconds += result.device_seconds
        self.shards += 0 if result.skipped else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--shard-tokens", type=int, default=16_384)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "records.parquet"
        write_dataset(source, args.rows, args.seed)
        t0 = time.perf_counter()
        llm = LLM(dtype=args.dtype)
        load_seconds = time.perf_counter() - t0
        clock = EngineClock()
        t0 = time.perf_counter()
        ledger = run_job(
            str(source),
            str(Path(tmp) / "out"),
            llm=llm,
            progress=clock,
            id_column="id",
            template="Classify the urgency of this support record as low, medium or high.\n"
            "Record: {record}",
            max_tokens=args.max_tokens,
            shard_tokens=args.shard_tokens,
        )
        wall = time.perf_counter() - t0
    pipeline = wall - clock.engine_seconds
    print(
        f"{args.rows:,} rows ({ledger.rows_ok:,} ok), {clock.shards} shards, dtype {llm.dtype}: "
        f"job {wall:.2f} s, engine {clock.engine_seconds:.2f} s, pipeline {pipeline:.2f} s "
        f"= {100 * pipeline / clock.engine_seconds:.1f}% of engine time "
        f"(model load {load_seconds:.2f} s, once per worker)"
    )


if __name__ == "__main__":
    main()
