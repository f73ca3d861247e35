"""Quantized linear layers: `LLM(..., quantization=NAME)`, one method object per mode.

Quantization is a property of the loaded model's linear layers: after the weights load,
`quantize_model` swaps the decoder layers' projections (q/k/v, o, gate/up, down) for
quantized modules with nn.Linear's forward. The scheduler, the KV cache and everything
else in the engine never see it; the rest of the model (embeddings, norms, attention,
and the lm_head unless the mode quantizes it) runs in the engine's float dtype. The modes:

- "int8": per-channel int8 weights, dynamically quantized int8 activations (int8.py),
  smoothed SmoothQuant-style with statistics from a short float run at load
  (calibrate.py); the lm_head too with `quantize_lm_head=True`. A mixture of experts'
  experts: int8 weights with a scale per output column, for the grouped kernel
  (kernels/moe.py).
- "int4": group-wise 4-bit weights (group 32), bf16 activations (int4.py); a mixture of
  experts' experts: the same groups in the grouped kernel, activations in the model's
  dtype. "gguf" is refused for such models (its converter keeps no expert blocks).
- "gguf": the GGUF's own quantized blocks, kept as they are (gguf_linear.py).

A checkpoint quantized by another tool (config.json's quantization_config) loads its
layers in its own format where a reader in checkpoint/ takes it (compressed-tensors),
onto the same int4 and int8 kernels; other formats are refused by name
(checkpoint_formats.py).

Every check that can fail runs before any weight is touched (`check_quantization`).

How to add a quantization mode
------------------------------
Write one module here with a `QuantizationMethod` subclass (method.py): its `name`,
`help`, the `layer_classes` it makes, a `check` that refuses models or devices it cannot
run, and a `quantize` that swaps a loaded model's linear layers (`quantized_targets`
lists them) - then `register(YourMethod())` at the module's end. This package imports
every module in it, so the job option's choices, `LLM(quantization=...)`'s check and the
tools that walk a model follow with no other edit.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tokenmill.engine.kernels import moe as moe_kernel
from tokenmill.engine.models.moe import MoeConfig
from tokenmill.engine.quant.checkpoint import CheckpointQuantization
from tokenmill.engine.quant.checkpoint_formats import (
    CheckpointInfo,
    check_checkpoint_quantization,
    checkpoint_info,
)
from tokenmill.engine.quant.method import (
    HeldOutBytes,
    MeasureInputs,
    OnFilled,
    QuantizationMethod,
    quantized_targets,
    registered,
)
from tokenmill.engine.quant.packed_linear import PackedLinear

# Modules of this package that are not quantization modes.
_NOT_MODES = frozenset({"calibrate", "checkpoint", "checkpoint_formats", "method", "packed_linear"})

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _NOT_MODES:
        importlib.import_module(f"{__name__}.{_module.name}")

QUANTIZATIONS: tuple[str, ...] = tuple(sorted(registered()))
# The modes that also quantize a mixture of experts' experts (their `expert_format`).
EXPERT_QUANTIZATIONS = tuple(n for n, m in sorted(registered().items()) if m.expert_format)


def get_method(quantization: str) -> QuantizationMethod:
    """The method called `quantization`; raises ValueError naming the choices."""
    methods = registered()
    if quantization not in methods:
        raise ValueError(
            f"unknown quantization {quantization!r}; choose one of "
            f"{', '.join(QUANTIZATIONS)} or None"
        )
    return methods[quantization]


def validate_name(quantization: str | None) -> str | None:
    """The quantization name, checked; raises ValueError naming the choices."""
    if quantization is not None:
        get_method(quantization)
    return quantization


def validate_lm_head(quantization: str | None, quantize_lm_head: bool) -> None:
    """Raise ValueError when `quantize_lm_head=True` asks what the mode cannot do."""
    if not quantize_lm_head:
        return
    offering = sorted(n for n, m in registered().items() if m.quantizes_lm_head)
    if quantization is None or not get_method(quantization).quantizes_lm_head:
        raise ValueError(
            f"quantize_lm_head=True needs quantization={' or '.join(map(repr, offering))}, "
            f"not {quantization!r}"
        )


def check_quantization(
    quantization: str | None, model_dir: Path, config, *, device: torch.device
) -> CheckpointQuantization | None:
    """Raise ValueError when this model cannot run quantized this way here - or at all,
    its checkpoint being quantized by another tool in a format not read
    (checkpoint_formats.py).

    Args:
        quantization: a name from QUANTIZATIONS, or None.
        model_dir: the model's HF-layout directory (a GGUF conversion for "gguf").
        config: its ModelConfig.
        device: where it will run.
    Returns:
        The checkpoint's own quantization, read, or None for a float checkpoint.
    """
    checkpoint = check_checkpoint_quantization(model_dir)
    if checkpoint is not None:
        if quantization is not None:
            raise ValueError(
                f"{Path(model_dir).name} is quantized already ({checkpoint.format}); leave "
                f"quantization unset (not {quantization!r}) to run its own weights"
            )
        if device.type != "cpu":
            raise ValueError(
                f"quantized checkpoints ({checkpoint.format}) run on CPU only, not {device.type}"
            )
    if quantization is not None and isinstance(config, MoeConfig):
        check_expert_quantization(quantization, config, device)
    if quantization is not None:
        get_method(quantization).check(model_dir, config, device)
    return checkpoint


def expert_weight_format(quantization: str | None) -> str:
    """The weight format a mixture of experts' experts are packed in for the native
    kernel under this mode (kernels/moe.py): the mode's `expert_format`, else "float"
    (the model's dtype: no mode, or one whose check refuses MoE models)."""
    if quantization is None:
        return "float"
    return get_method(quantization).expert_format or "float"


def load_quantizer(quantization: str | None) -> OnFilled | None:
    """The mode's callback quantizing each decoder linear layer as the load fills it
    (method.load_quantizer), or None: no mode, or one that quantizes after the load."""
    return None if quantization is None else get_method(quantization).load_quantizer()


def load_hold_out(quantization: str | None, model_dir: Path):
    """The mode's hold-out for the load (method.hold_out): the tensors it reads in their
    stored format itself; None for no mode or one that quantizes float weights."""
    return None if quantization is None else get_method(quantization).hold_out(model_dir)


def held_out_bytes(quantization: str | None, model_dir: Path) -> HeldOutBytes | None:
    """The bytes the layers the mode's hold-out leaves out of the float load take as
    stored (method.held_out_bytes), for the memory plan; None for no mode or one that
    holds nothing out."""
    return None if quantization is None else get_method(quantization).held_out_bytes(model_dir)


def loaded_layer_bytes(quantization: str | None) -> Callable[[int, int, bool], int] | None:
    """(out_features, in_features, bias) -> the bytes a decoder linear layer takes once
    the load has quantized it, for a mode that quantizes as it loads (load_quantizer);
    else None (its layers are float until the load ends)."""
    if load_quantizer(quantization) is None:
        return None
    return get_method(quantization).loaded_layer_bytes


def held_layer_bytes(quantization: str | None) -> Callable[[int, int, bool], int] | None:
    """(out_features, in_features, bias) -> the bytes a decoder linear layer takes once
    the mode has quantized it, load over (method.held_layer_bytes); None where its layers
    stay as the load left them."""
    return None if quantization is None else get_method(quantization).held_layer_bytes()


def held_head_bytes(
    quantization: str | None, quantize_lm_head: bool
) -> Callable[[int, int, bool], int] | None:
    """The same for the lm_head, where `quantize_lm_head` has the mode quantize it."""
    if quantization is None or not quantize_lm_head:
        return None
    return get_method(quantization).held_head_bytes()


def check_expert_quantization(quantization: str, config, device: torch.device) -> None:
    """Raise ValueError unless this mode quantizes a mixture of experts' experts here: the
    modes swap nn.Linear layers, and stacked experts are none - they would stay float
    while the memory plan counted them quantized. int8 packs them for the native grouped
    kernel (kernels/moe.py)."""
    if not config.quantizable_experts:
        raise ValueError(
            f"quantization={quantization!r} does not quantize {config.architecture}'s MXFP4 "
            "experts: the checkpoint stores them in 4 bits already, and they run as stored; "
            "leave it unset"
        )
    if quantization not in EXPERT_QUANTIZATIONS:
        raise ValueError(
            f"quantization={quantization!r} does not quantize the experts of a "
            f"mixture-of-experts model ({config.architecture}) yet; use "
            f"{' or '.join(map(repr, EXPERT_QUANTIZATIONS))}, or leave it unset "
            "(dtype='bfloat16' halves fp32's memory)"
        )
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    if not moe_kernel.available(torch.float32, device, hidden, inter, config.num_experts_per_tok):
        raise ValueError(
            f"quantization={quantization!r} of {config.architecture}'s experts needs the "
            f"native kernels on a CPU (here: {device.type})"
        )
    group = moe_kernel.INT4_GROUP
    if quantization == "int4" and (hidden % group or inter % group):
        raise ValueError(
            f"quantization='int4' needs expert sizes that are multiples of {group}; "
            f"{config.architecture} has hidden_size {hidden}, moe_intermediate_size {inter}"
        )


def quantize_model(
    model: nn.Module,
    quantization: str,
    model_dir: Path,
    *,
    dtype: torch.dtype,
    measure_inputs: MeasureInputs,
    lm_head: bool,
) -> int:
    """Swap the decoder layers' linear layers for quantized ones, in place.

    Args:
        measure_inputs: runs the float model for statistics a method needs (int8's),
            see method.MeasureInputs.
        lm_head: quantize the lm_head too (validate_lm_head has checked that the method
            can; a model with no lm_head, a pooling decoder, has none to quantize).
    Returns:
        Bytes the quantized layers' weights take (for the memory report).
    """
    return get_method(quantization).quantize(
        model,
        model_dir,
        dtype=dtype,
        measure_inputs=measure_inputs,
        lm_head=lm_head and hasattr(model, "lm_head"),
    )


def linear_kinds() -> tuple[type, ...]:
    """Every module class that computes a linear layer in a model the engine builds:
    float (nn.Linear, oneDNN's PackedLinear) and each quantization's."""
    kinds = [nn.Linear, PackedLinear]
    for method in registered().values():
        kinds += [c for c in method.layer_classes if c not in kinds]
    return tuple(kinds)


__all__ = [
    "QUANTIZATIONS",
    "CheckpointInfo",
    "CheckpointQuantization",
    "QuantizationMethod",
    "check_checkpoint_quantization",
    "checkpoint_info",
    "check_quantization",
    "get_method",
    "held_head_bytes",
    "held_layer_bytes",
    "held_out_bytes",
    "linear_kinds",
    "load_hold_out",
    "load_quantizer",
    "loaded_layer_bytes",
    "quantize_model",
    "quantized_targets",
    "validate_lm_head",
    "validate_name",
    "weight_bytes",
]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds: float parameters and quantized buffers,
    the tied embedding/lm_head counted once."""
    seen, total = set(), 0
    for module in model.modules():
        if hasattr(module, "weight_bytes"):
            total += module.weight_bytes
            continue
        for param in module.parameters(recurse=False):
            if param.data_ptr() not in seen:
                seen.add(param.data_ptr())
                total += param.numel() * param.element_size()
        packed = getattr(module, "packed_weight", None)
        if packed is not None:  # PackedLinear: oneDNN's copy, its storage opaque
            total += module.in_features * module.out_features * packed.element_size()
    return total
