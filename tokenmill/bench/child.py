"""The benchmark's child process: runs one system once, or measures the matmul peak and
the memory bandwidth.

    python -m tokenmill.bench.child run JOB.json RESULT.json
    python -m tokenmill.bench.child peak MODEL_DIR DEVICE DTYPES RESULT.json

A fresh process per run keeps peak RSS per system and stops one system's thread pools,
allocator caches and compiled kernels from helping or hurting the next.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from tokenmill.bench.result import RunResult, load_avg_1m, peak_rss_bytes
from tokenmill.bench.systems import Job
from tokenmill.bench.workload import Workload


def run_job(job: Job) -> RunResult:
    """Run job.system over its workload in this process; fill in RSS and load."""
    if job.threads and job.system.kind in ("tokenmill", "hf"):
        import torch

        torch.set_num_threads(job.threads)
    workload = Workload.from_json(job.workload_path)
    runner = _runner(job.system.kind)
    result = runner(job, workload)
    # A system served by another process (llama-server) reports that process's peak.
    result.peak_rss_bytes = max(peak_rss_bytes(), result.peak_rss_bytes or 0)
    result.load_avg_1m = load_avg_1m()
    return result


def measure_peaks(model_dir: str, device: str, dtypes: list[str]) -> dict:
    """{dtype: MatmulPeak as a dict} for the model's prefill-shaped matmuls."""
    from tokenmill.bench.flops import ModelShape, llm_matmul_shapes, measure_matmul_peak

    # A CPU step computes a few hundred tokens at a time at full speed; a GPU needs
    # thousands of rows before a matmul stops being launch-bound.
    num_tokens = 256 if device == "cpu" else 8192
    shapes = llm_matmul_shapes(ModelShape.from_dir(model_dir), num_tokens)
    return {d: asdict(measure_matmul_peak(d, shapes, device=device)) for d in dtypes}


def _runner(kind: str):
    # Imported on demand: each runner pulls in its own (heavy, optional) library.
    if kind == "tokenmill":
        from tokenmill.bench.run_tokenmill import run_tokenmill

        return run_tokenmill
    if kind == "hf":
        from tokenmill.bench.run_hf import run_hf

        return run_hf
    if kind == "llamacpp":
        from tokenmill.bench.run_llamacpp import run_llamacpp

        return run_llamacpp
    if kind == "llamacpp-server":
        from tokenmill.bench.run_llamacpp_server import run_llamacpp_server

        return run_llamacpp_server
    if kind == "vllm":
        from tokenmill.bench.run_vllm import run_vllm

        return run_vllm
    raise ValueError(f"unknown system kind {kind!r}")


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[0] == "run":
        run_job(Job.from_json(argv[1])).to_json(argv[2])
    elif len(argv) == 5 and argv[0] == "peak":
        from tokenmill.bench.bandwidth import measure_bandwidth

        peaks = measure_peaks(argv[1], argv[2], argv[3].split(","))
        bandwidth = asdict(measure_bandwidth()) if argv[2] == "cpu" else None
        Path(argv[4]).write_text(json.dumps({"matmul": peaks, "bandwidth": bandwidth}))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
