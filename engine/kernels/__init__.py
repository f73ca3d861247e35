"""Native CPU kernels, compiled on first use with the system C compiler.

Every .c file here is built into one shared library, once per machine, in the
tokenmill cache (keyed by the sources, the flags and the CPU), and loaded with ctypes;
it links nothing from torch, so it builds in a few seconds. When no compiler is
available the engine falls back to its pure-PyTorch paths, which compute the same
things (attention with gathered copies of the cache).

This module builds and loads the library; `paged_attention` and `elementwise` wrap its
functions for torch tensors.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

log = logging.getLogger(__name__)

_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
# Linked without -ffast-math: with it GCC (before 13) links crtfastmath.o into the
# library, whose constructor turns on flush-to-zero and denormals-are-zero for the whole
# process the moment the library loads - changing the user's own float arithmetic.
_LINK_FLAGS = ["-shared", "-fopenmp"]


def _cpu_fingerprint() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _library_path(sources: dict[str, str]) -> Path:
    from tokenmill.engine.model_files import cache_dir

    parts = [f"{name}\0{text}" for name, text in sorted(sources.items())]
    flags = [*_COMPILE_FLAGS, *_LINK_FLAGS]
    key = hashlib.sha256("\0".join([*parts, *flags, _cpu_fingerprint()]).encode()).hexdigest()
    return cache_dir() / "kernels" / f"tokenmill-kernels-{key[:16]}.so"


def _compile(source_dir: Path, target: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Build every .c file in source_dir into one shared library at target (tests add
    flags to build the paths other CPUs take)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as objects:
            object_files = []
            for source in _c_files(source_dir):
                obj = Path(objects) / f"{source.stem}.o"
                _run([compiler, *_COMPILE_FLAGS, *extra_flags, "-c", str(source), "-o", str(obj)])
                object_files.append(str(obj))
            _run([compiler, *_LINK_FLAGS, *object_files, "-o", tmp, "-lm"])
        os.replace(tmp, target)  # atomic: concurrent builders never see half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def _c_files(source_dir: Path) -> list[Path]:
    return sorted(source_dir.glob("*.c"))


def _sources(source_dir: Path) -> dict[str, str]:
    """Every C source and header the library is built from, by file name."""
    files = [*_c_files(source_dir), *sorted(source_dir.glob("*.h"))]
    return {path.name: path.read_text() for path in files}


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The compiled native kernels, or None when they cannot be built here."""
    if os.environ.get("TOKENMILL_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        with resources.as_file(resources.files(__name__)) as source_dir:
            target = _library_path(_sources(source_dir))
            if not target.exists():
                _compile(source_dir, target)
        return _load(target)
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("native kernels unavailable, using the PyTorch paths: %s", detail)
        return None


def _load(path: Path) -> ctypes.CDLL:
    """Load a built library; the modules wrapping its functions declare their types."""
    return ctypes.CDLL(str(path))
