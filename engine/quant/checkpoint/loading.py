"""Loading a quantized checkpoint's layers: which modules they replace and which tensors
they take (`CheckpointQuantization.hold_out`, on the model still on the meta device,
from the headers alone), then reading those tensors a file at a time and building each
layer as soon as its tensors are in (`load_layers`) - so no layer is ever held in float,
and the load's peak is the float parts plus one layer's tensors (its temporaries given
back to the system as each layer is built: loader/heap.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tokenmill.engine.loader.heap import return_freed_heap
from tokenmill.engine.loader.model_files import weight_files
from tokenmill.engine.loader.safetensors_files import iter_tensors
from tokenmill.engine.loader.tensor_plan import FLOAT_DTYPES, TensorSource, shard_sizes
from tokenmill.engine.models.layers import GatedMLP
from tokenmill.engine.quant.checkpoint.format import FormatReader, check_tensor
from tokenmill.engine.quant.checkpoint.layers import build_layer
from tokenmill.engine.quant.checkpoint.weights import LayerScheme
from tokenmill.engine.quant.method import quantized_targets


class PendingLayer(nn.Module):
    """Stands in, on the meta device, for a linear layer the checkpoint stores quantized,
    until load_layers builds it: its parts' checkpoint names and schemes."""

    def __init__(self, linear: nn.Linear, prefixes, schemes, rows, gated_activation) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.prefixes: list[str] = prefixes
        self.schemes: list[LayerScheme | None] = schemes
        self.rows: list[int] = rows
        self.has_bias = linear.bias is not None
        self.gated_activation: str | None = gated_activation
        self.tensor_names: frozenset[str] = frozenset()  # what it reads, set by hold_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a quantized layer was used before its weights were loaded")


@dataclass
class CheckpointQuantization:
    """A quantized checkpoint's config, read (`summary` says it as a user would)."""

    format: str  # the registered format's name
    reader: FormatReader

    @property
    def schemes(self) -> list[LayerScheme]:
        return self.reader.all_schemes()

    @property
    def summary(self) -> str:
        """The format and every scheme, e.g. "compressed-tensors pack-quantized, W4A16 g64"."""
        kinds = sorted({s.format for s in self.schemes})
        labels = sorted({s.label for s in self.schemes})
        return f"{'/'.join(kinds)}, {'/'.join(labels)}"

    @property
    def bits(self) -> tuple[int, ...]:
        return tuple(sorted({s.bits for s in self.schemes}))

    def hold_out(self, model: nn.Module, sources: list[TensorSource]) -> frozenset[str]:
        """Swap every linear layer the checkpoint stores quantized for a PendingLayer and
        return the checkpoint tensors they will read (weights, scales, zero points, bias).

        Raises:
            ValueError: a layer's tensor missing, of another dtype or shape, naming it.
        """
        by_name = {s.name: s for s in sources}
        config = model.config
        targets = quantized_targets(model)
        if hasattr(model, "lm_head"):
            targets.append((model, "lm_head", model.lm_head))
        names = {module: name for name, module in model.named_modules()}
        held: set[str] = set()
        for parent, attr, linear in targets:
            ours = f"{names[parent]}.{attr}" if names[parent] else attr
            prefixes, rows = _parts(model, ours, linear, config)
            schemes = [self.reader.scheme(p) for p in prefixes]
            if all(s is None for s in schemes):
                continue
            if attr == "lm_head" and config.tie_word_embeddings:
                raise ValueError(
                    "the checkpoint quantizes lm_head, which this model ties to its embeddings; "
                    "a tied quantized lm_head is not read"
                )
            mine: set[str] = set()
            for prefix, scheme, num_rows in zip(prefixes, schemes, rows):
                mine |= self._check_part(prefix, scheme, num_rows, linear, by_name)
            held |= mine
            gated = attr == "gate_up_proj" and isinstance(parent, GatedMLP)
            pending = PendingLayer(
                linear, prefixes, schemes, rows, parent.activation if gated else None
            )
            pending.tensor_names = frozenset(mine)
            setattr(parent, attr, pending)
        return frozenset(held)

    def _check_part(self, prefix, scheme, rows, linear, by_name) -> set[str]:
        k = linear.in_features
        if scheme is None:
            specs = {"weight": None}
        else:
            specs = self.reader.tensors(scheme, rows, k)
        held = set()
        for suffix, spec in specs.items():
            name = f"{prefix}.{suffix}"
            source = by_name.get(name)
            if source is None:
                if spec is None or spec.required:
                    what = "the float weight" if spec is None else spec.what
                    raise ValueError(f"quantized checkpoint is missing {name} ({what})")
                continue
            if spec is None:  # a float part of a fused layer whose other parts are quantized
                if source.dtype not in FLOAT_DTYPES or tuple(source.shape) != (rows, k):
                    raise ValueError(
                        f"weight {name} is {source.dtype} {tuple(source.shape)}, expected a "
                        f"float ({rows}, {k})"
                    )
            else:
                check_tensor(name, spec, source.dtype, source.shape)
            held.add(name)
        bias = by_name.get(f"{prefix}.bias")
        if (bias is None) == (linear.bias is not None):
            state = "lacks" if bias is None else "has"
            raise ValueError(f"checkpoint {state} {prefix}.bias, which the model does not match")
        if bias is not None:
            if bias.dtype not in FLOAT_DTYPES or tuple(bias.shape) != (rows,):
                raise ValueError(
                    f"bias {prefix}.bias has shape {tuple(bias.shape)}, expected ({rows},)"
                )
            held.add(bias.name)
        return held

    def load_layers(self, model: nn.Module, model_dir: Path, *, dtype: torch.dtype) -> int:
        """Read the held tensors and replace every PendingLayer by its module; returns the
        bytes the new layers' weights take."""
        pending = [
            (parent, attr, child)
            for parent in model.modules()
            for attr, child in parent.named_children()
            if isinstance(child, PendingLayer)
        ]
        owner = {name: index for index, (_, _, p) in enumerate(pending) for name in p.tensor_names}
        received: dict[int, dict[str, torch.Tensor]] = {}
        total = 0
        for path in weight_files(model_dir):
            for name, tensor in iter_tensors(path, set(owner)):
                index = owner[name]
                tensors = received.setdefault(index, {})
                tensors[name] = tensor
                parent, attr, layer = pending[index]
                if len(tensors) == len(layer.tensor_names):
                    module = self._build(layer, received.pop(index), dtype)
                    setattr(parent, attr, module)
                    total += module.weight_bytes
                    # the layer's temporaries, freed, would otherwise stay in the heap
                    return_freed_heap()
        return total

    def _build(self, layer: PendingLayer, tensors: dict, dtype: torch.dtype) -> nn.Module:
        parts, biases = [], []
        for prefix, scheme, rows in zip(layer.prefixes, layer.schemes, layer.rows):
            if scheme is None:
                parts.append(tensors[f"{prefix}.weight"])
            else:
                mine = {
                    n.removeprefix(f"{prefix}."): t
                    for n, t in tensors.items()
                    if n.rpartition(".")[0] == prefix and not n.endswith(".bias")
                }
                try:
                    parts.append(self.reader.decode(scheme, mine, rows, layer.in_features))
                except ValueError as error:
                    raise ValueError(f"quantized layer {prefix}: {error}") from None
            if layer.has_bias:
                biases.append(tensors[f"{prefix}.bias"].float())
        bias = torch.cat(biases) if biases else None
        return build_layer(
            parts, layer.schemes, bias, dtype=dtype, gated_activation=layer.gated_activation
        )


def _parts(model, ours: str, linear, config) -> tuple[list[str], list[int]]:
    """The checkpoint layers our layer `ours` is made of, in row order, with their rows."""
    for fused, _ in model.packed_modules.values():
        if ours.endswith(f".{fused}"):
            base = ours.removesuffix(fused)
            shards = sorted(
                (shard, hf) for hf, (name, shard) in model.packed_modules.items() if name == fused
            )
            sizes = shard_sizes(fused, config)
            return [f"{base}{hf}" for _, hf in shards], [sizes[s] for s, _ in shards]
    return [ours], [linear.out_features]
