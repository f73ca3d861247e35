"""Quantized linear layers: `LLM(..., quantization="int8" | "int4" | "gguf")`.

Quantization is a property of the loaded model's linear layers: after the weights load,
`quantize_model` swaps the decoder layers' projections (q/k/v, o, gate/up, down) for
quantized modules with nn.Linear's forward. The scheduler, the KV cache and everything
else in the engine never see it; the rest of the model (embeddings, norms, attention,
the lm_head) runs in the engine's float dtype.

- "int8": per-channel int8 weights, dynamically quantized int8 activations (int8.py),
  smoothed SmoothQuant-style with statistics from a short float run at load
  (calibrate.py).
- "int4": group-wise 4-bit weights (group 32), bf16 activations (int4.py).
- "gguf": the GGUF's own quantized blocks, kept as they are (gguf_linear.py).

Every check that can fail runs before any weight is touched (`check_quantization`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

QUANTIZATIONS = ("int8", "int4", "gguf")
INT4_GROUP_SIZE = 32


def validate_name(quantization: str | None) -> str | None:
    """The quantization name, checked; raises ValueError naming the choices."""
    if quantization is None or quantization in QUANTIZATIONS:
        return quantization
    raise ValueError(
        f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)} or None"
    )


def check_quantization(
    quantization: str | None, model_dir: Path, config, *, device: torch.device
) -> None:
    """Raise ValueError when this model cannot run quantized this way here.

    Args:
        quantization: a name from QUANTIZATIONS, or None.
        model_dir: the model's HF-layout directory (a GGUF conversion for "gguf").
        config: its ModelConfig.
        device: where it will run.
    """
    if quantization is None:
        return
    validate_name(quantization)
    if device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only, not {device.type}")
    if quantization == "int8":
        from tokenmill.engine.quant.int8 import onednn_int8_available

        if not onednn_int8_available():
            raise ValueError("quantization='int8' needs a torch build with oneDNN's int8 ops")
    elif quantization == "int4":
        q_size = config.num_attention_heads * config.head_dim
        inputs = {config.hidden_size, config.intermediate_size, q_size}
        bad = sorted(w for w in inputs if w % INT4_GROUP_SIZE)
        if bad:
            raise ValueError(
                f"quantization='int4' needs layer inputs that are multiples of "
                f"{INT4_GROUP_SIZE}; this model has {', '.join(map(str, bad))}"
            )
        # PyTorch's int4 kernel packs output rows in 16s.
        kv_size = config.num_key_value_heads * config.head_dim
        outputs = {q_size + 2 * kv_size, config.hidden_size, 2 * config.intermediate_size}
        bad = sorted(w for w in outputs if w % 16)
        if bad:
            raise ValueError(
                "quantization='int4' needs layer outputs that are multiples of 16; this "
                f"model has {', '.join(map(str, bad))}"
            )
    else:
        from tokenmill.engine.quant.gguf_linear import check_gguf_blocks

        check_gguf_blocks(model_dir)


def quantized_targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every nn.Linear inside the decoder layers."""
    return [
        (parent, name, child)
        for layer in model.model.layers
        for parent in layer.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]


def linear_kinds() -> tuple[type, ...]:
    """Every module class that computes a linear layer in a model the engine builds:
    float (nn.Linear, oneDNN's PackedLinear) and each quantization's. A GGUF RowConcat
    holds GroupedLinear or Int4Linear parts."""
    from tokenmill.engine.quant.gguf_linear import GroupedLinear, RowConcat
    from tokenmill.engine.quant.int4 import Int4Linear
    from tokenmill.engine.quant.int8 import Int8Linear
    from tokenmill.engine.quant.packed_linear import PackedLinear

    return (nn.Linear, PackedLinear, Int8Linear, Int4Linear, GroupedLinear, RowConcat)


def quantize_model(
    model: nn.Module,
    quantization: str,
    model_dir: Path,
    *,
    dtype: torch.dtype,
    measure_inputs=None,
) -> int:
    """Swap the decoder layers' linear layers for quantized ones, in place.

    measure_inputs(model, layers, token_ids) -> {layer: max|x| per input channel} runs
    the float model for int8's statistics (`worker/calibration.input_absmax`).

    Returns:
        Bytes the quantized layers' weights take (for the memory report).
    """
    from tokenmill.engine.models.layers import GatedMLP
    from tokenmill.engine.quant.int4 import Int4Linear
    from tokenmill.engine.quant.int8 import Int8Linear

    if quantization == "gguf":
        from tokenmill.engine.quant.gguf_linear import load_gguf_layers

        return load_gguf_layers(model, model_dir, dtype=dtype)
    targets = quantized_targets(model)
    smooth: dict[nn.Module, torch.Tensor] = {}
    if quantization == "int8":
        from tokenmill.engine.quant import calibrate

        absmax = measure_inputs(
            model,
            [linear for _, _, linear in targets],
            calibrate.calibration_token_ids(model_dir, model.config.vocab_size),
        )
        smooth = {
            linear: calibrate.smoothing_factors(absmax[linear], linear.weight)
            for _, _, linear in targets
        }
    total = 0
    for parent, name, linear in targets:
        bias = linear.bias
        if quantization == "int8":
            # A gated MLP's gate_up takes its activation into the product where it can.
            gated = isinstance(parent, GatedMLP) and name == "gate_up_proj"
            activation = parent.activation if gated else None
            layer = Int8Linear.from_float(
                linear.weight, bias, smooth[linear], gated_activation=activation
            )
        else:
            layer = Int4Linear.from_float(linear.weight, bias, group_size=INT4_GROUP_SIZE)
        setattr(parent, name, layer)
        total += layer.weight_bytes
    return total


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
