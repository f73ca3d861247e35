"""LoRA on the decoder's fused projections: which layer a PEFT target is, and the wrapper
that adds each adapter's low-rank term to the rows that use it.

PEFT names a Llama-family decoder's projections as transformers does (q_proj, k_proj,
v_proj, o_proj, gate_proj, up_proj, down_proj); the engine fuses q/k/v into `qkv_proj`
and gate/up into `gate_up_proj` (the model's `packed_modules`). A target is therefore a
slice of a fused layer's output: its rows `[offset, offset + out)`.

`LoRALinear` wraps one such layer. Its base (float, oneDNN-packed or quantized) runs once
on the whole step; then, for each run of rows that share an adapter (the step's
`LoRAStep`, set by the runner), it adds `(x @ A^T) @ B^T` for that adapter: A stacks the
adapter's lora_A of every target in the layer ([r_total, in]), B places each target's
lora_B, pre-multiplied by its scaling, in that target's output rows and rank columns
([out, r_total], zero elsewhere), and each target is a block (its rank columns, its output
rows). On a CPU with the native kernels every run's terms are one call per layer
(engine/kernels/lora.c), which multiplies only each target's block; elsewhere each long
run of rows (a prompt chunk) gets its own two matmuls and the short runs of a decode step
one batched matmul pair over every adapter's rows at once. Each matmul call costs
microseconds of dispatch, which outweigh a few rows' arithmetic (docs/design.md,
"LoRA adapters").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.engine.kernels import lora as lora_kernel
from tokenmill.engine.models.config import ModelConfig

# PEFT target name -> (the decoder block's submodule, the engine's layer there).
LORA_TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("self_attn", "qkv_proj"),
    "k_proj": ("self_attn", "qkv_proj"),
    "v_proj": ("self_attn", "qkv_proj"),
    "o_proj": ("self_attn", "o_proj"),
    "gate_proj": ("mlp", "gate_up_proj"),
    "up_proj": ("mlp", "gate_up_proj"),
    "down_proj": ("mlp", "down_proj"),
}


@dataclass(frozen=True)
class TargetShape:
    """Where a PEFT target sits in the engine's layer, and its shape."""

    parent: str  # "self_attn" | "mlp"
    layer: str  # the engine's (possibly fused) linear layer
    in_features: int
    out_features: int
    offset: int  # its first output row in the fused layer's output


def lora_target_shapes(config: ModelConfig) -> dict[str, TargetShape]:
    """Every PEFT target of a decoder layer with this config, by its PEFT name."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    return {
        "q_proj": TargetShape("self_attn", "qkv_proj", hidden, q_size, 0),
        "k_proj": TargetShape("self_attn", "qkv_proj", hidden, kv_size, q_size),
        "v_proj": TargetShape("self_attn", "qkv_proj", hidden, kv_size, q_size + kv_size),
        "o_proj": TargetShape("self_attn", "o_proj", q_size, hidden, 0),
        "gate_proj": TargetShape("mlp", "gate_up_proj", hidden, inter, 0),
        "up_proj": TargetShape("mlp", "gate_up_proj", hidden, inter, inter),
        "down_proj": TargetShape("mlp", "down_proj", inter, hidden, 0),
    }


@dataclass
class SlotWeights:
    """One adapter's term for one layer, ready to multiply: x @ a_t @ b_t."""

    a_t: torch.Tensor  # [in, r_total]: lora_A of each target, stacked and transposed
    b_t: torch.Tensor  # [r_total, out]: scaling * lora_B of each target, in its rows
    targets: tuple[str, ...] = field(default=())  # the PEFT targets it covers
    # (first rank column, end, first output, end) of each target: b_t is zero outside
    # them. Empty: one block, the whole of b_t. Blocks start on even columns (the native
    # bf16 kernel multiplies pairs of them).
    blocks: tuple[tuple[int, int, int, int], ...] = field(default=())


@dataclass
class BatchedRows:
    """Short runs of rows (decode steps: a few rows per adapter), computed together: each
    slot of `lo..hi` gets `rows_per_slot` rows of the batch, padded, as one batched matmul
    over the slots' stacked weights - one call where a loop would make two per adapter."""

    lo: int  # the first slot of the span
    hi: int  # one past the last
    rows_per_slot: int
    index: torch.Tensor  # [(hi - lo) * rows_per_slot] long: the batch row of each entry
    mask: torch.Tensor  # [hi - lo, rows_per_slot, 1]: 1 for a row, 0 for padding


@dataclass
class LoRAStep:
    """The step's rows by adapter, shared by every LoRALinear of a model; the runner sets
    it before the forward pass and clears it after (`is_active` False: no row of the step
    uses an adapter, and the wrappers only run their base)."""

    # (slot, first row, end row): rows [first, end) use the adapter in `slot`, each run
    # computed with its own two matmuls.
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    batched: BatchedRows | None = None
    # Every run as (slot, first row, end row), int64 [num_runs, 3], for native wrappers.
    runs: torch.Tensor | None = None
    is_active: bool = False

    def clear(self) -> None:
        self.segments, self.batched, self.runs, self.is_active = [], None, None, False


class LoRALinear(nn.Module):
    """A linear layer (any of the engine's kinds) plus per-row LoRA terms.

    Slot s's term is x @ a[s, :, :r[s]] @ b[s, :r[s]]: `a` [num_slots, in, R] stacks each
    loaded adapter's lora_A of every target in the layer (transposed), `b` [num_slots, R,
    out] places each target's scaled lora_B in its output columns; R is the largest
    r_total loaded (even), the rest zero. r[s] == 0: the adapter in slot s leaves this
    layer be. Native bf16 wrappers keep `a` and `b` in pairs of rows instead
    (`lora_kernel.to_pairs`), as their kernel reads them, with B padded as it asks
    (kernels.h, tm_lora_args).

    Args:
        base: the layer; it keeps computing the whole batch.
        step: the model's shared LoRAStep.
        num_slots: how many adapters can be loaded at once (max_loras).
        native: add the terms with the native kernel (`step.runs`), not matmuls.
    """

    def __init__(
        self, base: nn.Module, step: LoRAStep, num_slots: int, *, native: bool = False
    ) -> None:
        super().__init__()
        self.base_layer = base
        self.step = step
        self.num_slots = num_slots
        self.native = native
        self.a: torch.Tensor | None = None  # allocated by the first set_slot
        self.b: torch.Tensor | None = None
        self.ranks = [0] * num_slots
        self.targets: list[tuple[str, ...]] = [()] * num_slots
        self._tables: lora_kernel.LoRATables | None = None  # native: built on first use
        if native:
            self.slot_ranks = torch.zeros(num_slots, dtype=torch.int64)
            self.slot_blocks = torch.zeros(
                num_slots, lora_kernel.max_blocks(), 4, dtype=torch.int64
            )
            self.slot_num_blocks = torch.zeros(num_slots, dtype=torch.int64)

    @property
    def fused_activation(self) -> str | None:
        """The base's fused activation (an int8 gate_up, quant/int8.py), on steps without
        adapters only: an adapter's term must be added before the activation."""
        if self.step.is_active:
            return None
        return getattr(self.base_layer, "fused_activation", None)

    def set_slot(self, slot: int, weights: SlotWeights | None) -> None:
        """Load one adapter's term into `slot` (None: the adapter has no target here)."""
        self._tables = None
        if weights is None:
            if self.a is not None:
                self.a[slot].zero_()
                self.b[slot].zero_()
            self.ranks[slot], self.targets[slot] = 0, ()
            if self.native:
                self.slot_ranks[slot] = self.slot_num_blocks[slot] = 0
            return
        a_t, b_t = weights.a_t, weights.b_t
        (in_features, rank), out_features = a_t.shape, b_t.shape[1]
        rank += rank % 2  # pairs of rank columns: pad an odd rank
        blocks = weights.blocks or ((0, rank, 0, out_features),)
        pairs = self._pairs_for(a_t.dtype)
        # The native bf16 kernel reads each block's rank rows of b in whole 16s.
        b_rows = max(rank, *(lo + -(hi - lo) // 16 * -16 for lo, hi, _, _ in blocks))
        if self.a is None or rank > self.a_cols or (pairs and b_rows > self.b_rows):
            grown = max(rank, self.a_cols)
            self._grow(grown, max(b_rows, self.b_rows) if pairs else grown, a_t, b_t)
        a = a_t.new_zeros(in_features, self.a_cols)
        b = b_t.new_zeros(self.b_rows, self.b.shape[2])
        a[:, : a_t.shape[1]] = a_t
        b[: b_t.shape[0], :out_features] = b_t
        self.a[slot] = lora_kernel.to_pairs(a) if pairs else a
        self.b[slot] = lora_kernel.to_pairs(b) if pairs else b
        self.ranks[slot], self.targets[slot] = rank, weights.targets
        if self.native:
            self.slot_ranks[slot] = rank
            self.slot_num_blocks[slot] = len(blocks)
            self.slot_blocks[slot].zero_()
            self.slot_blocks[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)

    def _pairs_for(self, dtype: torch.dtype) -> bool:
        """Whether slots of this dtype are kept in pairs of rows (native bf16)."""
        return self.native and dtype == torch.bfloat16

    @property
    def pairs(self) -> bool:
        """Whether `a` and `b` are in pairs of rows."""
        return self.a is not None and self._pairs_for(self.a.dtype)

    @property
    def a_cols(self) -> int:
        """The rank columns each slot's A has room for."""
        return 0 if self.a is None else self.a.shape[2]

    @property
    def b_rows(self) -> int:
        """The rank rows each slot's B has (as many as A's columns, or more in pairs)."""
        if self.b is None:
            return 0
        return self.b.shape[1] * 2 if self.pairs else self.b.shape[1]

    def _grow(self, a_cols: int, b_rows: int, a_t: torch.Tensor, b_t: torch.Tensor) -> None:
        """Stacks with room for a_cols and b_rows, keeping the slots loaded so far. Pairs
        give B 16 spare columns: the AMX tiles read up to 16 past a block."""
        in_features, out_features = a_t.shape[0], b_t.shape[1]
        if self._pairs_for(a_t.dtype):
            a = a_t.new_zeros(self.num_slots, in_features // 2, a_cols, 2)
            b = b_t.new_zeros(self.num_slots, b_rows // 2, out_features + 16, 2)
        else:
            a = a_t.new_zeros(self.num_slots, in_features, a_cols)
            b = b_t.new_zeros(self.num_slots, b_rows, out_features)
        if self.a is not None:
            a[:, :, : self.a_cols] = self.a
            b[:, : self.b.shape[1]] = self.b
        self.a, self.b = a, b

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """x [num_tokens, in] -> [num_tokens, out] (or the base's fused activation's)."""
        y = self.base_layer(x, **kwargs)
        step = self.step
        if not step.is_active or self.a is None:
            return y
        if self.native:
            if step.runs is not None:
                if self._tables is None:
                    self._tables = lora_kernel.LoRATables(
                        self.a, self.b, self.slot_ranks, self.slot_blocks, self.slot_num_blocks
                    )
                y = y.contiguous()
                self._tables.add(x.contiguous(), y, step.runs)
            return y
        for slot, start, end in step.segments:
            rank = self.ranks[slot]
            if rank:
                # y[start:end] is a view: the term is added in place, in y's dtype.
                a, b = self.a[slot, :, :rank], self.b[slot, :rank]
                y[start:end].addmm_(x[start:end] @ a, b)
        rows = step.batched
        if rows is not None:
            span = rows.hi - rows.lo
            xs = x.index_select(0, rows.index).view(span, rows.rows_per_slot, -1)
            t = torch.bmm(xs, self.a[rows.lo : rows.hi]).mul_(rows.mask)
            delta = torch.bmm(t, self.b[rows.lo : rows.hi])  # padding rows add 0
            y.index_add_(0, rows.index, delta.view(span * rows.rows_per_slot, -1))
        return y

    def extra_repr(self) -> str:
        loaded = sum(1 for r in self.ranks if r)
        return f"slots={self.num_slots}, loaded={loaded}"
