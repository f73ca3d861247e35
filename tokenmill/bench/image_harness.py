"""`tokenmill bench --preset images512`: tokenmill's vision-language generation against
transformers' `generate` on the same model, images and prompts: in fp32 (`--baseline hf`), bf16
(`hf-bf16`) or both.

One invocation draws the images once (Pillow, seeded: image_workload.py), picks HF's best
batch size (one timed run per candidate), then runs `repeat` rounds; each round measures
the matmul peak at the tower's shapes, then runs every system once, in a fixed order,
each in its own process (`image_child.py`). Ratios are medians of within-round ratios.
Reported per system: rows/s, image tokens/s, the tower's seconds and its share of the
roofline (the tower's FLOPs, image_workload.py, over its seconds and the peak),
preprocessing's share of the run's CPU seconds, and greedy tokens identical to the
reference (the first HF baseline named, else the first system).
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenmill.bench.child_process import run_child
from tokenmill.bench.cpu import cpu_name
from tokenmill.bench.image_child import ImageRun, ImageSystem
from tokenmill.bench.image_workload import (
    IMAGE_PRESETS,
    ImageWorkload,
    VisionShape,
    build_image_workload,
)
from tokenmill.bench.stats import median

IMAGE_BASELINES = ("hf", "hf-bf16")
# baseline -> the transformers system's label and dtype
HF_IMAGE_SYSTEMS = {"hf": ("hf-fp32", "float32"), "hf-bf16": ("hf-bf16", "bfloat16")}
HF_IMAGE_BATCH_SIZES = (4, 8, 16, 32)
PEAK_PATCHES = 1024  # rows of the matmuls the tower's peak is measured at


@dataclass
class ImageBenchConfig:
    preset: str = "images512"
    model: str | None = None
    dtypes: tuple[str, ...] = ("float32",)
    baselines: tuple[str, ...] = IMAGE_BASELINES
    repeat: int = 1
    hf_batch_sizes: tuple[int, ...] = HF_IMAGE_BATCH_SIZES
    threads: int | None = None
    engine_args: dict = field(default_factory=dict)
    seed: int | None = None
    timeout_s: float = 1800.0
    command: str = ""

    def __post_init__(self) -> None:
        if self.preset not in IMAGE_PRESETS:
            raise ValueError(
                f"unknown image preset {self.preset!r}; choose from {', '.join(IMAGE_PRESETS)}"
            )
        unknown = [b for b in self.baselines if b not in IMAGE_BASELINES]
        if unknown:
            raise ValueError(
                f"unknown image baseline(s) {unknown}; choose from {', '.join(IMAGE_BASELINES)}"
            )
        if self.model is None:
            raise ValueError(
                "an image preset needs --model: a Gemma 3, Qwen2.5-VL or Qwen2-VL directory "
                "(python -m tokenmill.bench.tiny_vlm builds a tiny random one)"
            )
        if self.repeat < 1:
            raise ValueError("repeat must be >= 1")
        if not self.hf_batch_sizes or min(self.hf_batch_sizes) < 1:
            raise ValueError("hf_batch_sizes must be positive")


@dataclass
class ImageSummary:
    label: str
    dtype: str
    is_baseline: bool
    num_runs: int = 0
    wall_s: float | None = None
    wall_s_runs: list[float] = field(default_factory=list)
    rows_per_s: float | None = None
    image_tokens_per_s: float | None = None
    tower_s: float | None = None
    tower_share: float | None = None  # of the wall time
    tower_roofline: float | None = None  # tower FLOPs / tower seconds / matmul peak
    prep_cpu_share: float | None = None  # preprocessing CPU s / the run's CPU s
    cpu_util: float | None = None
    peak_rss_mb: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)  # baseline -> x its rows/s
    same_tokens: int | None = None  # requests with the reference's greedy tokens
    extra: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class ImageReport:
    preset: str
    model_dir: str
    command: str
    num_requests: int
    num_image_tokens: int
    tower_tflop: float
    peaks_gflops: dict[str, float]
    systems: list[ImageSummary]
    reference: str | None
    sweep: list[dict]
    machine: dict
    notes: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


Log = Callable[[str], None]


def run_image_benchmark(config: ImageBenchConfig, log: Log = lambda _: None) -> ImageReport:
    """Run every system `config.repeat` times, alternating, and summarise."""
    from dataclasses import replace

    from tokenmill.bench.harness import _machine_facts, source_version
    from tokenmill.engine import resolve_model

    model_dir = str(resolve_model(config.model))
    shape = VisionShape.from_dir(model_dir)
    spec = IMAGE_PRESETS[config.preset]
    if config.seed is not None:
        spec = replace(spec, seed=config.seed)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-image-bench-") as tmp:
        tmp = Path(tmp)
        log(f"drawing {spec.num_requests} images")
        workload = build_image_workload(spec, model_dir, tmp / "images")
        workload_path = tmp / "workload.json"
        workload.to_json(workload_path)
        runner = _Runner(tmp, workload_path, config.timeout_s, log)
        systems = [
            ImageSystem(
                f"tokenmill-{_short(dtype)}",
                "tokenmill",
                dtype,
                model_dir,
                dict(config.engine_args or {}),
                threads=config.threads,
            )
            for dtype in config.dtypes
        ]
        sweep: list[dict] = []
        for hf in hf_systems(config, model_dir):
            systems.append(_best_batch(runner, hf, config.hf_batch_sizes, workload, sweep))
        runs: dict[str, list[ImageRun | None]] = {s.label: [] for s in systems}
        peaks: dict[str, float] = {}
        for round_index in range(config.repeat):
            log(f"round {round_index + 1}/{config.repeat}")
            for dtype, gflops in _peaks(shape, sorted({s.dtype for s in systems})).items():
                peaks[dtype] = max(peaks.get(dtype, 0.0), gflops)
            for system in systems:
                runs[system.label].append(runner.run(system))
        summaries, reference = _summaries(systems, runs, runner.errors, workload, shape, peaks)
    machine = _machine_facts(_Device(threads=config.threads)) | {
        "source": source_version(),
        "cpu": cpu_name(),
    }
    return ImageReport(
        preset=config.preset,
        model_dir=model_dir,
        command=config.command,
        num_requests=workload.num_requests,
        num_image_tokens=sum(shape.image_tokens(*s) for s in workload.image_sizes),
        tower_tflop=_tower_flops(workload, shape) / 1e12,
        peaks_gflops=peaks,
        systems=summaries,
        reference=reference,
        sweep=sweep,
        machine=machine,
        notes=notes,
    )


def hf_systems(config: ImageBenchConfig, model_dir: str) -> list[ImageSystem]:
    """transformers' generate in each precision the baselines name (each at its own
    fastest batch size)."""
    systems = []
    for name in config.baselines:
        label, dtype = HF_IMAGE_SYSTEMS[name]
        systems.append(ImageSystem(label, "hf", dtype, model_dir, threads=config.threads))
    return systems


@dataclass
class _Device:
    device: str = "cpu"
    threads: int | None = None


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)


class _Runner:
    """Starts one child per run and keeps why any failed."""

    def __init__(self, tmp: Path, workload_path: Path, timeout_s: float, log: Log) -> None:
        self.tmp, self.workload_path, self.timeout_s, self.log = tmp, workload_path, timeout_s, log
        self.errors: dict[str, str] = {}
        self._count = 0

    def run(self, system: ImageSystem) -> ImageRun | None:
        self._count += 1
        system_path = self.tmp / f"system{self._count}.json"
        result_path = self.tmp / f"run{self._count}.json"
        system_path.write_text(json.dumps(asdict(system)))
        command = [sys.executable, "-m", "tokenmill.bench.image_child", "run"]
        failure = run_child(
            [*command, str(system_path), str(self.workload_path), str(result_path)],
            self.timeout_s,
        )
        if failure is not None:
            self.errors[system.label] = failure
            self.log(f"  {system.label}: FAILED - {failure}")
            return None
        run = ImageRun(**json.loads(result_path.read_text()))
        self.log(
            f"  {system.label}: {run.wall_s:.2f} s, {len(run.output_ids) / run.wall_s:,.1f} "
            f"rows/s, tower {run.tower_s:.2f} s, CPU/wall {run.cpu_s / run.wall_s:.2f}"
        )
        return run


def _best_batch(
    runner: _Runner,
    system: ImageSystem,
    candidates: tuple[int, ...],
    workload: ImageWorkload,
    sweep: list[dict],
) -> ImageSystem:
    """The HF baseline at its fastest batch size on this workload (one run per size;
    sizes above the number of requests collapse into one)."""
    from dataclasses import replace

    sizes = sorted({min(b, workload.num_requests) for b in candidates})
    if len(sizes) == 1:
        return replace(system, batch_size=sizes[0])
    runner.log(f"{system.label}: trying batch sizes {sizes}")
    best: tuple[float, int] | None = None
    for size in sizes:
        run = runner.run(replace(system, batch_size=size))
        if run is None:
            continue
        sweep.append({"system": system.label, "batch_size": size, "wall_s": run.wall_s})
        if best is None or run.wall_s < best[0]:
            best = (run.wall_s, size)
    size = best[1] if best else sizes[-1]
    runner.log(f"{system.label}: best batch size {size}")
    runner.errors.pop(system.label, None)  # a failed candidate is not a failed system
    return replace(system, batch_size=size)


def _peaks(shape: VisionShape, dtypes: list[str]) -> dict[str, float]:
    from tokenmill.bench.flops import measure_matmul_peak

    shapes = shape.matmul_shapes(PEAK_PATCHES)
    return {d: measure_matmul_peak(d, shapes).gflops for d in dtypes}


def _tower_flops(workload: ImageWorkload, shape: VisionShape) -> int:
    """The tower's FLOPs over the workload: each distinct image once (a system that
    encodes a repeated image again computes more than this)."""
    return sum(shape.tower_flops(*size) for size in workload.image_sizes)


def _summaries(systems, runs, errors, workload: ImageWorkload, shape: VisionShape, peaks):
    baselines = [s.label for s in systems if s.kind != "tokenmill"]
    reference = baselines[0] if baselines else systems[0].label
    reference_run = next((r for r in runs[reference] if r is not None), None)
    flops = _tower_flops(workload, shape)
    summaries = []
    for system in systems:
        done = [r for r in runs[system.label] if r is not None]
        summary = ImageSummary(
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
        summary.rows_per_s = workload.num_requests / summary.wall_s
        summary.image_tokens_per_s = first.num_image_tokens / summary.wall_s
        summary.tower_s = median([r.tower_s for r in done])
        summary.tower_share = median([r.tower_s / r.wall_s for r in done])
        peak = peaks.get(system.dtype)
        if peak and summary.tower_s:
            summary.tower_roofline = flops / summary.tower_s / (peak * 1e9)
        summary.prep_cpu_share = median([r.prep_cpu_s / r.cpu_s for r in done if r.cpu_s])
        summary.cpu_util = median([r.cpu_s / r.wall_s for r in done])
        summary.peak_rss_mb = max(r.peak_rss_bytes for r in done) / 2**20
        summary.extra = first.extra
        for base in baselines:
            pairs = [
                (ours.wall_s, theirs.wall_s)
                for ours, theirs in zip(runs[system.label], runs[base])
                if ours is not None and theirs is not None and base != system.label
            ]
            if pairs:
                summary.ratios[base] = median([t / o for o, t in pairs])
        if reference_run is not None:
            summary.same_tokens = sum(
                a == b for a, b in zip(first.output_ids, reference_run.output_ids)
            )
    return summaries, reference


def render_image_report(report: ImageReport, console=None) -> None:
    """The report as a rich table, with the CPU, the tower's work, the peaks and notes."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if sys.stdout.isatty() else 200)
    peaks = ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in report.peaks_gflops.items())
    console.print(
        f"[bold]{report.preset}[/]: {report.num_requests} images, {report.num_image_tokens:,} "
        f"image tokens, tower {report.tower_tflop:.3f} TFLOP; matmul peak at the tower's "
        f"shapes ({PEAK_PATCHES} patches): {peaks}"
    )
    console.print(f"CPU: {report.machine.get('cpu')}")
    baselines = [s.label for s in report.systems if s.is_baseline]
    table = Table(title="Images (medians over rounds)")
    columns = ["system", "runs", "wall s", "rows/s", "image tok/s", "tower s", "tower/wall"]
    columns += ["tower roofline", "prep CPU share", "CPU/wall", "peak RSS MB"]
    for name in [*columns, *(f"x {b}" for b in baselines), f"same tokens as {report.reference}"]:
        table.add_column(name, justify="left" if name == "system" else "right")
    for s in report.systems:
        if s.wall_s is None:
            table.add_row(s.label, "0", f"failed: {s.error or 'no run'}"[:60])
            continue
        row = [
            s.label,
            str(s.num_runs),
            f"{s.wall_s:.2f}",
            f"{s.rows_per_s:,.1f}",
            f"{s.image_tokens_per_s:,.0f}",
            f"{s.tower_s:.2f}",
            f"{s.tower_share:.0%}",
            f"{s.tower_roofline:.1%}" if s.tower_roofline is not None else "-",
            f"{s.prep_cpu_share:.1%}" if s.prep_cpu_share is not None else "-",
            f"{s.cpu_util:.2f}",
            f"{s.peak_rss_mb:,.0f}",
        ]
        row += [f"{s.ratios[b]:.2f}" if b in s.ratios else "-" for b in baselines]
        row.append(f"{s.same_tokens}/{report.num_requests}" if s.same_tokens is not None else "-")
        table.add_row(*row)
    console.print(table)
    for entry in report.sweep:
        console.print(
            f"sweep: {entry['system']} batch {entry['batch_size']}: {entry['wall_s']:.2f} s"
        )
    for note in report.notes:
        console.print(f"note: {note}")
