"""Checkpoints quantized by other tools (config.json's `quantization_config`): read by
the format that accepts them (quant/checkpoint/), or refused by name, before any weight
is read.

A quantized checkpoint stores its weights as integers (or fp8) beside their scales,
zero points and packing; read as plain numbers they give a different model without a
word. So every format no reader takes - block-wise FP8, bitsandbytes, MXFP4 (but gpt-oss's
MXFP4 experts, which its model loads as its own parameters: models/gpt_oss.py), any method
not listed - and every variant a reader does not run is refused, naming the method and format,
with the nearest thing that runs: the unquantized checkpoint quantized at load by one of
tokenmill's own modes. (A checkpoint with integer weights and no
quantization_config is refused by the loader, naming the tensors: loader/tensor_plan.py.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenmill.engine.loader.tensor_plan import build_on_meta
from tokenmill.engine.models import load_config
from tokenmill.engine.quant.checkpoint import (
    CheckpointQuantization,
    quantization_settings,
    read_checkpoint_quantization,
)
from tokenmill.engine.quant.checkpoint.layers import describe_kernels

# The own mode nearest each weight precision: 8-bit formats -> int8, 4-bit or less -> int4.
_INT8 = "--quantization int8 (quantization='int8')"
_INT4 = "--quantization int4 (quantization='int4'), or a Q4 GGUF with --quantization gguf"
# compressed-tensors' sparse formats, and its 4-bit float ones (no integer num_bits).
_SPARSE_FORMATS = frozenset({"sparse-24-bitmask", "sparse-bitmask", "marlin-24"})
_FP4_FORMATS = frozenset({"nvfp4-pack-quantized", "mxfp4-pack-quantized"})


def check_checkpoint_quantization(model_dir: Path) -> CheckpointQuantization | None:
    """The checkpoint's quantization as its format's reader takes it, None for a float
    checkpoint; raises ValueError when config.json says its weights are quantized
    (`quantization_config`, or compressed-tensors' older `compression_config`) in a
    format or variant no reader runs.
    """
    found = quantization_settings(model_dir)
    if found is None:
        return None
    key, settings = found
    if settings.get("quant_method") == "mxfp4" and _reads_mxfp4(model_dir):
        return None  # the architecture's own parameters hold it (models/gpt_oss.py)
    kind, nearest = describe(settings)
    where = f"{Path(model_dir).name} is a quantized checkpoint ({key}: {kind})"
    try:
        read = read_checkpoint_quantization(settings)
    except ValueError as error:
        raise ValueError(
            f"{where}; {error}. Or load the unquantized checkpoint with {nearest}"
        ) from None
    if read is None:
        raise ValueError(
            f"{where}; tokenmill does not read this format - its weights need the format's "
            f"own scales and packing. Load the unquantized checkpoint with {nearest} instead"
        )
    return read


@dataclass(frozen=True)
class CheckpointInfo:
    """A quantized checkpoint as `tokenmill models info`, a model description and a
    ledger name it, from config.json alone."""

    summary: str  # format and schemes: "compressed-tensors pack-quantized, W4A16 g64"
    bits: tuple[int, ...]  # weight bits, as the checkpoint stores them
    group_sizes: tuple[int | None, ...]  # None: per channel
    kernels: tuple[str, ...]  # per scheme, what runs it here
    refusal: str | None = None  # why it does not load, where it does not
    # The model's parameters (its architecture's, from config.json): the checkpoint's own
    # tensors hold several codes per element, so counting them says nothing.
    num_parameters: int | None = None


def checkpoint_info(model_dir: Path) -> CheckpointInfo | None:
    """What the checkpoint's quantization is (None for a float checkpoint); never raises
    for a format not read - `refusal` says why instead."""
    try:
        read = check_checkpoint_quantization(model_dir)
    except ValueError as error:
        kind, _ = describe(quantization_settings(model_dir)[1])
        return CheckpointInfo(kind, (), (), (), refusal=str(error))
    if read is None:
        return None
    schemes = read.schemes
    return CheckpointInfo(
        summary=read.summary,
        bits=read.bits,
        group_sizes=tuple(sorted({s.group_size for s in schemes}, key=lambda g: g or 0)),
        kernels=tuple(f"{s.label}: {describe_kernels(s)}" for s in schemes),
        num_parameters=_num_parameters(model_dir),
    )


def _reads_mxfp4(model_dir: Path) -> bool:
    """Whether the model's architecture loads its MXFP4 experts as its own parameters."""
    try:
        config = load_config(model_dir)
    except ValueError:
        return False  # loading the model says why
    return bool(getattr(config, "mxfp4_experts", False))


def _num_parameters(model_dir: Path) -> int | None:
    """The architecture's parameters for this config (an lm_head tied to the embeddings
    counted once, as its checkpoint stores it); None for an architecture or config the
    engine does not run (loading it says why)."""
    try:
        config = load_config(model_dir)
    except ValueError:
        return None
    named = dict(build_on_meta(config).named_parameters())
    if config.tie_word_embeddings:
        named.pop("lm_head.weight", None)
    return sum(p.numel() for p in named.values())


def describe(settings: dict) -> tuple[str, str]:
    """(how a quantization_config reads to a user, the nearest own mode).

    Names the method and what decides the layout: the format of a compressed-tensors
    checkpoint, the bits of GPTQ/AWQ/bitsandbytes, the block size of FP8.
    """
    method = str(settings.get("quant_method", "unknown")).lower()
    if method == "compressed-tensors" or "config_groups" in settings:
        return _compressed_tensors(settings)
    bits = settings.get("bits") or settings.get("w_bit")
    if method in ("gptq", "awq", "auto-round", "gptqmodel"):
        parts = [f"quant_method {method}", f"{bits}-bit"]
        if settings.get("group_size") is not None:
            parts.append(f"group_size {settings['group_size']}")
        layout = settings.get("checkpoint_format") or settings.get("version")
        if layout:
            parts.append(f"format {layout}")
        return ", ".join(parts), _INT8 if bits == 8 else _INT4
    if method == "bitsandbytes":
        eight = settings.get("load_in_8bit") and not settings.get("load_in_4bit")
        kind = "int8" if eight else str(settings.get("bnb_4bit_quant_type", "nf4"))
        return f"quant_method bitsandbytes, {kind}", _INT8 if eight else _INT4
    if method in ("fp8", "fbgemm_fp8"):
        block = settings.get("weight_block_size")
        layout = f"block-wise {block}" if block else "per-tensor or per-channel"
        return f"quant_method {method} (FP8 e4m3 weights, {layout})", _INT8
    if method == "mxfp4":
        return "quant_method mxfp4 (4-bit floats in blocks of 32)", _INT4
    return f"quant_method {method}", _INT8 if bits == 8 else _INT4


def _compressed_tensors(settings: dict) -> tuple[str, str]:
    """A compressed-tensors config: its format(s) and each scheme's weight precision."""
    groups = (settings.get("config_groups") or {}).values()
    default = str(settings.get("format") or "dense")  # for the groups that name none
    formats = {str(g.get("format") or default) for g in groups} or {default}
    schemes, widest = [], 0
    for group in groups:
        weights = group.get("weights") or {}
        activations = group.get("input_activations") or {}
        bits = weights.get("num_bits")
        bits = max(bits.values()) if isinstance(bits, dict) else bits
        # The Hub's names (w8a8, w4a16, fp8-dynamic), with the number types spelled out.
        scheme = f"W{bits}A{activations.get('num_bits', 16)} ({weights.get('type', 'int')} weights"
        if activations:
            scheme += f", {activations.get('type', 'int')} activations"
        scheme += ")"
        schemes.append(scheme)
        widest = max(widest, bits or 0)
    text = f"compressed-tensors, format {'/'.join(sorted(formats))}"
    if schemes:
        text += f", {'/'.join(sorted(set(schemes)))}"
    if settings.get("sparsity_config") or formats & _SPARSE_FORMATS:
        text += ", sparse"
    four_bit = 0 < widest <= 4 or bool(formats & _FP4_FORMATS)
    return text, _INT4 if four_bit else _INT8
