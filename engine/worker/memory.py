"""Whether an engine fits in this machine's memory, said before any weight is read.

A CPU engine holds two large things: its weights and its KV cache. The load
materialises every parameter in the engine's dtype before int8 shrinks the linear
layers (its smoothing needs a float pass), so the weights' peak is the float model's
size, known exactly from the architecture built on the meta device - but for the layers
a mode reads as stored and never loads as float (a GGUF's blocks in the `gguf` mode),
counted at the most their built layers can take, and for what the
load quantizes as it fills: a mixture of experts' experts, packed for the native kernel
(in int8 or int4 where the mode quantizes them) layer by layer, and int4's decoder linear
layers, each swapped as it fills; those count in their quantized size, plus one layer's
float weights. A checkpoint quantized by another tool is
the exception: its quantized layers load as they are stored, never in float, so its
weights are counted from its headers. The RAM the process may still take is the
kernel's `MemAvailable`, or less where a cgroup limits the process.

Sizing and refusal follow from those three numbers:

- the default KV budget (no `kv_cache_memory`) is the least of the device default (a
  share of RAM, capped), what every admissible sequence could fill, and a share of the
  RAM the weights leave: the rest stays free for activations, the tokenizer and the
  job's own buffers;
- an engine whose weights and KV cache together exceed the RAM left is refused with
  the numbers, before the load, rather than killed by the kernel halfway through it.

On CUDA the cache is sized from the device's free memory after the load
(`kv_cache.default_cache_bytes`); this module then plans nothing.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from tokenmill.engine.loader.model_files import weight_files
from tokenmill.engine.loader.safetensors_files import read_header
from tokenmill.engine.loader.tensor_plan import FLOAT_DTYPES, build_on_meta
from tokenmill.engine.models import ModelConfig
from tokenmill.engine.models.moe import KernelExperts
from tokenmill.engine.quant.method import HeldOutBytes, quantized_targets

# The default KV cache takes at most this share of the RAM the weights leave.
KV_SHARE_OF_RAM_LEFT = 0.5


def load_bytes(
    config: ModelConfig,
    dtype: torch.dtype,
    *,
    expert_format: str | None = None,
    device: torch.device | None = None,
    layer_bytes: Callable[[int, int, bool], int] | None = None,
    held_out: HeldOutBytes | None = None,
    after_load: bool = False,
    head_bytes: Callable[[int, int, bool], int] | None = None,
) -> int:
    """The bytes of every parameter of `config`'s architecture in `dtype`, counted on
    the meta device (no memory); tied embeddings once, as the load ties them.

    With `expert_format` (kernels/moe.py's "float", "int8" or "int4"), the load's peak
    where it packs each MoE layer's experts as soon as they are filled (worker/build.py):
    the experts the native kernel serves on `device` counted packed in that format
    (`KernelExperts.planned_bytes`: every family's, gpt-oss's biases included), plus the
    loaded parameters of one layer's experts (the largest), alive until they are packed.

    With `layer_bytes` ((out, in, bias) -> bytes: quant's loaded_layer_bytes), the peak
    where a quantization mode swaps each decoder linear layer as the load fills it: those
    layers counted quantized, plus the largest one's float weight, alive while it fills.

    With `held_out` (quant's held_out_bytes), the linear layers whose weights a mode's
    hold-out leaves out of the float load (a GGUF's blocks in the `gguf` mode): each
    weight counted at the most bytes its built layer can take (never less than the load
    takes), its bias (loaded as float) as usual.

    With `after_load`, what the engine holds once the load and the mode's quantization
    are over, not the load's peak: the layers `layer_bytes` counts (the mode's
    held_layer_bytes: int8's too, which quantizes after the load) without the one float
    layer alive while it fills, the experts without one float layer of them, and the
    lm_head counted by `head_bytes` where the mode quantizes it (beside the embedding
    where the two are tied: the float embedding stays).
    """
    model = build_on_meta(config, dtype)
    seen: set[int] = set()
    total = 0
    if held_out is not None:
        for linear, stored in held_out(model).items():
            total += stored
            seen.add(id(linear.weight))
    if layer_bytes is not None:
        float_linear = 0
        for _, _, linear in quantized_targets(model):
            if id(linear.weight) in seen:
                continue  # held out, counted above
            params = [p for p in (linear.weight, linear.bias) if p is not None]
            total += layer_bytes(linear.out_features, linear.in_features, linear.bias is not None)
            float_linear = max(float_linear, sum(p.numel() * p.element_size() for p in params))
            seen.update(id(p) for p in params)
        total += 0 if after_load else float_linear
    if expert_format is not None and device is not None:
        float_layer = 0
        for experts in (m for m in model.modules() if isinstance(m, KernelExperts)):
            packed = experts.planned_bytes(device, expert_format)
            if packed is None:
                continue  # left as loaded, counted below
            total += packed
            # Packing replaces all of the module's parameters (gpt-oss's biases too).
            replaced = list(experts.parameters())
            float_layer = max(float_layer, sum(p.numel() * p.element_size() for p in replaced))
            seen.update(id(p) for p in replaced)
        total += 0 if after_load else float_layer
    if after_load and head_bytes is not None:
        head = model.lm_head
        total += head_bytes(head.out_features, head.in_features, head.bias is not None)
        if not config.tie_word_embeddings:
            seen.update(id(p) for p in head.parameters())
    for name, param in model.named_parameters(remove_duplicate=False):
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # the load makes it the embedding
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


# Bytes per weight of a decoder layer's linear layers (dense projections and expert
# stacks) in each quantization mode, what it stores beside the codes included: int8 an
# fp32 scale per output row (added per row below), int4 4-bit codes with a bf16 scale and
# minimum per group of 32 inputs.
_QUANTIZED_BYTES_PER_WEIGHT = {"int8": 1.0, "int4": 0.5 + 4 / 32}


def precision_bytes(config: ModelConfig) -> dict[str, int]:
    """The bytes `config`'s weights take in bf16, int8 and int4: a quantization mode
    quantizes the decoder layers' linear layers; the embedding, the norms, biases and the
    lm_head stay in bf16 (the CPU's fast float; an lm_head quantized too is smaller).
    Counted on the meta device: nothing is read or allocated."""
    model = build_on_meta(config, torch.bfloat16)
    layer_weights = rows = 0
    for name, param in model.named_parameters():
        if ".layers." in name and param.dim() >= 2:
            layer_weights += param.numel()
            rows += param.numel() // param.shape[-1]
    total = load_bytes(config, torch.bfloat16)
    rest = total - 2 * layer_weights
    sizes = {"bfloat16": total}
    for mode, per_weight in _QUANTIZED_BYTES_PER_WEIGHT.items():
        scales = 4 * rows if mode == "int8" else 0
        sizes[mode] = rest + round(layer_weights * per_weight) + scales
    return sizes


def checkpoint_load_bytes(model_dir: Path, config: ModelConfig, dtype: torch.dtype) -> int:
    """The bytes a checkpoint quantized by another tool takes once loaded, from its
    headers: its float tensors in `dtype`, its quantized tensors as stored (the load reads
    them into their layers as they are; no float copy of them is ever made). Layers whose
    codes are expanded per call (an fp32 engine's exact path) hold 4-bit codes a byte
    each, up to twice their stored size."""
    total = 0
    for path in weight_files(model_dir):
        for entry in read_header(path):
            if config.tie_word_embeddings and entry.name == "lm_head.weight":
                continue  # the load makes it the embedding
            numel = math.prod(entry.shape)
            size = dtype.itemsize if entry.dtype in FLOAT_DTYPES else entry.dtype.itemsize
            total += numel * size
    return total


def available_ram() -> int:
    """The RAM this process may still take: `MemAvailable`, or the room its cgroup's
    limit leaves where that is less."""
    available = _meminfo_available()
    room = _cgroup_room()
    return available if room is None else min(available, room)


def _meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    # Kernels before 3.14 lack the line: all of RAM is the most that could be left.
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_room() -> int | None:
    """Limit minus usage of this process's memory cgroup (v2, else v1); None: no limit
    or no cgroup to read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _id, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            files = ("memory.max", "memory.current")
            roots = [Path("/sys/fs/cgroup")]
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            roots = [Path("/sys/fs/cgroup/memory")]
        else:
            continue
        root = roots[0]
        group = root / path.lstrip("/")
        if not group.is_dir():  # in a cgroup namespace the process's group is the root
            group = root
        return _room(group / files[0], group / files[1])
    return None


def _room(limit_file: Path, usage_file: Path) -> int | None:
    try:
        limit = limit_file.read_text().strip()
        usage = int(usage_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as a huge number
        return None
    return max(int(limit) - usage, 0)
