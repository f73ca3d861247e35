"""The wheel maps the design card's folders into the one import root, `tokenmill`."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_wheel_installs_subpackages_under_tokenmill(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(REPO),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("tokenmill-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in (
        "engine/api/llm.py",
        "engine/models/llama.py",
        "engine/kernels/paged_attention.c",  # the native kernels build from the wheel's
        "engine/kernels/kernel_common.h",  # own sources on first use
        "connectors/__init__.py",
        "pipelines/__init__.py",
        "flows/__init__.py",
        "cli/__init__.py",
    ):
        assert f"tokenmill/{module}" in names
    top_level = {name.split("/")[0] for name in names if not name.startswith("tokenmill-")}
    assert top_level == {"tokenmill"}, top_level  # nothing called `engine` in site-packages

    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
    )
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import tokenmill.engine.api.llm as m, tokenmill.cli as c;"
        "assert m.__file__.startswith(sys.argv[1]), m.__file__;"
        "from tokenmill import LLM, SamplingParams;"
        "from tokenmill.engine.kernels import native_library;"
        "assert native_library() is not None, 'kernels did not build from the wheel';"
        "print('ok')"
    )
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path / "cache")}  # a fresh build
    result = subprocess.run(
        [sys.executable, "-c", probe, str(target)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_every_package_folder_is_in_the_package_list():
    """pyproject lists packages one by one (the folders map into `tokenmill`): a folder
    with an __init__.py that the list misses would be left out of the wheel."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]
    roots = {folder: package for package, folder in package_dir.items() if "/" not in folder}
    found = set()
    for folder, package in roots.items():
        for init in (REPO / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *parts)))
    assert sorted(setuptools["packages"]) == sorted(found)
