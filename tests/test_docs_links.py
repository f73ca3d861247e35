"""The docs' pointers hold: every place the code sends a reader exists, and so does every
file the docs name.

- A comment or message that points to a docs page ("docs/design.md, 'Decode attention'",
  or a `#anchor`) names a page of docs/ and a heading on it.
- Nothing points to the headings of a README or of DESIGN.md any more: reasons live on
  the docs' Design page, figures on its Performance page.
- Every repository path a docs page (or a README) names exists, and so does every
  top-level path a code comment names - so a moved module shows up here, not in a
  reader's dead end.
- The Contributing page's layout names every engine package and every architecture.

Everything here reads files; nothing is imported from the package but the docs' hook.
"""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Folders whose files may hold pointers, and single files at the root.
CODE_FOLDERS = (
    "engine",
    "connectors",
    "pipelines",
    "flows",
    "tokenmill",
    "benchmarks",
    "examples",
    "tests",
    ".ci",
)
CODE_SUFFIXES = {".py", ".c", ".h", ".sh", ".toml", ".yaml", ".yml", ""}
ROOT_FILES = ("pyproject.toml", "mkdocs.yml")
# Markdown outside docs/ whose paths and links are checked like the pages'.
OTHER_MARKDOWN = ("README.md", "benchmarks/README.md", "flows/README.md")
THIS_FILE = Path(__file__).resolve()

TOP_LEVEL = r"(?:engine|connectors|pipelines|flows|tokenmill|tests|benchmarks|examples|docs)"
# A repository path: a top-level folder, then names; not part of a URL or a longer path.
REPO_PATH = re.compile(rf"(?<![\w./:-]){TOP_LEVEL}/[\w./-]*")
FILE_SUFFIXES = {".py", ".c", ".h", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".json"}
POINTER = re.compile(r"docs/([\w-]+\.md)(#[\w-]+)?")
QUOTED = re.compile(r"""\s*(?:,|\band\b|\()?\s*["“']([^"”']+)["”']""")
STALE = [
    (re.compile(r"benchmarks/README"), "benchmarks/README.md holds no results or reasons"),
    (re.compile(r"README(?:\.md)?(?:,\s*|\s+)\(?[\"“']"), "a README heading"),
    (re.compile(r"DESIGN\.md"), "DESIGN.md is not in the repository"),
]


def code_files() -> list[Path]:
    files = [ROOT / name for name in ROOT_FILES]
    for folder in CODE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if (
                path.is_file()
                and path.suffix in CODE_SUFFIXES
                and "__pycache__" not in path.parts
                and path.resolve() != THIS_FILE
            ):
                files.append(path)
    return files


def joined(text: str) -> str:
    """A source file's text with comment markers dropped and lines joined by one space,
    so that a pointer wrapped over two comment lines reads as one."""
    lines = []
    for line in text.splitlines():
        line = line.strip()
        line = re.sub(r"^(?:/\*+|\*+/?|//+|#+)\s?", "", line)
        lines.append(line)
    return " ".join(lines)


def slug(text: str) -> str:
    """Python-Markdown's toc slug of a heading, as MkDocs makes the anchor."""
    text = unicodedata.normalize("NFKD", text.replace("`", "")).encode("ascii", "ignore")
    text = re.sub(r"[^\w\s-]", "", text.decode()).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def headings(page: str) -> set[str]:
    """The headings of a docs page, as written (code marks dropped), outside code blocks."""
    found, fenced = set(), False
    for line in (DOCS / page).read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.add(line.lstrip("#").strip().replace("`", ""))
    return found


def pointers(text: str) -> list[tuple[str, str | None, list[str]]]:
    """(page, anchor, quoted headings) for every docs/ pointer in a text."""
    found = []
    for match in POINTER.finditer(text):
        page, anchor = match.group(1), match.group(2)
        quoted, rest = [], text[match.end() :]
        while (heading := QUOTED.match(rest)) is not None:
            quoted.append(heading.group(1))
            rest = rest[heading.end() :]
        found.append((page, anchor, quoted))
    return found


def check_pointer(where: str, page: str, anchor: str | None, quoted: list[str]) -> list[str]:
    if not (DOCS / page).is_file():
        return [f"{where}: docs/{page} does not exist"]
    problems = []
    names = headings(page)
    if anchor and anchor[1:] not in {slug(name) for name in names}:
        problems.append(f"{where}: docs/{page} has no heading with anchor {anchor}")
    for heading in quoted:
        if heading not in names:
            problems.append(f"{where}: docs/{page} has no heading {heading!r}")
    return problems


def test_code_pointers_name_docs_pages_and_headings_that_exist():
    problems, count = [], 0
    for path in code_files():
        where = str(path.relative_to(ROOT))
        for page, anchor, quoted in pointers(joined(path.read_text(errors="replace"))):
            count += 1
            problems += check_pointer(where, page, anchor, quoted)
    assert problems == []
    assert count >= 40  # the kernels', quantization's and the harness's "why" pointers


def test_nothing_points_to_a_readme_heading_or_design_md():
    problems = []
    for path in code_files():
        text = joined(path.read_text(errors="replace"))
        for pattern, why in STALE:
            for match in pattern.finditer(text):
                around = text[max(0, match.start() - 40) : match.end() + 40]
                problems.append(f"{path.relative_to(ROOT)}: {why}: ...{around}...")
    assert problems == []


def repo_path_exists(path: str) -> bool:
    path = path.rstrip(".,")
    if (ROOT / path).exists():
        return True
    # engine/loader/pooling_config.served_tasks: a module, then a name in it.
    module, _, _ = path.partition(".")
    return Path(path).suffix not in FILE_SUFFIXES and (ROOT / f"{module}.py").is_file()


def markdown_files() -> list[Path]:
    return sorted(DOCS.glob("*.md")) + [ROOT / name for name in OTHER_MARKDOWN]


def test_paths_the_docs_name_exist():
    missing = []
    for path in markdown_files():
        for code in re.findall(r"`([^`\n]+)`|```.*?```", path.read_text(), flags=re.S):
            for found in REPO_PATH.findall(code):
                if not repo_path_exists(found):
                    missing.append(f"{path.relative_to(ROOT)}: {found}")
    assert missing == []


def test_links_from_readmes_into_the_docs_resolve():
    problems = []
    for name in OTHER_MARKDOWN:
        path = ROOT / name
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if target.startswith(("http://", "https://", "#")):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve()
            if not resolved.exists():
                problems.append(f"{name}: {target} does not exist")
            elif anchor and resolved.parent == DOCS:
                names = headings(resolved.name)
                if anchor not in {slug(n) for n in names}:
                    problems.append(f"{name}: {target}: no such heading")
    assert problems == []


def test_paths_named_in_code_comments_exist():
    """Top-level paths in comments and docstrings (engine/..., pipelines/...) exist."""
    missing = []
    for path in code_files():
        text = joined(path.read_text(errors="replace"))
        for found in REPO_PATH.findall(text):
            if "." not in found:
                continue  # prose ("engine/tokenmill changes") or a folder
            if not repo_path_exists(found):
                missing.append(f"{path.relative_to(ROOT)}: {found}")
    assert missing == []


def test_the_layout_names_every_engine_package_and_architecture():
    layout = (DOCS / "contributing.md").read_text()
    packages = sorted(
        str(init.parent.relative_to(ROOT)) + "/" for init in (ROOT / "engine").glob("*/__init__.py")
    )
    architectures = sorted(
        path.name
        for path in (ROOT / "engine" / "models").glob("*.py")
        if path.name not in {"__init__.py", "config.py", "registry.py"}
    )
    assert [p for p in packages if f"`{p}`" not in layout] == []
    assert [a for a in architectures if f"`{a}`" not in layout] == []


def load_hook():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_page_renders_its_generated_tables(page):
    rendered = load_hook().render(page)
    assert load_hook().MARKER.search(rendered) is None
