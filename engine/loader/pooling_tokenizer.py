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
literal text "[SEP]" where special tokens are allowed) is an error rather than a pair
silently split in the wrong place.

Texts are data: a special-token string inside one is encoded as plain text where its
spans are given (`data_spans`; `SpecialText.find` for a whole text). Those few texts are
encoded without the library's truncation and cut here, by its rules (`longest_first`):
the tokenizer's added tokens (the template's "[CLS]", "[SEP]") kept, the text's cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from tokenizers import Tokenizer as BackendTokenizer

from tokenmill.engine.loader.special_text import Spans, SpecialText
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
        self._tokenizer = tokenizer
        self._plain = tokenizer.backend
        self._cutting = BackendTokenizer.from_str(self._plain.to_str())
        self._cutting.no_padding()
        self._cutting.enable_truncation(max_length, strategy="longest_first")
        self.pair_separator_id = pair_separator_id(self._plain)

    @property
    def special_text(self) -> SpecialText:
        """The model's special-token strings (`find` gives a text's data spans)."""
        return self._tokenizer.special_text

    def encode(
        self,
        texts: Sequence[str],
        *,
        truncate: bool = True,
        data_spans: Sequence[Spans] | None = None,
    ) -> list[EncodedText]:
        """Token ids of each text, cut to max_length (or refused, without `truncate`).

        Args:
            texts: the texts.
            truncate: cut over-long texts (False: they are errors).
            data_spans: per text, spans of special-token strings to encode as plain text
                (None: every special string becomes its token). Lowercasing keeps them.
        """
        if not texts:
            return []
        spans = list(data_spans) if data_spans is not None else [()] * len(texts)
        texts, spans = self._lowercased(texts, spans)
        plain = [i for i, s in enumerate(spans) if not s]
        out: list[EncodedText | None] = [None] * len(texts)
        if plain:
            encoded = self._backend(truncate).encode_batch_fast([texts[i] for i in plain])
            for i, e in zip(plain, self._encoded(encoded, truncate)):
                out[i] = e
        spanned = [i for i, s in enumerate(spans) if s]
        if spanned:
            contents = self._tokenizer.special_text.encode_batch(
                [texts[i] for i in spanned], [spans[i] for i in spanned], False
            )
            for i, content in zip(spanned, contents):
                out[i] = self._laid_out([content], truncate)
        return out

    def encode_pairs(
        self,
        queries: Sequence[str],
        documents: Sequence[str],
        *,
        truncate: bool = True,
        query_spans: Sequence[Spans] | None = None,
        document_spans: Sequence[Spans] | None = None,
    ) -> list[EncodedText]:
        """Token ids of each (query, document) pair by the pair template, cut to
        max_length longest-first (or refused, without `truncate`); spans as for `encode`."""
        if len(queries) != len(documents):
            raise ValueError(f"{len(queries)} queries for {len(documents)} documents")
        if not queries:
            return []
        n = len(queries)
        queries, q_spans = self._lowercased(
            queries, list(query_spans) if query_spans is not None else [()] * n
        )
        documents, d_spans = self._lowercased(
            documents, list(document_spans) if document_spans is not None else [()] * n
        )
        plain = [i for i in range(n) if not q_spans[i] and not d_spans[i]]
        out: list[EncodedText | None] = [None] * n
        if plain:
            pairs = [(queries[i], documents[i]) for i in plain]
            encoded = self._encoded(self._backend(truncate).encode_batch_fast(pairs), truncate)
            for i, e in zip(plain, encoded):
                out[i] = e
        spanned = [i for i in range(n) if q_spans[i] or d_spans[i]]
        if spanned:
            special = self._tokenizer.special_text
            texts = [queries[i] for i in spanned] + [documents[i] for i in spanned]
            contents = special.encode_batch(
                texts, [q_spans[i] for i in spanned] + [d_spans[i] for i in spanned], False
            )
            half = len(spanned)
            for k, i in enumerate(spanned):
                out[i] = self._laid_out([contents[k], contents[half + k]], truncate)
        separator = self.pair_separator_id
        if separator is None:
            return out
        query_ids = self._tokenizer.encode_batch(
            list(queries), add_special_tokens=False, data_spans=q_spans
        )
        return [
            EncodedText(None, error="the query holds the tokenizer's pair separator token")
            if e.token_ids is not None and separator in q
            else e
            for e, q in zip(out, query_ids)
        ]

    def _lowercased(
        self, texts: Sequence[str], spans: list[Spans]
    ) -> tuple[list[str], list[Spans]]:
        """The texts lowercased when the model says so, each data span moved with its text
        (and dropped where its string, lowercased, is no special string any more)."""
        if not self.lowercase:
            return list(texts), spans
        strings = set(self._tokenizer.special_text.strings)
        out_texts, out_spans = [], []
        for text, text_spans in zip(texts, spans):
            pieces, kept, last, length = [], [], 0, 0
            for start, end in text_spans:
                before, string = text[last:start].lower(), text[start:end].lower()
                length += len(before)
                if string in strings:
                    kept.append((length, length + len(string)))
                pieces += [before, string]
                length += len(string)
                last = end
            pieces.append(text[last:].lower())
            out_texts.append("".join(pieces))
            out_spans.append(tuple(kept))
        return out_texts, out_spans

    def _backend(self, truncate: bool) -> BackendTokenizer:
        return self._cutting if truncate else self._plain

    def _encoded(self, encodings, truncate: bool) -> list[EncodedText]:
        out = []
        for e in encodings:
            if truncate:
                out.append(EncodedText(e.ids, truncated=bool(e.overflowing)))
            else:
                out.append(self._checked(e.ids))
        return out

    def _checked(self, ids: list[int]) -> EncodedText:
        """`ids` uncut, or the error of a text too long for max_length."""
        if len(ids) > self.max_length:
            return EncodedText(
                None,
                error=f"text is {len(ids)} tokens, longer than the model's "
                f"max_seq_length of {self.max_length} (truncation is off)",
            )
        return EncodedText(ids)

    def _laid_out(self, contents: list[list[int]], truncate: bool) -> EncodedText:
        """One text's (or pair's) content ids cut as the library cuts them, between the
        tokens the tokenizer adds around them."""
        layout = self._layouts[len(contents) - 1]
        cut = contents
        if truncate:
            budget = max(0, self.max_length - sum(len(part) for part in layout))
            cut = longest_first(contents, budget)
        ids = list(layout[0])
        for part, after in zip(cut, layout[1:]):
            ids += part + after
        if not truncate:
            return self._checked(ids)
        return EncodedText(ids, truncated=cut != contents)

    @cached_property
    def _layouts(self) -> tuple[tuple[list[int], ...], ...]:
        """The ids the tokenizer adds around one text and around a pair: (before, after)
        and (before, between, after)."""
        return (_added_around(self._plain, 1), _added_around(self._plain, 2))


def longest_first(contents: list[list[int]], budget: int) -> list[list[int]]:
    """One text or a pair cut to `budget` ids in all, as `tokenizers` cuts them
    ("longest_first", from the right): a pair keeps its shorter part whole where the
    longer one can give up enough, else both are cut to half the budget each."""
    if sum(len(part) for part in contents) <= budget:
        return contents
    if len(contents) == 1:
        return [contents[0][:budget]]
    first, second = contents
    shorter, longer = sorted((len(first), len(second)))
    keep_longer = shorter if shorter > budget else max(shorter, budget - shorter)
    keep_shorter = shorter
    if keep_shorter + keep_longer > budget:
        keep_shorter = budget // 2
        keep_longer = keep_shorter + budget % 2
    if len(first) > len(second):
        return [first[:keep_longer], second[:keep_shorter]]
    return [first[:keep_shorter], second[:keep_longer]]


def _added_around(backend: BackendTokenizer, num_parts: int) -> tuple[list[int], ...]:
    """The ids the post-processor puts before, between and after a text's parts."""
    probe = backend.encode(*["a", "b"][:num_parts])
    pieces: list[list[int]] = [[]]
    parts: list[int] = []
    for token_id, part in zip(probe.ids, probe.sequence_ids):
        if part is None:  # a token the post-processor added
            pieces[-1].append(token_id)
        elif not parts or parts[-1] != part:
            parts.append(part)
            pieces.append([])
    if parts != list(range(num_parts)):
        raise ValueError("the tokenizer's post-processor interleaves a text's parts")
    return tuple(pieces)


def pair_separator_id(backend: BackendTokenizer) -> int | None:
    """The special token the pair template puts between a pair's two segments (BERT's
    [SEP]), or None when the template has no second segment."""
    probe = backend.encode("a", "b")
    types = probe.type_ids
    if 1 not in types:
        return None
    first_b = types.index(1)
    return probe.ids[first_b - 1] if first_b > 0 else None
