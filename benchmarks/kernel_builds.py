"""Two builds of an engine kernel side by side: engine/kernels' C sources, this tree's or
another git revision's, compiled with the engine's compiler and flags into one shared
library each, so that a micro-benchmark calls both in one process, alternating.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

# Below the front door: the kernel benchmarks (moe_kernel.py, q4_decode.py) build the
# engine's C sources with its compiler and flags, which no public API exposes.
from tokenmill.engine.kernels import c_compiler, compile_flags

REPO = Path(__file__).resolve().parent.parent
TREE_KERNELS = REPO / "engine" / "kernels"


def build_library(
    kernels: Path, sources: tuple[str, ...], out: Path, extra_flags: tuple[str, ...] = ()
) -> ctypes.CDLL:
    """`sources` (file names in `kernels`) compiled as the engine compiles them, with
    `extra_flags` after its own (`-march=x86-64-v3`: the build an AVX2 CPU gets), and
    linked into one library at `out`."""
    compiler, _ = c_compiler()
    objects = []
    for name in sources:
        obj = out.with_suffix(f".{name}.o")
        command = [compiler, *compile_flags(name), *extra_flags, "-I", str(kernels), "-c"]
        command.append(str(kernels / name))
        subprocess.run([*command, "-o", str(obj)], check=True)
        objects.append(str(obj))
    subprocess.run([compiler, "-shared", "-fopenmp", *objects, "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def revision_kernels(revision: str, into: Path) -> Path:
    """engine/kernels as `revision` has it, extracted under `into`."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", revision, "engine/kernels"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "engine" / "kernels"
