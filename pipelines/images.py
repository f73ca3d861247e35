"""A job's images: each row's image cell read as encoded bytes under the job's rules,
checked from its header, and hashed - before any model is loaded.

A cell holds one image or a list of them (a multi-image row), each one of:

    bytes                 taken as they are (Parquet binary, bytes in a DataFrame)
    {"bytes", "path"}     a Hugging Face datasets Image struct: its bytes, else its path
    data: URL             base64, decoded; always allowed (nothing is fetched)
    a local path, file:// read only under one of the job's `image_root`s, after resolving
                          it (`..` and symbolic links cannot leave a root); no root given,
                          no path is read
    any other URL         fetched only when its scheme is in `allow_url_schemes`, with the
                          job's storage options; an http(s) host is resolved first and
                          refused when any of its addresses is private, loopback,
                          link-local or otherwise not global, then fetched from the
                          address checked, without credentials or redirects
                          (`image_fetch`)

Every problem - a null cell, a scheme not allowed, a path outside the roots, a URL that
cannot be reached, bytes that are no image, an image over `max_image_pixels` - is that
row's error message, never an exception: the other rows run. Only the header is read
here (`tokenmill.engine.image_size`); the engine decodes the pixels when the row runs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ipaddress
import os
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import fsspec

from tokenmill.engine import (
    DEFAULT_MAX_IMAGE_PIXELS,
    EngineConfig,
    ImageError,
    image_layout,
    image_size,
)
from tokenmill.pipelines.image_fetch import fetch_pinned
from tokenmill.pipelines.templating import ImagePlaces

# Rows whose images are read at once: a URL's latency overlaps the others'.
READ_THREADS = 8
LOCAL_SCHEMES = frozenset({"", "file", "local"})
_HOSTED_SCHEMES = frozenset({"http", "https"})


@dataclass(frozen=True)
class ImageAccess:
    """Where a job may read images from, and how large they may be."""

    roots: tuple[str, ...] = ()
    url_schemes: tuple[str, ...] = ()
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    storage_options: dict[str, Any] = field(default_factory=dict)
    # host -> its addresses; a test replaces it to stand for DNS.
    resolve: Callable[[str], list[str]] | None = None

    def __post_init__(self) -> None:
        schemes = tuple(s.lower().rstrip(":/") for s in self.url_schemes)
        refused = sorted(set(schemes) & LOCAL_SCHEMES)
        if refused:
            raise ValueError(
                f"allow_url_schemes may not name {', '.join(map(repr, refused))}: local "
                "paths are read under image_root"
            )
        object.__setattr__(self, "url_schemes", schemes)
        roots = tuple(os.path.realpath(os.path.expanduser(r)) for r in self.roots)
        for root in roots:
            if not os.path.isdir(root):
                raise ValueError(f"image_root {root} is not a directory")
        object.__setattr__(self, "roots", roots)


@dataclass(frozen=True)
class RowImageReader:
    """How a job's rows get their images: the column, where images may be read from, and
    where the model places them."""

    column: str
    access: ImageAccess
    places: ImagePlaces


def image_reader(
    values: Any,
    *,
    model_dir: str,
    model_name: str,
    tokenizer: Any,
    task: str,
    pan_and_scan: bool | None = EngineConfig.pan_and_scan,
) -> RowImageReader | None:
    """The image reader of a job's (or a notebook call's) options - `values.<name>` or
    `values[name]` - for its model (None: no image_column). pan_and_scan is the engine
    setting the job runs with (Gemma 3's crops: more image blocks per image).

    Raises:
        ValueError: an image column for a task other than generate, or for a model without
            a vision tower; pan_and_scan for a model without it.
    """
    get = values.get if isinstance(values, dict) else lambda name: getattr(values, name)
    if get("image_column") is None:
        return None
    if task != "generate":
        raise ValueError(f"image_column is read by generate jobs, not {task} jobs")
    places = image_layout(model_dir, tokenizer, pan_and_scan=pan_and_scan)
    if places is None:
        raise ValueError(
            f"model {model_name} has no vision tower: image_column needs a vision-language "
            "model (e.g. Gemma 3, Qwen2.5-VL)"
        )
    return RowImageReader(get("image_column"), _access(values), places)


def openai_image_reader(
    values: Any,
    *,
    model_dir: str,
    tokenizer: Any,
    pan_and_scan: bool | None = EngineConfig.pan_and_scan,
) -> RowImageReader | None:
    """The reader of an OpenAI batch file's image parts for the job's model (None: it has
    no vision tower, so a line with images is an error row); the lines' messages place
    them."""
    places = image_layout(model_dir, tokenizer, pan_and_scan=pan_and_scan)
    if places is None:
        return None
    return RowImageReader("messages", _access(values), places)


def _access(values: Any) -> ImageAccess:
    get = values.get if isinstance(values, dict) else lambda name: getattr(values, name)
    return ImageAccess(
        roots=get("image_root") or (),
        url_schemes=get("allow_url_schemes") or (),
        max_pixels=get("max_image_pixels"),
        storage_options=dict(get("storage_options") or {}),
    )


@dataclass(frozen=True)
class RowImages:
    """One row's images, encoded, with their content hashes - or why the row fails."""

    data: tuple[bytes, ...] = ()
    hashes: tuple[bytes, ...] = ()  # blake2b-128 of each image's bytes
    # (width, height) of each image, from its header: what a dynamic-resolution model's
    # token count for it is computed from.
    sizes: tuple[tuple[int, int], ...] = ()
    error: str | None = None


def read_row_images(cells: Sequence[Any], access: ImageAccess) -> list[RowImages]:
    """Each cell's images (a batch of rows, read in threads), in order."""
    if len(cells) <= 1:
        return [_read_cell(c, access) for c in cells]
    with ThreadPoolExecutor(min(READ_THREADS, len(cells))) as pool:
        return list(pool.map(lambda cell: _read_cell(cell, access), cells))


def image_hash(data: bytes) -> bytes:
    """The content hash the engine keys an image's KV blocks by (blake2b-128 of its bytes)."""
    return hashlib.blake2b(data, digest_size=16).digest()


def _read_cell(cell: Any, access: ImageAccess) -> RowImages:
    if cell is None:
        return RowImages(error="image is null")
    items = list(cell) if isinstance(cell, (list, tuple)) else [cell]
    if not items:
        return RowImages(error="image list is empty")
    data, sizes = [], []
    for i, item in enumerate(items):
        where = "image" if len(items) == 1 else f"image {i}"
        try:
            encoded = _read_one(item, access)
            sizes.append(image_size(encoded, max_pixels=access.max_pixels))
        except (ImageError, ValueError) as exc:
            return RowImages(error=f"{where}: {exc}")
        data.append(encoded)
    return RowImages(tuple(data), tuple(image_hash(d) for d in data), tuple(sizes))


def _read_one(item: Any, access: ImageAccess) -> bytes:
    if isinstance(item, dict):  # a datasets Image struct
        item = item.get("bytes") if item.get("bytes") is not None else item.get("path")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if item is None:
        raise ValueError("is null")
    if not isinstance(item, str):
        raise ValueError(f"must be bytes, a path or a URL, not {type(item).__name__}")
    scheme = urlsplit(item).scheme.lower() if "://" in item or item.startswith("data:") else ""
    if scheme == "data":
        return _data_url(item)
    if scheme in LOCAL_SCHEMES:
        return _read_local(item.split("://", 1)[1] if scheme else item, access)
    if scheme not in access.url_schemes:
        raise ValueError(
            f"URL scheme {scheme!r} is not allowed; allow it with allow_url_schemes "
            "(--allow-url-schemes)"
        )
    if scheme in _HOSTED_SCHEMES:
        return fetch_pinned(item, _checked_address(urlsplit(item).hostname, access))
    return _fetch(item, access)


def _data_url(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ValueError("a data: image URL must be base64 (data:image/...;base64,...)")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"the data: URL is not valid base64: {exc}") from None


def _read_local(path: str, access: ImageAccess) -> bytes:
    if not access.roots:
        raise ValueError(
            f"local path {path!r} is not read: name the directories images may be read "
            "from with image_root (--image-root)"
        )
    real = os.path.realpath(os.path.expanduser(path))
    if not any(
        real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in access.roots
    ):
        raise ValueError(f"path {path!r} is outside the image roots ({', '.join(access.roots)})")
    try:
        with open(real, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"path {path!r} cannot be read ({exc.strerror or exc})") from None


def _checked_address(host: str | None, access: ImageAccess) -> str:
    """The address to fetch `host` from, once every address it resolves to is a global
    one (not private, loopback, link-local, reserved...)."""
    if not host:
        raise ValueError("URL has no host")
    try:
        addresses = (access.resolve or _resolve)(host)
    except OSError as exc:
        raise ValueError(f"host {host!r} cannot be resolved ({exc})") from None
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if not ip.is_global:
            raise ValueError(
                f"host {host!r} resolves to {ip}, a private, loopback or link-local address: "
                "never fetched"
            )
    if not addresses:
        raise ValueError(f"host {host!r} resolves to no address")
    return addresses[0]


def _resolve(host: str) -> list[str]:
    return sorted({info[4][0] for info in socket.getaddrinfo(host, None)})


def _fetch(url: str, access: ImageAccess) -> bytes:
    try:
        with fsspec.open(url, "rb", **access.storage_options) as f:
            return f.read()
    except Exception as exc:  # any store's error: this row cannot be reached
        raise ValueError(f"URL cannot be read ({type(exc).__name__}: {exc})") from None
