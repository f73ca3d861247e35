"""The FLOP model behind the roofline column, and the matmul peak it is compared with.

FLOPs of a decoder-only transformer for one request (multiply-add = 2 FLOPs):

    linear    = 2 * P_layers * (prompt tokens computed + generated - 1)
    lm_head   = 2 * hidden * vocab * generated
    attention = 4 * heads * head_dim * sum over layers and computed tokens of the context
                the token sees in that layer: its position + 1, or at most the window in a
                sliding-window layer (Mistral; Gemma 3's local layers)

P_layers counts the weights of the per-layer matmuls one token goes through (q, k, v, o,
gate, up, down); the embedding lookup, norms and rotary are not matmuls and are left out.
In a mixture of experts a token goes through its layer's router and its top-k experts
only, so P_layers counts those, not the experts it skips (a dense layer of Qwen3-MoE's
`mlp_only_layers` counts its dense MLP). The last generated
token is sampled but never fed back, hence `generated - 1` tokens through the layers.
Logits are needed only where a token is sampled: the lm_head term counts those positions.
The attention term is QK^T plus AV over the causal context (a token at position p sees
p + 1 tokens, min(p + 1, window) in a sliding-window layer), with no work for masked or
padded positions. Gemma 3 needs nothing else: GeGLU has the same three matmuls as
SwiGLU, head_dim is read from the config, and its 262k-row lm_head is the lm_head term.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    """The dimensions the FLOP count needs, read from an HF config.json."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    sliding_window: int | None = None
    num_window_layers: int = 0  # layers that attend within sliding_window
    # A mixture of experts: experts per sparse layer, how many a token runs, each one's
    # intermediate size, and how many layers are sparse (the rest keep intermediate_size).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    num_sparse_layers: int = 0

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelShape:
        """The shape the engine reads from config.json (one parser for both)."""
        from tokenmill.engine import load_config

        config = load_config(model_dir)
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            sliding_window=config.sliding_window,
            num_window_layers=sum(
                config.layer_sliding_window(i) is not None for i in range(config.num_hidden_layers)
            ),
            **_experts(config),
        )

    @property
    def layer_matmul_params(self) -> int:
        """Weights of the per-layer matmuls one token goes through (the non-embedding
        parameters that cost FLOPs): in a mixture of experts, its router and top-k experts."""
        return self._layer_params(self.experts_per_token)

    def layer_params_read(self, batch: int) -> float:
        """Weights a decode step of `batch` sequences reads in its layers: every dense
        matmul once, and of a sparse layer's experts the distinct ones its rows choose -
        E * (1 - (1 - k/E) ** batch) expected under uniform routing (a trained router is
        uneven, so fewer are read: the figure is an estimate, not a floor; where the
        engine counted the experts a step ran, `layer_params_with_experts` is exact)."""
        if not self.num_sparse_layers:
            return float(self.layer_matmul_params)
        e, k = self.num_experts, self.experts_per_token
        return self._layer_params(e * (1 - (1 - k / e) ** batch))

    def layer_params_with_experts(self, experts_used: float) -> float:
        """Weights a step reads in its layers when its sparse layers ran `experts_used`
        experts in all (each layer's distinct experts, summed over layers: EngineStats
        .moe_experts_used per step): every dense matmul and router once, and those experts."""
        if not self.num_sparse_layers:
            raise ValueError("experts used given for a model without experts")
        return float(self._layer_params(experts_used / self.num_sparse_layers))

    def _layer_params(self, experts: float) -> float | int:
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o + k, v
        dense_mlp = 3 * h * self.intermediate_size  # gate, up, down
        num_dense = self.num_layers - self.num_sparse_layers
        sparse = h * self.num_experts + experts * 3 * h * self.expert_intermediate_size
        return self.num_layers * attention + num_dense * dense_mlp + self.num_sparse_layers * sparse


def _experts(config) -> dict:
    """ModelShape's mixture-of-experts fields from an engine config (none for a dense one)."""
    num_experts = getattr(config, "num_experts", 0)
    if not num_experts:
        return {}
    return {
        "num_experts": num_experts,
        "experts_per_token": config.num_experts_per_tok,
        "expert_intermediate_size": config.moe_intermediate_size,
        "num_sparse_layers": sum(
            config.is_sparse_layer(i) for i in range(config.num_hidden_layers)
        ),
    }


@dataclass(frozen=True)
class RequestWork:
    """What one request made a system compute.

    Args:
        num_computed_prompt: prompt tokens run through the model (after any cache hit,
            including any padding the system computes).
        num_cached_prompt: leading prompt tokens served from a cache (context, no compute).
        num_generated: tokens sampled.
    """

    num_computed_prompt: int
    num_cached_prompt: int
    num_generated: int


def _sum_range(start: int, stop: int) -> int:
    """sum(range(start, stop)) in O(1)."""
    return (stop - start) * (start + stop - 1) // 2 if stop > start else 0


def _sum_capped_range(start: int, stop: int, cap: int) -> int:
    """sum(min(c, cap) for c in range(start, stop)) in O(1)."""
    below = min(stop, max(start, cap + 1))  # c < below means c <= cap
    return _sum_range(start, below) + cap * max(0, stop - below)


def request_flops(shape: ModelShape, work: RequestWork) -> int:
    """FLOPs of one request under the module's formula."""
    num_fed = work.num_computed_prompt + max(work.num_generated - 1, 0)
    linear = 2 * shape.layer_matmul_params * num_fed
    lm_head = 2 * shape.hidden_size * shape.vocab_size * work.num_generated
    # The token at position p attends over p + 1 positions; the computed ones sit at
    # positions num_cached .. num_cached + num_fed - 1.
    first = work.num_cached_prompt
    context_sum = _sum_range(first + 1, first + num_fed + 1)
    num_full_layers = shape.num_layers - shape.num_window_layers
    context_sum_all_layers = num_full_layers * context_sum
    if shape.num_window_layers:
        windowed = _sum_capped_range(first + 1, first + num_fed + 1, shape.sliding_window)
        context_sum_all_layers += shape.num_window_layers * windowed
    attention = 4 * shape.num_heads * shape.head_dim * context_sum_all_layers
    return linear + lm_head + attention


def total_flops(shape: ModelShape, works: list[RequestWork]) -> int:
    return sum(request_flops(shape, w) for w in works)


def minimal_works(
    prompt_lens: list[int],
    output_lens: list[int],
    prefix_group: list[int | None],
    shared_len: list[int],
) -> list[RequestWork]:
    """Each request's work when every shared prefix is computed exactly once.

    This is the workload's floor: the same number for every system, so dividing it by a
    system's wall time says how close that system came to the fastest possible run.
    """
    seen: set[int] = set()
    works = []
    for length, generated, group, shared in zip(prompt_lens, output_lens, prefix_group, shared_len):
        cached = shared if group is not None and group in seen else 0
        if group is not None:
            seen.add(group)
        works.append(RequestWork(length - cached, cached, generated))
    return works


@dataclass(frozen=True)
class MatmulPeak:
    """Best matmul throughput measured for one dtype."""

    dtype: str
    gflops: float
    shape: tuple[int, int, int]  # (m, k, n) of the best shape


def llm_matmul_shapes(shape: ModelShape, num_tokens: int = 256) -> list[tuple[int, int, int]]:
    """(m, k, n) of the model's big prefill matmuls for a batch of num_tokens tokens."""
    h, i = shape.hidden_size, shape.intermediate_size
    return [
        (num_tokens, h, i),
        (num_tokens, i, h),
        (num_tokens, h, shape.num_heads * shape.head_dim),
    ]


def measure_matmul_peak(
    dtype: str,
    shapes: list[tuple[int, int, int]],
    *,
    device: str = "cpu",
    num_trials: int = 5,
    min_seconds: float = 0.05,
) -> MatmulPeak:
    """Best GFLOP/s over `shapes` (x @ w.T), best of num_trials, over every way this
    torch can run it: F.linear (as nn.Linear does) and, on CPU, oneDNN with the weight
    packed once (as tokenmill's engine does; on AMD CPUs it is 2x MKL's fp32), so the
    roofline is the machine's, not one library's.

    Each trial repeats the matmul for at least min_seconds so timer resolution and call
    overhead do not count; the best trial is the one least disturbed by other work.
    """
    import torch

    from tokenmill.engine import onednn_linear_available

    torch_dtype = getattr(torch, dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def timed(matmul, reps: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            matmul()
        sync()
        return time.perf_counter() - start

    best = MatmulPeak(dtype, 0.0, shapes[0])
    for m, k, n in shapes:
        x = torch.randn(m, k, device=device).to(torch_dtype)
        w = torch.randn(n, k, device=device).to(torch_dtype)
        matmuls = [lambda x=x, w=w: torch.nn.functional.linear(x, w)]
        if device == "cpu" and onednn_linear_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            matmuls.append(
                lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
            )
        for matmul in matmuls:
            timed(matmul, 1)  # warm-up: the library picks and caches its kernel
            reps = 1
            while (elapsed := timed(matmul, reps)) < min_seconds / 4:
                reps *= 2
            reps = max(reps, round(reps * min_seconds / elapsed))
            for _ in range(num_trials):
                gflops = 2 * m * k * n * reps / timed(matmul, reps) / 1e9
                if gflops > best.gflops:
                    best = MatmulPeak(dtype, gflops, (m, k, n))
    return best
