"""Mixture-of-experts layers: the router and the experts, as separate pieces.

A sparse MoE block stands where a decoder layer's gated MLP would: the router scores each
token against every expert and keeps its top k with their weights (`Routing.route`, a
pure function: how each family softmaxes and renormalises), and the experts run each
token through its k experts' gated MLPs and sum the outputs, weighted, back into token
order (`Experts`).

The experts' weights are stacked, one parameter per projection, as transformers keeps
them: gate_up_proj [num_experts, 2 * intermediate, hidden] (the gate rows first) and
down_proj [num_experts, hidden, intermediate]; a checkpoint's per-expert tensors load
into their slices (loader/tensor_plan.py).

Expert compute is one grouped call per layer. On the CPU with the native kernels it is
kernels/moe.c (weights packed once, after loading: `Experts.pack`): the step's (token,
expert) pairs counting-sorted by expert, each expert's rows one contiguous run, gate_up,
the activation, down and the weighted sum back into token order in one call - no Python
loop over experts, no padding to the busiest expert; the weights in the model's dtype,
or int8 / int4 when the int8 / int4 quantization packs them (quant/int8.py, int4.py).
Elsewhere torch's grouped matmul does the same over the sorted rows (`grouped_experts`),
in float only: quant/ refuses quantized experts where the native kernel does not run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tokenmill.engine.kernels import moe as moe_kernel
from tokenmill.engine.models.config import ModelConfig
from tokenmill.engine.models.layers import GatedMLP
from tokenmill.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# The gated activations experts compute, by their HF config name.
_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
EXPERT_ACTIVATIONS = tuple(_ACTIVATIONS)


@dataclass(frozen=True)
class Routing:
    """How a family turns router logits into each token's experts and weights.

    softmax over every expert in fp32, then the top k (transformers' Qwen3-MoE, Mixtral,
    OLMoE); `renormalize` divides the k weights by their sum (Qwen3-MoE's norm_topk_prob,
    always for Mixtral, never for OLMoE); `round_to_model_dtype`: the weights are rounded
    to the logits' dtype before they scale the experts (Qwen3-MoE and OLMoE; Mixtral keeps
    them fp32). `softmax_of_top_k`: the top k of the logits first, then a softmax over
    those k alone in the logits' dtype (gpt-oss).
    """

    top_k: int
    renormalize: bool
    round_to_model_dtype: bool = True
    softmax_of_top_k: bool = False

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [num_tokens, num_experts] -> (weights fp32, expert ids int64), each
        [num_tokens, top_k]."""
        if self.softmax_of_top_k:
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).float(), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_to_model_dtype:
            weights = weights.to(logits.dtype).float()
        return weights, ids


class ExpertUsage:
    """How many experts a model's MoE layers ran: each layer's distinct experts per
    forward pass, summed over layers - the experts whose weights those passes read (a
    decode step of many rows reads an expert once however many rows chose it).

    Counted from each router's top-k ids as they come out, on the CPU only: there the ids
    are host memory and a count costs microseconds per layer; on an accelerator it would
    wait for every layer (`track_expert_usage` attaches none there).
    """

    def __init__(self) -> None:
        self.num_used = 0

    def add(self, expert_ids: torch.Tensor, num_experts: int) -> None:
        counts = torch.bincount(expert_ids.reshape(-1), minlength=num_experts)
        self.num_used += int(counts.count_nonzero())

    def take(self) -> int:
        """The experts counted since the last take, and start again from zero."""
        num_used, self.num_used = self.num_used, 0
        return num_used


class Router(nn.Module):
    """A linear score per expert (`weight` [num_experts, hidden], a `bias` [num_experts]
    where the family has one: gpt-oss) and the family's Routing. `usage`, where one is
    attached (`track_expert_usage`), counts the experts each forward chooses."""

    usage: ExpertUsage | None = None

    def __init__(
        self, hidden_size: int, num_experts: int, routing: Routing, *, bias: bool = False
    ) -> None:
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] -> (weights, expert ids) as Routing.route."""
        weights, expert_ids = self.routing.route(F.linear(x, self.weight, self.bias))
        if self.usage is not None:
            self.usage.add(expert_ids, self.weight.shape[0])
        return weights, expert_ids


def track_expert_usage(model: nn.Module, device: torch.device) -> ExpertUsage | None:
    """One ExpertUsage counting every router of `model`, on the CPU; None for a model
    without routers, or on another device (ExpertUsage says why)."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    if not routers or device.type != "cpu":
        return None
    usage = ExpertUsage()
    for router in routers:
        router.usage = usage
    return usage


class KernelExperts(nn.Module):
    """A layer's experts that the native grouped kernel may serve: `pack()` moves their
    weights into its layout after loading (`packed`: the kernel's copy, or None)."""

    packed: moe_kernel.PackedExperts | None = None

    def pack(self, weight_format: str = "float") -> bool:
        """Pack where the kernel serves these experts, their weights in `weight_format`
        (moe_kernel.PackedExperts'); returns whether they are packed."""
        raise NotImplementedError

    def planned_bytes(self, device: torch.device, weight_format: str) -> int | None:
        """What `pack(weight_format)` would leave on `device` (the kernel's copy, which
        replaces every parameter of this module), from the shapes alone - this module may
        be on the meta device: the memory plan's count. None where the kernel would not
        serve these experts there (they stay as their parameters)."""
        raise NotImplementedError

    @property
    def weight_bytes(self) -> int:
        """What the weights take: the kernel's copy once packed, else the parameters."""
        if self.packed is not None:
            return self.packed.weight_bytes
        return sum(p.numel() * p.element_size() for p in self.parameters())


class Experts(KernelExperts):
    """num_experts gated MLPs over stacked weights (see the module docstring)."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported expert activation {activation!r}; supported: {list(_ACTIVATIONS)}"
            )
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.activation = activation
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.packed: moe_kernel.PackedExperts | None = None  # the native kernel's copy

    def pack(self, weight_format: str = "float") -> bool:
        """Move the weights into the native kernel's layout, where it serves them (the
        parameters then hold no memory); returns whether they are packed. weight_format:
        "float" (the parameters' dtype) or "int8" (moe_kernel.PackedExperts)."""
        gate_up = self.gate_up_proj
        hidden, inter = gate_up.shape[2], self.intermediate_size
        if self.packed is not None or not moe_kernel.available(
            gate_up.dtype, gate_up.device, hidden, inter, 1
        ):
            return self.packed is not None
        self.packed = moe_kernel.PackedExperts(
            gate_up.data, self.down_proj.data, self.activation, weight_format
        )
        release_to_meta(self, ("gate_up_proj", "down_proj"))
        return True

    def planned_bytes(self, device: torch.device, weight_format: str) -> int | None:
        num_experts, two_inter, hidden = self.gate_up_proj.shape
        dtype = self.gate_up_proj.dtype
        if not moe_kernel.available(dtype, device, hidden, two_inter // 2, 1):
            return None
        return moe_kernel.packed_bytes(num_experts, hidden, two_inter // 2, dtype, weight_format)

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """x: [num_tokens, hidden]; weights, expert_ids: [num_tokens, top_k] -> [num_tokens, hidden]."""
        if self.packed is not None:
            return self.packed(x, expert_ids, weights)
        return grouped_experts(
            x, weights, expert_ids, self.gate_up_proj, self.down_proj, self.activation
        )


def release_to_meta(module: nn.Module, names: tuple[str, ...]) -> None:
    """Replace the named parameters with meta tensors of their shapes, once the kernel
    holds its own copy: the shapes stay for tools; the memory goes."""
    for name in names:
        param = getattr(module, name)
        meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
        setattr(module, name, nn.Parameter(meta, requires_grad=False))


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str | Callable[[torch.Tensor], torch.Tensor],
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts in PyTorch, as one grouped matmul per projection over the (token,
    expert) pairs sorted by expert (torch's grouped_mm takes each expert's run of rows by
    its end offset); the weighted terms are added back in ascending expert order.

    Args:
        x: [num_tokens, hidden]; weights, expert_ids: [num_tokens, top_k]
        gate_up: [num_experts, 2 * inter, hidden]; down: [num_experts, hidden, inter]
        activation: a gated activation's name (gate rows first, then up), or a function
            of the gate_up products [rows, 2 * inter] -> [rows, inter] (gpt-oss's)
        gate_up_bias: [num_experts, 2 * inter]; down_bias: [num_experts, hidden] (or None)
    """
    num_tokens, top_k = expert_ids.shape
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, tokens ascending within
    tokens = order // top_k
    ends = torch.bincount(flat, minlength=gate_up.shape[0]).cumsum(0).to(torch.int32)
    rows = x.index_select(0, tokens)
    row_experts = flat[order]
    gate_up_out = _grouped_mm(rows, gate_up, ends)
    if gate_up_bias is not None:
        gate_up_out += gate_up_bias.index_select(0, row_experts)
    glu = activation if callable(activation) else functools.partial(_halves_glu, activation)
    hidden = _grouped_mm(glu(gate_up_out), down, ends)
    if down_bias is not None:
        hidden += down_bias.index_select(0, row_experts)
    terms = hidden.float() * weights.reshape(-1)[order, None]
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, tokens, terms).to(x.dtype)


def _halves_glu(activation: str, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return _ACTIVATIONS[activation](gate) * up


def _grouped_mm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [n, k] (sorted by expert) times each expert's weights [E, out, k] transposed."""
    if hasattr(F, "grouped_mm") and _aligned(rows, weights):
        return F.grouped_mm(rows, weights.transpose(1, 2), offs=ends)
    # Shapes grouped_mm does not take (rows not a multiple of 16 bytes): each pair gathers
    # its expert's weights - for the small models that have such shapes.
    starts = torch.cat((ends.new_zeros(1), ends[:-1])).long()
    experts = torch.repeat_interleave(
        torch.arange(weights.shape[0], device=rows.device), (ends.long() - starts)
    )
    return torch.bmm(weights.index_select(0, experts), rows.unsqueeze(-1)).squeeze(-1)


def _aligned(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    size = rows.element_size()
    return all(d * size % 16 == 0 for d in (weights.shape[1], weights.shape[2]))


class SparseMoeBlock(nn.Module):
    """The router and the experts: x -> the weighted sum of each token's experts."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        routing: Routing,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, num_experts, routing)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]."""
        weights, expert_ids = self.gate(x)
        return self.experts(x, weights, expert_ids)


def pack_experts(model: nn.Module) -> int:
    """Pack every MoE layer's experts for the native kernel where it serves them (those
    packed already stay as they are); returns how many layers are packed."""
    return sum(m.pack() for m in model.modules() if isinstance(m, KernelExperts))


def expert_packer(weight_format: str) -> Callable[[nn.Module, str], None]:
    """A load's `on_filled` callback (loader/weights.py): each layer's experts packed for
    the native kernel in `weight_format` the moment their stacks are complete, which
    frees the float stacks - so the load holds one layer's float experts at most beside
    the packed ones, never the whole float model's. Other modules are left alone."""

    def pack_filled(model: nn.Module, name: str) -> None:
        module = model.get_submodule(name)
        if isinstance(module, KernelExperts):
            module.pack(weight_format)

    return pack_filled


@dataclass
class MoeConfig(ModelConfig):
    """ModelConfig plus a mixture of experts' sizes and routing."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; intermediate_size is the dense layers'
    routing: Routing | None = None
    # Layers with a dense gated MLP instead of experts (Qwen3-MoE's mlp_only_layers and
    # decoder_sparse_step).
    dense_layers: tuple[int, ...] = ()
    # Whether the expert quantizations (int8, int4: quant/) take the experts: not
    # gpt-oss's MXFP4 ones, 4-bit as the checkpoint stores them.
    quantizable_experts: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {self.hidden_act!r} is not supported for {self.architecture} "
                f"(supported: {', '.join(_ACTIVATIONS)})"
            )

    def is_sparse_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.dense_layers


class MoeDecoderLayer(LlamaDecoderLayer):
    """The Llama decoder layer with a sparse MoE block for its MLP (a dense one on the
    config's dense layers)."""

    def build_mlp(self, config: MoeConfig, layer_idx: int) -> nn.Module:
        if not config.is_sparse_layer(layer_idx):
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            config.routing,
            config.hidden_act,
        )


class MoeModel(LlamaModel):
    decoder_layer = MoeDecoderLayer


class MoeForCausalLM(LlamaForCausalLM):
    base_model_class = MoeModel
