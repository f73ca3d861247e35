"""The KV-cache format registry (worker/kv_cache/): what each format declares, and that a
format module is the whole edit - the setting's check, the cache's sizing and
allocation and the attention backend's choice follow from its declaration."""

from __future__ import annotations

import pytest
import torch
from hf_models import build_hf_model, make_engine, run_all

from tokenmill.engine.kernels import native_library
from tokenmill.engine.models import load_config
from tokenmill.engine.types.config import EngineConfig
from tokenmill.engine.types.sampling_params import SamplingParams
from tokenmill.engine.worker.build import setting_choices
from tokenmill.engine.worker.kv_cache import (
    KV_CACHE_DTYPES,
    default_kv_cache_format,
    kv_cache_format,
)
from tokenmill.engine.worker.kv_cache import (
    format as kv_format_module,
)
from tokenmill.engine.worker.kv_cache.model_dtype import ModelDtypeFormat


def test_the_registered_formats_and_the_default():
    assert KV_CACHE_DTYPES == ("auto", "int8")
    assert setting_choices()["kv_cache_dtype"] == KV_CACHE_DTYPES
    # EngineConfig's default names the one default format.
    assert kv_cache_format(EngineConfig().kv_cache_dtype) is default_kv_cache_format()
    assert [f.name for f in map(kv_cache_format, KV_CACHE_DTYPES) if f.is_default] == ["auto"]
    assert kv_cache_format("auto").backends is None
    assert kv_cache_format("int8").backends == ("native",)
    assert [kv_cache_format(n).label for n in KV_CACHE_DTYPES] == ["", "kv8"]
    with pytest.raises(ValueError, match=r"unknown kv_cache_dtype 'fp8'; choose from auto, int8"):
        kv_cache_format("fp8")


def test_bytes_per_block_and_the_allocated_tensors(tmp_path):
    """2 layers x 2 kv heads x (keys, values) x 16 positions x 64 values: 4 bytes each in
    fp32, 2 in bf16; int8 takes 1 byte a value and a 4-byte scale per 32 values."""
    if native_library() is None:
        pytest.fail("the native kernels did not build; is a C compiler installed?")
    build_hf_model(
        "llama", tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64
    )
    config = load_config(tmp_path)
    auto, int8 = kv_cache_format("auto"), kv_cache_format("int8")
    assert auto.bytes_per_block(config, 16, torch.float32) == 8 * 16 * 64 * 4
    assert auto.bytes_per_block(config, 16, torch.bfloat16) == 8 * 16 * 64 * 2
    assert int8.bytes_per_block(config, 16, torch.bfloat16) == 8 * (16 * 64 + 16 * 2 * 4)
    cache = auto.allocate(config, 3, 16, torch.bfloat16, torch.device("cpu"), huge_pages=False)
    assert cache.format is auto
    assert cache.k.shape == (2, 3, 2, 64, 16) and cache.v.shape == (2, 3, 2, 16, 64)
    assert cache.k.dtype == torch.bfloat16 and int(cache.k.count_nonzero()) == 0
    cache = int8.allocate(config, 3, 16, torch.bfloat16, torch.device("cpu"), huge_pages=False)
    assert cache.format is int8 and cache.k.dtype == cache.v.dtype == torch.int8
    assert cache.k.shape == cache.v.shape == (2, 3, 2, 16 * 64 + 16 * 2 * 4)
    assert int8.unsupported(24, 16) == (
        "an int8 KV cache needs head_dim to be a multiple of 32; this model's is 24"
    )


class _PortableOnly(ModelDtypeFormat):
    """A format as a new module would declare it: the model's dtype, read only by the
    portable backend."""

    name = "portable-only"
    help = "the model's dtype, for the portable backend"
    label = "kvp"
    backends = ("portable",)
    is_default = False


def test_a_new_format_is_one_declaration(tmp_path, monkeypatch):
    """Registering a format is enough for an engine to take it by name: its backends
    choose the attention path, and its answers equal the default cache's."""
    monkeypatch.setitem(kv_format_module._FORMATS, _PortableOnly.name, _PortableOnly())
    build_hf_model(
        "llama", tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64
    )
    plain = make_engine(tmp_path)
    engine = make_engine(tmp_path, kv_cache_dtype="portable-only")
    assert engine.runner.kv_cache.format.name == "portable-only"
    assert engine.runner.attention.name == "portable"
    assert plain.block_manager.num_blocks == engine.block_manager.num_blocks
    prompts = [[5, 9, 33, 7, 2, 81, 40], [5, 9, 33, 11]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in run_all(plain, prompts, params)]
    got = [o.outputs[0].token_ids for o in run_all(engine, prompts, params)]
    assert got == want and all(len(ids) == 6 for ids in got)


def test_a_format_no_backend_reads_here_is_refused_by_name(tmp_path, monkeypatch):
    class _Nowhere(ModelDtypeFormat):
        name, label, backends, is_default = "nowhere", "kvn", (), False

    monkeypatch.setitem(kv_format_module._FORMATS, "nowhere", _Nowhere())
    build_hf_model("llama", tmp_path, hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ValueError, match="portable: does not read a nowhere KV cache"):
        make_engine(tmp_path, kv_cache_dtype="nowhere")
