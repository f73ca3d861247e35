"""The fate table held to the `openai` package: every request field of the package's own
types has a fate in connectors/openai_fields.py, and every field there (but vLLM's
extensions) is one the package still has.

The dev extras pin openai to one minor release. An upgrade that adds or drops a field
fails here with the decision to make, field by field; after deciding, the tables, the
samples in test_openai_fields.py and this pin move together.
"""

from __future__ import annotations

import importlib
import typing
from pathlib import Path

import openai
import pytest
import tomllib
from packaging.requirements import Requirement

from tokenmill.connectors.openai_fields import (
    CHAT_URL,
    COMPLETIONS_URL,
    EMBEDDINGS_FIELDS,
    EMBEDDINGS_URL,
    FIELDS,
    RESPONSES_URL,
    Field,
)

# Each endpoint's request type in the package: (module, name).
PACKAGE_TYPES = {
    CHAT_URL: ("openai.types.chat.completion_create_params", "CompletionCreateParams"),
    COMPLETIONS_URL: ("openai.types.completion_create_params", "CompletionCreateParams"),
    RESPONSES_URL: ("openai.types.responses.response_create_params", "ResponseCreateParams"),
    EMBEDDINGS_URL: ("openai.types.embedding_create_params", "EmbeddingCreateParams"),
}
TABLES: dict[str, tuple[Field, ...]] = {
    **{url: tuple(table.values()) for url, table in FIELDS.items()},
    EMBEDDINGS_URL: EMBEDDINGS_FIELDS,
}
REPO = Path(__file__).resolve().parents[2]


def package_fields(module: str, name: str) -> set[str]:
    """The keys of a request TypedDict; a union (streaming or not) gives all its members'."""
    params = getattr(importlib.import_module(module), name)
    members = typing.get_args(params) or (params,)
    return {key for member in members for key in typing.get_type_hints(member)}


def fate_decisions(url: str, table: tuple[Field, ...], known: set[str], where: str) -> list[str]:
    """What to decide for each field where the table and the package part (empty: none)."""
    ours = {f.name: f for f in table}
    decisions = [
        f"{url}: {where} has `{name}`, which the table lacks - decide its fate in "
        "connectors/openai_fields.py: honoured (a Field whose convert fills the row's "
        "columns), ignored (it cannot change the answer: say why), or refused (the "
        "error line names it) - and give it a sample in test_openai_fields.py"
        for name in sorted(known - set(ours))
    ]
    decisions += [
        f"{url}: {where} no longer has `{name}` ({ours[name].fate} here) - decide: "
        "remove its Field (a line with it is then refused as an unknown field), or keep "
        "it as an extension (extension=True) saying whose it is"
        for name in sorted(set(ours) - known)
        if not ours[name].extension
    ]
    decisions += [
        f"{url}: {where} now has `{name}`, kept here as vLLM's extension - check that "
        "OpenAI's meaning is the one honoured, then drop extension=True"
        for name in sorted(set(ours) & known)
        if ours[name].extension
    ]
    return decisions


@pytest.mark.parametrize("url", list(PACKAGE_TYPES))
def test_every_package_field_has_a_fate_and_no_fate_is_stale(url):
    module, name = PACKAGE_TYPES[url]
    where = f"openai {openai.__version__}'s {module}.{name}"
    known = package_fields(module, name)
    assert known, where  # the type was found and read
    decisions = fate_decisions(url, TABLES[url], known, where)
    assert not decisions, "\n" + "\n".join(decisions)


def test_the_decisions_name_each_field_that_parts():
    """The check itself: a field the package adds, one it drops and an extension it
    adopts each come back as a decision naming the field."""
    table = (
        Field("model", "ignored", ""),
        Field("gone", "ignored", ""),
        Field("top_k", "honoured", "", extension=True),
    )
    decisions = fate_decisions("/v1/x", table, {"model", "fresh", "top_k"}, "openai 9.9's X")
    assert [d.split(" - ")[0] for d in decisions] == [
        "/v1/x: openai 9.9's X has `fresh`, which the table lacks",
        "/v1/x: openai 9.9's X no longer has `gone` (ignored here)",
        "/v1/x: openai 9.9's X now has `top_k`, kept here as vLLM's extension",
    ]


def test_the_installed_openai_is_the_pinned_minor_release():
    """The fates were decided against the pinned release: another one installed (a
    different minor) may add or drop fields without this suite being the one to say so."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    dev = pyproject["project"]["optional-dependencies"]["dev"]
    (pin,) = [Requirement(r) for r in dev if Requirement(r).name == "openai"]
    assert pin.specifier.contains(openai.__version__), (
        f"openai {openai.__version__} is installed; the dev extras pin {pin}"
    )
    # One minor release: a lower and an upper bound, the upper the next minor.
    bounds = {s.operator: s.version for s in pin.specifier}
    assert set(bounds) == {">=", "<"}, pin
    low, high = (tuple(int(x) for x in bounds[op].split(".")[:2]) for op in (">=", "<"))
    assert high == (low[0], low[1] + 1), pin
