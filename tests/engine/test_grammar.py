"""The grammar layer alone: compile cache, bitmask fill and application, constraint keys."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_model import build_tiny_model

from tokenmill.engine.core import grammar
from tokenmill.engine.core.grammar import (
    GrammarCompiler,
    TokenBitmask,
    _closed_objects,
    apply_token_bitmask,
)
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.types.structured_outputs import StructuredOutputs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_dir(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def compiler(tokenizer):
    # A vocabulary wider than the tokenizer's (models pad it) and not a multiple of 32.
    return GrammarCompiler(tokenizer.backend.to_str(), tokenizer.vocab_size + 19, [2])


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    """Reference decoding of one bitmask row, a bit at a time."""
    words = [int(w) & 0xFFFFFFFF for w in bitmask_row.tolist()]
    return {t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1}


def test_apply_token_bitmask_masks_exactly_the_cleared_bits():
    gen = torch.Generator().manual_seed(0)
    vocab, num_rows = 77, 5
    logits = torch.randn(num_rows, vocab, generator=gen)
    rows = [0, 2, 3]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=gen)
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask, rows)
    for i, row in enumerate(rows):
        allowed = allowed_ids(bitmask[i], vocab)
        for t in range(vocab):
            expected = logits[row, t] if t in allowed else float("-inf")
            assert masked[row, t] == expected
    assert torch.equal(masked[[1, 4]], logits[[1, 4]])  # unconstrained rows untouched
    # Every row constrained: the in-place path gives the same rows.
    every_row = logits.clone()
    all_allowed = torch.full((1, 3), -1, dtype=torch.int32)
    full = torch.cat([bitmask[0:1], all_allowed, bitmask[1:3], all_allowed])
    apply_token_bitmask(every_row, full, list(range(num_rows)))
    assert torch.equal(every_row, masked)


def test_bitmask_allows_what_the_grammar_allows(compiler, tokenizer):
    vocab = compiler.vocab_size
    choice = compiler.compile(StructuredOutputs(choice=["red", "green"])).new_matcher()
    done = compiler.compile(StructuredOutputs(choice=["red", "green"])).new_matcher()
    for token_id in tokenizer.encode("red", add_special_tokens=False):
        assert done.accept(token_id)
    assert done.is_complete and done.is_accepting
    filled = TokenBitmask([choice, None, done], vocab, overlap=False)
    assert filled.rows == [0, 2]
    first = allowed_ids(filled.wait()[0], vocab)
    decoded = {tokenizer.decode([t]) for t in first}
    assert decoded and all("red".startswith(d) or "green".startswith(d) for d in decoded)
    assert allowed_ids(filled.wait()[1], vocab) == {2}  # complete: EOS only
    # Filled in the worker thread: the same bits.
    overlapped = TokenBitmask([choice, None, done], vocab, overlap=True)
    assert torch.equal(overlapped.wait(), filled.wait())
    # A matcher refusing a token allows nothing but EOS afterwards.
    broken = compiler.compile(StructuredOutputs(regex="[0-9]+")).new_matcher()
    assert not broken.accept(tokenizer.encode("abc", add_special_tokens=False)[0])
    assert allowed_ids(TokenBitmask([broken], vocab, overlap=False).wait()[0], vocab) == {2}
    assert not broken.is_accepting


def test_each_constraint_compiles_once_per_content(compiler, tokenizer, monkeypatch):
    calls = []
    real = GrammarCompiler._compile
    monkeypatch.setattr(
        GrammarCompiler, "_compile", lambda self, c: calls.append(c.key) or real(self, c)
    )
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    first = compiler.compile(StructuredOutputs(json=schema))
    # The same content as a string, through another compiler for the same tokenizer: cached.
    again = GrammarCompiler(tokenizer.backend.to_str(), compiler.vocab_size, [2]).compile(
        StructuredOutputs(
            json='{"type": "object", "properties": '
            '{"b": {"type": "integer"}, "a": {"type": "string"}}}'
        )  # fmt: skip
    )
    assert again is first and len(calls) == 1
    # Property order is part of the output, so a reordered schema is another grammar.
    reordered = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
    }
    assert compiler.compile(StructuredOutputs(json=reordered)) is not first
    # Another tokenizer (here: another EOS) never shares compiled grammars.
    other_eos = GrammarCompiler(tokenizer.backend.to_str(), compiler.vocab_size, [1])
    assert other_eos.compile(StructuredOutputs(json=schema)) is not first
    assert len(calls) == 3


def test_compile_cache_is_bounded_and_thread_safe(compiler, monkeypatch):
    monkeypatch.setattr(grammar, "MAX_COMPILED", 8)
    regexes = [f"[a-z]{{{n}}}" for n in range(1, 25)]
    errors = []

    def work(offset: int) -> None:
        try:
            for regex in regexes[offset:] + regexes[:offset]:
                compiler.compile(StructuredOutputs(regex=regex)).new_matcher()
        except Exception as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i * 6,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(grammar._COMPILED) <= 8


def test_constraint_keys_and_shapes():
    a = StructuredOutputs(json={"type": "integer"})
    assert a == StructuredOutputs(json='{"type": "integer"}') and hash(a) == hash(
        StructuredOutputs(json='{"type":"integer"}')
    )
    assert a != StructuredOutputs(json={"type": "integer"}, disable_any_whitespace=False)
    assert StructuredOutputs(choice=("x", "y")).choice == ["x", "y"]
    assert StructuredOutputs(json_object=True).kind == "json_object"
    assert StructuredOutputs(grammar='start: "a"').kind == "grammar"
    assert _closed_objects(
        {"type": "object", "properties": {"n": {"properties": {"m": {}}}}, "items": [{}]}
    ) == {
        "type": "object",
        "properties": {"n": {"properties": {"m": {}}, "additionalProperties": False}},
        "items": [{}],
        "additionalProperties": False,
    }
    explicit = {"type": "object", "additionalProperties": True}
    assert _closed_objects(explicit) == explicit
