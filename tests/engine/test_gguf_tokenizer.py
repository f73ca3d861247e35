"""SentencePiece GGUF vocabularies (Llama 2 / Mistral and Gemma rules) encode and decode as
transformers' tokenizer for the same GGUF does (transformers 5 reads `gguf_file=`)."""

from __future__ import annotations

import json

import pytest
from gguf import GGUFReader
from model_fixtures import write_sentencepiece_gguf

from tokenmill.engine.loader.gguf_convert import read_metadata
from tokenmill.engine.loader.gguf_tokenizer import (
    build_generation_config,
    build_tokenizer,
    build_tokenizer_config,
    merges_from_vocab,
)
from tokenmill.engine.loader.tokenizer import Tokenizer

TRICKY = [
    "Hello world",
    " leading space",
    "  two leading spaces",
    "trailing  ",
    "a  b   c    d     e",
    "tabs\tand\nnewlines\n\n\nx",
    "digits 1234567890 3.14159 1,000,000 2024-01-01",
    "unicode: héllo wörld naïve café 日本語のテキスト Привет مرحبا",
    "emoji 🤖🚀 family 👨‍👩‍👧‍👦 math ∑∫√",
    "<s>specials</s> <bos>in<eos> text <start_of_turn>user",
    "\x00\x01 control bytes \x7f",
    "CRLF\r\nline",
    "    def f():\n        return 1\n",
    "▁ a literal U+2581",
    "",
    " ",
    "\n",
    "the theory of the thing " * 40,
]


def _ours_and_reference(tmp_path, architecture):
    transformers = pytest.importorskip("transformers")
    path = write_sentencepiece_gguf(tmp_path / f"{architecture}.gguf", architecture=architecture)
    meta = read_metadata(GGUFReader(path))
    tokenizer = build_tokenizer(meta)
    # Through the files a conversion writes and the engine's own Tokenizer.
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(build_tokenizer_config(meta)))
    (tmp_path / "generation_config.json").write_text(json.dumps(build_generation_config(meta)))
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    return Tokenizer.from_dir(tmp_path), reference


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_sentencepiece_encodes_and_decodes_as_transformers(tmp_path, architecture):
    ours, reference = _ours_and_reference(tmp_path, architecture)
    for text in TRICKY:
        expected = reference(text)["input_ids"]
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == reference.decode(expected, skip_special_tokens=True)
    assert ours.encode_batch(TRICKY) == [reference(t)["input_ids"] for t in TRICKY]


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_byte_fallback_bos_and_specials(tmp_path, architecture):
    ours, _ = _ours_and_reference(tmp_path, architecture)
    vocab = ours.backend.get_vocab()
    bos = "<bos>" if architecture == "gemma3" else "<s>"
    ids = ours.encode("日")  # not in the vocabulary: its three UTF-8 bytes
    assert ids[0] == vocab[bos] == ours.bos_token_id
    assert ids[-3:] == [vocab[f"<0x{b:02X}>"] for b in "日".encode()]
    assert ours.decode(ids) == "日"
    eos = "<eos>" if architecture == "gemma3" else "</s>"
    assert ours.encode(f"a{eos}", add_special_tokens=False)[-1] == vocab[eos]
    assert ours.eos_token_ids == [vocab[eos]]


def test_gemma_whitespace_runs_use_the_vocabulary_spelling(tmp_path):
    ours, _ = _ours_and_reference(tmp_path, "gemma3")
    vocab = ours.backend.get_vocab()
    # Stored as real spaces in the file; the model knows them as "▁▁▁".
    assert vocab["\u2581" * 3] == 6 + 4
    assert ours.encode("a   b", add_special_tokens=False)[1] == vocab["\u2581" * 3]
    assert ours.encode("\n\n", add_special_tokens=False) == [vocab["\n\n"]]


def test_merges_rank_by_score_then_longer_left_part():
    vocab = {"a": 0, "b": 1, "ab": 2, "abb": 3, "bb": 4}
    scores = {"ab": -1.0, "abb": -2.0, "bb": -0.5, "a": -9.0, "b": -9.0}
    assert merges_from_vocab(vocab, scores) == [("b", "b"), ("a", "b"), ("ab", "b"), ("a", "bb")]


@pytest.mark.slow
def test_gemma3_270m_vocabulary_encodes_as_transformers():
    """The real 262,144-token Gemma 3 vocabulary, on the same tricky text."""
    transformers = pytest.importorskip("transformers")
    from tokenmill.engine.loader.model_files import ALIASES, alias_gguf_path

    path = alias_gguf_path(ALIASES["gemma3-270m"])
    ours = build_tokenizer(read_metadata(GGUFReader(path)))
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TRICKY:
        assert ours.encode(text).ids == reference(text)["input_ids"], text
