"""Input files of the shapes data teams export - bare-CR CSV, JSON arrays, other
delimiters, blank lines - each with what a reference reader (Python's csv module,
pandas, json) finds in it, and the check a reader of a job's results makes: every row
answered or named as an error, none dropped. Shared by the pipeline, flow and fault
tests and the fault matrix (`scenarios_b.input_shapes`)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa


@dataclass(frozen=True)
class Expected:
    """One input row as the results must show it."""

    id: str
    prompt: str | None  # None: the row is an error row
    error: str | None = None  # how its error starts, after "<file>: "


@dataclass(frozen=True)
class InputShape:
    """One input file and what reading it must give."""

    name: str
    path: Path
    rows: list[Expected]
    blank: int  # blank records in the file (empty CSV records, blank JSON Lines lines)
    options: dict[str, str] = field(default_factory=dict)  # job options it needs

    @property
    def cli_args(self) -> list[str]:
        return [a for k, v in self.options.items() for a in (f"--{k.replace('_', '-')}", v)]

    @property
    def rows_failed(self) -> int:
        return sum(1 for r in self.rows if r.error is not None)

    @property
    def rows_read(self) -> int:
        return len(self.rows) + self.blank

    def check(self, results: pa.Table, *, shown_as: str | None = None) -> tuple[int, int]:
        """Asserts each row is in the results as expected - answered with its prompt
        carried through (`prompt` passthrough), or an error naming the file.

        Returns:
            `(rows_lost, rows_duplicated)` against the expected rows.
        """
        name = shown_as or str(self.path)
        found: dict[str, list[dict]] = {}
        for row in results.to_pylist():
            found.setdefault(row["id"], []).append(row)
        lost = 0
        for want in self.rows:
            got = found.get(want.id)
            if not got:
                lost += 1
                continue
            row = got[0]
            if want.error is None:
                assert row["error"] is None, (want, row["error"])
                assert row["prompt"] == want.prompt, (want, row["prompt"])
            else:
                assert row["finish_reason"] == "error", want
                assert row["error"].startswith(f"{name}: {want.error}"), (want, row["error"])
        assert set(found) <= {r.id for r in self.rows}, set(found)
        duplicated = sum(len(rows) - 1 for rows in found.values())
        return lost, duplicated


def position_id(index: int) -> str:
    """The id a row whose own id could not be read gets."""
    return f"row-{index:09d}"


def _csv_shape(
    directory: Path,
    name: str,
    file_name: str,
    data: bytes,
    *,
    delimiter: str = ",",
    quote: str = '"',
    options: dict[str, str] | None = None,
) -> InputShape:
    """A delimited file and its rows as Python's csv module reads them."""
    path = directory / file_name
    path.write_bytes(data)
    records = list(
        csv.reader(io.StringIO(data.decode(), newline=""), delimiter=delimiter, quotechar=quote)
    )
    header, *rest = [r for r in records if r]
    assert header == ["id", "prompt"], header
    rows = []
    for index, record in enumerate(rest):
        if len(record) == 2:
            rows.append(Expected(record[0], record[1]))
        else:  # a record the reader names as bad, with its line
            line = 1 + data.count(b"\n", 0, data.index(delimiter.join(record).encode()))
            rows.append(
                Expected(position_id(index), None, f"line {line}: expected 2 columns, got 3")
            )
    blank = sum(1 for r in records if not r)
    return InputShape(name, path, rows, blank, options or {})


def write_input_shapes(directory: Path) -> list[InputShape]:
    """The shapes, one file each; rows are read back with the reference readers."""
    directory.mkdir(parents=True, exist_ok=True)
    shapes = [
        _csv_shape(
            directory,
            "bare-CR CSV, quoted fields holding \\r\\n and \\r, a blank record",
            "cr.csv",
            b'id,prompt\rc1,Say hello\rc2,"line one\r\nline two"\r\rc3,"bare\rcr"\r'
            b'c4,"say ""hi"" twice"\r',
        ),
        _csv_shape(
            directory,
            "semicolon CSV (--csv-delimiter ';'), a record with a field too many",
            "semi.csv",
            b'id;prompt\r\ns1;Name a colour; then a fruit\r\ns2;"quoted; with, commas"\r\n'
            b"s3;one;too many\r\ns4;Count to three\r\n",
            delimiter=";",
            options={"csv_delimiter": ";"},
        ),
        _csv_shape(
            directory,
            "TSV (.tsv: tabs by default), CRLF and blank records",
            "tabs.tsv",
            b'id\tprompt\r\nt1\tWrite, briefly, a haiku\r\n\r\nt2\t"a ""quoted"" tab\there"\r\n'
            b"\r\n",
            delimiter="\t",
        ),
        _csv_shape(
            directory,
            "pipe-delimited, quoted with ' (--csv-delimiter '|' --csv-quote \"'\")",
            "pipe.csv",
            b"id|prompt\np1|'a | inside quotes'\np2|It's plain\n",
            delimiter="|",
            quote="'",
            options={"csv_delimiter": "|", "csv_quote": "'"},
        ),
    ]
    elements = [
        {"id": "j1", "prompt": "Summarise the following text in one sentence:"},
        {"id": "j2", "prompt": "line one\nline two"},
        [1, 2],
        {"id": "j4", "prompt": {"not": "text"}},
        {"id": "j5", "prompt": "What is the capital of France?"},
    ]
    path = directory / "rows.json"
    path.write_text(json.dumps(elements, indent=2))
    reference = json.loads(path.read_text())
    rows = [
        Expected(reference[0]["id"], reference[0]["prompt"]),
        Expected(reference[1]["id"], reference[1]["prompt"]),
        Expected(position_id(2), None, "array index 2: expected a JSON object, got list"),
        Expected("j4", None, "array index 3: column 'prompt': a dict value where text was"),
        Expected(reference[4]["id"], reference[4]["prompt"]),
    ]
    shapes.append(
        InputShape("JSON array, pretty-printed, bad elements in the middle", path, rows, 0)
    )
    lines = [b"", b'{"id": "l1", "prompt": "Say hi"}', b"  ", b'{"id": "l2", "prompt": "x\\r"}']
    path = directory / "lines.jsonl"
    path.write_bytes(b"\r\n".join([*lines, b"\r", b""]))
    rows = [Expected("l1", "Say hi"), Expected("l2", "x\r")]
    shapes.append(InputShape("JSON Lines, CRLF, blank lines", path, rows, 3))
    return shapes
