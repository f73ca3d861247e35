"""Runs the systems side by side: the same workload, alternating, each run in its own process.

One invocation: draw the workload once; pick HF's best batch size (one run per
candidate); then `repeat` rounds, each measuring the matmul peak and running every
system once in a fixed order (A B C, A B C). Medians and within-round ratios follow.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tokenmill.bench.flops import ModelShape
from tokenmill.bench.report import BenchReport, build_summaries, useful_flops
from tokenmill.bench.result import RunResult
from tokenmill.bench.systems import (
    HF_BATCH_SIZES,
    Job,
    SystemSpec,
    baseline_systems,
    tokenmill_systems,
)
from tokenmill.bench.workload import Workload, load_preset

DTYPES = ("float32", "bfloat16")


@dataclass
class BenchConfig:
    """What to compare and how (see `tokenmill bench --help` for each knob)."""

    preset: str = "mixed64"
    model: str | None = None
    dtypes: tuple[str, ...] = ("float32",)
    baselines: tuple[str, ...] = ("hf",)
    repeat: int = 1
    hf_batch_sizes: tuple[int, ...] = HF_BATCH_SIZES
    device: str = "cpu"
    threads: int | None = None
    engine_args: dict = field(default_factory=dict)
    quantizations: tuple[str, ...] = ()  # tokenmill systems with LLM(quantization=...)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)  # each tokenmill system with each
    vllm_args: dict = field(default_factory=dict)
    vllm_python: str | None = None
    llamacpp_gguf: str | None = None
    llama_server: str | None = None  # llama-server binary for the llamacpp-server baseline
    llama_server_slots: int | None = None  # its -np (None: one per request, at most 64)
    seed: int | None = None
    timeout_s: float = 1800.0  # per child process
    command: str = ""  # the command line, recorded in the report

    def __post_init__(self) -> None:
        if self.repeat < 1:
            raise ValueError("repeat must be >= 1")
        if self.llama_server_slots is not None and self.llama_server_slots < 1:
            raise ValueError("llama_server_slots must be >= 1")
        if not self.dtypes:
            raise ValueError("at least one tokenmill dtype is needed")
        for dtype in self.dtypes:
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        from tokenmill.engine.quant import validate_name

        for quantization in self.quantizations:
            validate_name(quantization)
        from tokenmill.engine.worker.kv_cache import validate_kv_cache_dtype

        for kv_cache_dtype in self.kv_cache_dtypes:
            validate_kv_cache_dtype(kv_cache_dtype)
        if not self.kv_cache_dtypes:
            raise ValueError("at least one KV cache dtype is needed")
        if not self.hf_batch_sizes or min(self.hf_batch_sizes) < 1:
            raise ValueError("hf_batch_sizes must be positive")


Log = Callable[[str], None]


def run_benchmark(config: BenchConfig, log: Log = lambda _: None) -> BenchReport:
    """Run every system `config.repeat` times, alternating, and summarise.

    Args:
        config: what to run.
        log: receives one line per step (progress; never prompts or outputs).

    Returns:
        The report (its systems in run order: tokenmill first, then the baselines).
    """
    from tokenmill.engine.loader.model_files import resolve_model

    code_at_start = source_version()
    model_dir = str(resolve_model(config.model))
    workload = load_preset(config.preset, model_dir, seed=config.seed)
    shape = ModelShape.from_dir(model_dir)
    baselines, notes = baseline_systems(
        list(config.baselines),
        llamacpp_gguf=config.llamacpp_gguf,
        vllm_python=config.vllm_python,
        vllm_args=config.vllm_args,
        llama_server=config.llama_server,
        llama_server_slots=config.llama_server_slots,
    )
    for note in notes:
        log(note)
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        runner = _ChildRunner(Path(tmp), model_dir, config, log)
        workload.to_json(runner.workload_path)
        adapters = _lora_adapters(workload, model_dir, Path(tmp), log)
        baselines, sweep = _pick_hf_batch_sizes(runner, baselines, config.hf_batch_sizes, workload)
        specs = tokenmill_systems(
            list(config.dtypes),
            config.engine_args,
            list(config.quantizations),
            structured=workload.json_schema is not None,
            kv_cache_dtypes=list(config.kv_cache_dtypes),
            lora_adapters=adapters,
        )
        specs += baselines
        runs: dict[str, list[RunResult | None]] = {s.label: [] for s in specs}
        peaks: dict[str, float] = {}
        for round_index in range(config.repeat):
            log(f"round {round_index + 1}/{config.repeat}")
            for dtype, gflops in runner.peaks(sorted({s.dtype for s in specs})).items():
                peaks[dtype] = max(peaks.get(dtype, 0.0), gflops)
            for spec in specs:
                # A system sized by another's outputs runs after it, in the same round.
                source = spec.options.get("output_lens_from")
                earlier = runs[source][-1] if source else None
                if source and earlier is None:
                    runner.notes.append(f"{spec.label}: skipped a round, {source} failed in it")
                    runs[spec.label].append(None)
                    continue
                lens = earlier.generated if earlier is not None else None
                runs[spec.label].append(runner.run(spec, round_index, output_lens=lens))
    if source_version() != code_at_start:
        # Every child imports the engine afresh: results from different code do not compare.
        runner.notes.append("the source tree changed during this run: rounds ran different code")
    summaries = build_summaries(
        specs, runs, runner.errors, workload=workload, shape=shape, peaks_gflops=peaks
    )
    return BenchReport(
        preset=config.preset,
        model_dir=model_dir,
        command=config.command,
        workload=_workload_facts(workload, shape),
        machine=_machine_facts(config) | {"source": code_at_start},
        peaks_gflops=peaks,
        systems=summaries,
        hf_sweep=sweep,
        runs=runner.records,
        notes=notes + runner.notes,
    )


def _lora_adapters(workload: Workload, model_dir: str, tmp: Path, log: Log) -> list[str]:
    """A LoRA workload's adapters, written once for every run of this invocation."""
    if not workload.adapters:
        return []
    # Deferred: it imports torch, which the parent process otherwise never loads (the
    # systems run in children).
    from tokenmill.bench.lora import make_adapters

    spec = workload.spec
    num, rank = spec["num_adapters"], spec["adapter_rank"]
    log(f"writing {num} LoRA adapters of rank {rank} on every linear layer")
    paths = make_adapters(model_dir, tmp / "adapters", num_adapters=num, rank=rank)
    return [str(p) for p in paths]


class _ChildRunner:
    """Starts child processes and keeps what they report (results, failures, records)."""

    def __init__(self, tmp: Path, model_dir: str, config: BenchConfig, log: Log) -> None:
        self.tmp = tmp
        self.model_dir = model_dir
        self.config = config
        self.log = log
        self.workload_path = tmp / "workload.json"
        self.errors: dict[str, str] = {}
        self.notes: list[str] = []
        self.records: list[dict] = []
        self._count = 0

    def run(
        self, spec: SystemSpec, round_index: int | None, output_lens: list[int] | None = None
    ) -> RunResult | None:
        """One timed run of spec; None (and an error noted) if its process failed."""
        self._count += 1
        job_path = self.tmp / f"job{self._count}.json"
        result_path = self.tmp / f"result{self._count}.json"
        Job(
            spec,
            self.model_dir,
            str(self.workload_path),
            self.config.device,
            self.config.threads,
            output_lens,
        ).to_json(job_path)
        failure = self._spawn(spec.python, ["run", str(job_path), str(result_path)])
        if failure is not None:
            self.errors[spec.label] = failure
            self.log(f"  {spec.label}: FAILED - {failure}")
            return None
        result = RunResult.from_json(result_path)
        rate = (result.num_prompt_tokens + result.num_generated_tokens) / result.wall_s
        self.log(
            f"  {spec.label}: {result.wall_s:.2f} s, {rate:,.0f} tok/s, "
            f"RSS {result.peak_rss_bytes / 2**20:,.0f} MB, CPU/wall {result.cpu_s / result.wall_s:.2f}"
        )
        self.records.append(
            {
                "system": spec.label,
                "round": round_index,
                "options": spec.options,
                "wall_s": result.wall_s,
                "total_tok_s": rate,
                "peak_rss_mb": result.peak_rss_bytes / 2**20,
                "cpu_s": result.cpu_s,
                "load_avg_1m": result.load_avg_1m,
                "extra": result.extra,
            }
        )
        return result

    def peaks(self, dtypes: list[str]) -> dict[str, float]:
        """Matmul GFLOP/s per dtype, measured now in a child (empty if that failed)."""
        import json

        self._count += 1
        path = self.tmp / f"peak{self._count}.json"
        args = ["peak", self.model_dir, self.config.device, ",".join(dtypes), str(path)]
        failure = self._spawn(None, args)
        if failure is not None:
            self.notes.append(f"matmul peak not measured: {failure}")
            return {}
        peaks = {d: p["gflops"] for d, p in json.loads(path.read_text()).items()}
        self.log("  peak: " + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in peaks.items()))
        return peaks

    def _spawn(self, python: str | None, args: list[str]) -> str | None:
        env = dict(os.environ)
        if python is not None:
            # Another interpreter (vLLM's environment) sees tokenmill.bench through the
            # source tree; it needs nothing else from tokenmill.
            root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        command = [python or sys.executable, "-m", "tokenmill.bench.child", *args]
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=self.config.timeout_s
            )
        except subprocess.TimeoutExpired:
            return f"timed out after {self.config.timeout_s:.0f} s"
        if done.returncode != 0:
            lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
            return (lines[-1] if lines else f"exit status {done.returncode}")[:300]
        return None


def _pick_hf_batch_sizes(
    runner: _ChildRunner,
    baselines: list[SystemSpec],
    candidates: tuple[int, ...],
    workload: Workload,
) -> tuple[list[SystemSpec], list[dict]]:
    """Give each HF baseline its fastest batch size: one timed run per candidate.

    Candidates above the number of requests collapse into one (a single batch).
    """
    sizes = sorted({min(b, workload.num_requests) for b in candidates})
    picked, sweep = [], []
    for spec in baselines:
        if spec.kind != "hf":
            picked.append(spec)
            continue
        if len(sizes) == 1:
            picked.append(spec.with_options(batch_size=sizes[0]))
            continue
        runner.log(f"{spec.label}: trying batch sizes {sizes}")
        best: tuple[float, int] | None = None
        for size in sizes:
            result = runner.run(spec.with_options(batch_size=size), None)
            if result is None:
                continue
            rate = (result.num_prompt_tokens + result.num_generated_tokens) / result.wall_s
            sweep.append(
                {
                    "system": spec.label,
                    "batch_size": size,
                    "wall_s": result.wall_s,
                    "total_tok_s": rate,
                }
            )
            if best is None or rate > best[0]:
                best = (rate, size)
        size = best[1] if best else sizes[-1]
        runner.log(f"{spec.label}: best batch size {size}")
        picked.append(spec.with_options(batch_size=size))
    return picked, sweep


def _workload_facts(workload: Workload, shape: ModelShape) -> dict:
    return {
        "name": workload.name,
        "num_requests": workload.num_requests,
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": workload.num_output_tokens,
        "num_unique_prompt_tokens": workload.num_unique_prompt_tokens,
        "useful_tflop": useful_flops(workload, shape) / 1e12,
        "layer_matmul_params": shape.layer_matmul_params,
        "spec": workload.spec,
    }


def _machine_facts(config: BenchConfig) -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "device": config.device,
        "threads": config.threads,
    }


def source_version() -> str:
    """The checkout's commit, plus a digest of uncommitted engine/tokenmill changes if any.

    Returns "unknown" outside a git checkout.
    """
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        )
        diff = subprocess.run(
            ["git", "diff", "HEAD", "--", "engine", "tokenmill"], cwd=root, capture_output=True
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    version = head.stdout.strip()
    if diff.stdout:
        version += "+dirty." + hashlib.sha256(diff.stdout).hexdigest()[:8]
    return version
