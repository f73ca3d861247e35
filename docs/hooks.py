"""MkDocs hook: the reference tables the code declares, written into the pages at build.

A page asks for a table with a marker line, `<!-- generated: NAME -->`, and the build
replaces the marker with the table made from its one declaration, so the docs never
restate (and never drift from) what the code says:

    job-options       every job option, by section      pipelines/options.py, OPTIONS
    engine-settings   every LLM(...) setting             engine/types/config.py, EngineConfig
    sampling-params   every SamplingParams field         engine/types/sampling_params.py
    environment       every TOKENMILL_* variable         engine/env.py, SWITCHES
    openai-fields     the OpenAI batch field-fate tables connectors/openai_fields.py

An unknown marker name fails the build. mkdocs.yml names this file under `hooks:` and
keeps it out of the site (`exclude_docs`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)

# The order sections appear in on the Jobs page, and their titles; a section the table
# does not know yet is listed after these under its own name.
SECTIONS = {
    "input": "Input",
    "prompts": "Prompts",
    "sampling": "Sampling and structured outputs",
    "pooling": "Embeddings, classification, reranking",
    "model": "Model and engine",
    "costs": "Prices",
    "run": "Running the job",
}
# Where an option is offered, as a reader knows each surface; the common sets by one word
# (the Jobs page says what each means).
SURFACE_NAMES = {
    "cli": "`run`",
    "flow": "flow",
    "job": "`run_job`",
    "notebook": "`generate`",
}
SURFACE_SETS = {
    frozenset(SURFACE_NAMES): "all",
    frozenset({"cli", "flow", "job"}): "jobs",
    frozenset({"job", "notebook"}): "Python",
}


def _cell(text: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(value: Any) -> str:
    if value is None or value == ():
        return "-"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def job_options_table() -> str:
    """Every job option, grouped by section: flag and keyword, default, surfaces, help."""
    from tokenmill.pipelines.options import OPTIONS

    by_section: dict[str, list] = {}
    for option in OPTIONS:
        by_section.setdefault(option.section, []).append(option)
    order = [s for s in SECTIONS if s in by_section] + [s for s in by_section if s not in SECTIONS]
    lines = []
    for section in order:
        lines += [
            f"#### {SECTIONS.get(section, section.capitalize())}",
            "",
            "| option | default | on | what it does |",
            "|---|---|---|---|",
        ]
        for option in by_section[section]:
            name = f"`{option.name}`"
            if "cli" in option.surfaces:
                flag = option.flag or "--" + option.name.replace("_", "-")
                name = " / ".join(f"`{f}`" for f in flag.split("/")) + f"<br>{name}"
            surfaces = SURFACE_SETS.get(frozenset(option.surfaces)) or ", ".join(
                SURFACE_NAMES[s] for s in SURFACE_NAMES if s in option.surfaces
            )
            if option.per_row:
                surfaces += ", per OpenAI line"
            lines.append(
                f"| {name} | {_cell(_default(option.default))} | {surfaces} "
                f"| {_cell(option.help)} |"
            )
        lines.append("")
    return "\n".join(lines)


def engine_settings_table() -> str:
    """Every engine setting: `LLM(name=...)`, its default, and its help text."""
    from tokenmill.engine import engine_settings

    lines = ["| setting | default | job option | what it does |", "|---|---|---|---|"]
    for setting in engine_settings():
        default = setting.default if setting.default is not MISSING else setting.default_factory()
        job = "yes" if setting.metadata.get("job") else "via `engine_options`"
        lines.append(
            f"| `{setting.name}` | {_cell(_default(default))} | {job} "
            f"| {_cell(setting.metadata['help'])} |"
        )
    return "\n".join(lines) + "\n"


def sampling_params_table() -> str:
    """Every SamplingParams field: its default, whether a job offers it, and its help."""
    from tokenmill.engine import SamplingParams

    lines = ["| field | default | job option | what it does |", "|---|---|---|---|"]
    for param in fields(SamplingParams):
        if param.default is not MISSING:
            default = param.default
        else:
            default = param.default_factory()
        job = "yes" if param.metadata.get("job") else "-"
        lines.append(
            f"| `{param.name}` | {_cell(_default(default))} | {job} "
            f"| {_cell(param.metadata.get('help', ''))} |"
        )
    return "\n".join(lines) + "\n"


def environment_table() -> str:
    """Every TOKENMILL_* variable the engine reads, with its value when unset."""
    from tokenmill.engine import env

    lines = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for switch in env.SWITCHES:
        # The cache's default is under the reader's home, not the machine that built this.
        default = "~/.cache/tokenmill" if switch is env.CACHE_DIR else switch.default
        lines.append(f"| `{switch.name}` | `{default}` | {_cell(switch.help)} |")
    return "\n".join(lines) + "\n"


def openai_fields_table() -> str:
    """The OpenAI batch field-fate tables, one per endpoint."""
    from tokenmill.connectors.openai_fields import fate_table

    return fate_table()


TABLES: dict[str, Callable[[], str]] = {
    "job-options": job_options_table,
    "engine-settings": engine_settings_table,
    "sampling-params": sampling_params_table,
    "environment": environment_table,
    "openai-fields": openai_fields_table,
}


def expand(markdown: str, where: str = "a page") -> str:
    """`markdown` with each marker replaced by its table.

    Raises:
        ValueError: a marker names no table (the name and the page say which).
    """

    def table(match: re.Match) -> str:
        name = match.group(1)
        if name not in TABLES:
            raise ValueError(
                f"{where}: unknown generated table {name!r}; known: {', '.join(TABLES)}"
            )
        return TABLES[name]()

    return MARKER.sub(table, markdown)


def render(page: str | Path) -> str:
    """A page of docs/ as the site shows it (its tables generated)."""
    path = Path(__file__).parent / page
    return expand(path.read_text(), str(page))


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    """MkDocs' hook: called with each page's Markdown before it is converted."""
    return expand(markdown, page.file.src_uri)
