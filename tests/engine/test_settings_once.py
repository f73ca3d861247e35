"""Engine settings are declared once, in EngineConfig: no function of the engine or the
pipeline gives a parameter named after a setting a default of its own. Internal
constructors take the config object; where a parameter keeps a default for callers
that have no config (tests, tools), it is the declaration itself
(`EngineConfig.<setting>`), never a restated value."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from tokenmill.engine.types.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
# dtype and device are torch objects by the time a function takes them (the settings
# are resolved in LLM), so a parameter of that name is not the setting.
RESOLVED = {"dtype", "device"}


def _defaults(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            positional = args.posonlyargs + args.args
            with_defaults = positional[len(positional) - len(args.defaults) :]
            yield from ((node, a, d) for a, d in zip(with_defaults, args.defaults))
            yield from (
                (node, a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None
            )


def test_no_engine_setting_default_is_restated():
    settings = {f.name for f in fields(EngineConfig)} - RESOLVED
    restated = []
    for folder in ("engine", "pipelines"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node, arg, default in _defaults(ast.parse(path.read_text(encoding="utf-8"))):
                if arg.arg in settings and ast.unparse(default) != f"EngineConfig.{arg.arg}":
                    restated.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                        f"({arg.arg}={ast.unparse(default)})"
                    )
    assert restated == []
