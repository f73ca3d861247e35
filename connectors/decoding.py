"""Bytes -> text, one rule for every input format: what to do with bytes that do not decode.

Text formats (JSON Lines, CSV, OpenAI batch) are read as a stream of UTF-8 bytes: a
UTF-8 file as it is (a leading byte order mark dropped), a file in any other encoding
(`Decoding.encoding`, e.g. latin-1 or utf-16) transcoded to UTF-8 as it streams. Each
line or record is then checked on its own, so a bad byte costs only its row:

    on_error="error-row"  the row becomes a bad line ("not valid UTF-8 (byte 0xff at
                          offset 4)"): an error row, or an error with on_bad_line="error"
    on_error="replace"    undecodable bytes become U+FFFD and the row is flagged
                          (`REPLACED_COLUMN`) so its results can say so

Binary values (a Parquet binary column, bytes handed to `tokenmill.generate`) follow the
same rule, value by value (`decode_value`, `decode_binary`).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa

OnDecodeError = Literal["error-row", "replace"]
ON_DECODE_ERROR = ("error-row", "replace")

_BOM = codecs.BOM_UTF8
# A transcoded stream marks each undecodable run with a lone surrogate, which encodes
# (surrogatepass) to bytes that are never valid UTF-8: the per-line check then finds it
# in the line it belongs to. Strict decoders never produce lone surrogates themselves.
_MARK = "\udcff"
_MARK_BYTES = _MARK.encode("utf-8", "surrogatepass")
_READ_BYTES = 1 << 20


class UndecodableText(ValueError):
    """Bytes that are not valid text; the message names the problem, never the bytes' text."""


@dataclass(frozen=True)
class Decoding:
    """How input bytes become text.

    Args:
        encoding: any Python text codec name (utf-8, latin-1, cp1252, utf-16...).
        on_error: "error-row" (a row that does not decode is a bad row) or "replace"
            (undecodable bytes become U+FFFD and the row is flagged).
    """

    encoding: str = "utf-8"
    on_error: OnDecodeError = "error-row"

    def __post_init__(self) -> None:
        check_encoding(self.encoding)
        if self.on_error not in ON_DECODE_ERROR:
            raise ValueError(
                f"on_decode_error must be one of {', '.join(ON_DECODE_ERROR)}, "
                f"got {self.on_error!r}"
            )

    @property
    def is_utf8(self) -> bool:
        """Whether input bytes are UTF-8 already (then they are checked, never transcoded)."""
        return codecs.lookup(self.encoding).name in ("utf-8", "utf-8-sig")

    @property
    def replaces(self) -> bool:
        return self.on_error == "replace"


def check_encoding(name: str) -> str:
    """`name` if it is a text encoding Python knows; ValueError otherwise."""
    try:
        # Codecs such as base64 or zlib turn bytes into bytes, not text.
        is_text = getattr(codecs.lookup(name), "_is_text_encoding", True)
        problem = None if is_text else "not a text encoding"
    except LookupError:
        problem = "not an encoding"
    if problem is not None:
        raise ValueError(f"{name!r} is {problem} (e.g. utf-8, latin-1, cp1252, utf-16)")
    return name


UTF8 = Decoding()


def open_decoded(raw: Any, decoding: Decoding) -> Any:
    """A binary stream of UTF-8 bytes over `raw` (a binary file object).

    Args:
        raw: the file, already decompressed.
        decoding: the input's encoding.

    Returns:
        An object with `read(size)`. UTF-8 input passes through unchanged but for a
        leading byte order mark; other encodings are transcoded, each undecodable run
        becoming bytes that `to_utf8` rejects (or replaces) in the line they fall in.
    """
    return _Utf8Stream(raw) if decoding.is_utf8 else _Transcoder(raw, decoding.encoding)


def to_utf8(line: bytes, decoding: Decoding) -> tuple[bytes, bool]:
    """One line or record of an `open_decoded` stream, checked.

    Args:
        line: the line's bytes, without its newline.
        decoding: the input's encoding and what to do with bytes that do not decode.

    Returns:
        `(utf8_bytes, is_replaced)`; raises `UndecodableText` when the bytes are not
        valid and `decoding` does not replace.
    """
    if line.isascii():
        return line, False
    try:
        line.decode("utf-8")
        return line, False
    except UnicodeDecodeError as exc:
        if decoding.replaces:
            return line.decode("utf-8", "tokenmill.replace").encode("utf-8"), True
        if decoding.is_utf8:
            raise UndecodableText(_problem("UTF-8", line, exc)) from None
        # The offset in the transcoded line is not one the user could find in the file.
        raise UndecodableText(f"not valid {decoding.encoding}") from None


def decode_value(value: bytes, decoding: Decoding) -> tuple[str, bool]:
    """A binary value as text.

    Args:
        value: the bytes (a Parquet binary value, bytes given to `tokenmill.generate`).
        decoding: their encoding and what to do with bytes that do not decode.

    Returns:
        `(text, is_replaced)`; raises `UndecodableText` when the bytes do not decode
        and `decoding` does not replace.
    """
    value = bytes(value)
    try:
        return value.decode(decoding.encoding), False
    except UnicodeDecodeError as exc:
        if decoding.replaces:
            return value.decode(decoding.encoding, "replace"), True
        name = "UTF-8" if decoding.is_utf8 else decoding.encoding
        raise UndecodableText(_problem(name, value, exc)) from None


@dataclass
class DecodedColumn:
    """A column of values with its binary ones decoded (`decode_values`, `decode_binary`)."""

    values: Any  # a list, or an Arrow string array
    errors: dict[int, str]  # row index -> why its value did not decode (value is null)
    replaced: list[bool] | None  # with on_error="replace": which rows had bytes replaced


def decode_values(values: Sequence[Any], decoding: Decoding) -> DecodedColumn:
    """Python values with every bytes value decoded; other values are kept as they are."""
    out: list[Any] = []
    errors: dict[int, str] = {}
    replaced = [False] * len(values) if decoding.replaces else None
    for index, value in enumerate(values):
        if not isinstance(value, (bytes, bytearray, memoryview)):
            out.append(value)
            continue
        try:
            text, is_replaced = decode_value(value, decoding)
        except UndecodableText as exc:
            text, errors[index] = None, str(exc)
        else:
            if replaced is not None:
                replaced[index] = is_replaced
        out.append(text)
    return DecodedColumn(out, errors, replaced)


def decode_binary(array: pa.Array, decoding: Decoding) -> DecodedColumn:
    """An Arrow binary column as a string column, value by value only when it must be."""
    string_type = pa.large_string() if pa.types.is_large_binary(array.type) else pa.string()
    if decoding.is_utf8:
        try:
            # Arrow validates UTF-8 in C; only a column holding bad bytes goes value by value.
            replaced = [False] * len(array) if decoding.replaces else None
            return DecodedColumn(array.cast(string_type), {}, replaced)
        except pa.ArrowInvalid:
            pass
    column = decode_values(array.to_pylist(), decoding)
    column.values = pa.array(column.values, string_type)
    return column


def _problem(name: str, data: bytes, exc: UnicodeDecodeError) -> str:
    return f"not valid {name} (byte 0x{data[exc.start]:02x} at offset {exc.start})"


def _mark(exc: UnicodeError) -> tuple[str, int]:
    return _MARK, exc.end


def _replace(exc: UnicodeError) -> tuple[str, int]:
    # One U+FFFD for each mark a transcoded stream left, rather than one per its bytes.
    if exc.object[exc.start : exc.start + len(_MARK_BYTES)] == _MARK_BYTES:
        return "\ufffd", exc.start + len(_MARK_BYTES)
    return "\ufffd", exc.end


codecs.register_error("tokenmill.mark", _mark)
codecs.register_error("tokenmill.replace", _replace)


class _Utf8Stream:
    """UTF-8 bytes as they are, without a leading byte order mark."""

    def __init__(self, raw: Any):
        self._raw = raw
        self._at_start = True

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        if self._at_start:
            while data and len(data) < len(_BOM) and _BOM.startswith(data):
                more = self._raw.read(size)
                if not more:
                    break
                data += more
            self._at_start = False
            if data.startswith(_BOM):
                data = data[len(_BOM) :]
        return data


class _Transcoder:
    """Another encoding's bytes as UTF-8, decoded incrementally (memory: one read)."""

    def __init__(self, raw: Any, encoding: str):
        self._raw = raw
        self._decoder = codecs.getincrementaldecoder(encoding)(errors="tokenmill.mark")
        self._at_start = True
        self._done = False

    def read(self, size: int = -1) -> bytes:
        size = _READ_BYTES if size is None or size < 0 else size
        while not self._done:
            data = self._raw.read(size)
            self._done = not data
            text = self._decoder.decode(data, final=self._done)
            if self._at_start and text:
                self._at_start = False
                text = text.removeprefix("\ufeff")
            if text:
                return text.encode("utf-8", "surrogatepass")
        return b""
