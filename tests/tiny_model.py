"""A tiny random-weight Llama in HF layout, built in a test in about a second.

Everything a real model directory has: config.json, model.safetensors (HF parameter
names), tokenizer.json (a byte-level BPE trained here on a small corpus, with ChatML
special tokens), tokenizer_config.json with a ChatML chat template (or none, for a
base model), and generation_config.json. The weights are random, so outputs are gibberish - but the
engine, tokenizer and pipelines run end to end on it, on CPU, in milliseconds.

The weights are written directly with safetensors (no `transformers` import, which
costs seconds); `build_tiny_model(..., use_transformers=True)` builds the same
layout through `LlamaForCausalLM` for reference checks.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Answer briefly and clearly.",
    "Summarise the following text in one sentence:",
    "What is the capital of France? Paris is the capital of France.",
    "Translate to French: good morning, thank you, see you tomorrow.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "user assistant system question answer prompt output",
]


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE (any text encodes) with ChatML specials as ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def _llama_config(vocab_size: int, max_position_embeddings: int, eos_id: int, bos_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }


def _random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg["head_dim"]
    q_dim = cfg["num_attention_heads"] * head_dim
    kv_dim = cfg["num_key_value_heads"] * head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    weights = {
        "model.embed_tokens.weight": rand(cfg["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(q_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    return weights


def build_tiny_model(
    path: str | Path,
    *,
    max_position_embeddings: int = 256,
    vocab_size: int = 512,
    seed: int = 0,
    use_transformers: bool = False,
    chat_template: str | None = CHATML_TEMPLATE,
) -> Path:
    """Write a tiny random Llama model directory at `path` (created if needed).

    Args:
        path: the directory to write.
        max_position_embeddings: the context length (small, so over-long prompts are cheap).
        vocab_size: BPE vocabulary size to train for.
        seed: weight seed; the same seed gives the same weights.
        use_transformers: build the weights with `transformers.LlamaForCausalLM`.
        chat_template: the template in tokenizer_config.json; None: a model without one
            (a base model, whose prompts run raw).

    Returns:
        The directory.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    tok.save(str(path / "tokenizer.json"))
    bos_id, eos_id = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    cfg = _llama_config(tok.get_vocab_size(), max_position_embeddings, eos_id, bos_id)
    if use_transformers:
        import transformers

        torch.manual_seed(seed)
        hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
        transformers.LlamaForCausalLM(hf_cfg).save_pretrained(path, safe_serialization=True)
    else:
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(_random_weights(cfg, seed), str(path / "model.safetensors"), {"format": "pt"})
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos_id, "eos_token_id": eos_id})
    )
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "chat_template": chat_template,
        "model_max_length": max_position_embeddings,
    }
    if chat_template is None:
        del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path
