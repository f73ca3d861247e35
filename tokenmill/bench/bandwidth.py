"""Memory bandwidth beside the matmul peak, and decode's share of the bandwidth roofline.

A decode step computes one token per running sequence, so its FLOPs grow with the batch
while the bytes it must read - every weight once, plus each sequence's KV cache - barely
do. Below some batch size the step is bound by reading, above it by computing. Both
bounds of one step, for a batch of B sequences with C tokens of context each:

    bytes  = weight_bytes + B * C * kv_bytes_per_token
    flops  = B * (2 * P_layers + 2 * hidden * vocab) + 4 * B * heads * head_dim * C * layers
    bound  = max(bytes / read bandwidth, flops / matmul peak)

The step is memory-bound where the first term is the larger (bytes / bandwidth > FLOPs /
peak). weight_bytes are the per-layer matmul weights and the lm_head at the system's
bytes per weight (a quantized mode's codes with their scales); embeddings are looked up
a row at a time and norms are negligible, so neither counts. A mixture of experts' step
reads each expert its rows chose once per layer: the engine counts them per step
(EngineStats.moe_experts_used: each layer's distinct top-k experts), and the bytes are
those experts' - the real ones, not an estimate. Only where no count came back (none is
taken off the CPU) do the bytes fall back to the experts uniform routing would choose,
and the row says so. A measured step's share of the
bound is bound / measured time: 1.0 would be the hardware's limit.

Bandwidth is measured in the same run as the peak, two ways, each over buffers far larger
than any cache: read-only (a sum over one buffer: what a decode step does with weights)
and STREAM's triad (a = b + s * c, counted as STREAM counts it: two reads and a write).
"Far larger" is taken from the machine: four times its largest cache, and never under
256 MB. A fixed 256 MB fits in a 300 MB last-level cache (Emerald Rapids), where the
probe measured the cache whenever the host left it to us, and every share of the bound
came out low by as much.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.flops import ModelShape

# Bytes one weight takes in each tokenmill precision: the codes and their scales (int8:
# an fp32 scale per output row, negligible; int4: 4-bit codes with a bf16 scale and
# minimum per group of 32; gguf Q4_0: 18 bytes per block of 32).
WEIGHT_BYTES = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "int8": 1.0,
    "int4": (16 + 4) / 32,
    "Q8_0": 34 / 32,
    "Q4_0": 18 / 32,
}
MIN_BUFFER_BYTES = 1 << 28  # 256 MB: where the machine does not say its caches' sizes
CACHE_SIZES = Path("/sys/devices/system/cpu/cpu0/cache")


def largest_cache_bytes(cache_dir: Path = CACHE_SIZES) -> int:
    """The largest cache of the first CPU, from sysfs (`index*/size`, e.g. "307200K"); 0
    where sysfs does not say."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    largest = 0
    for size_file in cache_dir.glob("index*/size"):
        text = size_file.read_text().strip()
        if not text:
            continue
        scale = units.get(text[-1].upper(), 1)
        digits = text[:-1] if text[-1].upper() in units else text
        if digits.isdigit():
            largest = max(largest, int(digits) * scale)
    return largest


def probe_buffer_bytes(cache_dir: Path = CACHE_SIZES) -> int:
    """Bytes per probe buffer: four times the largest cache, at least MIN_BUFFER_BYTES, so
    that at most a quarter of a pass could be served from any cache."""
    return max(MIN_BUFFER_BYTES, 4 * largest_cache_bytes(cache_dir))


@dataclass(frozen=True)
class Bandwidth:
    """Best GB/s measured, read-only and STREAM triad."""

    read_gbs: float
    triad_gbs: float


def measure_bandwidth(
    *, buffer_bytes: int | None = None, num_trials: int = 5, threads: int | None = None
) -> Bandwidth:
    """Read-only and triad bandwidth in GB/s (best of num_trials, all torch threads).

    buffer_bytes: per buffer (three for the triad); by default probe_buffer_bytes().
    The best trial is the one least disturbed by other work on the machine.
    """
    import torch

    if buffer_bytes is None:
        buffer_bytes = probe_buffer_bytes()

    if threads is not None:
        torch.set_num_threads(threads)
    n = buffer_bytes // 4
    a, b, c = (torch.ones(n) for _ in range(3))  # touched, so every page is resident
    scalar = 3.0

    def best(run, nbytes: int) -> float:
        run()  # warm-up
        fastest = float("inf")
        for _ in range(num_trials):
            start = time.perf_counter()
            run()
            fastest = min(fastest, time.perf_counter() - start)
        return nbytes / fastest / 1e9

    read = best(lambda: b.sum(), 4 * n)
    triad = best(lambda: torch.add(b, c, alpha=scalar, out=a), 3 * 4 * n)
    return Bandwidth(read, triad)


@dataclass(frozen=True)
class DecodeBound:
    """One decode step's two bounds at a batch size, and a measured step against them."""

    batch: int
    context: int  # tokens of context per sequence assumed for the KV reads
    bytes_read: int
    flops: int
    memory_s: float  # bytes / read bandwidth
    compute_s: float  # FLOPs / matmul peak
    measured_s: float | None = None  # mean measured step time at this batch size
    num_steps: int = 0
    # A mixture of experts: the experts a step read, per sparse layer (mean over steps),
    # and whether the engine counted them ("counted") or uniform routing estimates them.
    experts_per_layer: float | None = None
    experts_source: str | None = None

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def share(self) -> float | None:
        """The roofline's time over the measured time (1.0: at the hardware's limit)."""
        if not self.measured_s:
            return None
        return max(self.memory_s, self.compute_s) / self.measured_s


def weight_bytes(
    shape: ModelShape,
    bytes_per_weight: float,
    lm_head_bytes: float,
    batch: int = 1,
    *,
    experts_used: float | None = None,
) -> int:
    """Bytes a decode step of `batch` sequences reads of weights: the layers' matmuls and
    the lm_head. In a mixture of experts, the experts the step ran where the engine
    counted them (`experts_used`, summed over its sparse layers), else those its rows are
    expected to choose under uniform routing (`ModelShape.layer_params_read`)."""
    lm_head = shape.hidden_size * shape.vocab_size * lm_head_bytes
    if experts_used is not None:
        layers = shape.layer_params_with_experts(experts_used)
    else:
        layers = shape.layer_params_read(batch)
    return round(layers * bytes_per_weight + lm_head)


def kv_bytes_per_token(shape: ModelShape, kv_bytes: float) -> float:
    """K and V of one token over every layer."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_bytes


def decode_bound(
    shape: ModelShape,
    batch: int,
    context: int,
    *,
    weight_bytes_read: int,
    kv_bytes: float,
    read_gbs: float,
    peak_gflops: float,
) -> DecodeBound:
    """The memory and compute bounds of one decode step of `batch` sequences."""
    bytes_read = round(weight_bytes_read + batch * context * kv_bytes_per_token(shape, kv_bytes))
    per_token = 2 * shape.layer_matmul_params + 2 * shape.hidden_size * shape.vocab_size
    attention = 4 * shape.num_heads * shape.head_dim * context * shape.num_layers
    flops = batch * (per_token + attention)
    return DecodeBound(
        batch,
        context,
        bytes_read,
        flops,
        memory_s=bytes_read / (read_gbs * 1e9),
        compute_s=flops / (peak_gflops * 1e9),
    )


def crossover_batch(
    shape: ModelShape, context: int, *, weight_bytes_read: int, kv_bytes: float,
    read_gbs: float, peak_gflops: float, largest: int = 4096,
) -> int | None:  # fmt: skip
    """The smallest batch whose decode step is compute-bound (None: none up to `largest`)."""
    for batch in range(1, largest + 1):
        bound = decode_bound(
            shape, batch, context, weight_bytes_read=weight_bytes_read, kv_bytes=kv_bytes,
            read_gbs=read_gbs, peak_gflops=peak_gflops,
        )  # fmt: skip
        if bound.bound == "compute":
            return batch
    return None


class DecodeStepTimer:
    """Times each engine step through `LLM.generate(on_step=...)` and keeps the steps that
    only decoded (no prompt token computed), by batch size: the engine's counters say how
    many prompt tokens a step computed, how many tokens it sampled and, in a mixture of
    experts, how many experts its layers ran. The steps that computed prompt tokens are
    summed apart (prefill_summary), for prefill's share of the compute roofline
    (report.prefill_roofline)."""

    def __init__(self) -> None:
        self.steps: dict[int, list[float]] = {}  # batch size -> step seconds
        self.experts: dict[int, list[int]] = {}  # batch size -> experts each step ran
        self.prefill_s = 0.0  # steps that computed prompt tokens, decode rows beside them too
        self.prefill_steps = 0
        self.prefill_tokens = 0
        self._last: tuple[float, int, int, int] | None = None

    def _counters(self, stats) -> tuple[float, int, int, int]:
        return (
            time.perf_counter(),
            stats.computed_prompt_tokens,
            stats.generated_tokens,
            stats.moe_experts_used,
        )

    def start(self, stats) -> None:
        self._last = self._counters(stats)

    def __call__(self, stats) -> None:
        now = self._counters(stats)
        if self._last is not None:
            then, prompt, generated, experts = self._last
            sampled = now[2] - generated
            if now[1] == prompt and sampled > 0:
                self.steps.setdefault(sampled, []).append(now[0] - then)
                self.experts.setdefault(sampled, []).append(now[3] - experts)
            elif now[1] > prompt:
                self.prefill_s += now[0] - then
                self.prefill_steps += 1
                self.prefill_tokens += now[1] - prompt
        self._last = now

    def summary(self) -> dict[int, dict]:
        """{batch: {"num_steps", "mean_s"}} over the pure decode steps, with
        "mean_experts_used" (per step, summed over sparse layers) where the engine
        counted experts."""
        summary = {}
        for batch, times in sorted(self.steps.items()):
            summary[batch] = {"num_steps": len(times), "mean_s": sum(times) / len(times)}
            experts = self.experts[batch]
            if any(experts):
                summary[batch]["mean_experts_used"] = sum(experts) / len(experts)
        return summary

    def prefill_summary(self) -> dict:
        """{"num_steps", "seconds", "num_tokens"} over the steps that computed prompt tokens."""
        return {
            "num_steps": self.prefill_steps,
            "seconds": self.prefill_s,
            "num_tokens": self.prefill_tokens,
        }
