"""Renders BenchReports as rich tables: per preset throughput, then latency and memory;
across presets each tokenmill mode against llama.cpp's best run of its precision class
(like for like), and llama.cpp's own benchmarks when they ran."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from tokenmill.bench.report import BenchReport, SystemSummary
from tokenmill.bench.stats import Percentiles


def render(report: BenchReport, console: Console | None = None) -> None:
    """Print the report's tables and notes."""
    # Piped output (a file, CI log, README) would otherwise wrap at 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    w = report.workload
    console.print(
        f"[bold]{report.preset}[/]: {w['num_requests']} requests, "
        f"{w['num_prompt_tokens']:,} prompt + {w['num_output_tokens']:,} generated tokens "
        f"({w['num_unique_prompt_tokens']:,} prompt tokens with shared prefixes once); "
        f"useful work {w['useful_tflop']:.2f} TFLOP"
    )
    caps = [
        f"{label} {w['spec'][key]:,}"
        for key, label in (
            ("rows_cap", "first rows"),
            ("output_tokens_cap", "output tokens at most"),
        )
        if w.get("spec", {}).get(key) is not None
    ]
    if caps:
        console.print(f"capped: {', '.join(caps)} (not the whole preset)")
    if w.get("sequential"):
        console.print("requests run one at a time, each after the previous one finished")
    peaks = ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in report.peaks_gflops.items())
    console.print(f"matmul peak measured in this run: {peaks or 'not measured'}")
    bandwidth = report.bandwidth_gbs
    if bandwidth:
        console.print(
            f"memory bandwidth measured in this run: read {bandwidth['read_gbs']:.1f} GB/s, "
            f"STREAM triad {bandwidth['triad_gbs']:.1f} GB/s"
        )
    console.print(throughput_table(report.systems))
    console.print(latency_table(report.systems))
    if any(s.decode for s in report.systems):
        console.print(decode_table(report.systems))
    lines = prefill_lines(report.systems) + structured_lines(report.systems)
    for line in lines + adapter_load_lines(report.systems):
        console.print(line)
    for note in report.notes:
        console.print(f"note: {note}")


def render_all(reports: list[BenchReport], console: Console | None = None) -> None:
    """Every preset's report, then the like-for-like table and llama.cpp's own benchmarks."""
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    for report in reports:
        render(report, console)
    for table in (like_for_like_table(reports), llama_reference_table(reports)):
        if table is not None:
            console.print(table)
    files = next((r.llamacpp.get("files") for r in reports if r.llamacpp), None)
    for fmt, facts in (files or {}).items():
        types = ", ".join(f"{kind} {count}" for kind, count in facts["tensor_types"].items())
        console.print(f"llama.cpp {fmt}: {facts['path']} ({types})")


def prefill_lines(systems: list[SystemSummary]) -> list[str]:
    """Each system's prefill steps against the compute roofline (report.prefill_roofline)."""
    return [
        f"{s.label}: prefill steps {s.prefill_s:.2f} s, {s.prefill_roofline:.0%} of the "
        f"compute roofline (attention causal; decode rows beside prompt chunks not counted)"
        for s in systems
        if s.prefill_roofline is not None
    ]


def decode_table(systems: list[SystemSummary]) -> Table:
    """Each tokenmill system's pure decode steps by batch size: the measured step, its
    memory bound (bytes / read bandwidth) and compute bound (FLOPs / matmul peak), which
    one binds, and the step's share of it - where the crossover lies, at a glance. A
    mixture of experts' rows say how many experts a layer read per step: counted by the
    engine, or (est.) uniform routing's estimate where no count came back."""
    table = Table(title="Decode steps by batch size, against the bandwidth and compute rooflines")
    moe = any(row.get("experts_source") for s in systems for row in s.decode)
    if moe:
        table.caption = (
            "experts/layer: the distinct experts a step's sparse layers ran, counted by the "
            "engine ((est.): uniform routing's estimate, no count); MB read holds those "
            "experts' weights, the dense weights, the lm_head and the KV reads"
        )
    for name in (
        "system", "batch", "steps", "context", "step ms",
        *(["experts/layer"] if moe else []), "MB read", "memory ms",
        "compute ms", "bound by", "share of bound",
    ):  # fmt: skip
        table.add_column(name, justify="left" if name in ("system", "bound by") else "right")
    for summary in systems:
        for row in summary.decode:
            experts = [_experts_cell(row)] if moe else []
            table.add_row(
                summary.label,
                str(row["batch"]),
                str(row["num_steps"]),
                str(row["context"]),
                f"{row['measured_s'] * 1e3:.2f}",
                *experts,
                f"{row['bytes_read'] / 1e6:,.1f}",
                f"{row['memory_s'] * 1e3:.2f}",
                f"{row['compute_s'] * 1e3:.2f}",
                row["bound"],
                f"{row['share']:.0%}",
            )
    return table


def _experts_cell(row: dict) -> str:
    if not row.get("experts_source"):
        return "-"
    estimated = " (est.)" if row["experts_source"] == "uniform" else ""
    return f"{row['experts_per_layer']:.1f}{estimated}"


def throughput_table(systems: list[SystemSummary]) -> Table:
    baselines = [s.label for s in systems if s.is_baseline]
    # Quantized systems also carry a ratio to tokenmill at their float precision.
    baselines += [label for s in systems for label in s.ratios if label not in baselines]
    baselines = list(dict.fromkeys(baselines))
    table = Table(title="Throughput (medians over runs)")
    for name in ("system", "runs", "wall s", "tok/s", "gen tok/s", "prompt computed / cached"):
        table.add_column(name, justify="left" if name == "system" else "right")
    table.add_column("roofline (exec)", justify="right")
    for base in baselines:
        table.add_column(f"x {base}", justify="right")
    with_peers = any(s.peer_ratio is not None for s in systems)
    if with_peers:
        table.add_column("x best llama.cpp, same class", justify="right")
    for s in systems:
        if s.wall_s is None:
            table.add_row(s.label, "0", f"failed: {s.error or 'no run'}"[:60])
            continue
        row = [
            s.label,
            str(s.num_runs),
            f"{s.wall_s:.2f}",
            f"{s.total_tok_s:,.0f}",
            f"{s.gen_tok_s:,.0f}",
            f"{s.num_computed_prompt_tokens:,} / {s.num_cached_prompt_tokens:,}",
            _roofline(s),
        ]
        row += [f"{s.ratios[b]:.2f}" if b in s.ratios else "-" for b in baselines]
        if with_peers:
            row.append(f"{s.peer_ratio:.2f}" if s.peer_ratio is not None else "-")
        table.add_row(*row)
    return table


def latency_table(systems: list[SystemSummary]) -> Table:
    table = Table(title="Per-request latency within the batch, memory, agreement")
    for name in (
        "system", "TTFT p50/p95/p99 s", "TPOT p50/p95/p99 ms", "peak RSS MB", "CPU/wall", "load 1m",
    ):  # fmt: skip
        table.add_column(name, justify="left" if name == "system" else "right")
    table.add_column("greedy outputs identical (mean tokens agreeing)")
    for s in systems:
        if s.wall_s is None:
            continue
        table.add_row(
            s.label,
            _percentiles(s.ttft_s, 1.0, "{:.2f}"),
            _percentiles(s.tpot_s, 1000.0, "{:.1f}"),
            f"{s.peak_rss_mb:,.0f}" if s.peak_rss_mb is not None else "-",
            f"{s.cpu_util:.2f}" if s.cpu_util is not None else "-",
            f"{s.load_avg:.1f}" if s.load_avg is not None else "-",
            _agreement(s),
        )
    return table


def like_for_like_table(reports: list[BenchReport]) -> Table | None:
    """Per preset, each tokenmill system with llama.cpp peers against the fastest of them
    (None when no tokenmill system had a peer)."""
    table = Table(title="Like for like: tokenmill against llama.cpp's best run of the same class")
    for name in ("preset", "tokenmill", "tok/s", "CPU/wall", "roofline",
                 "llama.cpp (fastest of class)", "tok/s ", "CPU/wall ", "roofline ", "x",
                 "load 1m"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("preset", "tokenmill") else "right")
    rows = 0
    for report in reports:
        by_label = {s.label: s for s in report.systems}
        for s in report.systems:
            if s.peer_ratio is None or s.wall_s is None:
                continue
            peer = by_label[s.best_peer]
            loads = [x.load_avg for x in (s, peer) if x.load_avg is not None]
            table.add_row(
                report.preset,
                s.label,
                f"{s.total_tok_s:,.0f}",
                f"{s.cpu_util:.2f}",
                _roofline(s),
                _peer_name(peer),
                f"{peer.total_tok_s:,.0f}",
                f"{peer.cpu_util:.2f}",
                _roofline(peer),
                f"{s.peer_ratio:.2f}",
                "-" if not loads else f"{min(loads):.1f}-{max(loads):.1f}",
            )
            rows += 1
    return table if rows else None


def llama_reference_table(reports: list[BenchReport]) -> Table | None:
    """llama.cpp's own benchmarks per format (None when they did not run)."""
    references = next((r.llamacpp.get("reference") for r in reports if r.llamacpp), None)
    if not references:
        return None
    table = Table(title="llama.cpp's own benchmarks (its shapes, not the workload)")
    for name in ("format", "tool", "figures", "load 1m"):
        table.add_column(name, justify="left" if name != "load 1m" else "right")
    for ref in references:
        if "error" in ref:
            figures = f"failed: {ref['error'][:80]}"
        elif ref["tool"] == "llama-bench":
            figures = f"pp512 {ref.get('pp_tok_s', 0):,.0f} tok/s, tg128 {ref.get('tg_tok_s', 0):,.1f} tok/s"
        else:
            figures = ", ".join(f"{n}: {v:,.0f}" for n, v in ref["by_parallel"].items())
            figures = f"tok/s by parallel sequences {figures}"
        table.add_row(ref["format"], ref["tool"], figures, f"{ref['load_avg_1m']:.1f}")
    return table


def _peer_name(peer: SystemSummary) -> str:
    slots = (peer.extra or {}).get("parallel")
    return f"{peer.label}, {slots} slot{'s' if slots != 1 else ''}" if slots else peer.label


def structured_lines(systems: list[SystemSummary]) -> list[str]:
    """One line per constrained system: its grammar mask costs per generated token."""
    lines = []
    for s in systems:
        extra = s.extra or {}
        if "mask_fill_us_per_token" not in extra:
            continue
        lines.append(
            f"{s.label}: {extra['num_constrained_tokens']:,} constrained tokens; mask fill "
            f"{extra['mask_fill_us_per_token']:.1f} us/token, steps held up by masks "
            f"{extra['mask_blocking_us_per_token']:.1f} us/token; "
            f"{extra['num_complete']} outputs complete"
        )
    return lines


def adapter_load_lines(systems: list[SystemSummary]) -> list[str]:
    """One line per system serving adapters: reading them and filling their slots, done
    once before its clock starts, as loading the model is."""
    return [
        f"{s.label}: adapters loaded in {s.extra['adapter_load_s']:.2f} s before the timed run"
        for s in systems
        if "adapter_load_s" in (s.extra or {})
    ]


def _agreement(s: SystemSummary) -> str:
    if s.outputs_match is None:
        return "(reference)"
    count, _, reference = s.outputs_match.partition(" vs ")
    return f"{count} ({s.mean_agreeing_tokens:.1f}) vs {reference}"


def _roofline(s: SystemSummary) -> str:
    if s.roofline is None:
        return "-"
    return f"{s.roofline:.0%} ({s.executed_roofline:.0%})"


def _percentiles(p: Percentiles | None, scale: float, fmt: str) -> str:
    if p is None:
        return "-"
    return " / ".join(fmt.format(v * scale) for v in (p.p50, p.p95, p.p99))
