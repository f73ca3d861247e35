"""Texts and (query, document) pairs -> token ids for pooling, cut as sentence-transformers
cuts them.

sentence-transformers tokenizes with truncation at the model's `max_seq_length`
("longest_first", from the right, special tokens kept: "[CLS] ... [SEP]" stays whole),
after lowercasing when its config says `do_lower_case`. The same cut is made here,
through the `tokenizers` library's own truncation on a copy of the model's tokenizer,
and each text says whether it was cut (`EncodedText.truncated`). With `truncate=False`
nothing is cut and an over-long text is an error instead.

A pair is laid out by the tokenizer's pair template ("[CLS] query [SEP] document
[SEP]"); the encoder reads the tokens after the first separator as the second segment
(`worker/encoder_runner.py`), so a query that itself encodes to the separator (the
literal text "[SEP]") is an error rather than a pair silently split in the wrong place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer as BackendTokenizer

from tokenmill.engine.loader.tokenizer import Tokenizer


@dataclass(frozen=True)
class EncodedText:
    """One text (or pair) as token ids, or why it cannot be pooled."""

    token_ids: list[int] | None
    truncated: bool = False
    error: str | None = None


class PoolingTokenizer:
    """Encodes texts for a pooling model.

    Args:
        tokenizer: the model's tokenizer.
        max_length: texts are cut to this many tokens (sentence-transformers'
            max_seq_length, else the model's context).
        lowercase: lowercase texts first (sentence-transformers' do_lower_case).
    """

    def __init__(self, tokenizer: Tokenizer, *, max_length: int, lowercase: bool = False) -> None:
        self.max_length = max_length
        self.lowercase = lowercase
        self._plain = tokenizer.backend
        self._cutting = BackendTokenizer.from_str(self._plain.to_str())
        self._cutting.no_padding()
        self._cutting.enable_truncation(max_length, strategy="longest_first")
        self.pair_separator_id = pair_separator_id(self._plain)

    def encode(self, texts: Sequence[str], *, truncate: bool = True) -> list[EncodedText]:
        """Token ids of each text, cut to max_length (or refused, without `truncate`)."""
        texts = [t.lower() if self.lowercase else t for t in texts]
        if not texts:
            return []
        return self._encoded(self._backend(truncate).encode_batch_fast(texts), truncate)

    def encode_pairs(
        self, queries: Sequence[str], documents: Sequence[str], *, truncate: bool = True
    ) -> list[EncodedText]:
        """Token ids of each (query, document) pair by the pair template, cut to
        max_length longest-first (or refused, without `truncate`)."""
        if len(queries) != len(documents):
            raise ValueError(f"{len(queries)} queries for {len(documents)} documents")
        if self.lowercase:
            queries = [q.lower() for q in queries]
            documents = [d.lower() for d in documents]
        if not queries:
            return []
        pairs = list(zip(queries, documents))
        encoded = self._encoded(self._backend(truncate).encode_batch_fast(pairs), truncate)
        separator = self.pair_separator_id
        if separator is None:
            return encoded
        query_ids = self._plain.encode_batch_fast(list(queries), add_special_tokens=False)
        return [
            EncodedText(None, error="the query holds the tokenizer's pair separator token")
            if e.token_ids is not None and separator in q.ids
            else e
            for e, q in zip(encoded, query_ids)
        ]

    def _backend(self, truncate: bool) -> BackendTokenizer:
        return self._cutting if truncate else self._plain

    def _encoded(self, encodings, truncate: bool) -> list[EncodedText]:
        out = []
        for e in encodings:
            if truncate:
                out.append(EncodedText(e.ids, truncated=bool(e.overflowing)))
            elif len(e.ids) > self.max_length:
                out.append(
                    EncodedText(
                        None,
                        error=f"text is {len(e.ids)} tokens, longer than the model's "
                        f"max_seq_length of {self.max_length} (truncation is off)",
                    )
                )
            else:
                out.append(EncodedText(e.ids))
        return out


def pair_separator_id(backend: BackendTokenizer) -> int | None:
    """The special token the pair template puts between a pair's two segments (BERT's
    [SEP]), or None when the template has no second segment."""
    probe = backend.encode("a", "b")
    types = probe.type_ids
    if 1 not in types:
        return None
    first_b = types.index(1)
    return probe.ids[first_b - 1] if first_b > 0 else None
