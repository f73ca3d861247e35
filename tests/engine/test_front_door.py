"""`tokenmill.engine`, the one door into the engine: every exported name resolves to its
definition, what type checkers see is what is exported, and importing the door (or the
CLI) loads no torch."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import tokenmill.engine as engine

DOOR = Path(engine.__file__)


def test_every_export_is_the_object_its_module_defines():
    for name, module in engine._EXPORTS.items():
        assert getattr(engine, name) is getattr(importlib.import_module(module), name), name
    assert sorted(engine.__all__) == sorted(engine._EXPORTS)
    assert set(engine.__all__) <= set(dir(engine))


def test_an_unknown_name_is_refused_by_name():
    with pytest.raises(AttributeError, match="has no attribute 'Scheduler'"):
        engine.Scheduler  # noqa: B018


def test_type_checkers_see_exactly_the_exports():
    """The TYPE_CHECKING block imports each exported name from its module - no more."""
    tree = ast.parse(DOOR.read_text(encoding="utf-8"))
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
    ]
    seen = {
        alias.name: node.module
        for node in ast.walk(block)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert seen == engine._EXPORTS


@pytest.mark.parametrize("module", ["tokenmill", "tokenmill.engine", "tokenmill.cli"])
def test_importing_the_door_loads_no_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_package_root_re_exports_the_engine_through_its_door():
    import tokenmill

    assert tokenmill.LLM is engine.LLM
    assert tokenmill.SamplingParams is engine.SamplingParams
