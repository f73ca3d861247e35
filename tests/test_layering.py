"""The import graph: no cycles anywhere, the engine's layers import only downwards, and
everything outside the engine comes in through its front door (`tokenmill.engine`).

Every module of the package is parsed (nothing is imported), and every import counts -
at module top, inside functions, or under TYPE_CHECKING. Each rule is a function that
lists what breaks it; the tests expect empty lists of the real tree, and a negative
control expects each rule to find the one fault planted for it in a copy of the tree
(a checker that silently finds nothing fails there). Run this file as a script to print
the engine's floors with their files and line counts, and the front door's count.
"""

from __future__ import annotations

import ast
import functools
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Top-level folders -> the import names they are mapped to (pyproject's package-dir).
PACKAGES = {
    "tokenmill": "tokenmill",
    "engine": "tokenmill.engine",
    "connectors": "tokenmill.connectors",
    "pipelines": "tokenmill.pipelines",
    "flows": "tokenmill.flows",
}

# The engine's floors, top to bottom (engine/__init__.py lists the folders): a module may
# import modules of its own floor or of floors below it, never above. "parts" are what a
# step runs with, beside the worker that runs it: sampling, LoRA, pooling.
ENGINE_FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("api", ("tokenmill.engine.api",)),
    ("worker", ("tokenmill.engine.worker",)),
    ("parts", ("tokenmill.engine.sample", "tokenmill.engine.lora", "tokenmill.engine.pooling")),
    ("quant", ("tokenmill.engine.quant",)),
    ("loader", ("tokenmill.engine.loader",)),
    ("models", ("tokenmill.engine.models",)),
    ("core", ("tokenmill.engine.core",)),
    ("kernels", ("tokenmill.engine.kernels", "tokenmill.engine.cuda")),
    ("base", ("tokenmill.engine.types", "tokenmill.engine.env")),
)
# Modules outside the engine that may import below its front door, each with the reason.
# (None: the pipeline, connectors, flows, CLI and bench harness use `tokenmill.engine`.)
FRONT_DOOR_EXCEPTIONS: dict[str, str] = {}
# A benchmark script that imports below the front door (a kernel micro-benchmark) says why
# in a comment that begins with this.
BENCHMARK_REASON = "# Below the front door:"

# Third-party modules the engine may import inside a function: heavy, and needed only by
# some jobs (each deferral says why where it is made).
DEFERRED_IMPORTS = ("llguidance", "huggingface_hub", "tokenmill.engine.cuda.triton_kernels")


@dataclass
class Module:
    name: str
    path: Path
    imports: set[str] = field(default_factory=set)
    deferred: set[str] = field(default_factory=set)  # imported inside a function


def load_modules(*roots: Path) -> dict[str, Module]:
    """Every module of the package by import name, with what it imports: the modules
    under ROOT, or under each of `roots` in turn (a later root's modules join them)."""
    modules = {}
    for root in roots or (ROOT,):
        for folder, package in PACKAGES.items():
            for path in sorted((root / folder).rglob("*.py")):
                parts = path.relative_to(root / folder).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                name = ".".join((package, *parts))
                modules[name] = Module(name, path)
    for module in modules.values():
        _read_imports(module, modules)
    return modules


@functools.cache
def _import_statements(path: Path, name: str) -> tuple[tuple[str, tuple[str, ...], bool], ...]:
    """Each import of a file as (module, the names imported from it - empty for `import
    module` -, whether it sits inside a function); relative imports made absolute.
    Parsed once per file: the tests read the same tree many times."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for n in ast.walk(node) if n is not node}
    is_package = path.name == "__init__.py"
    statements = []
    for node in ast.walk(tree):
        deferred = id(node) in in_function
        if isinstance(node, ast.Import):
            statements += [(alias.name, (), deferred) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.split(".")
                keep = len(parent) - node.level + (1 if is_package else 0)
                base = ".".join(parent[:keep] + ([base] if base else []))
            statements.append((base, tuple(alias.name for alias in node.names), deferred))
    return tuple(statements)


def _read_imports(module: Module, modules: dict[str, Module]) -> None:
    for base, names, deferred in _import_statements(module.path, module.name):
        # `from package import submodule` imports the submodule, not the package body.
        subs = [f"{base}.{name}" for name in names]
        known = [s for s in subs if s in modules]
        targets = known if subs and len(known) == len(subs) else [base, *known]
        for target in targets:
            if deferred:
                module.deferred.add(target)
            if target in modules and target != module.name:
                module.imports.add(target)


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(name: str) -> None:
        index[name] = low[name] = len(index)
        stack.append(name)
        on_stack.add(name)
        for target in sorted(modules[name].imports):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in on_stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == name:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def engine_floor(name: str) -> int | None:
    """The floor of an engine module (0 = top); None for modules outside the engine."""
    best, floor = -1, None
    for number, (_, prefixes) in enumerate(ENGINE_FLOORS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), number
    return floor


def _engine_modules(modules: dict[str, Module]) -> list[Module]:
    return [
        m
        for n, m in modules.items()
        if n == "tokenmill.engine" or n.startswith("tokenmill.engine.")
    ]


# -- the rules: each lists what breaks it ------------------------------------------------


def floorless(modules: dict[str, Module]) -> list[str]:
    """Engine modules in no floor."""
    return [
        m.name
        for m in _engine_modules(modules)
        if m.name != "tokenmill.engine" and engine_floor(m.name) is None
    ]


def upward_imports(modules: dict[str, Module]) -> list[str]:
    """Engine imports of a module on a higher floor."""
    return [
        f"{m.name} -> {target}"
        for m in _engine_modules(modules)
        if m.name != "tokenmill.engine" and engine_floor(m.name) is not None
        for target in sorted(m.imports)
        if target.startswith("tokenmill.engine.")
        and engine_floor(target) is not None
        and engine_floor(target) < engine_floor(m.name)
    ]


def engine_imports_of_the_rest(modules: dict[str, Module]) -> list[str]:
    """Engine imports of the pipeline, connectors, flows or CLI."""
    return [
        f"{m.name} -> {target}"
        for m in _engine_modules(modules)
        for target in sorted(m.imports)
        if target.startswith("tokenmill.") and not target.startswith("tokenmill.engine")
    ]


def undeclared_deferred_imports(modules: dict[str, Module]) -> list[str]:
    """Engine imports inside functions that are not the declared heavy ones."""
    return sorted(
        f"{m.name}: {target}"
        for m in _engine_modules(modules)
        for target in m.deferred
        if not target.startswith(DEFERRED_IMPORTS)
    )


def engine_imports_of_its_door(modules: dict[str, Module]) -> list[str]:
    """Engine modules importing `tokenmill.engine` itself."""
    return [
        m.name
        for m in _engine_modules(modules)
        if m.name != "tokenmill.engine" and "tokenmill.engine" in m.imports
    ]


def test_no_module_imports_itself_in_a_loop():
    assert cycles(load_modules()) == []


def test_every_engine_module_has_a_floor():
    assert floorless(load_modules()) == []


def test_the_engine_imports_only_downwards():
    assert upward_imports(load_modules()) == []


def test_the_engine_imports_nothing_of_the_pipeline_or_the_cli():
    assert engine_imports_of_the_rest(load_modules()) == []


def test_engine_imports_inside_functions_are_the_deferred_heavy_ones():
    assert undeclared_deferred_imports(load_modules()) == []


def _outside_imports_of_internals(modules: dict[str, Module]) -> list[str]:
    return [
        f"{m.name} -> {target}"
        for n, m in sorted(modules.items())
        if not (n == "tokenmill.engine" or n.startswith("tokenmill.engine."))
        and n not in FRONT_DOOR_EXCEPTIONS
        for target in sorted(m.imports)
        if target.startswith("tokenmill.engine.")
    ]


def test_outside_the_engine_only_its_front_door_is_imported():
    """pipelines/, connectors/, flows/ and tokenmill/ (the CLI and the bench harness)
    import `from tokenmill.engine import ...`, never a module below it."""
    assert _outside_imports_of_internals(load_modules()) == []


def test_the_engine_never_imports_its_own_front_door():
    """Inside, modules import each other directly: through the door they would loop."""
    assert engine_imports_of_its_door(load_modules()) == []


# One planted fault per rule: (file under the copied tree, its text). The paths start
# with "./": they name no file of the repository (test_docs_links checks those that do).
PLANTED = {
    # An upward import, in a module nothing imports (so no cycle): core -> api.
    "./engine/core/planted_upward.py": "from tokenmill.engine.api import llm\n",
    # A module in a folder that is no floor.
    "./engine/planted_floor/orphan.py": "X = 1\n",
    # The engine reaching into the pipeline.
    "./engine/models/planted_pipeline.py": "import tokenmill.pipelines.job\n",
    # An import hidden inside a function that is not a declared heavy one.
    "./engine/loader/planted_deferred.py": (
        "def load():\n    from tokenmill.engine.models import registry\n    return registry\n"
    ),
    # The engine through its own front door.
    "./engine/core/planted_door.py": "from tokenmill.engine import LLM\n",
    # The pipeline below the front door.
    "./pipelines/planted_internals.py": "from tokenmill.engine.core import scheduler\n",
    # Two modules importing each other, one of them relatively.
    "./connectors/planted_a.py": "from tokenmill.connectors import planted_b\n",
    "./connectors/planted_b.py": "from . import planted_a\n",
}


def test_each_rule_finds_the_fault_planted_for_it(tmp_path):
    """The negative control: the tree with PLANTED added beside it; each rule reports its
    planted fault and nothing else, so a rule that can no longer see imports fails here
    while the real tree stays green."""
    for relative, text in PLANTED.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    modules = load_modules(ROOT, tmp_path)
    assert {str(Path(p)) for p in PLANTED} <= {
        str(m.path.relative_to(tmp_path))
        for m in modules.values()
        if m.path.is_relative_to(tmp_path)
    }
    assert cycles(modules) == [["tokenmill.connectors.planted_a", "tokenmill.connectors.planted_b"]]
    assert floorless(modules) == ["tokenmill.engine.planted_floor.orphan"]
    assert upward_imports(modules) == [
        "tokenmill.engine.core.planted_upward -> tokenmill.engine.api.llm"
    ]
    assert engine_imports_of_the_rest(modules) == [
        "tokenmill.engine.models.planted_pipeline -> tokenmill.pipelines.job"
    ]
    assert undeclared_deferred_imports(modules) == [
        "tokenmill.engine.loader.planted_deferred: tokenmill.engine.models.registry"
    ]
    assert engine_imports_of_its_door(modules) == ["tokenmill.engine.core.planted_door"]
    assert _outside_imports_of_internals(modules) == [
        "tokenmill.pipelines.planted_internals -> tokenmill.engine.core.scheduler"
    ]


def test_benchmarks_below_the_front_door_say_why():
    """Only kernel micro-benchmarks import engine internals, each saying why."""
    modules = load_modules()
    silent = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        reaches = any(
            name.startswith("tokenmill.engine.")
            for node in ast.walk(tree)
            for name in _imported_modules(node, modules)
        )
        if reaches and BENCHMARK_REASON not in path.read_text(encoding="utf-8"):
            silent.append(path.name)
    assert silent == []


def _imported_modules(node: ast.AST, modules: dict[str, Module]) -> list[str]:
    """The modules an import statement of a script loads (a name imported from a package
    counts when it is a submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module:
        subs = [f"{node.module}.{alias.name}" for alias in node.names]
        return [node.module, *(s for s in subs if s in modules)]
    return []


def _report() -> None:
    modules = load_modules()
    engine = _engine_modules(modules)
    print(f"{len(modules)} modules, {len(cycles(modules))} cycles")
    for number, (floor, _) in enumerate(ENGINE_FLOORS):
        members = sorted(
            (m for m in engine if engine_floor(m.name) == number), key=lambda m: m.name
        )
        lines = sum(len(m.path.read_text().splitlines()) for m in members)
        names = ", ".join(m.name.removeprefix("tokenmill.engine.") for m in members)
        print(f"{number} {floor:8} {len(members):3} files {lines:6} lines: {names}")
    edges = defaultdict(set)
    for m in engine:
        for target in m.imports:
            if engine_floor(m.name) is not None and engine_floor(target) is not None:
                edges[ENGINE_FLOORS[engine_floor(m.name)][0]].add(
                    ENGINE_FLOORS[engine_floor(target)][0]
                )
    for floor, below in edges.items():
        print(f"  {floor} imports {', '.join(sorted(below - {floor}))}")
    upward = sum(
        1
        for m in engine
        if m.name != "tokenmill.engine"
        for target in m.imports
        if target.startswith("tokenmill.engine.") and engine_floor(target) < engine_floor(m.name)
    )
    print(f"{upward} upward imports")
    outside = _outside_imports_of_internals(modules)
    print(
        f"{len(outside)} imports of engine internals from outside the engine "
        f"(allow-list: {len(FRONT_DOOR_EXCEPTIONS)})"
    )
    for line in outside:
        print(f"  {line}")


if __name__ == "__main__":
    _report()
