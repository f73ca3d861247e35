"""The native kernels as other CPUs get them, built here: each kernel's tests run its
plain-loop and AVX2 builds against the same references as this CPU's build."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from tokenmill.engine import kernels
from tokenmill.engine.kernels import NativeLibrary

# Extra compiler flags -> the CPU class they stand for.
OTHER_CPUS = pytest.mark.parametrize(
    "flags",
    [
        ("-mno-avx512bf16",),  # AVX-512 without AVX512-BF16 (Skylake-X to Ice Lake)
        ("-march=x86-64-v3",),  # AVX2 and FMA (Zen 1)
    ],
)


def build_with(flags: tuple[str, ...], directory: Path) -> NativeLibrary:
    """The kernels compiled with `flags` added, loaded from `directory`."""
    with resources.as_file(resources.files(kernels)) as source_dir:
        kernels._compile(source_dir, directory / "lib.so", extra_flags=flags)
    return kernels._load(directory / "lib.so")
