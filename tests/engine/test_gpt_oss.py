"""gpt-oss against transformers on the same random weights (fp32): attention sinks,
alternating sliding and full layers, yarn rope, the router's bias and top-k softmax, and
the experts' biases and clamped SwiGLU over interleaved gate_up columns - through `LLM`
with chunked prefill and the prefix cache, under preemption, and through a job. Router
ties are left out as in test_moe_models.py."""

from __future__ import annotations

import pytest
import torch
from hf_models import build_hf_model, make_engine, run_all, run_token_prompts_as_job
from test_moe_models import Compared, prompts_for

from tokenmill.engine.api.llm import LLM
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.models import load_config
from tokenmill.engine.models.gpt_oss import ClampedSwiGLU, GptOssConfig
from tokenmill.engine.types.sampling_params import SamplingParams


def gpt_oss_model(path, **overrides):
    from hf_models import save_char_tokenizer

    hf = build_hf_model("gpt_oss", path, **overrides)
    save_char_tokenizer(path)
    return hf


def test_config_reads_what_transformers_builds(tmp_path):
    hf = gpt_oss_model(tmp_path)
    config = load_config(tmp_path)
    assert isinstance(config, GptOssConfig)
    assert config.attention_sinks and config.attention_bias and config.attention_output_bias
    assert [config.layer_sliding_window(i) for i in range(3)] == [8, None, 8]
    assert [layer.self_attn.sliding_window for layer in hf.model.layers] == [8, None, 8]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        8,
        3,
        48,
    )
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 0.5)
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["truncate"] is False


def test_model_info_counts_the_experts_a_token_skips(tmp_path):
    from tokenmill.engine import model_info

    hf = gpt_oss_model(tmp_path)
    info = model_info(tmp_path)
    assert info.num_parameters == sum(p.numel() for p in hf.parameters())
    per_expert = 64 * 96 + 96 + 48 * 64 + 64  # gate_up and down, their biases
    assert info.num_active_parameters == info.num_parameters - 3 * (8 - 3) * per_expert


def test_clamped_swiglu_is_transformers_on_interleaved_columns(tmp_path):
    hf = gpt_oss_model(tmp_path)
    experts = hf.model.layers[0].mlp.experts
    gate_up = torch.randn(7, 96) * 2
    ours = ClampedSwiGLU(experts.alpha, experts.limit)(gate_up)
    torch.testing.assert_close(ours, experts._apply_gate(gate_up), atol=0, rtol=0)
    # The limit clamps: a gate of 10 counts as 0.5, an up of -10 as -0.5.
    clamped = ClampedSwiGLU(1.702, 0.5)(torch.tensor([[10.0, -10.0]]))
    assert float(clamped) == pytest.approx(0.5 * 0.5 * torch.sigmoid(torch.tensor(0.851)).item())


def test_gpt_oss_matches_one_transformers_forward(tmp_path):
    hf = gpt_oss_model(tmp_path)
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,  # chunked prefill
        enable_prefix_caching=True,
    )
    assert llm.engine.runner.attention.name == "native"  # the path that computes sinks
    experts = [layer.mlp.experts for layer in llm.engine.runner.model.model.layers]
    assert all(e.packed is not None for e in experts)  # the native grouped kernel
    prompts = prompts_for(seed=3)
    compared = Compared()
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        compared.check_output(out, prompt, hf)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        compared.check_output(out, prompt, hf)
    assert llm.engine.stats.cached_prompt_tokens > 0
    compared.assert_mostly_compared()


def test_every_piece_changes_the_answer(tmp_path):
    """The parity above is not vacuous: without the sinks, or with the grouped kernel's
    SwiGLU unclamped, the same engine no longer gives transformers' log-probs."""
    hf = gpt_oss_model(tmp_path)
    prompt = prompts_for(seed=3)[4]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def worst_prompt_logprob_error(engine) -> float:
        out = run_all(engine, [prompt], params)[0]
        with torch.no_grad():
            want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        return max(
            abs(entry[prompt[i + 1]] - float(want[i, prompt[i + 1]]))
            for i, entry in enumerate(out.prompt_logprobs[1:])
        )

    engine = make_engine(tmp_path)
    assert worst_prompt_logprob_error(engine) < 2e-4
    model = engine.runner.model
    for layer in model.model.layers:
        layer.self_attn.sinks = None
    assert worst_prompt_logprob_error(engine) > 1e-2
    engine = make_engine(tmp_path)
    for layer in engine.runner.model.model.layers:
        experts = layer.mlp.experts
        assert experts.packed is not None  # the native grouped kernel computes them
        experts.packed.swiglu = (experts.activation.alpha, 1e9)
    assert worst_prompt_logprob_error(engine) > 1e-2


def test_gpt_oss_matches_transformers_under_preemption(tmp_path):
    hf = gpt_oss_model(tmp_path)
    prompts = prompts_for(seed=11)
    config = load_config(tmp_path)
    block_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    engine = make_engine(
        tmp_path,
        kv_cache_memory=24 * block_bytes * 4 * 4,  # k and v, fp32, 4 tokens a block
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        max_num_seqs=8,  # set: admitted by their prompt alone, so decode preempts
    )
    assert engine.block_manager.num_blocks == 24
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    outputs = run_all(engine, prompts, params)
    assert engine.stats.num_preemptions > 0
    compared = Compared()
    for prompt, out in zip(prompts, outputs):
        assert out.finish_reason == "length"
        compared.check_generated(prompt, out.outputs[0].token_ids, out.outputs[0].logprobs, hf)
    compared.assert_mostly_compared()


def test_gpt_oss_matches_transformers_through_a_job(tmp_path):
    model_dir = tmp_path / "model"
    hf = gpt_oss_model(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = prompts_for(seed=7)
    results = run_token_prompts_as_job(model_dir, prompts, tmp_path / "out")
    compared = Compared()
    for prompt, row in zip(prompts, results):
        generated = tokenizer.encode(row["output"])
        assert len(generated) == 8 and row["finish_reason"] == "length"
        entries = [{t: e["logprob"]} for t, e in zip(generated, row["logprobs"])]
        compared.check_generated(prompt, generated, entries, hf)
    compared.assert_mostly_compared()


def test_backends_without_sinks_are_refused_by_name(tmp_path):
    from tokenmill.engine.worker.attention import AttentionSpec, select_backend
    from tokenmill.engine.worker.kv_cache import default_kv_cache_format

    gpt_oss_model(tmp_path)
    config = load_config(tmp_path)
    spec = AttentionSpec.of_model(
        config,
        default_kv_cache_format(),
        block_size=4,
        dtype=torch.float16,  # no native kernel: only the portable path would serve it
        device=torch.device("cpu"),
    )
    with pytest.raises(ValueError, match="portable: does not compute attention sinks"):
        select_backend(spec)


@pytest.mark.parametrize("weight_format", ["int8", "int4"])
def test_quantized_float_experts_compute_their_dequantized_weights(weight_format, tmp_path):
    """Float experts packed int8 or int4: the kernel, with the biases and the clamped
    SwiGLU over the reordered gate/up columns, computes what the float experts compute
    with the dequantized weights put back in the checkpoint's interleaved layout."""
    from tokenmill.engine.models.gpt_oss import GptOssExperts

    hf = gpt_oss_model(tmp_path, intermediate_size=64)  # int4: whole groups of 32
    config = load_config(tmp_path)
    source = hf.model.layers[1].mlp.experts
    quantized, reference = GptOssExperts(config), GptOssExperts(config)
    with torch.no_grad():
        for experts in (quantized, reference):
            for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                getattr(experts, name).copy_(getattr(source, name))
    assert quantized.pack(weight_format)  # the native grouped kernel serves them
    assert quantized.packed.weight_format == weight_format
    gate_then_up, down = (
        quantized.packed.dequantized()
    )  # [E, 2 * inter, hidden], [E, hidden, inter]
    inter = config.moe_intermediate_size
    interleaved = torch.empty_like(gate_then_up)
    interleaved[:, 0::2], interleaved[:, 1::2] = gate_then_up[:, :inter], gate_then_up[:, inter:]
    with torch.no_grad():
        reference.gate_up_proj.copy_(interleaved.transpose(1, 2))
        reference.down_proj.copy_(down.transpose(1, 2))
    assert reference.packed is None  # torch's grouped matmul, in float
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, config.hidden_size, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(37)])
    weights = torch.rand(37, 3, generator=g)
    ours = quantized(x, weights, ids)
    torch.testing.assert_close(ours, reference(x, weights, ids), atol=1e-5, rtol=1e-5)
    # The quantization is real: the float experts compute otherwise.
    exact = GptOssExperts(config)
    exact.load_state_dict(source.state_dict())
    assert not torch.allclose(ours, exact(x, weights, ids), atol=1e-5, rtol=1e-5)
    stored = {"int8": torch.int8, "int4": torch.uint8}[weight_format]  # int4: two a byte
    assert quantized.packed.gate_up.dtype == quantized.packed.down.dtype == stored


@pytest.mark.parametrize(
    ("quantization", "weight_format"), [(None, "float"), ("int8", "int8"), ("int4", "int4")]
)
def test_the_memory_plan_counts_the_experts_as_packed(quantization, weight_format, tmp_path):
    """The planned weight bytes are what the load holds at its peak when it packs each
    layer's experts as it fills (in int8/int4 under those modes): the model's parameters
    left in memory, every layer's packed experts (fp32 biases included), and the largest
    layer's experts as loaded (stacks and biases, alive until they are packed) - and
    under int4, which swaps the attention projections as they fill too, those in 4 bits
    (their biases in bf16) plus the largest one as loaded."""
    from tokenmill.engine.loader.tensor_plan import build_on_meta
    from tokenmill.engine.loader.weights import load_model
    from tokenmill.engine.quant import quantized_targets
    from tokenmill.engine.quant.int4 import Int4Linear
    from tokenmill.engine.types.config import EngineConfig
    from tokenmill.engine.worker import build
    from tokenmill.engine.worker.memory import load_bytes

    gpt_oss_model(tmp_path, intermediate_size=64)  # int4: whole groups of 32
    config = load_config(tmp_path)
    cpu, dtype = torch.device("cpu"), torch.bfloat16
    model = load_model(
        tmp_path, config, dtype=dtype, device=cpu, on_filled=build._on_filled(quantization)
    )
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert [e.packed.weight_format for e in experts] == [weight_format] * len(experts)
    assert all(p.is_meta for e in experts for p in e.parameters())  # the packing replaced them
    held = {id(p): p for p in model.parameters() if not p.is_meta}.values()
    loaded_layers = [sum(p.numel() * p.element_size() for p in e.parameters()) for e in experts]
    peak = (
        sum(p.numel() * p.element_size() for p in held)
        + sum(e.packed.weight_bytes for e in experts)
        + max(loaded_layers)
    )
    int4_layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    dense = [
        sum(p.numel() * p.element_size() for p in linear.parameters())
        for _, _, linear in quantized_targets(build_on_meta(config, dtype))
    ]
    assert len(int4_layers) == (len(dense) if quantization == "int4" else 0)
    if int4_layers:
        biases = sum(
            m.bias.numel() * m.bias.element_size() for m in int4_layers if m.bias is not None
        )
        peak += sum(m.weight_bytes for m in int4_layers) + biases + max(dense)
    planned = build.plan_memory(
        config, EngineConfig(quantization=quantization), dtype=dtype, device=cpu
    )
    assert planned.weight_bytes == peak
    if quantization is not None:  # smaller than the float model, by the experts' packing
        assert sum(e.packed.weight_bytes for e in experts) < 0.6 * sum(loaded_layers)
        assert peak < load_bytes(config, dtype)


def test_int8_engine_tracks_the_float_engine(tmp_path):
    """quantization="int8" on float gpt-oss: the attention projections SmoothQuant W8A8,
    the experts int8 in the grouped kernel (biases and clamped SwiGLU in it)."""
    from test_quantized_model import PARAMS, compare

    gpt_oss_model(tmp_path)
    prompts = prompts_for(seed=9)
    reference = run_all(make_engine(tmp_path), prompts, PARAMS)
    engine = make_engine(tmp_path, quantization="int8")
    layers = engine.runner.model.model.layers
    assert all(layer.mlp.experts.packed.weight_format == "int8" for layer in layers)
    mean_diff, agree, total = compare(run_all(engine, prompts, PARAMS), reference)
    # The bounds of the other MoE families' int8 test (test_moe_models.py).
    assert mean_diff < 0.2
    assert agree >= total * 0.6


def test_quantizing_mxfp4_experts_is_refused_before_loading(tmp_path):
    gpt_oss_model(tmp_path / "float", intermediate_size=64)  # whole MXFP4 blocks
    write_mxfp4_checkpoints(tmp_path / "float", tmp_path / "mxfp4", tmp_path / "dense")
    for quantization in ("int8", "int4"):
        with pytest.raises(ValueError, match="does not quantize GptOssForCausalLM's MXFP4 experts"):
            LLM(str(tmp_path / "mxfp4"), dtype="float32", quantization=quantization)


def test_bf16_engine_tracks_the_fp32_engine(tmp_path):
    """bf16 weights and activations (sinks and softmax in fp32): the fp32 engine's greedy
    tokens nearly all, its prompt log-probs within bf16's rounding."""
    gpt_oss_model(tmp_path)
    prompts = prompts_for(seed=3)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    runs = [LLM(str(tmp_path), dtype=d).generate(prompts, params) for d in ("float32", "bfloat16")]
    pairs = [(a.outputs[0].token_ids, b.outputs[0].token_ids) for a, b in zip(*runs)]
    agree = sum(x == y for ours, theirs in pairs for x, y in zip(ours, theirs))
    diffs = [
        abs(next(iter(x.values())) - next(iter(y.values())))
        for a, b in zip(*runs)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
    ]
    assert agree >= 0.85 * 8 * len(prompts)
    assert sum(diffs) / len(diffs) < 0.02


def write_mxfp4_checkpoints(float_dir, mxfp4_dir, dense_dir) -> None:
    """gpt-oss as released, from a float checkpoint: its experts packed to MXFP4 by this
    project's packer (`*_blocks`, `*_scales` and quantization_config as transformers
    writes them) - and the float checkpoint of exactly the weights they hold."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tokenmill.engine.quant import mxfp4

    for out in (mxfp4_dir, dense_dir):
        shutil.copytree(float_dir, out)
    tensors = load_file(float_dir / "model.safetensors")
    quantized, dense = dict(tensors), dict(tensors)
    for name, value in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        blocks, scales = mxfp4.quantize(value.transpose(1, 2))  # [E, out, in] rows
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        dense[name] = mxfp4.dequantize(blocks, scales).transpose(1, 2).contiguous()
    save_file(quantized, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(dense, dense_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mxfp4_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (mxfp4_dir / "config.json").write_text(json.dumps(config))


def test_mxfp4_checkpoint_runs_as_stored_and_equals_its_dequantized_float_model(tmp_path):
    """The experts stay MXFP4 in memory (the grouped kernel reads them as stored), and the
    engine computes exactly what it computes over a float checkpoint of the dequantized
    weights - which itself matches transformers."""
    gpt_oss_model(tmp_path / "float", intermediate_size=64)  # whole MXFP4 blocks
    write_mxfp4_checkpoints(tmp_path / "float", tmp_path / "mxfp4", tmp_path / "dense")
    llm = LLM(str(tmp_path / "mxfp4"), dtype="float32", block_size=4, max_num_batched_tokens=16)
    for layer in llm.engine.runner.model.model.layers:
        experts = layer.mlp.experts
        assert experts.mxfp4 and experts.packed.weight_format == "mxfp4"
        assert experts.packed.gate_up.dtype == torch.uint8
        assert experts.gate_up_proj_blocks.is_meta  # the loaded bytes given up once packed
    dense = LLM(str(tmp_path / "dense"), dtype="float32", block_size=4, max_num_batched_tokens=16)
    from tokenmill.engine.quant import weight_bytes

    def experts_bytes(model) -> int:
        return sum(layer.mlp.experts.weight_bytes for layer in model.model.layers)

    ours_model, dense_model = llm.engine.runner.model, dense.engine.runner.model
    # Only the experts differ: 4.25 bits a weight (and the pad) against fp32's 32.
    assert weight_bytes(ours_model) - experts_bytes(ours_model) == (
        weight_bytes(dense_model) - experts_bytes(dense_model)
    )
    assert experts_bytes(ours_model) < experts_bytes(dense_model) / 5
    prompts = prompts_for(seed=5)
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    for ours, theirs in zip(llm.generate(prompts, params), dense.generate(prompts, params)):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].logprobs == theirs.outputs[0].logprobs
        assert ours.prompt_logprobs == theirs.prompt_logprobs
    import transformers

    hf = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "dense").eval()
    compared = Compared()
    for prompt, out in zip(prompts, dense.generate(prompts, params)):
        compared.check_output(out, prompt, hf)
    compared.assert_mostly_compared()


def test_mxfp4_checkpoints_are_checked_before_any_read(tmp_path, monkeypatch):
    import json

    from safetensors.torch import load_file, save_file

    from tokenmill.engine.loader import weights

    gpt_oss_model(tmp_path / "float", intermediate_size=64)  # whole MXFP4 blocks
    write_mxfp4_checkpoints(tmp_path / "float", tmp_path / "mxfp4", tmp_path / "dense")
    mxfp4_dir = tmp_path / "mxfp4"

    def read(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(weights, "iter_tensors", read)
    tensors = load_file(mxfp4_dir / "model.safetensors")
    scales = "model.layers.1.mlp.experts.down_proj_scales"
    save_file(
        {**tensors, scales: tensors[scales][:, :, :1].contiguous()},
        mxfp4_dir / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(
        ValueError, match=rf"{scales} has shape \(8, 64, 1\), expected \(8, 64, 2\)"
    ):
        LLM(str(mxfp4_dir), dtype="float32")
    config = json.loads((mxfp4_dir / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"].append("model.layers.0.mlp.experts")
    (mxfp4_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MXFP4 checkpoint keeps experts in float"):
        LLM(str(mxfp4_dir), dtype="float32")
