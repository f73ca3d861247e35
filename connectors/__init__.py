"""fsspec sources and sinks: Parquet, JSON Lines, JSON arrays, CSV/TSV and the OpenAI
batch format (`formats.py` is the registry of input formats).

Reading: `open_source(uri, ...)` validates a dataset (files, format, schema, columns)
before any row is read, then `Source.iter_batches()` streams `pyarrow.RecordBatch`es.
A row that cannot be read (bad JSON, bytes not valid in the encoding - `decoding.py` -
a line over the size limit) costs only itself: an error, or an `__error__` message.
Writing: every file is published atomically (`write_part`, `write_json_atomic`,
`append_to_dataset`, `lines_writer`); `list_parts`/`read_parts` see only
complete files.
"""

from tokenmill.connectors.batches import ERROR_COLUMN, REPLACED_COLUMN
from tokenmill.connectors.errors import DiskFullError, SourceError
from tokenmill.connectors.formats import FORMATS, detect_format
from tokenmill.connectors.fs import redact_options, redact_url
from tokenmill.connectors.openai_batch import OPENAI_BATCH_SCHEMA, read_openai_batch_rows
from tokenmill.connectors.openai_fields import CHAT_URL, COMPLETIONS_URL, RESPONSES_URL
from tokenmill.connectors.openai_output import openai_batch_output_lines
from tokenmill.connectors.sink import (
    append_to_dataset,
    lines_writer,
    list_parts,
    read_json,
    read_part,
    read_parts,
    write_json_atomic,
    write_part,
)
from tokenmill.connectors.source import DEFAULT_BATCH_SIZE, Source, open_source

__all__ = [
    "CHAT_URL",
    "DiskFullError",
    "COMPLETIONS_URL",
    "DEFAULT_BATCH_SIZE",
    "ERROR_COLUMN",
    "FORMATS",
    "OPENAI_BATCH_SCHEMA",
    "REPLACED_COLUMN",
    "RESPONSES_URL",
    "Source",
    "SourceError",
    "append_to_dataset",
    "detect_format",
    "lines_writer",
    "list_parts",
    "open_source",
    "openai_batch_output_lines",
    "read_json",
    "read_openai_batch_rows",
    "read_part",
    "read_parts",
    "redact_options",
    "redact_url",
    "write_json_atomic",
    "write_part",
]
