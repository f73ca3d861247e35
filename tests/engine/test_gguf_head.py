"""The `gguf` mode's untied lm_head read from its blocks and packed slice by slice
(quant/gguf_head.py): the float load's weight and oneDNN's pack of it, bit for bit."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hf_models import make_engine, run_all
from model_fixtures import write_tiny_gguf

from tokenmill.engine.loader.model_files import resolve_model
from tokenmill.engine.loader.weights import load_model
from tokenmill.engine.models import load_config
from tokenmill.engine.quant import get_method, gguf_linear, packed_linear
from tokenmill.engine.quant.gguf_head import BlockHead, PendingHead, build_block_head
from tokenmill.engine.quant.packed_linear import PackedLinear, pack_linear_layers, packs_dtype
from tokenmill.engine.types.sampling_params import SamplingParams

CPU = torch.device("cpu")
PROMPTS = [[3, 5, 7, 9, 11, 4, 6], [8, 8, 2, 10, 12, 13, 1, 5, 9, 3, 3]]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(torch.uint8)


def _packed_bytes(packed: torch.Tensor) -> bytes:
    ops = torch.ops.mkldnn
    return ctypes.string_at(ops.data_ptr(packed), ops._nbytes(packed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_head_comes_from_its_blocks_packed_as_the_float_loads(
    quant_type, dtype, tmp_path, monkeypatch
):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", quant_type=quant_type, tie_word_embeddings=False)
    mapped = resolve_model(tiny.path, cache_root=tmp_path / "cache")
    config = load_config(mapped)
    model = load_model(
        mapped, config, dtype=dtype, device=CPU, hold_out=get_method("gguf").hold_out(mapped)
    )
    assert isinstance(model.lm_head, PendingHead)
    assert "lm_head.weight" not in dict(model.named_parameters())
    build_block_head(model, mapped)
    head = model.lm_head
    assert isinstance(head, BlockHead) and head.kind == quant_type
    float_head = load_model(mapped, config, dtype=dtype, device=CPU).lm_head.weight
    assert torch.equal(_bits(head.rows(0, config.vocab_size)), _bits(float_head))
    assert torch.equal(_bits(head.rows(64, 200)), _bits(float_head[64:200]))
    # 265 rows in slices of 128: two whole slices and one of part blocks.
    monkeypatch.setattr(packed_linear, "SLICE_ROWS", 128)
    pack_linear_layers(model, dtype=dtype, device=CPU)
    if not packs_dtype(dtype):
        assert type(model.lm_head) is torch.nn.Linear
        assert torch.equal(_bits(model.lm_head.weight), _bits(float_head))
        return
    assert isinstance(model.lm_head, PackedLinear)
    want = torch.ops.mkldnn._reorder_linear_weight(float_head.detach(), None)
    assert _packed_bytes(model.lm_head.packed_weight) == _packed_bytes(want)


def test_a_tied_head_is_not_held_out(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", quant_type="Q8_0")
    mapped = resolve_model(tiny.path, cache_root=tmp_path / "cache")
    model = load_model(
        mapped,
        load_config(mapped),
        dtype=torch.float32,
        device=CPU,
        hold_out=get_method("gguf").hold_out(mapped),
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantize_lm_head", [False, True])
def test_logprobs_are_those_of_the_head_loaded_as_float(
    quantize_lm_head, dtype, tmp_path, monkeypatch
):
    """Through the engine: the head from its blocks (packed from slices, or int8 from its
    decoded matrix) gives the logprobs the float-loaded head gives, exactly."""
    tiny = write_tiny_gguf(tmp_path / "m.gguf", quant_type="Q4_0", tie_word_embeddings=False)
    mapped = resolve_model(tiny.path, cache_root=tmp_path / "cache")
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    settings = dict(quantization="gguf", quantize_lm_head=quantize_lm_head, dtype=dtype)
    monkeypatch.setattr(packed_linear, "SLICE_ROWS", 128)
    packed_from_slices = []
    pack_rows = packed_linear.pack_rows

    def counted(source):
        packed = pack_rows(source)
        packed_from_slices.append(packed is not None)
        return packed

    monkeypatch.setattr(packed_linear, "pack_rows", counted)
    ours = run_all(make_engine(mapped, **settings), PROMPTS, params)
    packs = not quantize_lm_head and packs_dtype(getattr(torch, dtype))
    assert packed_from_slices == ([True] if packs else [])
    # The path before: the head loaded as float, then packed whole.
    monkeypatch.setattr(gguf_linear, "hold_out_head", lambda *args: set())
    theirs = run_all(make_engine(mapped, **settings), PROMPTS, params)
    assert packed_from_slices == ([True] if packs else [])
    for out, ref in zip(ours, theirs):
        assert out.token_ids == ref.token_ids
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs
        assert out.prompt_logprobs == ref.prompt_logprobs
