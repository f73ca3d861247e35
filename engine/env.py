"""The TOKENMILL_* environment variables the engine reads, declared and read here only.

Two kinds. Defaults of engine settings (`EngineConfig`): a variable sets the default of
a setting for every engine in the process, and `LLM(setting=...)` still overrides it.
Process-wide switches: how the native kernels are built and where files are cached -
decided once per process, before any engine exists. Values are read when asked for, so
a benchmark may flip a switch between two engines in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Switch:
    """One environment variable: its name, its value when unset, and what it does."""

    name: str
    default: str
    help: str

    def value(self) -> str:
        return os.environ.get(self.name) or self.default

    def is_on(self) -> bool:
        """For on/off switches: anything but "0" is on."""
        return self.value() != "0"


CACHE_DIR = Switch(
    "TOKENMILL_CACHE_DIR",
    str(Path.home() / ".cache" / "tokenmill"),
    "where converted GGUF models, file digests and the built native kernels are kept",
)
NATIVE_KERNELS = Switch(
    "TOKENMILL_NATIVE_KERNELS",
    "1",
    "0: never build or load the native CPU kernels (the PyTorch paths compute the same)",
)
KERNEL_MARCH = Switch(
    "TOKENMILL_KERNEL_MARCH",
    "native",
    "the -march the native kernels are built for (x86-64-v3: what an AVX2-only CPU runs)",
)
FUSED_OPS = Switch(
    "TOKENMILL_FUSED_OPS",
    "1",
    "0: norms, rotary and activations in PyTorch ops instead of the fused native kernels",
)
TUNE_MALLOC = Switch(
    "TOKENMILL_TUNE_MALLOC",
    "1",
    "0: leave glibc malloc's thresholds alone (a CPU engine raises them so activations "
    "are reused between steps instead of page-faulted every step)",
)
PACKED_LINEAR = Switch(
    "TOKENMILL_PACKED_LINEAR",
    "1",
    "default of the packed_linear setting: 0 keeps F.linear for float linear layers",
)
HUGE_PAGES = Switch(
    "TOKENMILL_HUGE_PAGES",
    "0",
    "default of the huge_pages setting: 1 asks for 2 MiB pages for the CPU KV cache",
)

SWITCHES: tuple[Switch, ...] = (
    CACHE_DIR,
    NATIVE_KERNELS,
    KERNEL_MARCH,
    FUSED_OPS,
    TUNE_MALLOC,
    PACKED_LINEAR,
    HUGE_PAGES,
)


def cache_dir() -> Path:
    """`$TOKENMILL_CACHE_DIR`, else `~/.cache/tokenmill`."""
    return Path(CACHE_DIR.value())
