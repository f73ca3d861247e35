"""A job's LoRA adapters: the `lora` option's NAME=PATH_OR_REPO entries, checked against
the job's model at planning, and each row's choice among them.

    lora         {name: "dir" | "org/name" | "org/name@revision"}: the adapters a job may use
    lora_column  each row's adapter name; null (or no column) = the base model
    OpenAI batch a line's body.model, when it names one of the adapters (what vLLM's batch
                 runner does); the base model otherwise

A row's adapter is an index into the job's adapters (`PromptRow.lora_index`): 0 is the
base model, i >= 1 the i-th adapter in name order. Planning describes every adapter
before any row is read (`pipelines/planning.py`): a missing adapter, one stored only as
pickle or one that does not fit the model fails the job there, before any compute; a
row naming an adapter that is not registered becomes an error row. Each adapter's
weights hash enters the ids of the shards that use it, so a job resumed after an adapter
changed is refused like one whose model changed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.engine import LoRARequest, describe_adapter

BASE_INDEX = 0  # PromptRow.lora_index of a row on the base model


@dataclass(frozen=True)
class JobAdapter:
    """One adapter of a planned job, pinned to what planning checked."""

    name: str
    path: str  # an absolute directory, or a Hub repo id
    revision: str | None  # the Hub commit planning resolved (None: a local directory)
    weights_hash: str

    @property
    def request(self) -> LoRARequest:
        return LoRARequest(self.name, self.path, self.revision)


def parse_adapter_location(name: str, location: Any) -> tuple[str, str | None]:
    """(path or repo id, revision) of a `lora` entry: a directory, "org/name" or
    "org/name@revision" (an existing path is taken as it is, "@" and all).

    Raises:
        ValueError: the location is not a non-empty string.
    """
    if isinstance(location, os.PathLike):
        location = os.fspath(location)
    if not isinstance(location, str) or not location:
        raise ValueError(f"lora {name!r}: give a directory or Hub repo id, got {location!r}")
    if Path(location).expanduser().exists() or "@" not in location:
        return location, None
    repo, _, revision = location.rpartition("@")
    return repo, revision or None


def check_lora_option(lora: Mapping[str, Any]) -> None:
    """Raise ValueError for a bad `lora` entry (before anything is read)."""
    for name, location in lora.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"lora names must be non-empty strings, got {name!r}")
        parse_adapter_location(name, location)


def describe_job_adapters(
    lora: Mapping[str, Any],
    model_config: Any,
    *,
    model_names: frozenset[str] | None,
    max_rank: int,
) -> list[JobAdapter]:
    """Every adapter of the `lora` option, in name order, checked against the model.

    Raises:
        ValueError (AdapterError): an adapter is missing, stored only as pickle, not a
            plain LoRA or does not fit the model; the message names it.
    """
    adapters = []
    for name in sorted(lora):
        path, revision = parse_adapter_location(name, lora[name])
        description = describe_adapter(
            name, path, model_config, revision=revision, model_names=model_names, max_rank=max_rank
        )
        local = description.revision is None
        adapters.append(
            JobAdapter(
                name=name,
                path=str(description.path) if local else path,
                revision=description.revision,
                weights_hash=description.weights_hash,
            )
        )
    return adapters


def lora_requests(adapters: Sequence[JobAdapter]) -> list[LoRARequest | None]:
    """By lora index: None (the base model), then each adapter's request."""
    return [None, *(a.request for a in adapters)]


def adapter_names(adapters: Sequence[JobAdapter]) -> list[str | None]:
    """By lora index: None (the base model), then each adapter's name."""
    return [None, *(a.name for a in adapters)]


def row_adapters(
    names: Sequence[Any], adapters: Sequence[JobAdapter], *, strict: bool
) -> list[tuple[int, str | None]]:
    """Each row's (lora index, error) from the adapter names its rows give.

    Args:
        names: one per row: an adapter name, or None for the base model.
        adapters: the job's adapters.
        strict: a name that is not an adapter makes its row an error (`lora_column`);
            otherwise it means the base model (an OpenAI batch line's body.model, which
            names the model itself when it is not an adapter).
    """
    index = {a.name: i for i, a in enumerate(adapters, start=1)}
    known = ", ".join(index) or "none"
    rows = []
    for name in names:
        if name is None:
            rows.append((BASE_INDEX, None))
        elif isinstance(name, str) and name in index:
            rows.append((index[name], None))
        elif strict:
            rows.append(
                (
                    BASE_INDEX,
                    f"LoRA adapter {name!r} is not one of the job's adapters ({known}); "
                    "register it with --lora NAME=PATH",
                )
            )
        else:
            rows.append((BASE_INDEX, None))
    return rows
