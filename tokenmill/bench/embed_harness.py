"""`tokenmill bench --preset embed4k`: tokenmill's embeddings against sentence-transformers
and ONNX Runtime, side by side on the same texts.

One invocation draws the texts once, exports the ONNX graph once (when onnxruntime is
installed), then runs `repeat` rounds; each round measures the matmul peak at the
shapes of an encoder batch, then runs every system once, in a fixed order, each in its
own process (`embed_child.py`). Ratios are medians of within-round ratios, so a
disturbance that slows one round slows both sides of its ratios. Every system's
embeddings are compared with the reference system's (the first baseline,
sentence-transformers in fp32): the lowest cosine over all texts.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from tokenmill.bench.child_process import run_child
from tokenmill.bench.cpu import cpu_name
from tokenmill.bench.embed_child import EmbedRun, EmbedSystem
from tokenmill.bench.embed_workload import (
    EMBED_PRESETS,
    EncoderShape,
    build_embed_workload,
)
from tokenmill.bench.stats import median

EMBED_BASELINES = ("st", "onnx")
PEAK_ROWS = 2048  # rows of the matmuls the peak is measured at: an encoder batch's


@dataclass
class EmbedBenchConfig:
    preset: str = "embed4k"
    model: str | None = "all-minilm-l6-v2"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    baselines: tuple[str, ...] = EMBED_BASELINES
    repeat: int = 3
    threads: int | None = None
    engine_args: dict = field(default_factory=dict)
    timeout_s: float = 1800.0
    command: str = ""

    def __post_init__(self) -> None:
        if self.preset not in EMBED_PRESETS:
            raise ValueError(f"unknown embedding preset {self.preset!r}")
        unknown = [b for b in self.baselines if b not in EMBED_BASELINES]
        if unknown:
            raise ValueError(
                f"unknown embedding baseline(s) {unknown}; choose from {', '.join(EMBED_BASELINES)}"
            )
        if self.repeat < 1:
            raise ValueError("repeat must be >= 1")


@dataclass
class EmbedSummary:
    label: str
    dtype: str
    is_baseline: bool
    num_runs: int = 0
    wall_s: float | None = None
    wall_s_runs: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None  # useful (computed, unpadded) tokens per second
    rows_per_s: float | None = None
    num_tokens: int = 0  # tokens of the texts after truncation
    num_computed_tokens: int = 0  # through the model, padding included
    num_input_tokens: int = 0  # before truncation
    roofline: float | None = None  # useful FLOPs / wall / matmul peak at this dtype
    ratios: dict[str, float] = field(default_factory=dict)  # baseline -> x its rows/s
    min_cosine: float | None = None  # against the reference system's embeddings
    cpu_util: float | None = None
    peak_rss_mb: float | None = None
    error: str | None = None


@dataclass
class EmbedReport:
    preset: str
    model_dir: str
    command: str
    num_texts: int
    useful_tflop: float
    peaks_gflops: dict[str, float]
    systems: list[EmbedSummary]
    reference: str | None
    machine: dict
    notes: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


Log = Callable[[str], None]


def run_embedding_benchmark(config: EmbedBenchConfig, log: Log = lambda _: None) -> EmbedReport:
    """Run every system `config.repeat` times, alternating, and summarise."""
    from tokenmill.bench.harness import _machine_facts, source_version
    from tokenmill.engine import resolve_model

    model_dir = str(resolve_model(config.model))
    workload = build_embed_workload(
        EMBED_PRESETS[config.preset], Path(model_dir) / "tokenizer.json"
    )
    shape = EncoderShape.from_dir(model_dir)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-embed-bench-") as tmp:
        tmp = Path(tmp)
        workload_path = tmp / "workload.json"
        workload.to_json(workload_path)
        systems = _systems(config, model_dir, tmp, notes, log)
        runs: dict[str, list[EmbedRun | None]] = {s.label: [] for s in systems}
        errors: dict[str, str] = {}
        peaks: dict[str, float] = {}
        count = 0
        for round_index in range(config.repeat):
            log(f"round {round_index + 1}/{config.repeat}")
            for dtype, gflops in _peaks(shape, sorted({s.dtype for s in systems})).items():
                peaks[dtype] = max(peaks.get(dtype, 0.0), gflops)
            for system in systems:
                count += 1
                system_path, result_path = tmp / f"system{count}.json", tmp / f"run{count}.json"
                system_path.write_text(json.dumps(asdict(system)))
                failure = _spawn(
                    ["run", str(system_path), str(workload_path), str(result_path)],
                    config.timeout_s,
                )
                if failure is not None:
                    errors[system.label] = failure
                    runs[system.label].append(None)
                    log(f"  {system.label}: FAILED - {failure}")
                    continue
                run = EmbedRun(**json.loads(result_path.read_text()))
                runs[system.label].append(run)
                log(
                    f"  {system.label}: {run.wall_s:.2f} s, "
                    f"{sum(run.lengths) / run.wall_s:,.0f} tok/s, "
                    f"{len(run.lengths) / run.wall_s:,.1f} rows/s"
                )
        summaries, reference = _summaries(systems, runs, errors, shape, peaks)
    if source_version() == "unknown":
        notes.append("not run from a git checkout: the code version is unknown")
    machine = _machine_facts(_Device()) | {"source": source_version(), "cpu": cpu_name()}
    lengths = next((r.lengths for rs in runs.values() for r in rs if r is not None), [])
    return EmbedReport(
        preset=config.preset,
        model_dir=model_dir,
        command=config.command,
        num_texts=len(workload.texts),
        useful_tflop=shape.flops(lengths) / 1e12,
        peaks_gflops=peaks,
        systems=summaries,
        reference=reference,
        machine=machine,
        notes=notes,
    )


@dataclass
class _Device:
    device: str = "cpu"
    threads: int | None = None


def _systems(config, model_dir: str, tmp: Path, notes: list[str], log: Log) -> list[EmbedSystem]:
    import importlib.util

    systems = []
    for name in config.baselines:
        if name == "st":
            if importlib.util.find_spec("sentence_transformers") is None:
                notes.append("st: skipped - sentence-transformers is not installed")
                continue
            systems.append(
                EmbedSystem("st-fp32", "st", model_dir=model_dir, threads=config.threads)
            )
        else:
            if importlib.util.find_spec("onnxruntime") is None:
                notes.append(
                    "onnx: skipped - onnxruntime is not installed "
                    "(pip install onnxruntime onnx onnxscript)"
                )
                continue
            onnx_path = tmp / "model.onnx"
            log("exporting the ONNX graph (once)")
            failure = _spawn(["export", model_dir, str(onnx_path)], config.timeout_s)
            if failure is not None:
                notes.append(f"onnx: skipped - the export failed: {failure}")
                continue
            systems.append(
                EmbedSystem(
                    "onnx-fp32",
                    "onnx",
                    model_dir=model_dir,
                    onnx_path=str(onnx_path),
                    threads=config.threads,
                )
            )
    for dtype in config.dtypes:
        short = {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)
        systems.insert(
            len([s for s in systems if s.kind == "tokenmill"]),
            EmbedSystem(
                f"tokenmill-{short}",
                "tokenmill",
                dtype,
                model_dir=model_dir,
                engine_args=dict(config.engine_args or {}),
                threads=config.threads,
            ),
        )
    return systems


def _peaks(shape: EncoderShape, dtypes: list[str]) -> dict[str, float]:
    from tokenmill.bench.flops import measure_matmul_peak

    return {d: measure_matmul_peak(d, shape.matmul_shapes(PEAK_ROWS)).gflops for d in dtypes}


def _spawn(args: list[str], timeout_s: float) -> str | None:
    return run_child([sys.executable, "-m", "tokenmill.bench.embed_child", *args], timeout_s)


def _summaries(systems, runs, errors, shape: EncoderShape, peaks):
    baselines = [s.label for s in systems if s.kind != "tokenmill"]
    reference = baselines[0] if baselines else None
    summaries = []
    for system in systems:
        done = [r for r in runs[system.label] if r is not None]
        summary = EmbedSummary(
            system.label,
            system.dtype,
            system.kind != "tokenmill",
            error=errors.get(system.label),
        )
        summaries.append(summary)
        if not done:
            continue
        first = done[0]
        summary.num_runs = len(done)
        summary.wall_s_runs = [r.wall_s for r in done]
        summary.wall_s = median(summary.wall_s_runs)
        summary.num_tokens = sum(first.lengths)
        summary.num_computed_tokens = first.num_computed_tokens
        summary.num_input_tokens = first.num_input_tokens
        summary.tokens_per_s = summary.num_tokens / summary.wall_s
        summary.rows_per_s = len(first.lengths) / summary.wall_s
        summary.cpu_util = median([r.cpu_s / r.wall_s for r in done])
        summary.peak_rss_mb = max(r.peak_rss_bytes for r in done) / 2**20
        peak = peaks.get(system.dtype)
        if peak:
            summary.roofline = shape.flops(first.lengths) / summary.wall_s / (peak * 1e9)
        for base in baselines:
            if base == system.label:
                continue
            pairs = [
                (ours.wall_s, theirs.wall_s)
                for ours, theirs in zip(runs[system.label], runs[base])
                if ours is not None and theirs is not None
            ]
            if pairs:
                summary.ratios[base] = median([t / o for o, t in pairs])
        if reference is not None and system.label != reference:
            ref = next((r for r in runs[reference] if r is not None), None)
            if ref is not None:
                summary.min_cosine = _min_cosine(first.embeddings_path, ref.embeddings_path)
    return summaries, reference


def _min_cosine(path: str, reference_path: str) -> float:
    a, b = np.load(path).astype(np.float64), np.load(reference_path).astype(np.float64)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return float(cos.min())


def render_embedding_report(report: EmbedReport, console=None) -> None:
    """The report as a rich table, with the CPU, peaks and notes."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 180)
    peaks = ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in report.peaks_gflops.items())
    console.print(
        f"[bold]{report.preset}[/]: {report.num_texts} texts, useful work "
        f"{report.useful_tflop:.2f} TFLOP; matmul peak at {PEAK_ROWS}-row encoder shapes: {peaks}"
    )
    console.print(f"CPU: {cpu_name()}")
    baselines = [s.label for s in report.systems if s.is_baseline]
    table = Table(title="Embedding throughput (medians over rounds)")
    columns = ["system", "runs", "wall s", "tok/s", "rows/s", "computed / useful tok", "roofline"]
    for name in [*columns, *(f"x {b}" for b in baselines), "min cos"]:
        table.add_column(name, justify="left" if name == "system" else "right")
    for s in report.systems:
        if s.wall_s is None:
            table.add_row(s.label, "0", f"failed: {s.error or 'no run'}"[:60])
            continue
        row = [
            s.label,
            str(s.num_runs),
            f"{s.wall_s:.2f}",
            f"{s.tokens_per_s:,.0f}",
            f"{s.rows_per_s:,.1f}",
            f"{s.num_computed_tokens / s.num_tokens:.2f}",
            f"{s.roofline:.0%}" if s.roofline is not None else "-",
        ]
        row += [f"{s.ratios[b]:.2f}" if b in s.ratios else "-" for b in baselines]
        row.append(f"{s.min_cosine:.6f}" if s.min_cosine is not None else "ref")
        table.add_row(*row)
    console.print(table)
    first = next((s for s in report.systems if s.num_tokens), None)
    if first is not None:
        console.print(
            f"tokens: {first.num_input_tokens:,} in the texts, {first.num_tokens:,} after "
            "truncation to max_seq_length (useful)"
        )
    for note in report.notes:
        console.print(f"note: {note}")
