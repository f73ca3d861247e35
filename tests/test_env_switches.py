"""Every TOKENMILL_* variable the engine reads is declared in engine/env.py, read nowhere
else, and documented on the docs' Engine API page with its default."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tokenmill.engine import env

ROOT = Path(__file__).resolve().parents[1]


def test_the_engine_reads_the_environment_only_in_env_py():
    readers = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "engine").rglob("*.py")
        if path.name != "env.py"
        and re.search(r"(environ|getenv)\W[^\n]*TOKENMILL_", path.read_text())
    ]
    assert readers == []


def test_the_docs_list_every_switch_with_its_default():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = hooks.render("engine-api.md")  # its table is generated from env.SWITCHES
    for switch in env.SWITCHES:
        default = "~/.cache/tokenmill" if switch is env.CACHE_DIR else switch.default
        assert f"| `{switch.name}` | `{default}` |" in page, switch.name
