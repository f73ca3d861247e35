"""POST /v1/files bodies, streamed: the multipart form is parsed as it arrives, the file
part written to a local spool file and counted, and nothing more kept once it passes the
size limit - a 250 MB upload is refused, never held in memory, and never reaches the
store. Then the spool is checked line by line (JSON Lines of objects, as a batch input
must be) before the store sees a byte of it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import BinaryIO

from python_multipart.multipart import MultipartParser, parse_options_header

from tokenmill.batch_api.errors import APIError

# Form fields other than the file are short: a purpose, an expiry.
MAX_FIELD_BYTES = 1024
# Headers and boundaries around the parts, allowed on top of the file's size limit.
FORM_OVERHEAD_BYTES = 64 * 1024
# An oversized body is read (and dropped) up to this many times the limit, then cut off.
DRAIN_FACTOR = 2


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the upload is larger than the limit of {limit:,} bytes; nothing was stored",
        code="file_too_large",
    )


@dataclass
class UploadForm:
    """What a multipart upload held: its text fields, the file's name and size."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    num_bytes: int = 0


async def receive_upload(
    chunks: AsyncIterator[bytes], content_type: str, spool: BinaryIO, *, limit: int
) -> UploadForm:
    """Parse a multipart body from `chunks`, writing its `file` part to `spool`.

    Raises:
        APIError: not a multipart form (400), a file part over `limit` bytes (413), more
            than one file, or an oversized field.
    """
    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise APIError(400, "an upload is a multipart/form-data form with file and purpose")
    form = UploadForm()
    part: dict = {}

    def on_part_begin() -> None:
        part.clear()
        part.update(headers={}, name=None, filename=None, data=bytearray(), header=b"")

    def on_header_field(data: bytes, start: int, end: int) -> None:
        part["header"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        name = part["header"].lower()
        part["headers"][name] = part["headers"].get(name, b"") + data[start:end]

    def on_header_end() -> None:
        part["header"] = b""

    def on_headers_finished() -> None:
        _, options = parse_options_header(part["headers"].get(b"content-disposition", b""))
        part["name"] = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        if filename is not None:
            if part["name"] != "file" or form.filename is not None:
                raise APIError(400, "an upload holds one file, in the form field 'file'")
            form.filename = filename.decode("utf-8", "replace") or "upload.jsonl"
            part["filename"] = form.filename

    def on_part_data(data: bytes, start: int, end: int) -> None:
        if part["filename"] is not None:
            form.num_bytes += end - start
            if form.num_bytes <= limit:
                spool.write(data[start:end])
            return
        part["data"] += data[start:end]
        if len(part["data"]) > MAX_FIELD_BYTES:
            raise APIError(400, f"form field {part['name']!r} is longer than {MAX_FIELD_BYTES}")

    def on_part_end() -> None:
        if part["filename"] is None and part["name"]:
            form.fields[part["name"]] = part["data"].decode("utf-8", "replace")

    parser = MultipartParser(
        boundary,
        {
            "on_part_begin": on_part_begin,
            "on_header_field": on_header_field,
            "on_header_value": on_header_value,
            "on_header_end": on_header_end,
            "on_headers_finished": on_headers_finished,
            "on_part_data": on_part_data,
            "on_part_end": on_part_end,
        },
    )
    received = 0
    async for chunk in chunks:
        received += len(chunk)
        if received > limit + FORM_OVERHEAD_BYTES:
            # Past the limit nothing more is kept; the rest of the body is read and
            # dropped (up to a bound), so the client, still sending, hears the refusal.
            if received > DRAIN_FACTOR * limit + FORM_OVERHEAD_BYTES:
                break
            continue
        try:
            parser.write(chunk)
        except APIError:
            raise
        except Exception as exc:  # the parser's own errors: a malformed form
            raise APIError(400, f"malformed multipart form ({type(exc).__name__})") from None
    if form.num_bytes > limit or received > limit + FORM_OVERHEAD_BYTES:
        raise too_large(limit)
    parser.finalize()
    if form.filename is None:
        raise APIError(400, "the upload has no file: send it in the form field 'file'")
    spool.flush()
    return form


def count_request_lines(spool: BinaryIO) -> int:
    """The JSON objects in a spooled JSON Lines file (blank lines skipped).

    Raises:
        APIError: a line that is not UTF-8 or not a JSON object, named by its number;
            or no line at all.
    """
    spool.seek(0)
    count = 0
    for number, raw in enumerate(spool, start=1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except UnicodeDecodeError:
            raise APIError(400, f"line {number} is not UTF-8 text", code="invalid_file") from None
        except ValueError:
            raise APIError(
                400,
                f"line {number} is not JSON: a batch input is JSON Lines, one request object a "
                "line; nothing was stored",
                code="invalid_file",
            ) from None
        if not isinstance(value, dict):
            raise APIError(
                400, f"line {number} is not a JSON object; nothing was stored", code="invalid_file"
            )
        count += 1
    if count == 0:
        raise APIError(400, "the file holds no request line", code="invalid_file")
    return count
