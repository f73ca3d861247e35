"""Build a model runner from a model directory: check, load, quantize, size the KV cache.

Every check that can fail - the quantization mode, the KV cache dtype, the attention
path - runs before any weight is read, so a bad option costs nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tokenmill.engine.loader.weights import load_model
from tokenmill.engine.models import GENERATE, ModelConfig, architecture_for, load_config
from tokenmill.engine.models.moe import expert_packer, pack_experts
from tokenmill.engine.pooling.config import read_pooling_config, served_tasks
from tokenmill.engine.pooling.pooler import Pooler
from tokenmill.engine.quant import (
    QUANTIZATIONS,
    check_checkpoint_quantization,
    check_quantization,
    expert_weight_format,
    held_head_bytes,
    held_layer_bytes,
    held_out_bytes,
    load_hold_out,
    load_quantizer,
    loaded_layer_bytes,
    quantize_model,
    validate_lm_head,
    validate_name,
)
from tokenmill.engine.quant.packed_linear import pack_linear_layers
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.memory import MemoryPlan
from tokenmill.engine.types.pooling_params import POOLING_TASKS
from tokenmill.engine.types.start_phases import StartPhases
from tokenmill.engine.worker.attention import AttentionSpec, select_backend
from tokenmill.engine.worker.calibration import input_absmax
from tokenmill.engine.worker.encoder_runner import EncoderRunner
from tokenmill.engine.worker.kv_cache import (
    KV_CACHE_DTYPES,
    default_cache_bytes,
    kv_cache_format,
    num_blocks_for_budget,
)
from tokenmill.engine.worker.memory import (
    KV_SHARE_OF_RAM_LEFT,
    available_ram,
    checkpoint_load_bytes,
    load_bytes,
)
from tokenmill.engine.worker.model_runner import ModelRunner


@dataclass
class LoadedModel:
    """A runner ready for steps, and what the loop must know about it."""

    runner: ModelRunner
    model_config: ModelConfig
    num_blocks: int  # KV cache blocks the runner's cache holds
    max_model_len: int  # the longest sequence it serves
    memory: MemoryPlan  # what it was planned to take, before the load

    @property
    def rope_variant(self) -> Callable[[int], int] | None:
        """The rope variant of a sequence of at most n tokens, where the model's rotary
        frequencies depend on the sequence's length (models/rope.py); else None."""
        rope = self.model_config.rope
        return rope.variant_for_length if rope.depends_on_length else None


def setting_choices() -> dict[str, tuple[str, ...]]:
    """The allowed values of the engine settings whose choices are registered outside
    EngineConfig: quantization modes (quant/) and KV-cache formats (worker/kv_cache/)."""
    return {"quantization": QUANTIZATIONS, "kv_cache_dtype": KV_CACHE_DTYPES}


def check_settings(engine_config: EngineConfig) -> None:
    """Raise ValueError for a setting outside its registered choices (see setting_choices)."""
    validate_name(engine_config.quantization)
    validate_lm_head(engine_config.quantization, engine_config.quantize_lm_head)
    kv_cache_format(engine_config.kv_cache_dtype)


def max_model_len_of(
    model_config: ModelConfig, engine_config: EngineConfig, max_seq_length: int | None = None
) -> int:
    """The longest sequence an engine serves: the model's context, or less if asked - and
    for an encoder, no more than sentence-transformers' `max_seq_length` where the
    model's directory declares one."""
    longest = min(engine_config.max_model_len or model_config.max_context, model_config.max_context)
    return min(longest, max_seq_length) if max_seq_length else longest


def num_cache_blocks(
    model_config: ModelConfig,
    engine_config: EngineConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    ram_left: int | None = None,
) -> int:
    """How many KV blocks an engine with these settings holds: its `kv_cache_memory`, or
    the device's default budget - never more than every admissible sequence at full
    context could fill, nor (given `ram_left`, the RAM its weights leave) more than a
    share of that RAM (memory.py). A forecast of prefix-cache reuse uses the same
    number."""
    block_size = engine_config.block_size
    kv_format = kv_cache_format(engine_config.kv_cache_dtype)
    if engine_config.kv_cache_memory is not None:
        budget = engine_config.kv_cache_memory
    else:
        block_bytes = kv_format.bytes_per_block(model_config, block_size, dtype)
        blocks_per_seq = -(-max_model_len_of(model_config, engine_config) // block_size)
        most_useful = engine_config.seq_cap * blocks_per_seq * block_bytes
        budget = min(default_cache_bytes(device), most_useful)
        if ram_left is not None:  # at least one block: the memory check then decides
            budget = min(budget, max(int(ram_left * KV_SHARE_OF_RAM_LEFT), block_bytes))
    return num_blocks_for_budget(model_config, block_size, dtype, budget, kv_format)


def plan_memory(
    model_config: ModelConfig,
    engine_config: EngineConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    encoder: bool = False,
    model_dir: Path | None = None,
    quantized_checkpoint: Path | None = None,
) -> MemoryPlan:
    """The weights and KV cache an engine with these settings will take, and the RAM
    left for them (CPU; on CUDA the cache is sized from what the load leaves).
    `model_dir`: the model's directory, where the mode may hold layers out of the float
    load to read them as stored (quant's held_out_bytes: a GGUF's blocks); without it
    every layer is planned as the load fills it.
    `quantized_checkpoint`: the model's directory where its checkpoint is quantized by
    another tool, whose layers load as they are stored (memory.checkpoint_load_bytes)."""
    if quantized_checkpoint is None:
        quantization = engine_config.quantization
        counted = functools.partial(
            load_bytes,
            model_config,
            dtype,
            expert_format=expert_weight_format(quantization),
            device=device,
            held_out=None if model_dir is None else held_out_bytes(quantization, model_dir),
        )
        weights = counted(layer_bytes=loaded_layer_bytes(quantization))
        held = counted(
            layer_bytes=held_layer_bytes(quantization),
            after_load=True,
            head_bytes=held_head_bytes(quantization, engine_config.quantize_lm_head),
        )
    else:
        weights = held = checkpoint_load_bytes(quantized_checkpoint, model_config, dtype)
    available = available_ram() if device.type == "cpu" else None
    num_blocks = kv_bytes = 0
    if not encoder:
        # The KV cache is allocated after the load and the mode's quantization, beside
        # the weights the engine keeps: an int8 model's cache is sized from its int8
        # weights, not from the float ones its load passes through.
        ram_left = None if available is None else available - held
        num_blocks = num_cache_blocks(
            model_config, engine_config, dtype=dtype, device=device, ram_left=ram_left
        )
        kv_format = kv_cache_format(engine_config.kv_cache_dtype)
        kv_bytes = num_blocks * kv_format.bytes_per_block(
            model_config, engine_config.block_size, dtype
        )
    dtype_name = str(dtype).removeprefix("torch.")
    return MemoryPlan(
        str(device),
        dtype_name,
        weights,
        kv_bytes,
        num_blocks,
        available,
        max_num_seqs=engine_config.max_num_seqs,
        block_size=engine_config.block_size,
        held_bytes=held,
    )


def build_runner(
    model_dir: Path,
    engine_config: EngineConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    phases: StartPhases | None = None,
) -> LoadedModel:
    """Load the weights, quantize them if asked, size and allocate the KV cache; each
    phase's wall time goes to `phases` (types/start_phases.py: laps from its last one)
    where given.

    Raises:
        ValueError: the model, its quantization or its cache cannot run here (before any
            weight is read).
    """
    phases = StartPhases() if phases is None else phases
    model_config = load_config(model_dir)
    max_model_len = max_model_len_of(model_config, engine_config)
    check_settings(engine_config)
    quantization = engine_config.quantization
    checkpoint = check_quantization(quantization, model_dir, model_config, device=device)
    kv_format = kv_cache_format(engine_config.kv_cache_dtype)
    if getattr(model_config, "vision", None) is not None:
        # Image tokens are attended to again from the cache (attention/image_spans.py),
        # which reads blocks in the model's dtype; the tower is not quantized.
        if not kv_format.is_default:
            raise ValueError(
                f"kv_cache_dtype {kv_format.name!r} is not supported for a model with a "
                "vision tower; leave it unset"
            )
        if quantization is not None:
            raise ValueError(
                f"quantization {quantization!r} is not supported for a model with a vision "
                "tower yet; leave it unset"
            )
    if hasattr(model_config, "mrope_section") and engine_config.cuda_graphs:
        # Captured decode graphs take 1D positions; 3D ones are made per step.
        raise ValueError(
            f"cuda_graphs is not supported for {model_config.architecture} (3D rotary "
            "positions); leave it unset"
        )
    # Some backend must read the cache for this model here: said before any weight loads.
    select_backend(
        AttentionSpec.of_model(
            model_config, kv_format, block_size=engine_config.block_size, dtype=dtype, device=device
        )
    )
    phases.lap("checks")
    # Sized before the load: once the weights are in, the RAM they took is no longer
    # free, and a model that cannot fit is refused rather than killed halfway.
    memory = plan_memory(
        model_config,
        engine_config,
        dtype=dtype,
        device=device,
        model_dir=model_dir,
        quantized_checkpoint=None if checkpoint is None else model_dir,
    )
    memory.check(model_dir.name)
    phases.lap("plan")
    # A quantized checkpoint's layers, or the layers a mode reads as stored (a GGUF's
    # blocks), are held out of the float load: never expanded to float.
    hold_out = load_hold_out(quantization, model_dir) if checkpoint is None else checkpoint.hold_out
    model = load_model(
        model_dir,
        model_config,
        dtype=dtype,
        device=device,
        hold_out=hold_out,
        on_filled=_timed(_on_filled(quantization), phases),
    )
    if checkpoint is not None:  # its quantized layers, read in their own format
        checkpoint.load_layers(model, model_dir, dtype=dtype)
    phases.lap("load")
    if quantization is not None:
        measure = functools.partial(input_absmax, dtype=dtype)
        quantize_model(
            model,
            quantization,
            model_dir,
            dtype=dtype,
            measure_inputs=measure,
            lm_head=engine_config.quantize_lm_head,
        )
    phases.lap("quantize")
    # the float layers left
    pack_linear_layers(model, dtype=dtype, device=device, enabled=engine_config.packed_linear)
    # Mixture-of-experts layers: the load packed each as it filled (expert_packer);
    # packed ones are skipped, so this packs only what it left float.
    pack_experts(model)
    phases.lap("pack")
    block_size = engine_config.block_size
    if memory.available_bytes is None:  # CUDA: sized from the memory the load left
        num_blocks = num_cache_blocks(model_config, engine_config, dtype=dtype, device=device)
        block_bytes = kv_format.bytes_per_block(model_config, block_size, dtype)
        memory = replace(
            memory, kv_cache_blocks=num_blocks, kv_cache_bytes=num_blocks * block_bytes
        )
    num_blocks = memory.kv_cache_blocks
    kv_cache = kv_format.allocate(
        model_config, num_blocks, block_size, dtype, device, huge_pages=engine_config.huge_pages
    )
    phases.lap("kv_cache")
    runner = ModelRunner(
        model,
        model_config,
        kv_cache,
        engine_config,
        max_model_len=max_model_len,
        device=device,
        dtype=dtype,
        pooler=build_pooler(model_dir, model),
    )
    phases.lap("runner")
    return LoadedModel(runner, model_config, num_blocks, max_model_len, memory)


def _on_filled(quantization: str | None) -> Callable[[torch.nn.Module, str], None]:
    """What the load does with each module as it fills: a MoE layer's experts are packed in
    their final format (the modes quantize experts from their weights alone), and a mode
    that quantizes from the weights alone (load_quantizer: int4) swaps each decoder linear
    layer - so the float copies of every layer, most of the model, are never in memory at
    once. int8 smooths with statistics of a float pass and quantizes after the load."""
    pack_experts_filled = expert_packer(expert_weight_format(quantization))
    quantize_filled = load_quantizer(quantization)
    if quantize_filled is None:
        return pack_experts_filled

    def on_filled(model: torch.nn.Module, name: str) -> None:
        pack_experts_filled(model, name)
        quantize_filled(model, name)

    return on_filled


def _timed(
    on_filled: Callable[[torch.nn.Module, str], None], phases: StartPhases
) -> Callable[[torch.nn.Module, str], None]:
    """on_filled with its time counted as quantizing, not as the load it runs inside."""

    def timed(model: torch.nn.Module, name: str) -> None:
        with phases.phase("quantize"):
            on_filled(model, name)

    return timed


def build_pooler(model_dir: Path, model) -> Pooler | None:
    """The pooling of a loaded model, or None when it serves no pooling task."""
    tasks = [t for t in served_tasks(model_dir) if t in POOLING_TASKS]
    if not tasks:
        return None
    is_encoder = architecture_for(model.config).is_encoder
    return Pooler(model, read_pooling_config(model_dir, is_encoder=is_encoder), tasks)


def is_encoder_dir(model_dir: Path) -> bool:
    """Whether a model directory holds an encoder (run by `build_encoder_runner`)."""
    return architecture_for(load_config(model_dir)).is_encoder


@dataclass
class LoadedEncoder:
    """An encoder runner ready for batches, and what its loop must know."""

    runner: EncoderRunner
    model_config: ModelConfig
    max_model_len: int  # the longest sequence it serves
    memory: MemoryPlan  # its weights, planned before the load


def build_encoder_runner(
    model_dir: Path,
    engine_config: EngineConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    pair_separator_id: int | None = None,
) -> LoadedEncoder:
    """Load an encoder (no KV cache) and its pooling.

    Its longest sequence is the model's positions, sentence-transformers'
    max_seq_length where the directory declares one, or `max_model_len` if less.

    Raises:
        ValueError: a setting an encoder cannot use (quantization, an int8 KV cache).
    """
    model_config = load_config(model_dir)
    check_settings(engine_config)
    if check_checkpoint_quantization(model_dir) is not None:
        raise ValueError("quantized checkpoints are not read for encoder models; load a float one")
    if engine_config.quantization is not None:
        raise ValueError("quantization is not available for encoder models; leave it unset")
    if not kv_cache_format(engine_config.kv_cache_dtype).is_default:
        raise ValueError("an encoder keeps no KV cache; leave kv_cache_dtype unset")
    pooling = read_pooling_config(model_dir, is_encoder=True)
    max_model_len = max_model_len_of(model_config, engine_config, pooling.max_seq_length)
    memory = plan_memory(model_config, engine_config, dtype=dtype, device=device, encoder=True)
    memory.check(model_dir.name)
    model = load_model(model_dir, model_config, dtype=dtype, device=device)
    pack_linear_layers(model, dtype=dtype, device=device, enabled=engine_config.packed_linear)
    tasks = [t for t in served_tasks(model_dir) if t != GENERATE]
    runner = EncoderRunner(
        model,
        Pooler(model, pooling, tasks),
        device=device,
        dtype=dtype,
        pair_separator_id=pair_separator_id,
    )
    return LoadedEncoder(runner, model_config, max_model_len, memory)
