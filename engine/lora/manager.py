"""The runner's LoRA adapters: host copies of every registered adapter, `max_loras` slots of
weights ready for the model's layers, and each step's rows by adapter.

    register(description)  read an adapter's weights once (kept in host memory, fp32) and
                           give it an id; equal files get the same id. The layers it
                           targets are wrapped in LoRALinear the first time any adapter
                           targets them, so a model that never sees an adapter is the
                           model as loaded.
    begin_step(out)        map the step's rows to slots, loading adapters into slots as
                           needed: runs of rows with the same adapter (the scheduler
                           orders them so each adapter's rows are one run of the decodes
                           and one of the prompt chunks). With the native kernel
                           every run goes to it in one table; otherwise runs of more
                           than BATCHED_ROWS rows are (slot, first, end) segments, the
                           others one padded batch (`layers.BatchedRows`). Nothing
                           when no row has an adapter: every wrapper then only runs its
                           base.
    end_step()             clear the mapping.

Slots are reused least recently used first: an adapter evicted from its slot keeps its
host copy and is prepared again (fused, scaled, cast, moved to the device) when a step
needs it. The scheduler never runs more than `max_loras` adapters at once, so a step's
adapters always fit.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

import numpy as np
import torch
from torch import nn

from tokenmill.engine.core.step import SchedulerOutput
from tokenmill.engine.kernels import lora as lora_kernel
from tokenmill.engine.lora.adapters import AdapterDescription, AdapterTarget, load_adapter
from tokenmill.engine.lora.layers import (
    BatchedRows,
    LoRALinear,
    LoRAStep,
    SlotWeights,
    TargetShape,
    lora_target_shapes,
)
from tokenmill.engine.models import ModelConfig

HostWeights = dict[AdapterTarget, tuple[torch.Tensor, torch.Tensor]]

# Runs of at most this many rows go into the step's one padded batch; longer ones (prompt
# chunks) get matmuls of their own. ref: docs/design.md, "LoRA adapters".
BATCHED_ROWS = 32


class LoRAManager:
    """Adapters for one model runner.

    Args:
        model: the loaded model (its decoder layers get wrapped).
        config: its config (the targets' shapes).
        max_loras: slots: adapters ready for a step at once.
        dtype, device: of the model's activations.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        *,
        max_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model = model
        self.max_loras = max_loras
        self.dtype = dtype
        self.device = device
        self.step = LoRAStep()
        self.shapes = lora_target_shapes(config)
        # Each engine layer's output width (a fused layer's, for its targets' offsets).
        self.layer_out = {
            s.layer: max(
                t.offset + t.out_features for t in self.shapes.values() if t.layer == s.layer
            )
            for s in self.shapes.values()
        }
        # One native call per layer for every run of rows, where the kernel takes every
        # layer an adapter could target.
        self.native = all(
            lora_kernel.available(dtype, device, shape.in_features)
            for shape in self.shapes.values()
        )
        self.layers: dict[tuple[int, str], LoRALinear] = {}  # (layer index, name) -> wrapper
        self.descriptions: dict[int, AdapterDescription] = {}
        self._ids: dict[str, int] = {}  # weights hash -> lora id
        self._host: dict[int, HostWeights] = {}
        self._slots: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self.num_slot_loads = 0  # adapters prepared into a slot: first loads and reloads

    @property
    def has_adapters(self) -> bool:
        return bool(self._ids)

    def register(self, description: AdapterDescription) -> int:
        """The lora id of a described adapter, its weights read on first registration.

        Returns:
            An id >= 1 (0 is the base model), the same for every description of the
            same files.
        """
        known = self._ids.get(description.weights_hash)
        if known is not None:
            return known
        weights = load_adapter(description)
        lora_id = len(self._ids) + 1
        self._ids[description.weights_hash] = lora_id
        self._host[lora_id] = weights
        self.descriptions[lora_id] = description
        for key in sorted({(t.layer, self.shapes[t.module].layer) for t in weights}):
            self._wrap(key)
        return lora_id

    def begin_step(self, out: SchedulerOutput) -> bool:
        """Set the step's rows by slot for every wrapper; False (and nothing set) when no
        row uses an adapter. Rows follow the runner's batch order: out.chunks,
        num_new_tokens rows each."""
        if not self._ids:
            return False
        runs: list[list[int]] = []  # [lora id, first row, end row]
        row = 0
        for chunk in out.chunks:
            lora_id, num = chunk.seq.lora_id, chunk.num_new_tokens
            if lora_id:
                if runs and runs[-1][0] == lora_id and runs[-1][2] == row:
                    runs[-1][2] += num
                else:
                    runs.append([lora_id, row, row + num])
            row += num
        if not runs:
            return False
        slots = self._slots_for({lora_id for lora_id, _, _ in runs})
        step = self.step
        step.is_active = True
        if self.native:
            step.runs = torch.tensor([(slots[i], a, b) for i, a, b in runs], dtype=torch.int64)
            return True
        short = [(slots[i], a, b) for i, a, b in runs if b - a <= BATCHED_ROWS]
        step.segments = [(slots[i], a, b) for i, a, b in runs if b - a > BATCHED_ROWS]
        if len(short) > 1:
            step.batched = batched_rows(short, device=self.device, dtype=self.dtype)
        else:
            step.segments += short
        return True

    def end_step(self) -> None:
        self.step.clear()

    # -- slots ------------------------------------------------------------------------------

    def _slots_for(self, lora_ids: set[int]) -> dict[int, int]:
        """Each adapter's slot, loading the ones not in a slot (evicting the least recently
        used adapters this step does not need)."""
        for lora_id in sorted(lora_ids):
            if lora_id in self._slots:
                self._slots.move_to_end(lora_id)
                continue
            taken = set(self._slots.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:
                victim = next((i for i in self._slots if i not in lora_ids), None)
                if victim is None:
                    raise RuntimeError(
                        f"a step uses {len(lora_ids)} adapters and there are {self.max_loras} "
                        "slots (the scheduler admits at most max_loras at once)"
                    )
                slot = self._slots.pop(victim)
            self._load(lora_id, slot)
            self._slots[lora_id] = slot
        return {lora_id: self._slots[lora_id] for lora_id in lora_ids}

    def _load(self, lora_id: int, slot: int) -> None:
        by_layer = self._by_layer(lora_id)
        for key, wrapper in self.layers.items():
            parts = by_layer.get(key)
            wrapper.set_slot(slot, self._prepare(key[1], parts) if parts else None)
        self.num_slot_loads += 1

    def _by_layer(self, lora_id: int) -> dict[tuple[int, str], list]:
        parts: dict[tuple[int, str], list] = defaultdict(list)
        for target, (a, b) in self._host[lora_id].items():
            shape = self.shapes[target.module]
            parts[(target.layer, shape.layer)].append((shape, target, a, b))
        return parts

    def _prepare(
        self,
        layer_name: str,
        parts: list[tuple[TargetShape, AdapterTarget, torch.Tensor, torch.Tensor]],
    ) -> SlotWeights:
        """One adapter's targets in one engine layer as a single shrink and expand: A
        stacked over the targets, B with each target's rows and rank columns (scaled).
        Each target's columns start on an even one (a zero column after an odd rank),
        as the native bf16 kernel's pairs need."""
        parts = sorted(parts, key=lambda p: p[0].offset)
        width = sum(p[1].rank + p[1].rank % 2 for p in parts)
        in_features = parts[0][2].shape[1]
        a = torch.zeros(width, in_features)  # [r_total, in]
        b = torch.zeros(self.layer_out[layer_name], width)  # [out, r_total]
        blocks, col = [], 0
        for shape, target, lora_a, lora_b in parts:
            a[col : col + target.rank] = lora_a
            rows = slice(shape.offset, shape.offset + shape.out_features)
            b[rows, col : col + target.rank] = lora_b * target.scaling
            end = col + target.rank + target.rank % 2
            blocks.append((col, end, shape.offset, shape.offset + shape.out_features))
            col = end
        return SlotWeights(
            a_t=a.t().contiguous().to(self.device, self.dtype),
            b_t=b.t().contiguous().to(self.device, self.dtype),
            targets=tuple(p[1].module for p in parts),
            blocks=tuple(blocks),
        )

    def _wrap(self, key: tuple[int, str]) -> None:
        """Wrap one engine layer in a LoRALinear (once), filling the slots already loaded."""
        if key in self.layers:
            return
        layer_idx, name = key
        parent_name = next(s.parent for s in self.shapes.values() if s.layer == name)
        parent = getattr(self.model.model.layers[layer_idx], parent_name)
        wrapper = LoRALinear(getattr(parent, name), self.step, self.max_loras, native=self.native)
        setattr(parent, name, wrapper)
        self.layers[key] = wrapper
        for lora_id, slot in self._slots.items():
            parts = self._by_layer(lora_id).get(key)
            wrapper.set_slot(slot, self._prepare(name, parts) if parts else None)


def batched_rows(
    runs: list[tuple[int, int, int]], *, device: torch.device, dtype: torch.dtype
) -> BatchedRows:
    """Short runs of rows, (slot, first row, end row) each, as one padded batch over the
    span of their slots."""
    rows: dict[int, list[int]] = defaultdict(list)
    for slot, start, end in runs:
        rows[slot].extend(range(start, end))
    lo, hi = min(rows), max(rows) + 1
    per_slot = max(len(r) for r in rows.values())
    index = np.zeros((hi - lo, per_slot), dtype=np.int64)  # padding gathers row 0 ...
    mask = np.zeros((hi - lo, per_slot, 1), dtype=np.float32)  # ... and adds nothing
    for slot, slot_rows in rows.items():
        index[slot - lo, : len(slot_rows)] = slot_rows
        mask[slot - lo, : len(slot_rows)] = 1.0
    return BatchedRows(
        lo=lo,
        hi=hi,
        rows_per_slot=per_slot,
        index=torch.from_numpy(index.reshape(-1)).to(device),
        mask=torch.from_numpy(mask).to(device, dtype),
    )
