"""A batch's `validating` step: OpenAI's rules on the input file as a whole.

    every line's url is the batch's endpoint          url_mismatch
    custom_ids are unique                             duplicate_custom_id
    at most max_lines lines (50,000)                  too_many_requests
    at most max_embedding_inputs inputs (50,000)      too_many_embedding_inputs
    the lines name one served model (or none)         model_not_found, mixed_models

A file that breaks them fails the batch, its `errors` naming the lines; nothing runs.
A line that is wrong on its own (a refused field, a bad message) is not this step's
business: it becomes an error line of the output, as in any batch file job
(`connectors/openai_batch.py`). The file is read as a stream, one line at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.batch_api.models import ServedModels
from tokenmill.batch_api.store import Store

# Errors listed on the batch at most; the rest are counted in the last one's message.
MAX_LISTED_ERRORS = 100


@dataclass
class Validated:
    """What validating found: the served model the lines ask for, and the problems."""

    num_lines: int = 0
    model: str | None = None  # a served model's id
    errors: list[dict[str, Any]] = field(default_factory=list)
    num_errors: int = 0

    def add(self, code: str, message: str, line: int | None = None) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append({"code": code, "message": message, "line": line, "param": None})

    def listed(self) -> list[dict[str, Any]]:
        more = self.num_errors - len(self.errors)
        if more <= 0:
            return self.errors
        return self.errors + [
            {"code": "more_errors", "message": f"{more} more lines fail", "line": None}
        ]


def validate_input(
    store: Store,
    file_id: str,
    endpoint: str,
    models: ServedModels,
    *,
    max_lines: int,
    max_embedding_inputs: int,
) -> Validated:
    """Check the batch's input file against the batch (see the module docstring).

    Raises:
        OSError: the store could not be read (the batch stays queued; try again later).
    """
    found = Validated()
    seen: set[str] = set()
    embedding_inputs = 0
    with store.open_file(file_id) as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            found.num_lines += 1
            try:
                line = json.loads(raw)
            except ValueError:
                found.add("invalid_json_line", "the line is not a JSON object", number)
                continue
            if not isinstance(line, dict):
                found.add("invalid_json_line", "the line is not a JSON object", number)
                continue
            if line.get("url") != endpoint:
                found.add(
                    "url_mismatch", f"the line's url is not the batch's endpoint {endpoint}", number
                )
            custom_id = line.get("custom_id")
            if isinstance(custom_id, str):
                if custom_id in seen:
                    found.add("duplicate_custom_id", "custom_id repeats an earlier line's", number)
                seen.add(custom_id)
            body = line.get("body") if isinstance(line.get("body"), dict) else {}
            if endpoint == "/v1/embeddings":
                value = body.get("input")
                embedding_inputs += len(value) if isinstance(value, list) else 1
            _check_model(found, body.get("model"), models, number)
    if found.num_lines > max_lines:
        found.add(
            "too_many_requests",
            f"the file holds {found.num_lines:,} requests; a batch takes at most {max_lines:,}",
        )
    if embedding_inputs > max_embedding_inputs:
        found.add(
            "too_many_embedding_inputs",
            f"the file holds {embedding_inputs:,} embedding inputs; a batch takes at most "
            f"{max_embedding_inputs:,}",
        )
    if found.num_lines == 0:
        found.add("empty_file", "the file holds no request line")
    if found.model is None:
        found.model = models.default.id
    return found


def _check_model(found: Validated, name: Any, models: ServedModels, number: int) -> None:
    if name is None:
        return
    served = models.find(name) if isinstance(name, str) else None
    if served is None:
        found.add(
            "model_not_found",
            "body.model names no served model or adapter (GET /v1/models lists them)",
            number,
        )
        return
    if found.model is None:
        found.model = served.id
    elif served.id != found.model:
        found.add(
            "mixed_models",
            f"body.model is {served.id!r}, an earlier line's {found.model!r}: a batch runs "
            "one model (and its adapters)",
            number,
        )
