"""GGUF tokenizer metadata -> a `tokenizers.Tokenizer` and the HF tokenizer files.

Two kinds of GGUF vocabulary are rebuilt: byte-level BPE (`tokenizer.ggml.model = gpt2`:
SmolLM, Llama 3, Qwen) and SentencePiece BPE (`llama`: Llama 2, Mistral, Gemma), each so
that it encodes as the model's own tokenizer does.
"""

from __future__ import annotations

from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.models import BPE

_SPACE = "\u2581"  # SentencePiece's visible space, "▁"
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> (split digits one by one first, split regex), following llama.cpp's
# llama-vocab.cpp. The digit-first group is how SmolLM/StarCoder were trained (their original
# tokenizer.json has a `Digits` pre-tokenizer); transformers' GGUF loader skips that step,
# which changes the ids of a whitespace run followed by a digit ("a  2").
_PRE_TOKENIZERS = {
    **dict.fromkeys(["gpt-2", "mpt", "olmo", "jais", "phi-2"], (False, _GPT2_SPLIT)),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"],
        (True, _GPT2_SPLIT),
    ),
    **dict.fromkeys(
        ["llama-bpe", "llama3", "smaug-bpe", "falcon3", "dbrx"], (False, _LLAMA3_SPLIT)
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], (False, _QWEN2_SPLIT)),
}


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """Rebuild the GGUF's vocabulary as a `tokenizers.Tokenizer`.

    Args:
        meta: the GGUF metadata (`gguf_convert.read_metadata`).

    Returns:
        The tokenizer, adding BOS/EOS as the file declares.
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(meta)
    elif kind == "llama":
        tokenizer = _sentencepiece_bpe(meta)
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer {kind!r}; supported: 'gpt2' (byte-level BPE) and "
            "'llama' (SentencePiece BPE)"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    # Control tokens are special (skipped when decoding); user-defined ones, like `<think>` or
    # Gemma's newline runs, are plain added tokens. Both are matched whole in raw text.
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, token_types)
            if k == _CONTROL
        ]
    )
    # A SentencePiece token respelled with "▁" stays out: the normalizer spells text that way.
    vocab = tokenizer.get_vocab()
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, token_types)
            if k == _USER_DEFINED and (kind == "gpt2" or t in vocab)
        ]
    )
    processor = _post_processor(meta, tokens)
    if processor is not None:
        tokenizer.post_processor = processor
    elif kind == "gpt2":
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _byte_level_bpe(meta: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE model, pre-tokenizer and decoder (SmolLM, Llama 3, Qwen)."""
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"unsupported tokenizer.ggml.pre {pre!r}; supported: {sorted(_PRE_TOKENIZERS)}"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    byte_chars = bytes_to_unicode()
    alphabet = set(byte_chars.values())
    vocab = {}
    for index, (token, token_type) in enumerate(zip(tokens, token_types)):
        # llama.cpp stores ordinary tokens in the byte-to-unicode spelling already; the odd one
        # written as raw text is respelled so BPE can reach it. Control tokens stay verbatim.
        if token_type != _CONTROL and not set(token) <= alphabet:
            token = "".join(byte_chars[b] for b in token.encode("utf-8"))
        vocab[token] = index
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))

    split_digits, split_regex = _PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    if split_regex == _GPT2_SPLIT:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(split_regex), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(meta: dict[str, Any]) -> Tokenizer:
    """SentencePiece BPE as a `tokenizers` BPE with byte fallback (Llama 2, Mistral, Gemma).

    Spaces become U+2581 ("▁"); characters outside the vocabulary fall back to their UTF-8
    bytes (`<0x41>` tokens). A GGUF keeps no merges for these vocabularies, so they are
    recovered from the tokens: every split of a token into two tokens is a merge, ranked by
    the token's score - or, for Gemma, whose scores do not follow its merge order, by the
    token's position in the file. Llama-style vocabularies put "▁" before the text (only
    before the first piece between added tokens); Gemma's do not.
    """
    tokens = list(meta["tokenizer.ggml.tokens"])
    is_gemma = meta.get("general.architecture") in _GEMMA_ARCHITECTURES
    if is_gemma:
        # Gemma files store the tokens that are runs of spaces as spaces; the vocabulary
        # the model learned spells them with "▁", which is what the normalizer produces.
        tokens = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = {token: -index for index, token in enumerate(tokens)}
    else:
        scores = dict(zip(tokens, meta["tokenizer.ggml.scores"]))
    vocab = {token: index for index, token in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges_from_vocab(vocab, scores),
            unk_token=tokens[unk_id] if is_gemma and unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if is_gemma:
        tokenizer.normalizer = normalizers.Replace(" ", _SPACE)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPACE, prepend_scheme="first", split=False
        )
        steps.append(decoders.Strip(" ", 1, 0))  # the space the pre-tokenizer put first
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: each way of cutting a token into two tokens.

    Args:
        vocab: token -> id.
        scores: token -> rank score, higher merges first; its order is the tie-break order.

    Returns:
        (left, right) pairs, best first: by the merged token's score, then longer left
        parts, then longer right parts; pairs of one token by the ids of their parts.
    """
    ranked = []
    for token, score in scores.items():
        cuts = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab]
        cuts = sorted(
            ((left, right) for left, right in cuts if right in vocab),
            key=lambda pair: (vocab[pair[0]], vocab[pair[1]]),
        )
        ranked += [(-score, -len(left), -len(right), left, right) for left, right in cuts]
    # sorted() is stable, so pairs with equal keys keep the order they were found in.
    ranked.sort(key=lambda entry: entry[:3])
    return [(left, right) for *_, left, right in ranked]


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    """Add BOS/EOS around encoded text exactly when the GGUF asks for it (None: neither)."""
    bos_id, eos_id = (
        meta.get("tokenizer.ggml.bos_token_id"),
        meta.get("tokenizer.ggml.eos_token_id"),
    )
    add_bos = _add_bos(meta) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if not (add_bos or add_eos):
        return None
    before = [f"{tokens[bos_id]}:0"] if add_bos else []
    after = [f"{tokens[eos_id]}:0"] if add_eos else []
    specials = [(tokens[i], i) for i, wanted in ((bos_id, add_bos), (eos_id, add_eos)) if wanted]
    return processors.TemplateProcessing(
        single=" ".join([*before, "$A:0", *after]),
        pair=" ".join([*before, "$A:0", *after, *before, "$B:1", *after]),
        special_tokens=specials,
    )


def _add_bos(meta: dict[str, Any]) -> bool:
    # Files without the flag: llama.cpp adds BOS for sentencepiece vocabularies only.
    return bool(
        meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama")
    )


def build_tokenizer_config(meta: dict[str, Any]) -> dict:
    """The HF `tokenizer_config.json`: special tokens, BOS/EOS flags and the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": _add_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get(f"{meta['general.architecture']}.context_length"),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def build_generation_config(meta: dict[str, Any]) -> dict:
    """The HF `generation_config.json`; every end-of-turn id the GGUF names is an EOS id."""
    eos_ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        index = meta.get(f"tokenizer.ggml.{key}")
        if index is not None and index not in eos_ids:
            eos_ids.append(index)
    config = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id")}
    config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return config


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    # The remaining bytes (controls, space, ...) get code points from 256 upwards, in order.
    shifted = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return dict(sorted(mapping.items()))
