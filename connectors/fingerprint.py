"""An input's fingerprint: which files it is, and their sizes and version stamps.

A job stores its input's fingerprint beside its results; a resumed run compares it
with the input it finds, so rows of an old and a new input are never mixed. Only
metadata is read (one `info` per file), not the data: the stamp is the store's own
version of the content - an ETag, generation or checksum on object stores, the
modification time on local disk. A file rewritten with the same bytes can therefore
count as changed on local disk; that errs on the side of refusing.
"""

from __future__ import annotations

from typing import Any

from tokenmill.connectors.fs import display

# Keys of `fs.info()` that stamp a file's content, most specific first.
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "version_id", "mtime", "LastModified")


def fingerprint_files(fs, paths: list[str]) -> list[dict[str, Any]]:
    """Per file, in order: its (redacted) URL, size in bytes and version stamp.

    Args:
        fs: the fsspec filesystem.
        paths: the files, as `discover` lists them.

    Returns:
        JSON-ready entries `{"file", "size", "version"}`.
    """
    entries = []
    for path in paths:
        info = fs.info(path)
        stamp = next((info[k] for k in _VERSION_KEYS if info.get(k) is not None), None)
        entries.append(
            {
                "file": display(fs, path),
                "size": info.get("size"),
                "version": None if stamp is None else str(stamp),
            }
        )
    return entries


def first_difference(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> str | None:
    """How two fingerprints differ, in words (the first difference), or None."""
    old_by_file = {e["file"]: e for e in old}
    new_by_file = {e["file"]: e for e in new}
    for name in new_by_file.keys() - old_by_file.keys():
        return f"{name} was added"
    for name in old_by_file.keys() - new_by_file.keys():
        return f"{name} was removed"
    for name, entry in new_by_file.items():
        before = old_by_file[name]
        if entry["size"] != before["size"]:
            return f"{name} changed size ({before['size']} -> {entry['size']} bytes)"
        if entry["version"] != before["version"]:
            return f"{name} was modified"
    return None
