"""A GGUF runs from its own file: the loader reads each tensor from the mapped GGUF, bit
for bit the tensors an exported directory (`convert_gguf`) holds, and the model it builds
answers exactly as the exported directory's does - in float and in the `gguf` mode, whose
blocks are never expanded to float by the load."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from gguf import GGUFReader
from hf_models import build_hf_model, make_engine, run_all
from model_fixtures import (
    llama3_rope_freqs,
    tiny_vocab,
    write_sentencepiece_gguf,
    write_tiny_gguf,
)
from safetensors.torch import load_file
from test_moe_gguf import write_qwen3_moe_gguf

import tokenmill.engine.worker.build as build
from tokenmill.engine import LLM, EngineConfig, InsufficientMemoryError
from tokenmill.engine.loader import gguf_blocks
from tokenmill.engine.loader.gguf_convert import GGUF_LINK, TABLE_FILE, convert_gguf
from tokenmill.engine.loader.gguf_tensors import GGUFTensors
from tokenmill.engine.loader.model_files import model_info, resolve_model, weights_hash
from tokenmill.engine.loader.tensor_plan import build_on_meta
from tokenmill.engine.loader.weights import load_model
from tokenmill.engine.models import load_config
from tokenmill.engine.quant import get_method
from tokenmill.engine.quant.gguf_embedding import (
    BlockEmbedding,
    PendingEmbedding,
    build_block_embedding,
)
from tokenmill.engine.quant.gguf_linear import PendingBlocks, blocks_hold_out
from tokenmill.engine.types.sampling_params import SamplingParams


def _llama(quant_type, **kwargs):
    return lambda tmp: write_tiny_gguf(tmp / "m.gguf", quant_type=quant_type, **kwargs).path


def _qwen3_moe(tmp):
    hf = build_hf_model(
        "qwen3_moe",
        tmp / "hf",
        vocab_size=len(tiny_vocab()[0]),
        mlp_only_layers=[],
        num_hidden_layers=2,
        moe_intermediate_size=64,
    )
    write_qwen3_moe_gguf(tmp / "hf", tmp / "m.gguf", hf.config, "Q8_0")
    return tmp / "m.gguf"


def _gemma3(tmp):
    vocab_size = 512
    hf = build_hf_model(
        "gemma3",
        tmp / "hf",
        vocab_size=vocab_size,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=64,
    )
    return write_sentencepiece_gguf(tmp / "m.gguf", architecture="gemma3", hf_model=hf)


# Every architecture and tensor type the GGUF tests write.
CASES = {
    "llama-f32": _llama("F32"),
    "llama-f16": _llama("F16"),
    "llama-bf16": _llama("BF16"),
    "llama-q8_0": _llama("Q8_0"),
    "llama-q4_0": _llama("Q4_0", hidden_size=64),
    "llama-q4_1-untied": _llama("Q4_1", hidden_size=64, tie_word_embeddings=False),
    "llama-q5_0-biases": _llama("Q5_0", hidden_size=64, biases=True),
    "llama3-rope-freqs": _llama("F32", rope_freqs=llama3_rope_freqs(16, 10000.0, 8.0)),
    "qwen3moe-q8_0": _qwen3_moe,
    "gemma3": _gemma3,
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(the GGUF, the directory convert_gguf exports, the directory it runs from)."""
    tmp = tmp_path_factory.mktemp(request.param)
    path = CASES[request.param](tmp)
    exported = convert_gguf(path, tmp / "exported", dtype=torch.float32)
    mapped = resolve_model(path, cache_root=tmp / "cache")
    return path, exported, mapped


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def test_tensors_read_from_the_file_equal_the_exported_ones(case):
    path, exported, mapped = case
    expected = load_file(exported / "model.safetensors")
    gguf = GGUFTensors.open_dir(mapped)  # the table written when indexed
    assert gguf.entries == GGUFTensors.open(path).entries  # the header parsed again
    assert sorted(s.name for s in gguf.sources()) == sorted(expected)
    got = dict(gguf.iter_float(set(expected)))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(_bits(got[name]), _bits(tensor)), name
    # The blocks the gguf mode runs: the same types, the same raw rows.
    kept = gguf_blocks.read_types(exported) or {}
    assert gguf.block_types() == kept
    runnable = [n for n, kind in kept.items() if kind in gguf_blocks.BLOCK_FORMATS]
    raw = gguf.raw_blocks(runnable)
    assert sorted(raw) == sorted(runnable)
    for name, rows in (gguf_blocks.load_raw(exported, runnable) if runnable else {}).items():
        assert torch.equal(raw[name], rows), name


def test_the_directory_it_runs_from_holds_no_weights(case):
    path, exported, mapped = case
    files = sorted(p.name for p in mapped.iterdir())
    assert files == sorted(
        [
            "config.json",
            "generation_config.json",
            GGUF_LINK,
            TABLE_FILE,
            "tokenizer.json",
            "tokenizer_config.json",
            "tokenmill_conversion.json",
            "tokenmill_source.json",
        ]
    )
    assert (mapped / GGUF_LINK).is_symlink() and (mapped / GGUF_LINK).samefile(path)
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (mapped / name).read_bytes() == (exported / name).read_bytes(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loaded_model_equals_the_exported_directorys(case, dtype):
    _, exported, mapped = case
    config = load_config(mapped)
    cpu = torch.device("cpu")
    ours = load_model(mapped, config, dtype=dtype, device=cpu).state_dict()
    theirs = load_model(exported, load_config(exported), dtype=dtype, device=cpu).state_dict()
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        if "rotary" in name or "inv_freq" in name:  # computed from the config, not loaded
            continue
        assert ours[name].dtype == tensor.dtype, name
        assert torch.equal(_bits(ours[name]), _bits(tensor)), name


def test_blocks_for_bf16_parameters_come_as_bf16_without_an_fp32_copy(tmp_path):
    """The Q4_1 embedding and head (untied) of a bf16 engine are decoded straight to bf16:
    the bits of the fp32 values rounded, read without the fp32 tensor."""
    tiny = write_tiny_gguf(
        tmp_path / "m.gguf", quant_type="Q4_1", hidden_size=64, tie_word_embeddings=False
    )
    gguf = GGUFTensors.open_dir(resolve_model(tiny.path, cache_root=tmp_path / "cache"))
    names = {s.name for s in gguf.sources()}
    kinds = {gguf.layout.hf_tensor_name(e.name): e.kind for e in gguf.weights()}
    wide = dict(gguf.iter_float(names))
    narrow = dict(gguf.iter_float(names, frozenset(names)))
    decoded = {n for n, kind in kinds.items() if kind in ("Q4_0", "Q4_1", "Q8_0")}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= decoded
    for name, tensor in narrow.items():
        want = wide[name].to(torch.bfloat16) if name in decoded else wide[name]
        assert tensor.dtype == want.dtype, name
        assert torch.equal(_bits(tensor), _bits(want)), name


PROMPTS = [[3, 5, 7, 9, 11, 4, 6], [8, 8, 2, 10, 12, 13, 1, 5, 9, 3, 3]]


@pytest.mark.parametrize(
    ("quant_type", "quantization", "tied"),
    [
        ("F16", None, True),
        ("Q8_0", None, True),
        ("Q4_0", "gguf", True),
        ("Q8_0", "gguf", True),
        ("Q4_1", "gguf", True),
        # untied: the gguf mode keeps the embedding in blocks (BlockEmbedding)
        ("Q4_1", "gguf", False),
        ("Q8_0", "gguf", False),
    ],
)
def test_greedy_tokens_and_logprobs_are_the_exported_directorys(
    quant_type, quantization, tied, tmp_path
):
    tiny = write_tiny_gguf(
        tmp_path / "m.gguf", quant_type=quant_type, hidden_size=64, tie_word_embeddings=tied
    )
    exported = convert_gguf(tiny.path, tmp_path / "exported", dtype=torch.float32)
    mapped = resolve_model(tiny.path, cache_root=tmp_path / "cache")
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3
    )
    ours = run_all(make_engine(mapped, quantization=quantization), PROMPTS, params)
    theirs = run_all(make_engine(exported, quantization=quantization), PROMPTS, params)
    for out, ref in zip(ours, theirs):
        assert out.token_ids == ref.token_ids
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs
        assert out.prompt_logprobs == ref.prompt_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_an_untied_gguf_embedding_stays_in_blocks_and_looks_up_the_float_loads_rows(
    quant_type, dtype, tmp_path
):
    tiny = write_tiny_gguf(
        tmp_path / "m.gguf", quant_type=quant_type, hidden_size=64, tie_word_embeddings=False
    )
    mapped = resolve_model(tiny.path, cache_root=tmp_path / "cache")
    config = load_config(mapped)
    cpu = torch.device("cpu")
    method = get_method("gguf")
    model = load_model(mapped, config, dtype=dtype, device=cpu, hold_out=method.hold_out(mapped))
    assert isinstance(model.model.embed_tokens, PendingEmbedding)
    assert "model.embed_tokens.weight" not in dict(model.named_parameters())
    stored = GGUFTensors.open_dir(mapped).stored_bytes()["model.embed_tokens.weight"]
    assert build_block_embedding(model, mapped) == stored
    embedding = model.model.embed_tokens
    assert isinstance(embedding, BlockEmbedding) and embedding.weight_bytes == stored
    float_rows = load_model(mapped, config, dtype=dtype, device=cpu).model.embed_tokens.weight
    ids = torch.tensor([[5, 0, config.vocab_size - 1], [7, 7, 3]])
    got = embedding(ids)
    assert got.dtype == dtype and got.shape == (2, 3, config.hidden_size)
    assert torch.equal(_bits(got), _bits(float_rows[ids]))
    every = embedding(torch.arange(config.vocab_size))
    assert torch.equal(_bits(every), _bits(float_rows.detach()))
    # The plan counts its blocks, not a float matrix: vocab x hidden floats fewer.
    plan = {
        q: build.plan_memory(
            config,
            EngineConfig(dtype=str(dtype).removeprefix("torch."), quantization=q),
            dtype=dtype,
            device=cpu,
            model_dir=mapped,
        )
        for q in (None, "gguf")
    }
    float_embedding = config.vocab_size * config.hidden_size * dtype.itemsize
    blocks = method.held_out_bytes(mapped)(build_on_meta(config, dtype))
    layers = sum(v for m, v in blocks.items() if not isinstance(m, torch.nn.Embedding))
    float_layers = sum(
        p.numel() * dtype.itemsize
        for n, p in build_on_meta(config, dtype).named_parameters()
        if ".layers." in n and n.endswith("proj.weight")
    )
    assert plan["gguf"].weight_bytes == (
        plan[None].weight_bytes - float_embedding + stored - float_layers + layers
    )


def test_a_tied_gguf_embedding_loads_as_float_in_the_gguf_mode(tmp_path):
    """A tied embedding is also the lm_head, whose product reads all of it."""
    tiny = write_tiny_gguf(tmp_path / "m.gguf", quant_type="Q8_0", hidden_size=64)
    mapped = resolve_model(tiny.path, cache_root=tmp_path / "cache")
    config = load_config(mapped)
    model = load_model(
        mapped,
        config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        hold_out=get_method("gguf").hold_out(mapped),
    )
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_the_gguf_mode_never_loads_its_blocks_as_float(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", quant_type="Q4_0", hidden_size=64)
    mapped = resolve_model(tiny.path, cache_root=tmp_path / "cache")
    config = load_config(mapped)
    model = load_model(
        mapped,
        config,
        dtype=torch.float32,
        device=torch.device("cpu"),
        hold_out=blocks_hold_out(mapped),
    )
    pending = [n for n, m in model.named_modules() if isinstance(m, PendingBlocks)]
    # q/k/v fused, o, gate/up fused, down: four per layer, none filled as float.
    assert len(pending) == 4 * config.num_hidden_layers
    loaded = {n for n, _ in model.named_parameters()}
    assert not [n for n in loaded if ".layers." in n and n.endswith("proj.weight")]


def test_a_moved_gguf_is_linked_again(tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", quant_type="Q8_0")
    cache = tmp_path / "cache"
    first = resolve_model(tiny.path, cache_root=cache)
    digest_before = weights_hash(first)
    moved = tmp_path / "elsewhere" / "m.gguf"
    moved.parent.mkdir()
    shutil.move(tiny.path, moved)
    assert not (first / GGUF_LINK).exists()  # the link dangles
    again = resolve_model(moved, cache_root=cache)
    assert again == first
    assert os.path.realpath(again / GGUF_LINK) == str(moved.resolve())
    assert weights_hash(again) == digest_before
    # Touched, same bytes: a start from the directory refuses it by name; resolving the
    # file again (its sha256 is the directory's key) takes it.
    os.utime(moved, ns=(1, 1))
    with pytest.raises(ValueError, match="is not the GGUF file that was indexed there"):
        make_engine(again)
    assert resolve_model(moved, cache_root=cache) == first
    assert run_all(make_engine(first), PROMPTS[:1], SamplingParams(max_tokens=2))
    record = json.loads((again / "tokenmill_conversion.json").read_text())
    assert list(record["weights_sha256"]) == [GGUF_LINK]


def test_models_info_reads_the_gguf_header(tmp_path, monkeypatch):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", quant_type="Q8_0")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    before = model_info(str(tiny.path))
    assert before.source == "gguf (not indexed yet)"
    expected = sum(t.numel() for t in tiny.hf_tensors.values())
    assert before.num_parameters == expected
    resolve_model(tiny.path)
    after = model_info(str(tiny.path))
    assert after.source == "gguf" and after.architecture == "LlamaForCausalLM"
    assert (after.num_parameters, after.dtype) == (expected, "gguf:Q8_0")


# Bytes of one block of 32 weights in each GGML format the plan test writes.
_BLOCK_BYTES = {"Q4_0": 18, "Q5_0": 22, "Q8_0": 34}


def _planned_weights(model_dir, quantization):
    config = load_config(model_dir)
    settings = EngineConfig(dtype="float32", quantization=quantization)
    plan = build.plan_memory(
        config, settings, dtype=torch.float32, device=torch.device("cpu"), model_dir=model_dir
    )
    return plan.weight_bytes


# The most bytes a weight of n values can take once built, by hand from the modules the
# mode may build: Q4_0 as stored (18 bytes a 32) or as Int4Linear (4-bit codes, a bf16
# scale and minimum a 32); Q5_0 as GroupedLinear (a byte a value, an fp32 scale a 32).
_BUILT_BOUND = {"Q4_0": lambda n: max(n // 32 * 18, n // 2 + n // 8), "Q5_0": lambda n: n + n // 8}


@pytest.mark.parametrize(("quant_type", "biases"), [("Q4_0", False), ("Q5_0", True)])
def test_the_gguf_modes_plan_counts_its_blocks_as_built_at_most(quant_type, biases, tmp_path):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", quant_type=quant_type, biases=biases)
    mapped = resolve_model(tiny.path, cache_root=tmp_path / "cache")
    # From the file's own header: the decoder layers' 2-D weights are the held-out blocks
    # (their biases and norms are F32 and load as float).
    blocks = [
        t
        for t in GGUFReader(tiny.path).tensors
        if t.name.startswith("blk.") and t.tensor_type.name == quant_type
    ]
    assert len(blocks) == 7 * 2  # q, k, v, o, gate, up, down in each of two layers
    for t in blocks:
        assert int(t.n_bytes) == int(t.n_elements) // 32 * _BLOCK_BYTES[quant_type]
    as_float = sum(int(t.n_elements) * 4 for t in blocks)
    as_built = sum(_BUILT_BOUND[quant_type](int(t.n_elements)) for t in blocks)
    float_plan = _planned_weights(mapped, None)
    planned = _planned_weights(mapped, "gguf")
    assert planned == float_plan - as_float + as_built
    # The bound holds: the layers the load builds take no more than the plan counted.
    llm = LLM(str(mapped), dtype="float32", quantization="gguf")
    built = [  # each swapped layer once: not the parts a wrapper or a RowConcat holds
        child.weight_bytes
        for layer in llm.engine.runner.model.model.layers
        for parent in layer.modules()
        if not hasattr(parent, "weight_bytes")
        for child in parent.children()
        if hasattr(child, "weight_bytes")
    ]
    assert built and 0 < sum(built) <= as_built


def test_a_gguf_too_big_as_float_is_planned_in_the_gguf_mode(tmp_path, monkeypatch):
    tiny = write_tiny_gguf(tmp_path / "m.gguf", quant_type="Q4_0")
    mapped = resolve_model(tiny.path, cache_root=tmp_path / "cache")
    float_weights = _planned_weights(mapped, None)
    assert _planned_weights(mapped, "gguf") < float_weights // 2
    # RAM that cannot hold the model in float, but holds its blocks and a KV cache.
    monkeypatch.setattr(build, "available_ram", lambda: float_weights - 1)
    with pytest.raises(InsufficientMemoryError):
        LLM.plan([], model=str(mapped), dtype="float32")
    planned = LLM.plan([], model=str(mapped), dtype="float32", quantization="gguf")
    memory = planned.shape.memory
    assert memory.fits and memory.kv_cache_blocks > 0
    llm = LLM(str(mapped), dtype="float32", quantization="gguf")
    assert llm.memory == memory  # the engine plans as the dry run did, and loads
