"""Runs the systems side by side: the same workloads, alternating, each run in its own
process.

One invocation: draw each preset's workload once; make the GGUF formats llama.cpp runs
(llama-quantize, cached); per preset pick HF's best batch size and llama-server's best
slot count (one run per candidate); then `repeat` rounds, each measuring the matmul peak
and running every system on every preset once in a fixed order (A B C, A B C).
Medians, within-round ratios and each tokenmill mode's ratio to llama.cpp's best run of
its precision class follow, one report per preset; llama.cpp's own benchmarks
(llama-bench, llama-batched-bench) run once at the end when asked for.
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

from tokenmill.bench import llamacpp
from tokenmill.bench.child_process import run_child
from tokenmill.bench.flops import ModelShape
from tokenmill.bench.llamacpp import LlamaTools
from tokenmill.bench.report import BenchReport, build_summaries, useful_flops
from tokenmill.bench.result import RunResult, load_avg_1m
from tokenmill.bench.systems import (
    HF_BATCH_SIZES,
    Job,
    SystemSpec,
    baseline_systems,
    peer_formats,
    split_quantization,
    tokenmill_systems,
)
from tokenmill.bench.workload import PRESET_NAMES, Workload, cap_workload, load_preset

DTYPES = ("float32", "bfloat16")
# llama-server slot counts tried when a workload has more requests than slots
# (docs/performance.md, "Baselines").
LLAMA_SERVER_SLOTS = (4, 8, 16, 64)


@dataclass
class BenchConfig:
    """What to compare and how (see `tokenmill bench --help` for each knob)."""

    presets: tuple[str, ...] = ("mixed64",)
    model: str | None = None
    dtypes: tuple[str, ...] = ("float32",)
    baselines: tuple[str, ...] = ("hf",)
    repeat: int = 1
    hf_batch_sizes: tuple[int, ...] = HF_BATCH_SIZES
    device: str = "cpu"
    threads: int | None = None
    engine_args: dict = field(default_factory=dict)
    quantizations: tuple[str, ...] = ()  # tokenmill systems with LLM(quantization=...)
    # Directories of the model quantized by another tool, each run as a tokenmill system.
    checkpoints: tuple[str, ...] = ()
    # Each tokenmill system with each KV cache dtype (none: the engine's default only).
    kv_cache_dtypes: tuple[str, ...] = ()
    vllm_args: dict = field(default_factory=dict)
    vllm_python: str | None = None
    llamacpp_gguf: str | None = None  # the GGUF llama.cpp's formats are made from
    llama_server: str | None = None  # llama-server binary for the llamacpp-server baseline
    llama_bin_dir: str | None = None  # llama.cpp's binaries (server, bench, quantize)
    # llama.cpp runs the model's GGUF in each format (default: the file as it is).
    llamacpp_formats: tuple[str, ...] = ()
    # llama-server's -np: one value, or several to sweep (default: LLAMA_SERVER_SLOTS).
    llama_server_slots: tuple[int, ...] = ()
    llama_server_args: tuple[str, ...] = ()  # extra llama-server arguments
    llama_reference: bool = False  # also run llama-bench and llama-batched-bench per format
    seed: int | None = None
    # Each preset's first `rows` requests, each output at most `output_tokens` (None:
    # whole): a run at a large model kept to minutes (workload.cap_workload).
    rows: int | None = None
    output_tokens: int | None = None
    timeout_s: float = 1800.0  # per child process
    command: str = ""  # the command line, recorded in the report

    def __post_init__(self) -> None:
        if self.repeat < 1:
            raise ValueError("repeat must be >= 1")
        if not self.presets:
            raise ValueError("at least one preset is needed")
        for preset in self.presets:
            if preset not in PRESET_NAMES:
                raise ValueError(
                    f"unknown preset {preset!r}; choose from {', '.join(PRESET_NAMES)}"
                )
        for label, cap in (("rows", self.rows), ("output_tokens", self.output_tokens)):
            if cap is not None and cap < 1:
                raise ValueError(f"{label} must be >= 1")
        if any(slots < 1 for slots in self.llama_server_slots):
            raise ValueError("llama_server_slots must be >= 1")
        for fmt in self.llamacpp_formats:
            llamacpp.validate_format(fmt)
        if not self.dtypes:
            raise ValueError("at least one tokenmill dtype is needed")
        for dtype in self.dtypes:
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
        from tokenmill.engine import EngineConfig, check_settings

        # Each raises for a name its registry does not know, naming the choices.
        for quantization in self.quantizations:
            method, fmt = split_quantization(quantization)
            check_settings(EngineConfig(quantization=method))
            if fmt is not None:
                llamacpp.validate_format(fmt)
        for kv_cache_dtype in self.kv_cache_dtypes:
            check_settings(EngineConfig(kv_cache_dtype=kv_cache_dtype))
        if not self.hf_batch_sizes or min(self.hf_batch_sizes) < 1:
            raise ValueError("hf_batch_sizes must be positive")


Log = Callable[[str], None]


def run_benchmark(config: BenchConfig, log: Log = lambda _: None) -> list[BenchReport]:
    """Run every system `config.repeat` times on every preset, alternating, and summarise.

    Args:
        config: what to run.
        log: receives one line per step (progress; never prompts or outputs).

    Returns:
        One report per preset, in config.presets' order (its systems in run order:
        tokenmill first, then the baselines).
    """
    from tokenmill.engine import resolve_model

    code_at_start = source_version()
    model_dir = str(resolve_model(config.model))
    workloads = {
        p: cap_workload(
            load_preset(p, model_dir, seed=config.seed),
            rows=config.rows,
            output_tokens=config.output_tokens,
        )
        for p in config.presets
    }
    shape = ModelShape.from_dir(model_dir)
    ggufs, source_format, notes = _llama_ggufs(config, model_dir, log)
    tools = LlamaTools.find(config.llama_bin_dir, config.llama_server)
    baselines, skipped = baseline_systems(
        list(config.baselines),
        llamacpp_gguf=config.llamacpp_gguf,
        vllm_python=config.vllm_python,
        vllm_args=config.vllm_args,
        llama_server=str(tools.server) if tools.server else None,
        llama_server_slots=config.llama_server_slots[0]
        if len(config.llama_server_slots) == 1
        else None,
        llamacpp_ggufs={fmt: str(path) for fmt, path in ggufs.items()} or None,
        llama_server_args=config.llama_server_args,
    )
    notes += skipped
    for note in notes:
        log(note)
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-") as tmp:
        runner = _ChildRunner(Path(tmp), model_dir, config, log)
        specs_by_preset, sweeps = {}, {}
        for preset, workload in workloads.items():
            workload.to_json(runner.workload_path(preset))
            runner.preset = preset
            adapters = _lora_adapters(workload, model_dir, Path(tmp) / preset, log)
            specs = tokenmill_systems(
                list(config.dtypes),
                config.engine_args,
                list(config.quantizations),
                structured=workload.json_schema is not None,
                kv_cache_dtypes=list(config.kv_cache_dtypes),
                gguf_files={fmt: str(path) for fmt, path in ggufs.items()},
                lora_adapters=adapters,
                checkpoints=list(config.checkpoints),
            )
            specs = [_with_model_dir(spec, log) for spec in specs]
            picked, sweep = _pick_hf_batch_sizes(runner, baselines, config.hf_batch_sizes, workload)
            picked, slot_sweep = _pick_llama_slots(
                runner, picked, config.llama_server_slots or LLAMA_SERVER_SLOTS, workload
            )
            specs_by_preset[preset], sweeps[preset] = specs + picked, sweep + slot_sweep
        runs = {p: {s.label: [] for s in specs_by_preset[p]} for p in workloads}
        peaks: dict[str, float] = {}
        bandwidth: dict[str, float] = {}
        for round_index in range(config.repeat):
            log(f"round {round_index + 1}/{config.repeat}")
            all_dtypes = {s.dtype for specs in specs_by_preset.values() for s in specs}
            round_peaks, round_bandwidth = runner.peaks(sorted(all_dtypes))
            for dtype, gflops in round_peaks.items():
                peaks[dtype] = max(peaks.get(dtype, 0.0), gflops)
            for kind, gbs in round_bandwidth.items():  # the best round, as for the peak
                bandwidth[kind] = max(bandwidth.get(kind, 0.0), gbs)
            for preset in workloads:
                runner.preset = preset
                if len(workloads) > 1:
                    log(f" {preset}")
                _run_round(runner, specs_by_preset[preset], runs[preset], round_index)
        references = _llama_references(config, tools, ggufs, log) if config.llama_reference else []
    if source_version() != code_at_start:
        # Every child imports the engine afresh: results from different code do not compare.
        runner.notes.append("the source tree changed during this run: rounds ran different code")
    reports = []
    for preset, workload in workloads.items():
        specs = specs_by_preset[preset]
        peers = {s.label: _peer_labels(s, specs, source_format) for s in specs}
        summaries = build_summaries(
            specs,
            runs[preset],
            runner.errors.get(preset, {}),
            workload=workload,
            shape=shape,
            peaks_gflops=peaks,
            peers=peers,
            read_gbs=bandwidth.get("read_gbs"),
        )
        reports.append(
            BenchReport(
                preset=preset,
                model_dir=model_dir,
                command=config.command,
                workload=_workload_facts(workload, shape),
                machine=_machine_facts(config) | {"source": code_at_start},
                peaks_gflops=peaks,
                bandwidth_gbs=bandwidth,
                systems=summaries,
                sweeps=sweeps[preset],
                runs=[r for r in runner.records if r["preset"] == preset],
                notes=notes + runner.notes,
                llamacpp=_llamacpp_facts(ggufs, source_format, references),
            )
        )
    return reports


def _run_round(
    runner: _ChildRunner,
    specs: list[SystemSpec],
    runs: dict[str, list[RunResult | None]],
    round_index: int,
) -> None:
    """Every system once, in order, on the runner's current preset."""
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


def _llama_ggufs(config: BenchConfig, model_dir: str, log: Log) -> tuple[dict, str | None, list]:
    """({format: GGUF path} llama.cpp and gguf:FMT run, the source file's layer format,
    notes): each format made from the source GGUF (--llamacpp-gguf, else the model's own
    file: --model's, or the one its alias converted) with llama-quantize, or the source
    itself in its own format."""
    from tokenmill.bench.run_llamacpp import source_gguf
    from tokenmill.bench.scale_shapes import GGUF_FORMATS, is_scale_model
    from tokenmill.engine import cache_dir

    wants_llama = any(b.startswith("llamacpp") for b in config.baselines)
    gguf_modes = [f for q in config.quantizations if (f := split_quantization(q)[1])]
    plain_gguf = any(split_quantization(q) == ("gguf", None) for q in config.quantizations)
    if not (wants_llama or gguf_modes or plain_gguf):
        return {}, None, []
    try:
        if config.llamacpp_gguf:
            source = Path(config.llamacpp_gguf)
        elif config.model and str(config.model).endswith(".gguf") and Path(config.model).is_file():
            source = Path(config.model)
        elif is_scale_model(model_dir):  # --shape: its GGUF written from the same values
            log("writing the scale model's GGUF (first use only)")
            source = _scale_gguf(model_dir, None)
        else:
            source = source_gguf(model_dir)
        source_format = llamacpp.layer_format(source)
    except (FileNotFoundError, ValueError) as error:
        return {}, None, [f"llama.cpp formats: {error}"]
    formats = list(config.llamacpp_formats or ((source_format,) if wants_llama else ()))
    formats += [f for f in gguf_modes if f not in formats]
    tools = LlamaTools.find(config.llama_bin_dir, config.llama_server)
    ggufs, notes = {}, []
    # A scale model's formats are written from its random values (gguf.quants), not
    # requantized from the BF16 file: llama-quantize is then not needed.
    written = is_scale_model(model_dir) and not config.llamacpp_gguf
    for fmt in formats:
        if written and fmt in GGUF_FORMATS:
            log(f"writing the scale model's {fmt} GGUF (first use only)")
            ggufs[fmt] = _scale_gguf(model_dir, fmt)
            continue
        try:
            ggufs[fmt] = llamacpp.prepare_gguf(
                tools.quantize, source, fmt, cache_dir() / "bench-gguf"
            )
            log(f"llama.cpp {fmt}: {ggufs[fmt]}")
        except (FileNotFoundError, RuntimeError) as error:
            notes.append(f"llama.cpp {fmt}: skipped - {error}")
    return ggufs, source_format, notes


def _scale_gguf(model_dir: str, fmt: str | None) -> Path:
    # Deferred: the writer imports torch, which the parent process otherwise never loads.
    from tokenmill.bench.scale_gguf import scale_gguf_path

    return scale_gguf_path(model_dir, fmt)


def _with_model_dir(spec: SystemSpec, log: Log) -> SystemSpec:
    """A tokenmill system on another model file gets its converted directory (made now,
    once, rather than inside a timed child's set-up)."""
    from tokenmill.engine import resolve_model

    if "model" not in spec.options:
        return spec
    model_dir = str(resolve_model(spec.options["model"]))
    log(f"{spec.label}: {spec.options['model']} -> {model_dir}")
    return spec.with_options(model_dir=model_dir)


def _peer_labels(spec: SystemSpec, specs: list[SystemSpec], source_format: str | None) -> list[str]:
    """The llama.cpp systems of spec's precision class (systems.peer_formats)."""
    formats = peer_formats(spec, source_format)
    return [
        other.label
        for other in specs
        if other.kind.startswith("llamacpp")
        and other.options.get("format", source_format) in formats
    ]


def _llama_references(
    config: BenchConfig, tools: LlamaTools, ggufs: dict[str, Path], log: Log
) -> list[dict]:
    """llama-bench (prompt 512, generate 128) and llama-batched-bench per format."""
    threads = config.threads or os.cpu_count() or 1
    references = []
    for fmt, gguf in ggufs.items():
        for tool, run in (
            ("llama-bench", llamacpp.run_llama_bench),
            ("llama-batched-bench", llamacpp.run_batched_bench),
        ):
            log(f"{tool} {fmt}")
            try:
                facts = run(tools, gguf, threads)
            except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as error:
                facts = {"tool": tool, "error": str(error)[:300]}
            references.append({"format": fmt, "load_avg_1m": load_avg_1m(), **facts})
    return references


def _llamacpp_facts(ggufs: dict[str, Path], source_format: str | None, references: list) -> dict:
    if not ggufs:
        return {}
    return {
        "source_format": source_format,
        "files": {
            fmt: {"path": str(path), "tensor_types": llamacpp.tensor_types(path)}
            for fmt, path in ggufs.items()
        },
        "reference": references,
    }


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
        self.preset = config.presets[0]  # the workload runs are on
        self.errors: dict[str, dict[str, str]] = {}  # preset -> label -> failure
        self.notes: list[str] = []
        self.records: list[dict] = []
        self._count = 0

    def workload_path(self, preset: str) -> Path:
        return self.tmp / f"workload-{preset}.json"

    def run(
        self, spec: SystemSpec, round_index: int | None, output_lens: list[int] | None = None
    ) -> RunResult | None:
        """One timed run of spec on the current preset; None (and an error noted) if its
        process failed."""
        self._count += 1
        job_path = self.tmp / f"job{self._count}.json"
        result_path = self.tmp / f"result{self._count}.json"
        Job(
            spec,
            spec.options.get("model_dir", self.model_dir),
            str(self.workload_path(self.preset)),
            self.config.device,
            self.config.threads,
            output_lens,
        ).to_json(job_path)
        failure = self._spawn(spec.python, ["run", str(job_path), str(result_path)])
        if failure is not None:
            self.errors.setdefault(self.preset, {})[spec.label] = failure
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
                "preset": self.preset,
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

    def peaks(self, dtypes: list[str]) -> tuple[dict[str, float], dict[str, float]]:
        """(matmul GFLOP/s per dtype, {"read_gbs", "triad_gbs"} on a CPU), measured now
        in a child (both empty if that failed)."""
        import json

        self._count += 1
        path = self.tmp / f"peak{self._count}.json"
        args = ["peak", self.model_dir, self.config.device, ",".join(dtypes), str(path)]
        failure = self._spawn(None, args)
        if failure is not None:
            self.notes.append(f"matmul peak and bandwidth not measured: {failure}")
            return {}, {}
        measured = json.loads(path.read_text())
        peaks = {d: p["gflops"] for d, p in measured["matmul"].items()}
        bandwidth = measured["bandwidth"] or {}
        self.log("  peak: " + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in peaks.items()))
        if bandwidth:
            self.log(
                f"  bandwidth: read {bandwidth['read_gbs']:.1f} GB/s, "
                f"triad {bandwidth['triad_gbs']:.1f} GB/s"
            )
        return peaks, bandwidth

    def _spawn(self, python: str | None, args: list[str]) -> str | None:
        env = dict(os.environ)
        if python is not None:
            # Another interpreter (vLLM's environment) sees tokenmill.bench through the
            # source tree; it needs nothing else from tokenmill.
            root = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        command = [python or sys.executable, "-m", "tokenmill.bench.child", *args]
        return run_child(command, self.config.timeout_s, env)


def _pick_hf_batch_sizes(
    runner: _ChildRunner,
    baselines: list[SystemSpec],
    candidates: tuple[int, ...],
    workload: Workload,
) -> tuple[list[SystemSpec], list[dict]]:
    """Give each HF baseline its fastest batch size: one timed run per candidate.

    Candidates above the number of requests collapse into one (a single batch).
    """
    if workload.sequential:  # one request at a time: batches of one, nothing to sweep
        candidates = (1,)
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


def _pick_llama_slots(
    runner: _ChildRunner,
    baselines: list[SystemSpec],
    candidates: tuple[int, ...],
    workload: Workload,
) -> tuple[list[SystemSpec], list[dict]]:
    """Give each llama-server baseline its fastest slot count (-np) on this workload: one
    timed run per candidate, like HF's batch sizes. Counts above the number of requests
    collapse into one; a sequential workload runs on one slot, unswept."""
    sizes = sorted({min(c, workload.num_requests) for c in candidates})
    picked, sweep = [], []
    for spec in baselines:
        if spec.kind != "llamacpp-server" or workload.sequential or "parallel" in spec.options:
            picked.append(spec)
            continue
        if len(sizes) == 1:
            picked.append(spec.with_options(parallel=sizes[0]))
            continue
        runner.log(f"{spec.label}: trying slot counts {sizes}")
        best: tuple[float, int] | None = None
        for size in sizes:
            result = runner.run(spec.with_options(parallel=size), None)
            if result is None:
                continue
            rate = (result.num_prompt_tokens + result.num_generated_tokens) / result.wall_s
            sweep.append(
                {
                    "system": spec.label,
                    "parallel": size,
                    "wall_s": result.wall_s,
                    "total_tok_s": rate,
                    "load_avg_1m": result.load_avg_1m,
                }
            )
            if best is None or rate > best[0]:
                best = (rate, size)
        size = best[1] if best else sizes[-1]
        runner.log(f"{spec.label}: best slot count {size}")
        picked.append(spec.with_options(parallel=size))
    return picked, sweep


def _workload_facts(workload: Workload, shape: ModelShape) -> dict:
    return {
        "name": workload.name,
        "num_requests": workload.num_requests,
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": workload.num_output_tokens,
        "num_unique_prompt_tokens": workload.num_unique_prompt_tokens,
        "sequential": workload.sequential,
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
