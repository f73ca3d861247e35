"""Inputs with bytes that are not text or fields larger than the limit, and the check a
reader of their results makes: every good row answered, one error row per bad row
naming its file and line. Shared by the fault tests, the flow tests and
`scenarios_b.hostile_bytes` (the fault matrix)."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

BAD_BYTE = b"\xff"  # never part of UTF-8
FIELD_MIB = 40


@dataclass(frozen=True)
class HostileInput:
    """One input file of good rows and bad ones."""

    name: str
    path: Path
    good_ids: list[str]
    bad_lines: dict[int, str]  # line number -> how its error message starts, after "line N: "
    baseline: Path  # the same file without its bad rows

    def check(self, results: pa.Table, *, shown_as: str | None = None) -> tuple[int, int]:
        """Asserts the results hold an answer per good row and an error row per bad one.

        Args:
            results: the job's results table.
            shown_as: how error messages name the file (default: its path).

        Returns:
            `(rows_lost, rows_duplicated)` against the good ids and the bad lines.
        """
        name = shown_as or str(self.path)
        rows = results.to_pylist()
        answered = [r["id"] for r in rows if r["error"] is None]
        errors = [r["error"] for r in rows if r["error"] is not None]
        found = {}
        for error in errors:
            assert error.startswith(f"{name}: line "), error
            number = int(error[len(name) + len(": line ") :].split(":", 1)[0])
            found[number] = found.get(number, 0) + 1
            assert number in self.bad_lines, error
            assert error.startswith(f"{name}: line {number}: {self.bad_lines[number]}"), error
        lost = sum(1 for i in self.good_ids if i not in answered)
        lost += sum(1 for n in self.bad_lines if n not in found)
        duplicated = len(answered) - len(set(answered)) + sum(n - 1 for n in found.values())
        return lost, duplicated


def _jsonl_row(row_id: bytes, prompt: bytes) -> bytes:
    return b'{"id": "' + row_id + b'", "prompt": "' + prompt + b'"}\n'


def _write_both(
    directory: Path,
    name: str,
    good: list[bytes],
    bad: dict[int, bytes],
    *,
    head: bytes = b"",
    pack=None,
):
    """Writes `name` (good rows with bad ones inserted at their indices) and its baseline."""
    pack = pack or (lambda data: data)
    rows = list(good)
    for index in sorted(bad):
        rows.insert(index, bad[index])
    path, baseline = directory / name, directory / f"baseline-{name}"
    path.write_bytes(pack(head + b"".join(rows)))
    baseline.write_bytes(pack(head + b"".join(good)))
    return path, baseline


def write_hostile_inputs(directory: Path, *, field_mib: int = FIELD_MIB) -> list[HostileInput]:
    """The issue's cases and their neighbours, each a file of good rows and bad ones.

    Args:
        directory: where the files are written.
        field_mib: the size of the oversized CSV field (over the 32 MiB record limit).

    Returns:
        One HostileInput per file; error lines count a header as line 1.
    """
    directory.mkdir(parents=True, exist_ok=True)
    good_ids = ["g0", "g1", "g2"]
    jsonl_good = [_jsonl_row(i.encode(), b"Say something about " + i.encode()) for i in good_ids]
    csv_good = [i.encode() + b",Say something about " + i.encode() + b"\r\n" for i in good_ids]
    not_utf8 = "not valid UTF-8 (byte 0xff"
    inputs = []

    path, baseline = _write_both(
        directory, "prompt.jsonl", jsonl_good, {1: _jsonl_row(b"b1", b"caf" + BAD_BYTE)}
    )
    inputs.append(
        HostileInput("invalid UTF-8 in a JSONL prompt", path, good_ids, {2: not_utf8}, baseline)
    )
    path, baseline = _write_both(
        directory, "id.jsonl", jsonl_good, {2: _jsonl_row(b"b" + BAD_BYTE, b"Say hi")}
    )
    inputs.append(
        HostileInput("invalid UTF-8 in a JSONL id", path, good_ids, {3: not_utf8}, baseline)
    )
    path, baseline = _write_both(
        directory,
        "prompt.csv",
        csv_good,
        {1: b"b1,caf" + BAD_BYTE + b"\r\n"},
        head=b"id,prompt\r\n",
    )
    inputs.append(
        HostileInput("invalid UTF-8 in a CSV row", path, good_ids, {3: not_utf8}, baseline)
    )
    path, baseline = _write_both(
        directory,
        "bom.csv.gz",
        csv_good,
        {3: b"b3," + BAD_BYTE + b"\r\n"},
        head=b"\xef\xbb\xbfid,prompt\r\n",
        pack=gzip.compress,
    )
    inputs.append(
        HostileInput(
            "invalid UTF-8 in a gzipped CSV with a BOM", path, good_ids, {5: not_utf8}, baseline
        )
    )
    path, baseline = directory / "field.csv", directory / "baseline-field.csv"
    for target, with_field in ((path, True), (baseline, False)):
        with open(target, "wb") as f:
            f.write(b"id,prompt\n" + csv_good[0])
            if with_field:
                # Written in pieces: no process holds the field. Commas and newlines in it.
                f.write(b'b1,"')
                piece = (b"a pasted document, line after line\n" * 30_000)[: 1 << 20]
                for _ in range(field_mib):
                    f.write(piece)
                f.write(b'"\n')
            f.write(b"".join(csv_good[1:]))
    limit = "longer than the record limit of 32 MiB"
    inputs.append(HostileInput(f"a {field_mib} MB CSV field", path, good_ids, {3: limit}, baseline))
    return inputs
