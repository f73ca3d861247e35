"""The reference a prompt with special-token strings in its data is checked against: the
chat template rendered with placeholders, its markup encoded with specials on, and each
content encoded on its own, cut at its special strings, each piece as plain text.

Built from `tokenizers` directly, not from `engine/loader/special_text.py`, so the tests
compare two constructions.
"""

from __future__ import annotations

import re

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers


def special_ids(tokenizer) -> set[int]:
    return {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}


def plain_encoder(tokenizer, *, first: bool) -> BackendTokenizer:
    """The tokenizer with special matching off; for a piece after a split, without the
    "▁" SentencePiece vocabularies put before a text's first piece only."""
    plain = BackendTokenizer.from_str(tokenizer.backend.to_str())
    plain.encode_special_tokens = True
    if not first and isinstance(plain.pre_tokenizer, pre_tokenizers.Metaspace):
        plain.pre_tokenizer.prepend_scheme = "never"
    return plain


def as_text_ids(tokenizer, text: str) -> list[int]:
    """`text` cut at its special strings, each piece encoded on its own with special
    matching off (the reference's own way, not the module's)."""
    plain = BackendTokenizer.from_str(tokenizer.backend.to_str())
    plain.encode_special_tokens = True
    strings = sorted(
        (t.content for t in plain.get_added_tokens_decoder().values() if t.special),
        key=len,
        reverse=True,
    )
    pieces = re.split("(" + "|".join(map(re.escape, strings)) + ")", text)
    return [
        i for piece in pieces if piece for i in plain.encode(piece, add_special_tokens=False).ids
    ]


def reference_ids(tokenizer, messages: list[dict]) -> tuple[list[int], int]:
    """The template rendered with placeholders for the contents, its markup encoded with
    specials on and each content encoded separately; and the markup's control tokens."""
    placeholders = [{**m, "content": f"@@{k}@@"} for k, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(placeholders)
    ids, num_control = [], 0
    for k, piece in enumerate(re.split(r"@@(\d+)@@", rendered)):
        if k % 2:  # a content
            ids += as_text_ids(tokenizer, messages[int(piece)]["content"])
        elif piece:
            markup = tokenizer.backend.encode(piece, add_special_tokens=False).ids
            num_control += sum(i in special_ids(tokenizer) for i in markup)
            ids += markup
    return ids, num_control


def filled_ids(tokenizer, template: str, value: str) -> list[int]:
    """A one-field `str.format` template filled with `value`, sent raw (by a tokenizer that
    adds no BOS): the template's own text encoded with specials on, the value as plain text."""
    before, after = template.split("{q}")
    encode = tokenizer.backend.encode
    ids = encode(before, add_special_tokens=False).ids + as_text_ids(tokenizer, value)
    return ids + encode(after, add_special_tokens=False).ids
