"""Special-token strings inside data: found, carried through a chat template, encoded as text.

A row's text (a review, an email, a scraped page) may hold the model's special-token
strings - `<|im_start|>`, `<start_of_turn>`, `<|eot_id|>`. Encoded as they stand, they
become control tokens, and the row writes its own turns. Here data stays data:

- `SpecialText.find(text)`: the spans of special strings in text that is data throughout
  (a raw prompt, a text to embed).
- `DataMarks`, one per prompt: the values a chat template is given (message contents,
  template fields) get a private-use sentinel character in place of each special string;
  once the template has rendered, `restore` puts the strings back and returns their spans
  in the rendered text. The template's own markup never holds a sentinel, so its special
  strings stay control tokens.
- `SpecialText.encode_batch(texts, spans)`: each span is encoded as the plain text it is,
  everything else exactly as the tokenizer always encodes it.

Encoding keeps the tokenizer's own segmentation. `tokenizers` splits text at special-token
matches before anything else, so each span is replaced by a boundary token (a special
token added to a copy of the tokenizer), the text is encoded once as usual - the markup's
specials become control tokens, every other piece tokenizes as it always did - and each
boundary's id is replaced by the span's plain-text ids: its string encoded with special
matching off, as a piece of its own (first in the text, or after a split: SentencePiece
vocabularies put "▁" before the first piece only). Text holding no special string never
takes this path; `tokenizers`' own `encode_special_tokens` is not used for whole texts
because it also changes the merges around each special string (`.<|im_end|>` -> `.<`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

Span = tuple[int, int]  # [start, end) in characters
Spans = tuple[Span, ...]

# Sentinels stand for special strings inside marked values: Unicode's private use plane 15,
# which no script and no emoji uses. A prompt's k-th distinct special string gets the k-th.
SENTINEL_BASE = 0xF0000
NUM_SENTINELS = 0xFFFFE - SENTINEL_BASE
_SENTINEL = re.compile("[\U000f0000-\U000ffffd]")
# A sentinel a template wrote as a JSON escape (`tojson(ensure_ascii=True)`): its high half.
_ESCAPED_SENTINEL = re.compile(r"\\ud[bB][89abAB][0-9a-fA-F]")
# Stands for a span while its text is encoded, in the encoding copy only (plane 16). Text
# that itself holds it gets that character encoded as plain text, as any span.
BOUNDARY = "\U0010fffd"
# Marks a split while plain-text ids are worked out, in a second copy that sees no data.
_SPLIT = "\U0010fffc"


class SpecialText:
    """The special-token strings of one tokenizer, and how data holding them is encoded.

    Args:
        backend: the `tokenizers.Tokenizer`; its added tokens marked special are the
            strings kept as text (plain added tokens, such as `<think>` or Gemma's newline
            runs, are ordinary text already).
    """

    def __init__(self, backend: BackendTokenizer) -> None:
        self._backend = backend
        specials = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
        self.strings: tuple[str, ...] = tuple(sorted(specials, key=lambda s: (-len(s), s)))
        self._pattern = re.compile(_trie_pattern(self.strings)) if self.strings else None
        # A text without any special string's first character needs no regex search: `in`
        # is a plain scan, the common case on the hot path.
        self._first_chars = "".join(sorted({s[0] for s in self.strings}))
        self._encoder: _SpanEncoder | None = None
        self._lock = threading.Lock()

    def holds(self, text: str) -> bool:
        """Whether `text` holds a special string."""
        if self._pattern is None:
            return False
        if len(self._first_chars) <= 8 and not any(c in text for c in self._first_chars):
            return False
        return self._pattern.search(text) is not None

    def find(self, text: str) -> Spans:
        """The spans of special strings in `text`, leftmost-longest, not overlapping."""
        if not self.holds(text):
            return ()
        return tuple(m.span() for m in self._pattern.finditer(text))

    def replace(self, text: str, replacement: Callable[[str], str]) -> str:
        """`text` with each special string `s` in it replaced by `replacement(s)`."""
        if not self.holds(text):
            return text
        return self._pattern.sub(lambda match: replacement(match.group()), text)

    def marks(self) -> DataMarks:
        """Sentinels for one prompt's data (see `DataMarks`)."""
        return DataMarks(self)

    def encode_batch(
        self, texts: Sequence[str], data_spans: Sequence[Spans], add_special_tokens: bool
    ) -> list[list[int]]:
        """Token ids of texts whose spans are data: each span as plain text, the rest as
        the tokenizer encodes it.

        Args:
            texts: the texts.
            data_spans: per text, spans that are each exactly one special string.
            add_special_tokens: add the tokenizer's BOS/EOS around each text.
        """
        return self._span_encoder().encode_batch(texts, data_spans, add_special_tokens)

    def _span_encoder(self) -> _SpanEncoder:
        # Built on the first text that needs it: two copies of the tokenizer, which most
        # jobs never pay for.
        with self._lock:
            if self._encoder is None:
                self._encoder = _SpanEncoder(self._backend, self.strings)
            return self._encoder


class DataMarks:
    """One prompt's data, marked: special strings become sentinels until `restore`.

    `mark` every value that is data (message contents, tool definitions, template field
    values, the system prompt), render the prompt from the marked values, then `restore`
    the rendered text. A value a template drops takes its sentinels with it.
    """

    def __init__(self, special: SpecialText) -> None:
        self._special = special
        self._strings: list[str] = []  # sentinel k stands for _strings[k]
        self._sentinels: dict[str, str] = {}
        self._values: list[str] = []  # every string marked, to check for sentinels of its own

    def mark(self, value: Any) -> Any:
        """`value` with each special string in its strings (dict keys and values, list
        items, nested) replaced by a sentinel; a string that holds none comes back as is."""
        if isinstance(value, str):
            self._values.append(value)
            return self._special.replace(value, self._sentinel)
        if isinstance(value, dict):
            return {self.mark(k): self.mark(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.mark(v) for v in value)
        return value

    def restore(self, text: str) -> tuple[str, Spans]:
        """The rendered `text` with every sentinel back as its special string, and the
        spans those strings have in it.

        Raises:
            ValueError: the data also held characters of the sentinels' plane, so which
                ones stand for special strings cannot be told (the row's own error).
        """
        if not self._strings:
            return text, ()
        if any(_SENTINEL.search(v) for v in self._values):
            raise ValueError(
                "the row holds special-token text and also characters of Unicode's private "
                "use plane 15 (U+F0000-U+FFFFD), which keep that text as data: remove those "
                "characters, or allow special tokens"
            )
        if _ESCAPED_SENTINEL.search(text):
            raise ValueError(
                "the chat template escaped the row's special-token text as ASCII JSON "
                "(tojson with ensure_ascii), which cannot be kept as data; allow special "
                "tokens to send it as the template writes it"
            )
        pieces: list[str] = []
        spans: list[Span] = []
        length = last = 0
        for match in _SENTINEL.finditer(text):
            index = ord(match.group()) - SENTINEL_BASE
            if index >= len(self._strings):
                raise ValueError("the chat template wrote a private use character of its own")
            before = text[last : match.start()]
            string = self._strings[index]
            pieces += [before, string]
            length += len(before)
            spans.append((length, length + len(string)))
            length += len(string)
            last = match.end()
        pieces.append(text[last:])
        return "".join(pieces), tuple(spans)

    def _sentinel(self, string: str) -> str:
        sentinel = self._sentinels.get(string)
        if sentinel is None:
            if len(self._strings) >= NUM_SENTINELS:
                raise ValueError(f"a row holds over {NUM_SENTINELS:,} distinct special strings")
            sentinel = chr(SENTINEL_BASE + len(self._strings))
            self._sentinels[string] = sentinel
            self._strings.append(string)
        return sentinel


class _SpanEncoder:
    """Encodes texts with data spans (see the module docstring).

    Two copies of the tokenizer: one with the BOUNDARY special token, which encodes the
    texts; one that worked out, when built, each special string's plain-text ids.
    """

    def __init__(self, backend: BackendTokenizer, strings: Sequence[str]) -> None:
        encoding = BackendTokenizer.from_str(backend.to_str())
        encoding.no_padding()
        encoding.no_truncation()
        encoding.add_special_tokens([AddedToken(BOUNDARY, special=True, normalized=False)])
        self._encoding = encoding
        self._boundary_id = encoding.token_to_id(BOUNDARY)
        self._plain_ids = _plain_ids(backend, [*strings, BOUNDARY])

    def encode_batch(
        self, texts: Sequence[str], data_spans: Sequence[Spans], add_special_tokens: bool
    ) -> list[list[int]]:
        marked, replaced = [], []
        for text, spans in zip(texts, data_spans):
            spans = _with_boundaries(text, spans)
            pieces, last = [], 0
            for start, end in spans:
                pieces += [text[last:start], BOUNDARY]
                last = end
            pieces.append(text[last:])
            marked.append("".join(pieces))
            replaced.append([(text[start:end], start == 0) for start, end in spans])
        encode = getattr(self._encoding, "encode_batch_fast", self._encoding.encode_batch)
        encodings = encode(marked, add_special_tokens=add_special_tokens)
        out = []
        for encoding, strings in zip(encodings, replaced):
            pending = iter(strings)
            ids: list[int] = []
            for token_id in encoding.ids:
                if token_id != self._boundary_id:
                    ids.append(token_id)
                    continue
                string, is_first = next(pending)
                first, after_split = self._plain_ids[string]
                ids += first if is_first else after_split
            if next(pending, None) is not None:  # a span the tokenizer did not split at
                raise RuntimeError("a data span was not encoded on its own")
            out.append(ids)
        return out


def _trie_pattern(strings: Sequence[str]) -> str:
    """A regex matching any of `strings`, the longest where several start at one place (as
    the tokenizer's own leftmost-longest matching does). Shared prefixes are written once,
    so a vocabulary with thousands of specials (`<unused0>`...) costs a search no more
    than a handful does."""
    trie: dict = {}
    for string in strings:
        node = trie
        for char in string:
            node = node.setdefault(char, {})
        node[""] = {}  # a string ends here

    def alternatives(node: dict) -> str:
        # Longer continuations are tried before ending here: the regex is greedy.
        branches = [re.escape(c) + alternatives(child) for c, child in node.items() if c]
        if not branches:
            return ""
        group = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{group})?" if "" in node else group

    return alternatives(trie)


def _with_boundaries(text: str, spans: Spans) -> Spans:
    """`spans`, checked, plus a span for each BOUNDARY character of the text itself."""
    if BOUNDARY in text:
        own = [(m.start(), m.end()) for m in re.finditer(BOUNDARY, text)]
        spans = tuple(sorted({*spans, *own}))
    last = 0
    for start, end in spans:
        if start < last or end <= start:
            raise ValueError(f"data spans overlap or are empty: {spans}")
        last = end
    return spans


def _plain_ids(backend: BackendTokenizer, strings: list[str]) -> dict[str, tuple[list, list]]:
    """Each string's ids as plain text, as the first piece of a text and after a split."""
    plain = BackendTokenizer.from_str(backend.to_str())
    plain.no_padding()
    plain.no_truncation()
    # _SPLIT is a plain added token, so it still splits with special matching off.
    plain.add_tokens([AddedToken(_SPLIT, special=False, normalized=False)])
    plain.encode_special_tokens = True
    first = plain.encode_batch(strings, add_special_tokens=False)
    after = plain.encode_batch([_SPLIT + s for s in strings], add_special_tokens=False)
    return {s: (f.ids, a.ids[1:]) for s, f, a in zip(strings, first, after)}
