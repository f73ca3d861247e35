"""Random-weight HF checkpoints built in the test, and HF `transformers` as the reference."""

from __future__ import annotations

import os
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Larger than the default 0.02 so the random model's distributions are peaked and
    # greedy choices are not decided by rounding.
    initializer_range=0.3,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

# Gemma 3 in small: one KV head, its own head_dim and query scale, three local layers
# (window 16, rope base 10k) around one global one (base 1M).
GEMMA3 = dict(
    num_hidden_layers=4,
    num_key_value_heads=1,
    head_dim=32,
    query_pre_attn_scalar=24,
    sliding_window=16,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
    hidden_activation="gelu_pytorch_tanh",
    initializer_range=0.1,
)


# Mixtures of experts in small: 8 experts, 2 or 3 of them per token.
MOE = {
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        num_hidden_layers=3,
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "olmoe": dict(num_experts=8, num_experts_per_tok=3, intermediate_size=48),
    # 3 of 8; weights of std 0.05 (gpt-oss's activations and sinks are tuned to them), a
    # SwiGLU limit small enough to clamp, a window of 8 on layers 0 and 2 (layer_types),
    # yarn rope (transformers' default: factor 32 over 4096 positions)
    "gpt_oss": dict(
        num_local_experts=8,
        num_experts_per_tok=3,
        intermediate_size=48,
        head_dim=16,
        num_hidden_layers=3,
        sliding_window=8,
        initializer_range=0.05,
        swiglu_limit=0.5,
    ),
}


def build_hf_model(kind: str, out_dir: Path, **overrides):
    """Save a random-weight `kind` (llama | qwen2 | qwen3 | gemma3 | mistral | phi3 |
    qwen3_moe | mixtral | olmoe | gpt_oss) checkpoint; return the HF model."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    }[kind]
    settings = {**SMALL, **(GEMMA3 if kind == "gemma3" else {}), **MOE.get(kind, {}), **overrides}
    if kind in ("qwen3", "qwen3_moe"):
        settings.setdefault("head_dim", settings["hidden_size"] // settings["num_attention_heads"])
    config = config_cls(**settings)
    torch.manual_seed(1234)
    model = model_cls(config).eval()
    if kind == "gemma3":
        # Gemma initialises its (1 + w) norm weights to zero; make them matter.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0, 0.3)
    # transformers initialises biases to zero (Qwen2's q/k/v, Llama's with attention_bias
    # or mlp_bias); make them matter.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.05 if kind == "gpt_oss" else 0.3)
            elif name.endswith("_proj_bias"):  # gpt-oss's experts'
                param.normal_(0, 0.05)
            elif name.endswith(".sinks"):  # large enough to take a share of each softmax
                param.normal_(0, 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation by full forward passes; also the log-softmax at each step."""
    ids = list(prompt)
    logprobs = []
    for _ in range(num_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        logprobs.append(torch.log_softmax(logits, dim=-1))
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :], logprobs


def reset_rotary(model) -> None:
    """Put transformers' rotary modules back to their starting frequencies: a dynamic
    rope keeps the longest sequence it has seen, so without this one forward's answer
    depends on the forwards before it."""
    for module in model.modules():
        if hasattr(module, "original_inv_freq") and hasattr(module, "original_max_seq_len"):
            module.inv_freq = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len


@torch.no_grad()
def hf_full_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids) - 1, vocab]: one forward over the whole sequence, from a fresh
    rotary state; row i is the log-softmax after token i (it scores token i + 1)."""
    reset_rotary(model)
    logits = model(torch.tensor([token_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches_full_forward(out, prompt: list[int], hf, k: int, atol: float = 2e-4) -> None:
    """An LLM output (greedy, with `logprobs=k` and `prompt_logprobs=k`) against one
    transformers forward over its prompt and completion: each generated token is the
    argmax there, its top k log-probs match, and so do the prompt's."""
    generated = out.outputs[0].token_ids
    reference = hf_full_logprobs(hf, prompt + generated)
    num_prompt = len(prompt)
    assert_matches(out, prompt, reference[: num_prompt - 1], k, atol=atol)
    for step, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs)):
        want = reference[num_prompt - 1 + step]
        assert token == int(want.argmax())
        ours = torch.tensor(list(entry.values()))
        torch.testing.assert_close(ours, want[list(entry.keys())], atol=atol, rtol=1e-4)


@torch.no_grad()
def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-softmax that scores prompt[i + 1]."""
    logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(
    out, prompt: list[int], reference: torch.Tensor, k: int, atol: float = 2e-4
) -> None:
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None
    for i, entry in enumerate(entries[1:]):
        want = reference[i]
        top_ids = set(want.topk(k).indices.tolist()) if k else set()
        # The actual token, plus the top k (which may include it).
        assert prompt[i + 1] in entry
        assert len(entry) == len(top_ids | {prompt[i + 1]}) or _near_tie(want, k)
        ours = torch.tensor(list(entry.values()))
        theirs = want[list(entry.keys())]
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=1e-4)


def _near_tie(logprobs: torch.Tensor, k: int) -> bool:
    """Whether the k-th and (k+1)-th best are within rounding, so the top-k set may differ."""
    values = logprobs.topk(k + 1).values
    return bool(values[k - 1] - values[k] < 1e-4)


def assert_logprobs_match(hf, engine, prompts: list[list[int]], num_tokens: int) -> None:
    """Greedy tokens equal HF's, and every step's full log-softmax to fp32 rounding."""
    from tokenmill.engine.types.sampling_params import SamplingParams

    vocab = hf.config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=vocab)
    for prompt, out in zip(prompts, run_all(engine, prompts, params)):
        ref_tokens, ref_logprobs = hf_greedy(hf, prompt, num_tokens)
        assert out.token_ids == ref_tokens
        for step, entry in enumerate(out.outputs[0].logprobs):
            ours = torch.tensor([entry[t] for t in range(vocab)])
            torch.testing.assert_close(ours, ref_logprobs[step], atol=2e-4, rtol=1e-4)


def save_char_tokenizer(out_dir: Path, vocab_size: int = 256, eos_token: str | None = None) -> None:
    """A tokenizer where every id is one distinct printable character.

    Random-weight models then decode to clean text, so stop strings and detokenization
    can be tested exactly.
    """
    import json

    from tokenizers import Tokenizer, decoders, models

    chars = [chr(ord("a") + i) for i in range(26)] + [chr(ord("A") + i) for i in range(26)]
    chars += [chr(0x4E00 + i) for i in range(vocab_size - len(chars))]
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "eos_token": eos_token,
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def make_engine(model_dir: Path, **config):
    """A small fp32 CPU engine over model_dir (block_size 4 so block edges are exercised)."""
    from tokenmill.engine.api.llm import build_engine
    from tokenmill.engine.loader.tokenizer import Tokenizer
    from tokenmill.engine.types.config import EngineConfig

    settings = dict(block_size=4, kv_cache_memory=8 << 20, max_num_batched_tokens=64)
    settings.update(config)
    has_tokenizer = (Path(model_dir) / "tokenizer.json").exists()
    return build_engine(
        model_dir,
        EngineConfig(**settings),
        dtype=torch.float32,
        device=torch.device("cpu"),
        tokenizer=Tokenizer.from_dir(model_dir) if has_tokenizer else None,
    )


def run_all(engine, prompts, params) -> list:
    """Add every prompt (one SamplingParams for all, or one each), step to the end."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    outputs = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id] = out
    return [outputs[str(i)] for i in range(len(prompts))]


def run_token_prompts_as_job(
    model_dir: Path, prompts: list[list[int]], out: Path
) -> list[list[dict]]:
    """Run token prompts through `run_job` as a raw-text Parquet job (a character
    tokenizer: each row's text is its tokens), 8 tokens each with ignore_eos and 3
    log-probs, in a small chunked cache; returns each row's result in prompt order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill.engine.loader.tokenizer import Tokenizer
    from tokenmill.pipelines.job import run_job
    from tokenmill.pipelines.output import read_results

    tokenizer = Tokenizer.from_dir(model_dir)
    texts = [tokenizer.decode(p) for p in prompts]
    assert [tokenizer.encode(t) for t in texts] == prompts
    source = out.with_name(out.name + "-in.parquet")
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(texts))], "text": texts}), source)
    run_job(
        str(source),
        str(out),
        model=str(model_dir),
        prompt_column="text",
        id_column="id",
        raw=True,
        max_tokens=8,
        ignore_eos=True,
        logprobs=3,
        dtype="float32",
        engine_options={"kv_cache_memory": 8 << 20, "block_size": 4, "max_num_batched_tokens": 16},
    )
    rows = {r["id"]: r for r in read_results(str(out)).to_pylist()}
    assert len(rows) == len(prompts)
    return [rows[f"r{i}"] for i in range(len(prompts))]
