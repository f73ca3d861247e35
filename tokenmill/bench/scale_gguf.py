"""The GGUF of a random-weight scale model (scale_build.py), for llama.cpp: the same
values as its safetensors checkpoint, written tensor by tensor with the `gguf` package.

Formats: F32 and BF16 as they are, Q8_0 and Q4_0 quantized by `gguf.quants` (numpy,
block by block, a chunk of whole rows at a time). Norms and the MoE router stay F32, as
llama.cpp's own converter keeps them. The layout is llama.cpp's for its `llama`
(Mixtral too: a llama with experts), `qwen2`, `olmoe` and `qwen3moe` architectures:
llama's q/k rows reordered as its converter does (rotary pairs interleaved rather than
split in halves), Llama 3's rope scaling as a `rope_freqs` tensor. A mixture-of-experts layer's per-expert projections
are written as one stacked tensor per projection (`ffn_gate_exps`, `ffn_up_exps`,
`ffn_down_exps`: [experts, out, in] in torch's order), expert after expert, each
expert's rows in chunks - the stack is never in memory. A MoE config llama.cpp's graph
cannot run as transformers does (OLMoE's `clip_qkv`, Qwen3-MoE's dense layers or
unrenormalised top-k) is refused by name.

The vocabulary is the model directory's tokenizer (the embedded default model's
byte-level BPE), padded with unused tokens up to the shape's vocabulary size, as
llama.cpp's converter pads a vocabulary smaller than the embedding.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tokenmill.bench.scale_build import tensor_chunks
from tokenmill.bench.scale_shapes import (
    GGUF_FORMATS,
    SCALE_RECORD,
    TensorSpec,
    checkpoint_tensors,
)

# model_type -> llama.cpp's architecture (Mixtral is its llama with experts).
_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "olmoe": "olmoe",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
}
# HF name parts -> llama.cpp's, per layer (blk.N.) or whole-model.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp",  # the MoE router
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's
}
# One expert's projection in a checkpoint; a GGUF stacks each projection's experts.
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
# An expert's projection by its checkpoint name (Mixtral's w1, w3, w2) -> llama.cpp's.
_PROJECTIONS = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}
_MODEL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def scale_gguf_path(model_dir: str | os.PathLike, fmt: str | None = None) -> Path:
    """The scale model's GGUF in `fmt` (None: the checkpoint's own precision), written
    beside its checkpoint on first use (complete, or not at all)."""
    model_dir = Path(model_dir)
    if fmt is None:
        dtype = json.loads((model_dir / "config.json").read_text())["torch_dtype"]
        fmt = "BF16" if dtype == "bfloat16" else "F32"
    path = model_dir / f"model.{fmt}.gguf"
    if not path.is_file():
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            write_scale_gguf(model_dir, fmt, partial)
            partial.rename(path)
        finally:
            partial.unlink(missing_ok=True)
    return path


def write_scale_gguf(model_dir: str | os.PathLike, fmt: str, out: str | os.PathLike) -> Path:
    """Write the GGUF of the scale model in `model_dir` (built by build_scale_model) in
    llama.cpp format `fmt`; the directory's config and build record fix every value.

    Raises:
        ValueError: a format outside GGUF_FORMATS, an architecture llama.cpp's layout is not
            written for here, or a directory build_scale_model did not make.
    """
    import gguf

    if fmt not in GGUF_FORMATS:
        raise ValueError(f"unknown GGUF format {fmt!r}; choose from {', '.join(GGUF_FORMATS)}")
    model_dir = Path(model_dir)
    record = model_dir / SCALE_RECORD
    if not record.is_file():
        raise ValueError(f"{model_dir} is not a scale model (no {record.name})")
    config = json.loads((model_dir / "config.json").read_text())
    arch = _ARCHITECTURES.get(config["model_type"])
    if arch is None:
        raise ValueError(
            f"no GGUF layout for {config['model_type']} here; written for "
            f"{', '.join(_ARCHITECTURES)}"
        )
    _check_llama_cpp_runs(config)
    seed = json.loads(record.read_text())["seed"]
    dtype = torch.bfloat16 if config["torch_dtype"] == "bfloat16" else torch.float32
    tensors = _gguf_tensors(config)
    out = Path(out)
    writer = gguf.GGUFWriter(str(out), arch)
    _add_metadata(writer, config, fmt)
    _add_tokenizer(writer, model_dir, config)
    rope_freqs = _llama3_rope_factors(config)
    if rope_freqs is not None:
        writer.add_tensor_info("rope_freqs.weight", rope_freqs.shape, np.float32, rope_freqs.nbytes)
    types = {tensor.name: _tensor_type(tensor, fmt) for tensor in tensors}
    for tensor in tensors:
        qtype = types[tensor.name]
        byte_shape = gguf.quants.quant_shape_to_byte_shape(tensor.shape, qtype)
        nbytes = _numel(byte_shape)
        writer.add_tensor_info(tensor.name, byte_shape, np.uint8, nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if rope_freqs is not None:
        writer.write_tensor_data(rope_freqs)
    for tensor in tensors:
        _write_tensor(writer, _encoded_chunks(tensor, config, dtype, seed, types[tensor.name]))
    writer.close()
    return out


@dataclass(frozen=True)
class _GGUFTensor:
    """One tensor of the file: llama.cpp's name, its shape in torch's order, and the
    checkpoint tensors whose rows it holds in order (one, or a layer's experts)."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[TensorSpec, ...]


def _gguf_tensors(config: dict) -> list[_GGUFTensor]:
    """The file's tensors in checkpoint order; each layer's experts stacked per projection
    where its first expert stood."""
    groups: dict[str, list[TensorSpec]] = {}
    for spec in checkpoint_tensors(config):
        match = _EXPERT.fullmatch(spec.name)
        if match is None:
            groups[_gguf_name(spec.name)] = [spec]
            continue
        layer, expert, projection = match.groups()
        stack = groups.setdefault(f"blk.{layer}.ffn_{_PROJECTIONS[projection]}_exps.weight", [])
        if int(expert) != len(stack):  # a stack's index is the expert's id
            raise AssertionError(f"{spec.name} is not expert {len(stack)} of its stack")
        stack.append(spec)
    return [
        _GGUFTensor(
            name,
            (len(parts), *parts[0].shape) if name.endswith("_exps.weight") else parts[0].shape,
            tuple(parts),
        )
        for name, parts in groups.items()
    ]


def _check_llama_cpp_runs(config: dict) -> None:
    """Refuse, by name, a config field whose effect llama.cpp's graph for the
    architecture does not compute (the file would load and run another model)."""
    model_type = config["model_type"]
    refused = []
    scaling = (config.get("rope_scaling") or {}).get("rope_type")
    if scaling is not None and not (scaling == "llama3" and model_type == "llama"):
        refused.append(f"rope_scaling {scaling!r}")
    if model_type == "olmoe":  # llama.cpp's olmoe: no clamp, top-k weights as softmaxed
        if config.get("clip_qkv") is not None:
            refused.append("clip_qkv")
        if config.get("norm_topk_prob"):
            refused.append("norm_topk_prob true")
    if model_type == "mixtral" and config.get("sliding_window") is not None:
        refused.append("sliding_window")  # llama.cpp's llama attends to the whole context
    if model_type == "qwen3_moe":  # llama.cpp's qwen3moe: every layer sparse, renormalised
        if not config.get("norm_topk_prob"):
            refused.append("norm_topk_prob false")
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            refused.append("dense layers (mlp_only_layers / decoder_sparse_step)")
        if config.get("use_sliding_window"):
            refused.append("use_sliding_window")
    if refused:
        raise ValueError(
            f"llama.cpp's {_ARCHITECTURES[model_type]} does not compute {', '.join(refused)}: "
            "no GGUF written for this config"
        )


def _add_metadata(writer, config: dict, fmt: str) -> None:
    import gguf

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_name(f"random {config['architectures'][0]} ({fmt})")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    if num_experts is not None:
        # OLMoE's and Mixtral's experts are intermediate_size wide; Qwen3-MoE's have a
        # size of their own.
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(
            config.get("moe_intermediate_size", config["intermediate_size"])
        )
    writer.add_file_type(_FILE_TYPES[fmt])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


_FILE_TYPES = {"F32": 0, "BF16": 32, "Q8_0": 7, "Q4_0": 2}  # llama.cpp's LLAMA_FTYPE_*


def _add_tokenizer(writer, model_dir: Path, config: dict) -> None:
    """The model directory's byte-level BPE tokenizer (tokenizer.json) as llama.cpp's
    `gpt2` vocabulary, its tokens padded to the shape's vocabulary size."""
    import gguf

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    if tokenizer["model"]["type"] != "BPE":
        raise ValueError(f"{model_dir}: only a BPE tokenizer is written to GGUF here")
    by_id = {i: token for token, i in tokenizer["model"]["vocab"].items()}
    types = dict.fromkeys(by_id, gguf.TokenType.NORMAL)
    for added in tokenizer.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        special = added.get("special")
        types[added["id"]] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    if sorted(by_id) != list(range(len(by_id))):
        raise ValueError(f"{model_dir}: the tokenizer's ids are not 0..{len(by_id) - 1}")
    vocab_size = config["vocab_size"]
    padding = range(len(by_id), vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")  # the default model's pre-tokenizer in llama.cpp
    writer.add_token_list([by_id[i] for i in range(len(by_id))] + [f"[PAD{i}]" for i in padding])
    writer.add_token_types(
        [types[i] for i in range(len(by_id))] + [gguf.TokenType.UNUSED] * len(padding)
    )
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for key, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
    ):
        if config.get(key) is not None:
            add(config[key])
    writer.add_add_bos_token(False)  # as the default model's own GGUF
    template = model_dir / "tokenizer_config.json"
    if template.is_file() and (chat := json.loads(template.read_text()).get("chat_template")):
        writer.add_chat_template(chat)


def _tensor_type(tensor: _GGUFTensor, fmt: str):
    import gguf

    # Norms and biases stay F32, and the router: llama.cpp never quantizes it.
    if len(tensor.shape) == 1 or fmt == "F32" or tensor.name.endswith("ffn_gate_inp.weight"):
        return gguf.GGMLQuantizationType.F32
    return gguf.GGMLQuantizationType[fmt]


def _encoded_chunks(tensor: _GGUFTensor, config: dict, dtype: torch.dtype, seed: int, qtype):
    """The tensor's bytes in GGUF type `qtype`, a chunk of whole rows at a time (a stack:
    expert after expert); llama's q and k whole (their rows are reordered per head)."""
    import gguf

    chunks = (chunk for spec in tensor.parts for chunk in tensor_chunks(spec, dtype, seed))
    permute = _permute_heads(tensor.parts[0].name, config)
    if permute is not None:
        chunks = [permute(torch.cat(list(chunks)))]
    for chunk in chunks:
        if qtype == gguf.GGMLQuantizationType.BF16:
            yield chunk.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
        elif qtype == gguf.GGMLQuantizationType.F32:
            yield chunk.float().numpy().view(np.uint8)
        else:
            yield gguf.quants.quantize(chunk.float().numpy(), qtype)


def _permute_heads(name: str, config: dict):
    """llama.cpp's row order for a llama q/k projection (its converter's `permute`): within
    each head, the rotary pairs interleaved instead of split in halves."""
    if _ARCHITECTURES[config["model_type"]] != "llama":
        return None
    if name.endswith("self_attn.q_proj.weight"):
        num_heads = config["num_attention_heads"]
    elif name.endswith("self_attn.k_proj.weight"):
        num_heads = config["num_key_value_heads"]
    else:
        return None

    def permute(weight: torch.Tensor) -> torch.Tensor:
        rows, columns = weight.shape
        return (
            weight.reshape(num_heads, 2, rows // num_heads // 2, columns)
            .transpose(1, 2)
            .reshape(rows, columns)
        )

    return permute


def _write_tensor(writer, chunks) -> None:
    """gguf's write_tensor_data for a tensor handed over in chunks: the next tensor's
    info taken in order, its start aligned, its bytes, then its padding."""
    fout = writer.fout[0]
    info = writer.tensors[0].pop(next(iter(writer.tensors[0])))
    writer.write_padding(fout, fout.tell())
    written = 0
    for chunk in chunks:
        chunk.tofile(fout)
        written += chunk.nbytes
    if written != info.nbytes:
        raise AssertionError(f"wrote {written} bytes of a {info.nbytes}-byte tensor")
    writer.write_padding(fout, written)


def _llama3_rope_factors(config: dict) -> np.ndarray | None:
    """Llama 3's per-frequency rope factors as llama.cpp reads them (rope_freqs), computed
    as its converter does from the config's rope_scaling."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") != "llama3":
        return None
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * config["rope_theta"] ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _gguf_name(name: str) -> str:
    if name in _MODEL_NAMES:
        return _MODEL_NAMES[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    part, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_LAYER_NAMES[part]}.{kind}"


def _numel(shape) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
