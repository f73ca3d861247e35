"""An engine's memory is planned before its load: the weights' bytes counted exactly, the
default KV cache sized from the RAM the weights leave, and an engine that cannot fit
refused with the numbers before any weight is read."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_model import build_tiny_model

import tokenmill.engine.worker.build as build
from tokenmill.engine import LLM, EngineConfig, InsufficientMemoryError, load_config
from tokenmill.engine.api.plan import shape_for
from tokenmill.engine.worker.kv_cache import kv_cache_format
from tokenmill.engine.worker.memory import KV_SHARE_OF_RAM_LEFT, _room, available_ram, load_bytes

MIB = 1 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("memory-plan"))


def _checkpoint_bytes(model_dir, element_size: int) -> int:
    """Every tensor the checkpoint stores, at `element_size` bytes an element: the
    reference the meta-device count must equal."""
    total = 0
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        for name in f.keys():
            total += math.prod(f.get_slice(name).get_shape()) * element_size
    return total


def test_the_weights_bytes_are_the_checkpoints_tensors_in_the_engines_dtype(model_dir):
    config = load_config(model_dir)
    assert config.tie_word_embeddings  # the head is the embedding, stored once
    assert load_bytes(config, torch.float32) == _checkpoint_bytes(model_dir, 4)
    assert load_bytes(config, torch.bfloat16) == _checkpoint_bytes(model_dir, 2)


def test_an_untied_head_counts_beside_the_embedding(tmp_path):
    untied = build_tiny_model(tmp_path / "untied")
    weights = load_file(untied / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, untied / "model.safetensors")
    raw = json.loads((untied / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    (untied / "config.json").write_text(json.dumps(raw))
    config = load_config(untied)
    head = config.vocab_size * config.hidden_size * 4
    assert load_bytes(config, torch.float32) == _checkpoint_bytes(untied, 4)
    assert head > 0 and _checkpoint_bytes(untied, 4) - head == load_bytes(
        load_config(build_tiny_model(tmp_path / "tied")), torch.float32
    )


def test_a_loaded_llm_states_its_memory(model_dir):
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=4 * MIB)
    memory = llm.memory
    block_bytes = kv_cache_format("auto").bytes_per_block(llm.model_config, 16, torch.float32)
    assert memory.weight_bytes == _checkpoint_bytes(model_dir, 4)
    assert memory.kv_cache_blocks == llm.engine.block_manager.num_blocks == 4 * MIB // block_bytes
    assert memory.kv_cache_bytes == memory.kv_cache_blocks * block_bytes
    assert memory.available_bytes > memory.needed_bytes  # it fit: planned before the load
    assert memory.fits and "float32" in memory.describe()


def test_an_engine_that_cannot_fit_is_refused_with_the_numbers_before_any_weight_is_read(
    model_dir, monkeypatch
):
    def no_load(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(build, "load_model", no_load)
    too_much = available_ram() * 2
    with pytest.raises(InsufficientMemoryError) as refused:
        LLM(str(model_dir), dtype="float32", kv_cache_memory=too_much)
    message = str(refused.value)
    assert "does not fit in this machine's memory" in message
    assert "RAM available" in message and "GiB" in message and "kv_cache_memory" in message
    # The plan of a job on that engine (a dry run without calibration) refuses it too.
    with pytest.raises(InsufficientMemoryError):
        LLM.plan([], model=str(model_dir), dtype="float32", kv_cache_memory=too_much)


def test_the_default_kv_cache_takes_a_share_of_the_ram_the_weights_leave(model_dir, monkeypatch):
    config = load_config(model_dir)
    weights = load_bytes(config, torch.float32)
    block_bytes = kv_cache_format("auto").bytes_per_block(config, 16, torch.float32)
    left = 300 * block_bytes  # less than the device default and the sequences could fill
    monkeypatch.setattr(build, "available_ram", lambda: weights + left)
    settings = EngineConfig(dtype="float32")
    plan = build.plan_memory(config, settings, dtype=torch.float32, device=torch.device("cpu"))
    assert plan.kv_cache_blocks == int(left * KV_SHARE_OF_RAM_LEFT) // block_bytes == 150
    assert plan.fits
    unbounded = build.num_cache_blocks(
        config, settings, dtype=torch.float32, device=torch.device("cpu")
    )
    assert unbounded > plan.kv_cache_blocks  # the share is what bounded it

    monkeypatch.setattr(build, "available_ram", lambda: weights // 2)
    starved = build.plan_memory(config, settings, dtype=torch.float32, device=torch.device("cpu"))
    assert starved.kv_cache_blocks == 1 and not starved.fits
    with pytest.raises(InsufficientMemoryError, match="try dtype bfloat16"):
        starved.check("tiny")


def _int8_saving(model_dir) -> int:
    """What int8 saves on the checkpoint's decoder linear weights against bf16, from the
    checkpoint alone: a byte a weight instead of two, less an fp32 scale per output row
    and an fp32 smoothing factor per input of each layer the engine runs (q, k and v
    share one input, as do gate and up)."""
    weights = rows = inputs = 0
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        for name in f.keys():
            shape = f.get_slice(name).get_shape()
            if ".layers." not in name or len(shape) != 2:
                continue
            weights += math.prod(shape)
            rows += shape[0]
            if not name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
                inputs += shape[1]
    return 2 * weights - (weights + 4 * rows + 4 * inputs)


def test_an_int8_kv_cache_is_sized_beside_the_int8_weights_not_the_float_ones(
    model_dir, monkeypatch
):
    config = load_config(model_dir)
    bf16 = load_bytes(config, torch.bfloat16)
    block_bytes = kv_cache_format("auto").bytes_per_block(config, 16, torch.bfloat16)
    left = 300 * block_bytes
    monkeypatch.setattr(build, "available_ram", lambda: bf16 + left)

    def plan(**settings):
        engine_config = EngineConfig(dtype="bfloat16", **settings)
        return build.plan_memory(
            config, engine_config, dtype=torch.bfloat16, device=torch.device("cpu")
        )

    float_plan, int8_plan = plan(), plan(quantization="int8")
    saved = _int8_saving(model_dir)
    assert saved == 67_072  # 2 layers x (73,728 bf16 - 40,192 int8) bytes
    assert float_plan.held_weight_bytes == float_plan.weight_bytes == bf16
    # The load's peak is the float model either way (int8 smooths from a float pass) ...
    assert int8_plan.weight_bytes == bf16
    # ... but the cache is allocated beside the int8 weights: a share of the bytes saved more.
    assert int8_plan.held_weight_bytes == bf16 - saved
    assert float_plan.kv_cache_blocks == int(left * KV_SHARE_OF_RAM_LEFT) // block_bytes == 150
    assert int8_plan.kv_cache_blocks == int((left + saved) * KV_SHARE_OF_RAM_LEFT) // block_bytes
    assert int8_plan.kv_cache_blocks == 158
    assert int8_plan.needed_bytes == max(bf16, bf16 - saved + 158 * block_bytes)
    assert "as the engine holds them" in int8_plan.describe()
    assert "the load's peak" in int8_plan.describe()
    # An int8 lm_head (tied here: the float embedding stays) adds its int8 bytes.
    head = config.vocab_size * config.hidden_size + 4 * config.vocab_size + 4 * config.hidden_size
    with_head = plan(quantization="int8", quantize_lm_head=True)
    assert with_head.held_weight_bytes == bf16 - saved + head


def test_int4_is_held_without_the_float_layer_its_load_keeps_while_it_fills(model_dir, monkeypatch):
    config = load_config(model_dir)
    monkeypatch.setattr(build, "available_ram", lambda: 1 << 40)
    engine_config = EngineConfig(dtype="bfloat16", quantization="int4")
    plan = build.plan_memory(
        config, engine_config, dtype=torch.bfloat16, device=torch.device("cpu")
    )
    # The largest float layer alive during the load: a gate_up [256, 64] in bf16.
    assert plan.weight_bytes - plan.held_weight_bytes == 256 * 64 * 2


@pytest.mark.parametrize(
    ("limit", "usage", "room"),
    [("1000", "300", 700), ("max", "300", None), (str(2**63 - 4096), "5", None), ("10", "30", 0)],
)
def test_a_cgroups_room_is_its_limit_less_its_usage(tmp_path, limit, usage, room):
    (tmp_path / "limit").write_text(limit + "\n")
    (tmp_path / "usage").write_text(usage + "\n")
    assert _room(tmp_path / "limit", tmp_path / "usage") == room
    assert _room(tmp_path / "missing", tmp_path / "usage") is None


@pytest.mark.parametrize("scheme", ["W4A16_ASYM", "FP8_DYNAMIC"])
def test_a_quantized_checkpoint_is_planned_at_its_stored_size_not_as_a_float_model(
    scheme, tmp_path, llmcompressor_checkpoints
):
    """llm-compressor's W4A16 and FP8_DYNAMIC checkpoints: their packed codes (int32
    words, e4m3 bytes), scales and zero points load as stored; only their float tensors
    (embeddings, norms, lm_head, scales) take the engine's dtype."""
    import shutil

    from hf_models import save_char_tokenizer

    model_dir = tmp_path / scheme
    shutil.copytree(llmcompressor_checkpoints[scheme], model_dir)
    save_char_tokenizer(model_dir)
    expected = 0
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            wide = tensor.dtype in (torch.float32, torch.bfloat16, torch.float16)
            size = 4 if wide else tensor.element_size()
            expected += tensor.numel() * size
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=4 * MIB)
    assert llm.memory.weight_bytes == expected
    assert expected < load_bytes(load_config(model_dir), torch.float32) / 2
    planned = shape_for(str(model_dir), dtype="float32", kv_cache_memory=4 * MIB).memory
    assert planned.weight_bytes == expected  # a dry run plans it the same way


def test_precision_bytes_quantize_only_the_decoder_layers_linear_weights(tmp_path):
    from click.testing import CliRunner

    from tokenmill.bench.scale_build import build_scale_model
    from tokenmill.cli import main
    from tokenmill.engine import precision_bytes

    tiny = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152}  # fmt: skip
    model_dir = build_scale_model(
        "llama-3.1-8b", num_layers=2, overrides=tiny, out_dir=tmp_path / "m"
    )
    # Per layer q 64x64, k and v 32x64, o 64x64, gate and up 96x64, down 64x96: 30,720
    # weights in 448 rows; embedding and lm_head 49,152x64 each, five norms of 64.
    layer_weights, rows = 2 * 30_720, 2 * 448
    rest = 2 * (2 * 49_152 * 64 + 5 * 64)
    assert precision_bytes(load_config(model_dir)) == {
        "bfloat16": rest + 2 * layer_weights,
        "int8": rest + layer_weights + 4 * rows,
        "int4": rest + layer_weights * 5 // 8,
    }
    shown = CliRunner().invoke(main, ["models", "info", str(model_dir)])
    assert shown.exit_code == 0, shown.output
    assert "weights:       bfloat16 0.01 GB, int8 0.01 GB, int4 0.01 GB" in shown.output


def test_the_plan_states_how_many_rows_run_at_once(model_dir):
    derived = LLM(str(model_dir), dtype="float32", kv_cache_memory=4 * MIB).memory
    assert derived.max_num_seqs is None and derived.block_size == 16
    blocks = derived.kv_cache_blocks
    assert derived.rows_at_once(16 * 4) == min(256, blocks // 4)
    assert derived.rows_at_once(16 * 4 + 1) == min(256, blocks // 5)
    assert derived.rows_at_once(16 * (blocks + 1)) == 1  # longer than the cache: alone
    assert "as many as" in derived.describe_rows()
    assert derived.describe_rows(16 * (blocks + 1)).startswith(
        f"1: {blocks:,} KV blocks of 16 tokens hold 0 rows"
    )
    roomy = replace(derived, kv_cache_blocks=257 * 2)
    assert roomy.rows_at_once(32) == 256 and "at most 256 run at once" in roomy.describe_rows(32)
    set_ = LLM(str(model_dir), dtype="float32", kv_cache_memory=4 * MIB, max_num_seqs=3).memory
    assert set_.max_num_seqs == set_.rows_at_once(16 * 4) == set_.rows_at_once(1) == 3
    assert set_.describe_rows(64).startswith("3 (max_num_seqs as set")
