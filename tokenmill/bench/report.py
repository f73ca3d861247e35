"""Turns per-run results into the per-system figures the table and the JSON show.

Every figure comes from runs made in the same benchmark invocation. Runs are in rounds
(A B C, A B C, ...): a ratio between two systems is the median over rounds of the ratio
within each round, so a disturbance that slows one round slows both sides of its ratio.
A tokenmill system's like-for-like ratio is, per round, against the fastest llama.cpp run
of its precision class in that round (its peers), so it always faces llama.cpp's best.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from tokenmill.bench.bandwidth import WEIGHT_BYTES, decode_bound, weight_bytes
from tokenmill.bench.flops import ModelShape, RequestWork, minimal_works, total_flops
from tokenmill.bench.result import RunResult
from tokenmill.bench.stats import Percentiles, median
from tokenmill.bench.systems import SystemSpec, counterparts
from tokenmill.bench.workload import Workload

FLOP_FORMULA = (
    "per request: 2*P_layers*(prompt tokens computed + generated - 1) "
    "+ 2*hidden*vocab*generated + 4*heads*head_dim*sum(context length per computed token "
    "and layer, at most the window in sliding-window layers); "
    "P_layers = weights of the per-layer matmuls (q,k,v,o,gate,up,down); "
    "useful FLOPs count each shared prefix once, executed FLOPs what the system computed"
)


@dataclass
class SystemSummary:
    """One system's figures over its successful runs (medians unless said otherwise)."""

    label: str
    kind: str
    dtype: str
    is_baseline: bool
    num_runs: int
    wall_s: float | None = None
    wall_s_runs: list[float] = field(default_factory=list)
    total_tok_s: float | None = None  # (prompt + generated tokens) / wall
    gen_tok_s: float | None = None  # generated tokens / wall
    num_prompt_tokens: int = 0
    num_computed_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    peak_rss_mb: float | None = None  # the largest over runs
    ttft_s: Percentiles | None = None
    tpot_s: Percentiles | None = None
    useful_tflop: float | None = None
    executed_tflop: float | None = None
    peak_gflops: float | None = None  # matmul peak measured in this invocation, same dtype
    roofline: float | None = None  # useful FLOPs / wall / peak
    executed_roofline: float | None = None  # executed FLOPs / wall / peak
    # The computed prompt tokens' FLOPs (attention causal, each request's first sampled
    # token's lm_head) over the steps that computed them, against the peak: a floor, as
    # decode rows run beside prompt chunks in those steps and their FLOPs are not counted.
    prefill_roofline: float | None = None
    prefill_s: float | None = None
    cpu_util: float | None = None  # CPU seconds per wall second during the timed run
    load_avg: float | None = None  # the machine's 1-minute load average after each run
    ratios: dict[str, float] = field(default_factory=dict)  # baseline -> x its total tok/s
    peers: list[str] = field(default_factory=list)  # llama.cpp systems of its class
    peer_ratio: float | None = None  # x the fastest peer of each round (median)
    best_peer: str | None = None  # the peer with the highest median tok/s
    outputs_match: str | None = None  # "61/64 vs tokenmill-fp32": identical greedy outputs
    # Mean number of leading generated tokens equal to the reference's (how late they diverge).
    mean_agreeing_tokens: float | None = None
    # Decode steps by batch size against their memory and compute bounds (bandwidth.py):
    # one dict per batch size the run decoded at (tokenmill systems on a CPU).
    decode: list[dict] = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    error: str | None = None


def summarize_system(
    spec: SystemSpec,
    runs: list[RunResult | None],
    *,
    workload: Workload,
    shape: ModelShape,
    peak_gflops: float | None,
    read_gbs: float | None = None,
    error: str | None = None,
) -> SystemSummary:
    """Figures for one system from its runs (None marks a failed round); read_gbs, the
    read bandwidth measured in the same invocation, adds the decode bounds."""
    summary = SystemSummary(spec.label, spec.kind, spec.dtype, spec.is_baseline, 0, error=error)
    done = [r for r in runs if r is not None]
    summary.num_runs = len(done)
    if not done:
        return summary
    first = done[0]
    summary.wall_s_runs = [r.wall_s for r in done]
    summary.wall_s = median(summary.wall_s_runs)
    total_tokens = first.num_prompt_tokens + first.num_generated_tokens
    summary.total_tok_s = total_tokens / summary.wall_s
    summary.gen_tok_s = first.num_generated_tokens / summary.wall_s
    summary.num_prompt_tokens = first.num_prompt_tokens
    summary.num_computed_prompt_tokens = first.num_computed_prompt_tokens
    summary.num_cached_prompt_tokens = first.num_cached_prompt_tokens
    summary.num_generated_tokens = first.num_generated_tokens
    summary.peak_rss_mb = max(r.peak_rss_bytes for r in done) / 2**20
    if all(r.ttft_s for r in done):
        summary.ttft_s = Percentiles.median_of([Percentiles.of(r.ttft_s) for r in done])
        summary.tpot_s = Percentiles.median_of([Percentiles.of(r.tpot_s) for r in done])
    useful = useful_flops(workload, shape, first.generated)
    executed = total_flops(shape, executed_works(first))
    summary.useful_tflop = useful / 1e12
    summary.executed_tflop = executed / 1e12
    summary.peak_gflops = peak_gflops
    if peak_gflops:
        summary.roofline = roofline_fraction(useful, summary.wall_s, peak_gflops)
        summary.executed_roofline = roofline_fraction(executed, summary.wall_s, peak_gflops)
    summary.cpu_util = median([r.cpu_s / r.wall_s for r in done])
    summary.load_avg = median([r.load_avg_1m for r in done])
    summary.extra = first.extra
    prefills = [(r, r.extra.get("prefill_steps")) for r in done]
    prefills = [(r, p["seconds"]) for r, p in prefills if p and p["seconds"] > 0]
    if peak_gflops and prefills:
        summary.prefill_s = median([seconds for _, seconds in prefills])
        summary.prefill_roofline = median(
            [roofline_fraction(prefill_flops(r, shape), s, peak_gflops) for r, s in prefills]
        )
    if read_gbs and peak_gflops and "decode_steps" in first.extra:
        summary.decode = decode_rows(spec, first, workload, shape, read_gbs, peak_gflops)
    return summary


def decode_rows(
    spec: SystemSpec,
    run: RunResult,
    workload: Workload,
    shape: ModelShape,
    read_gbs: float,
    peak_gflops: float,
) -> list[dict]:
    """A run's pure decode steps per batch size, each with its bounds and its share of
    the larger one. The KV reads assume every sequence at the workload's mean context
    during decode (its prompt plus half its output); a mixture of experts' weight bytes
    are those of the experts the engine counted its steps running (the mean per step at
    that batch size), else uniform routing's estimate, each row saying which; a mode
    whose bytes per weight are not known here (a GGUF format outside WEIGHT_BYTES) gets
    no rows."""
    args = spec.options.get("engine_args", {})
    mode = args.get("quantization")
    if mode == "gguf":
        mode = spec.options.get("format")
    per_weight = WEIGHT_BYTES.get(mode or spec.dtype)
    if per_weight is None:
        return []
    head = 1.0 if args.get("quantize_lm_head") else WEIGHT_BYTES[spec.dtype]
    kv = 1.0 if args.get("kv_cache_dtype") == "int8" else WEIGHT_BYTES[spec.dtype]
    contexts = [len(p) + n / 2 for p, n in zip(workload.prompt_ids, workload.output_lens)]
    context = round(sum(contexts) / len(contexts))
    rows = []
    for batch, measured in sorted(run.extra["decode_steps"].items(), key=lambda kv: int(kv[0])):
        experts_used = measured.get("mean_experts_used") if shape.num_sparse_layers else None
        bound = decode_bound(
            shape,
            int(batch),
            context,
            weight_bytes_read=weight_bytes(
                shape, per_weight, head, int(batch), experts_used=experts_used
            ),
            kv_bytes=kv,
            read_gbs=read_gbs,
            peak_gflops=peak_gflops,
        )
        bound = replace(bound, measured_s=measured["mean_s"], num_steps=measured["num_steps"])
        if shape.num_sparse_layers:
            bound = replace(bound, **_experts_read(shape, int(batch), experts_used))
        rows.append(asdict(bound) | {"bound": bound.bound, "share": bound.share})
    return rows


def _experts_read(shape: ModelShape, batch: int, experts_used: float | None) -> dict:
    """A decode row's experts per sparse layer: counted by the engine, or estimated."""
    if experts_used is not None:
        return {
            "experts_per_layer": experts_used / shape.num_sparse_layers,
            "experts_source": "counted",
        }
    e, k = shape.num_experts, shape.experts_per_token
    return {"experts_per_layer": e * (1 - (1 - k / e) ** batch), "experts_source": "uniform"}


def useful_flops(workload: Workload, shape: ModelShape, generated: list[int] | None = None) -> int:
    """The workload's floor: FLOPs with every shared prefix computed exactly once.

    generated: tokens each request actually generated, where that is not the workload's
    output length (a constrained run ends where its grammar does).
    """
    works = minimal_works(
        [len(p) for p in workload.prompt_ids],
        generated or workload.output_lens,
        workload.prefix_group,
        workload.shared_len,
    )
    return total_flops(shape, works)


def executed_works(run: RunResult) -> list[RequestWork]:
    return [
        RequestWork(c, k, g)
        for c, k, g in zip(run.computed_prompt, run.cached_prompt, run.generated)
    ]


def prefill_flops(run: RunResult, shape: ModelShape) -> int:
    """FLOPs of a run's computed prompt tokens: each request's computed tokens after its
    cached ones (attention causal over both), and the lm_head of its first sampled token,
    which the step that computes its last prompt token samples."""
    return total_flops(
        shape,
        [
            RequestWork(c, k, min(g, 1))
            for c, k, g in zip(run.computed_prompt, run.cached_prompt, run.generated)
        ],
    )


def roofline_fraction(flops: float, wall_s: float, peak_gflops: float) -> float:
    """Achieved FLOP rate as a fraction of the measured matmul peak."""
    return flops / wall_s / (peak_gflops * 1e9)


def paired_ratio(
    runs: list[RunResult | None], baseline_runs: list[RunResult | None]
) -> float | None:
    """Median over rounds of (system tokens/s) / (baseline tokens/s) within the round.

    Both sides process the same workload, so within a round the ratio is also
    baseline wall / system wall. Rounds where either side failed are left out.
    """
    ratios = []
    for run, base in zip(runs, baseline_runs):
        if run is None or base is None:
            continue
        run_rate = (run.num_prompt_tokens + run.num_generated_tokens) / run.wall_s
        base_rate = (base.num_prompt_tokens + base.num_generated_tokens) / base.wall_s
        ratios.append(run_rate / base_rate)
    return median(ratios) if ratios else None


def best_of_ratio(
    runs: list[RunResult | None], candidates: list[list[RunResult | None]]
) -> float | None:
    """Median over rounds of (system tokens/s) / (the fastest candidate's tokens/s in
    that round). Rounds where the system or every candidate failed are left out."""
    ratios = []
    for index, run in enumerate(runs):
        rivals = [c[index] for c in candidates if index < len(c) and c[index] is not None]
        if run is None or not rivals:
            continue
        fastest = min(
            rivals, key=lambda r: r.wall_s / (r.num_prompt_tokens + r.num_generated_tokens)
        )
        ratios.append(paired_ratio([run], [fastest]))
    return median(ratios) if ratios else None


def count_matching_outputs(outputs: list[list[int]], reference: list[list[int]]) -> int:
    """How many requests produced exactly the reference's tokens."""
    return sum(a == b for a, b in zip(outputs, reference))


@dataclass
class BenchReport:
    """Everything one `tokenmill bench` invocation measured."""

    preset: str
    model_dir: str
    command: str
    workload: dict
    machine: dict
    peaks_gflops: dict[str, float]
    systems: list[SystemSummary]
    bandwidth_gbs: dict[str, float] = field(default_factory=dict)  # read_gbs, triad_gbs
    sweeps: list[dict] = field(default_factory=list)  # HF batch sizes, llama-server slots
    runs: list[dict] = field(default_factory=list)  # every timed run, in the order run
    notes: list[str] = field(default_factory=list)
    # The GGUF files llama.cpp ran (format, path, tensor types) and llama.cpp's own
    # benchmarks on them, when run.
    llamacpp: dict = field(default_factory=dict)
    flop_formula: str = FLOP_FORMULA

    def to_dict(self) -> dict:
        return asdict(self)


def build_summaries(
    specs: list[SystemSpec],
    runs: dict[str, list[RunResult | None]],
    errors: dict[str, str],
    *,
    workload: Workload,
    shape: ModelShape,
    peaks_gflops: dict[str, float],
    peers: dict[str, list[str]] | None = None,
    read_gbs: float | None = None,
) -> list[SystemSummary]:
    """Per-system summaries with ratios to every baseline and output agreement.

    Outputs are compared with tokenmill at fp32 when it ran, else with the first system
    that has outputs: the count says how many greedy completions are token-identical.
    peers: label -> the llama.cpp systems of its precision class (like-for-like ratio).
    """
    summaries = [
        summarize_system(
            spec,
            runs[spec.label],
            workload=workload,
            shape=shape,
            peak_gflops=peaks_gflops.get(spec.dtype),
            read_gbs=read_gbs,
            error=errors.get(spec.label),
        )
        for spec in specs
    ]
    baselines = [s for s in specs if s.is_baseline]
    for spec, summary in zip(specs, summaries):
        # A quantized system is also compared with tokenmill at its float precision, one
        # with an int8 KV cache with the same system on the default cache.
        for base in baselines + counterparts(spec, specs):
            if base.label != spec.label:
                ratio = paired_ratio(runs[spec.label], runs[base.label])
                if ratio is not None:
                    summary.ratios[base.label] = ratio
    by_label = {s.label: s for s in summaries}
    for spec, summary in zip(specs, summaries):
        ran = [p for p in (peers or {}).get(spec.label, []) if by_label[p].wall_s is not None]
        if not ran:
            continue
        summary.peers = ran
        summary.peer_ratio = best_of_ratio(runs[spec.label], [runs[p] for p in ran])
        summary.best_peer = max(ran, key=lambda p: by_label[p].total_tok_s)
    reference = _reference_outputs(specs, runs)
    if reference is not None:
        ref_label, ref_outputs = reference
        for spec, summary in zip(specs, summaries):
            outputs = _first_outputs(runs[spec.label])
            if outputs is not None and spec.label != ref_label:
                matched = count_matching_outputs(outputs, ref_outputs)
                summary.outputs_match = f"{matched}/{len(ref_outputs)} vs {ref_label}"
                prefixes = agreeing_prefix_lengths(outputs, ref_outputs)
                summary.mean_agreeing_tokens = sum(prefixes) / len(prefixes)
    return summaries


def agreeing_prefix_lengths(outputs: list[list[int]], reference: list[list[int]]) -> list[int]:
    """Per request, how many leading tokens equal the reference's."""
    lengths = []
    for out, ref in zip(outputs, reference):
        n = 0
        while n < min(len(out), len(ref)) and out[n] == ref[n]:
            n += 1
        lengths.append(n)
    return lengths


def _first_outputs(runs: list[RunResult | None]) -> list[list[int]] | None:
    return next((r.output_ids for r in runs if r is not None and r.output_ids), None)


def _reference_outputs(
    specs: list[SystemSpec], runs: dict[str, list[RunResult | None]]
) -> tuple[str, list[list[int]]] | None:
    preferred = sorted(specs, key=lambda s: (s.kind, s.dtype) != ("tokenmill", "float32"))
    for spec in preferred:
        outputs = _first_outputs(runs[spec.label])
        if outputs is not None:
            return spec.label, outputs
    return None
