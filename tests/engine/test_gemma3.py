"""Gemma 3 against HF transformers on the same random weights (fp32): (1 + w) norms, the
extra norms, GeGLU, scaled embeddings, q/k norms, per-layer-type rope bases, query scale,
soft-capped logits and interleaved sliding-window / global layers."""

from __future__ import annotations

import pytest
import torch
from hf_models import (
    assert_logprobs_match,
    build_hf_model,
    hf_greedy,
    make_engine,
    run_all,
)
from test_hf_parity import mixed_prompts

from tokenmill.engine.models import load_config, parse_config
from tokenmill.engine.types.sampling_params import SamplingParams


def test_config_reads_gemma3_fields(tmp_path):
    build_hf_model("gemma3", tmp_path, final_logit_softcapping=30.0)
    config = load_config(tmp_path)
    assert config.architecture == "Gemma3ForCausalLM"
    assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert config.query_pre_attn_scalar == 24 and config.final_logit_softcapping == 30.0
    assert [config.layer_sliding_window(i) for i in range(4)] == [16, 16, None, 16]
    assert config.hidden_act == "gelu_pytorch_tanh" and config.qk_norm


def test_config_of_older_gemma3_files():
    """transformers 4.x wrote rope_theta / rope_local_base_freq and no layer_types."""
    raw = {
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    }
    config = parse_config(raw)
    assert [i for i in range(12) if config.layer_sliding_window(i) is None] == [5, 11]
    assert (config.rope_theta, config.rope_local_theta, config.head_dim) == (1e6, 1e4, 256)
    assert config.eos_token_ids == [1] and config.bos_token_id == 2


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_logprobs_match_transformers_within_the_window(softcap, tmp_path):
    hf = build_hf_model("gemma3", tmp_path, sliding_window=128, final_logit_softcapping=softcap)
    engine = make_engine(tmp_path, max_num_batched_tokens=16)  # forces chunked prefill
    assert_logprobs_match(hf, engine, mixed_prompts(256, seed=1)[:5], 6)


def test_head_dim_256_and_several_kv_heads(tmp_path):
    hf = build_hf_model("gemma3", tmp_path, head_dim=256, num_key_value_heads=2, sliding_window=128)
    engine = make_engine(tmp_path, max_num_batched_tokens=32)
    prompts = mixed_prompts(256, seed=4)[4:8]
    outputs = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, 5)[0]


def test_prompts_longer_than_the_window_match_transformers(tmp_path):
    """Window 16, prompts up to 100 tokens: local layers must forget what global ones see,
    across chunk boundaries (chunks of 16) and prefix-cache hits (block size 4)."""
    hf = build_hf_model("gemma3", tmp_path, final_logit_softcapping=30.0)
    engine = make_engine(tmp_path, max_num_batched_tokens=16, enable_prefix_caching=True)
    prompts = mixed_prompts(256, seed=2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=256)
    outputs = run_all(engine, prompts, params)
    assert max(len(p) for p in prompts) > 4 * 16
    for prompt, out in zip(prompts, outputs):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt, 12)
        assert out.token_ids == ref_tokens
        ours = torch.tensor([out.outputs[0].logprobs[-1][t] for t in range(256)])
        torch.testing.assert_close(ours, ref_logprobs[-1], atol=2e-4, rtol=1e-4)
    assert engine.stats.cached_prompt_tokens > 0  # the shared prefix came from the cache


def test_gemma3_gguf_converts_to_the_hf_weights_and_tokens(tmp_path):
    """A random Gemma 3 written as llama.cpp writes it (norm scales as 1 + w, Gemma's
    tensor names, SentencePiece vocabulary) converts back to the HF weights exactly, and
    the engine on the conversion generates what transformers generates."""
    from model_fixtures import sentencepiece_vocab, write_sentencepiece_gguf
    from safetensors.torch import load_file

    from tokenmill.engine.loader.gguf_convert import convert_gguf

    vocab_size = len(sentencepiece_vocab("gemma3")[0])
    # llama.cpp's layout for Gemma 3: every 6th layer global, query scale from head_dim.
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    hf = build_hf_model(
        "gemma3",
        tmp_path / "hf",
        vocab_size=vocab_size,
        num_hidden_layers=6,
        layer_types=layer_types,
        head_dim=64,
        query_pre_attn_scalar=64,
        sliding_window=64,
    )
    gguf_path = write_sentencepiece_gguf(tmp_path / "g.gguf", architecture="gemma3", hf_model=hf)
    out = convert_gguf(gguf_path, tmp_path / "converted", dtype=torch.float32)
    ours = load_file(out / "model.safetensors")
    expected = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        # Exact but for the norms: 1 + w was rounded to fp32 in the file (|1 + w| < 4 here).
        torch.testing.assert_close(ours[name], tensor, atol=2.4e-7, rtol=0, msg=name)
    config = load_config(out)
    assert config.layer_types == layer_types and config.sliding_window == 64
    assert (config.rope_theta, config.rope_local_theta) == (1_000_000.0, 10_000.0)
    engine = make_engine(out, max_num_batched_tokens=16)
    prompt = engine.tokenizer.encode("the theory of the thing: 12 345, héllo")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=vocab_size)
    got = run_all(engine, [prompt], params)[0]
    ref_tokens, ref_logprobs = hf_greedy(hf, prompt, 6)
    assert got.token_ids == ref_tokens
    ours = torch.tensor([got.outputs[0].logprobs[-1][t] for t in range(vocab_size)])
    torch.testing.assert_close(ours, ref_logprobs[-1], atol=2e-4, rtol=1e-4)


@pytest.mark.slow
def test_gemma3_270m_greedy_tokens_equal_transformers_on_the_gguf(tmp_path):
    """The real model (alias gemma3-270m), fp32 both sides: transformers loads the GGUF
    itself; we convert it (to fp32, so no weight is rounded) and run the engine with chunked
    prefill and the prefix cache on, over prompts shorter and longer than the 512-token
    window."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tokenmill.engine.api.llm import LLM
    from tokenmill.engine.loader.gguf_convert import convert_gguf
    from tokenmill.engine.loader.model_files import ALIASES, alias_gguf_path

    gguf_path = alias_gguf_path(ALIASES["gemma3-270m"])
    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=reference)
    reference.load_state_dict(state["tensors"], strict=False)
    reference.tie_weights()
    reference.eval()

    model_dir = convert_gguf(gguf_path, tmp_path / "gemma3-270m", dtype=torch.float32)
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=256)
    story = (
        "The old lighthouse keeper climbed the spiral stairs every evening, counting the "
        "steps as his father had, and lit the lamp that warned the fishing boats away from "
        "the rocks. "
    )
    prompts = [story * 4, story * 20 + "One night, the lamp would not light, and"]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    assert len(ids[0]) < 512 < len(ids[1])
    outputs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt_ids, out in zip(ids, outputs):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False
            )[0, len(prompt_ids) :]
        assert out.outputs[0].token_ids == expected.tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_norm_with_and_without_residual_computes_what_hf_computes(dtype):
    """(1 + w) in fp32 and one rounding at the end, on the fused path (fp32) and the
    PyTorch path (bf16); the residual is added in the model dtype, as HF adds it."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from tokenmill.engine.models.gemma3 import GemmaRMSNorm

    gen = torch.Generator().manual_seed(0)
    ours, reference = GemmaRMSNorm(640, 1e-6), Gemma3RMSNorm(640, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(640, generator=gen) * 0.5)
        ours.weight.copy_(reference.weight)
    ours, reference = ours.to(dtype), reference.to(dtype)
    x = torch.randn(7, 640, generator=gen).to(dtype)
    residual = (torch.randn(7, 640, generator=gen) * 4).to(dtype)
    ulp = 2e-7 if dtype == torch.float32 else 2**-8
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x), rtol=ulp, atol=1e-6)
        expected_sum = residual + x
        normed, new_residual = ours(x, residual.clone())
        assert torch.equal(new_residual, expected_sum)
        torch.testing.assert_close(normed, reference(expected_sum), rtol=ulp, atol=1e-6)
        # q/k norms see strided views of the qkv output.
        qkv = torch.randn(5, 3 * 640, generator=gen).to(dtype)
        view = qkv[:, :640]
        torch.testing.assert_close(ours(view), reference(view), rtol=ulp, atol=1e-6)
