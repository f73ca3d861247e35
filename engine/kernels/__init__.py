"""Native CPU kernels, compiled on first use with the system C compiler.

Every .c file here is built into one shared library, once per machine, in the
tokenmill cache (keyed by the sources, the flags, the compiler and the CPU), and loaded
with ctypes; it links nothing from torch, so it builds in a few seconds. kernels.h is the
interface: every exported function takes one struct, mirrored in interface.py, and the
limits are read from the library. The build needs GCC or Clang (checked first) and gives
each file its own floating-point flags (_FILE_FLAGS). When no compiler is
available the engine falls back to its pure-PyTorch paths, which compute the same
things (attention with gathered copies of the cache).

This module builds and loads the library; `paged_attention`, `elementwise` and
`quantize` wrap its functions for torch tensors.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tokenmill.engine import env
from tokenmill.engine.kernels import interface
from tokenmill.engine.kernels.interface import KernelLimits

log = logging.getLogger(__name__)

# Every file: optimised, OpenMP, position-independent.
_COMMON_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-std=c11"]
# Each file's floating-point contract, given on its own command line so that no file
# depends on one compiler's pragmas: attention may reassociate (it is tested against
# tolerances); the elementwise
# ops must round as PyTorch does (no FMA contraction, no reassociation), to the bit.
_FILE_FLAGS = {
    "interface.c": [],
    "amx.c": [],
    "paged_attention.c": ["-ffast-math"],
    # Its softmax is tested against a tolerance (a polynomial exp2, sums in tile order).
    "vision_attention.c": ["-ffast-math"],
    # Quantization: its max needs no NaN or signed-zero care to vectorize, but its
    # divisions stay divisions (no -ffast-math, whose reassociation turned v / scale into
    # v * (1 / scale)): the full rounding divides as compressed-tensors does (quantize_row.h).
    "quantize.c": [
        "-fno-math-errno",
        "-ffinite-math-only",
        "-fno-signed-zeros",
        "-fno-trapping-math",
    ],
    # Its integer sums are exact and its epilogue's multiply-adds explicit intrinsics; no
    # contraction and no errno, as elementwise.c, for the gated epilogue's activation.h.
    "int8_linear.c": ["-ffp-contract=off", "-fno-math-errno"],
    "elementwise.c": ["-fno-fast-math", "-ffp-contract=off", "-fno-math-errno"],
    # Explicit multiply-adds in its AVX-512 path; elsewhere activation.h's GELU, which
    # asks for no contraction and no errno.
    "gelu.c": ["-fno-fast-math", "-ffp-contract=off", "-fno-math-errno"],
    # Sums in its own 16 lanes (tested against a tolerance); each value rounded where the
    # header says.
    "layer_norm.c": ["-fno-fast-math", "-fno-math-errno", "-ffp-contract=fast"],
    # Comparisons only; NaNs must stay NaNs.
    "argmax.c": ["-fno-fast-math"],
    # Each weight rounded once from its own fp32 value, as the header states.
    "int4_unpack.c": ["-fno-fast-math", "-ffp-contract=off"],
    # Exact integer sums; the float steps are the ones the header states (explicit
    # multiply-adds, IEEE divisions and round-to-nearest-even), the same on every build.
    "q4_linear.c": ["-fno-fast-math", "-ffp-contract=off", "-fno-math-errno"],
    # Each weight one fp32 product (Q4_1: plus its minimum, never contracted).
    "gguf_dequantize.c": ["-fno-fast-math", "-ffp-contract=off"],
    # Each weight computed and split into bf16 parts exactly, as the header states.
    "q4_tiles.c": ["-fno-fast-math", "-ffp-contract=off", "-fno-math-errno"],
    # Sums in k order per output; contracting them into FMAs is what the vector path does.
    "lora.c": ["-ffp-contract=fast"],
    # Sums in fp32 in its own order (pairs of k, two running sums), as oneDNN's own are;
    # tested against a tolerance.
    "packed_matvec.c": ["-ffp-contract=fast"],
    # Its sums are explicit multiply-adds in k order; the gated activation as activation.h
    # asks (no contraction, no errno), and the weighted sum of the experts rounds each
    # product before adding it, as transformers does.
    "moe.c": ["-ffp-contract=off", "-fno-math-errno"],
    # Each weight one fp32 product of its code's value and its scale (stored before it is
    # summed, so never contracted); the sums in lanes, contracted into FMAs.
    "fp8_linear.c": ["-fno-fast-math", "-ffp-contract=fast", "-fno-math-errno"],
}
# Linked without -ffast-math: with it GCC (before 13) links crtfastmath.o into the
# library, whose constructor turns on flush-to-zero and denormals-are-zero for the whole
# process the moment the library loads - changing the user's own float arithmetic.
_LINK_FLAGS = ["-shared", "-fopenmp"]
# The compilers known to honour the flags above (and OpenMP, and GNU C builtins).
_COMPILER_FAMILIES = ("gcc", "clang")
_MARCH_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


@dataclass(frozen=True)
class NativeLibrary:
    """The loaded kernels: the library, its functions declared (interface.py), and the
    limits it was built with (kernels.h)."""

    lib: ctypes.CDLL
    limits: KernelLimits


def kernel_march() -> str:
    """The -march the kernels are built for: TOKENMILL_KERNEL_MARCH, default "native"
    (set x86-64-v3 to build what an AVX2-only CPU runs, on any x86-64 machine)."""
    march = env.KERNEL_MARCH.value()
    if not _MARCH_PATTERN.fullmatch(march):
        raise ValueError(f"TOKENMILL_KERNEL_MARCH={march!r} is not an architecture name")
    return march


def compile_flags(source_name: str) -> list[str]:
    """The flags one kernel source is compiled with (tests build with them too)."""
    if source_name not in _FILE_FLAGS:
        raise RuntimeError(f"{source_name} has no entry in _FILE_FLAGS: say how it rounds")
    return [*_COMMON_FLAGS, f"-march={kernel_march()}", *_FILE_FLAGS[source_name]]


@functools.cache
def c_compiler() -> tuple[str, str]:
    """The C compiler ($CC, else cc, gcc or clang on PATH) and its identity (family and
    version, from the compiler's own predefined macros).

    Raises:
        RuntimeError: there is none, or it is neither GCC nor Clang.
    """
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    compiler = next((path for name in names if (path := shutil.which(name))), None)
    if compiler is None:
        raise RuntimeError(f"no C compiler on PATH (looked for {', '.join(names)})")
    done = subprocess.run(
        [compiler, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True
    )
    defines = dict(
        line.removeprefix("#define ").partition(" ")[::2]
        for line in done.stdout.splitlines()
        if line.startswith("#define ")
    )
    # Clang defines __GNUC__ too; the Intel classic compiler does but is not GCC.
    family = None
    if "__clang__" in defines:
        family = "clang"
    elif "__GNUC__" in defines and "__INTEL_COMPILER" not in defines:
        family = "gcc"
    if done.returncode != 0 or family not in _COMPILER_FAMILIES:
        raise RuntimeError(
            f"the native kernels need GCC or Clang (for OpenMP and per-file floating-point "
            f"flags); {compiler} is not one of them (set CC to gcc or clang)"
        )
    return compiler, f"{family} {defines.get('__VERSION__', '')}"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be
    read); read once per process."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


def _cpu_fingerprint() -> str:
    return platform.machine() + " ".join(sorted(cpu_flags()))


def _library_path(sources: dict[str, str]) -> Path:
    parts = [f"{name}\0{text}" for name, text in sorted(sources.items())]
    flags = [f for name in sorted(_FILE_FLAGS) for f in (name, *compile_flags(name))]
    identity = [*parts, *flags, *_LINK_FLAGS, c_compiler()[1], _cpu_fingerprint()]
    key = hashlib.sha256("\0".join(identity).encode()).hexdigest()
    return env.cache_dir() / "kernels" / f"tokenmill-kernels-{key[:16]}.so"


def _compile(source_dir: Path, target: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Build every .c file in source_dir into one shared library at target, each with
    its own flags (tests add flags to build the paths other CPUs take)."""
    compiler, _version = c_compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as objects:
            object_files = []
            for source in _c_files(source_dir):
                obj = Path(objects) / f"{source.stem}.o"
                flags = [*compile_flags(source.name), *extra_flags]
                _run([compiler, *flags, "-c", str(source), "-o", str(obj)])
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
def native_library() -> NativeLibrary | None:
    """The compiled native kernels, or None when they cannot be built here."""
    if not env.NATIVE_KERNELS.is_on():
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


def kernel_isa(limit: str) -> str | None:
    """The instructions a native kernel with an ISA field in KernelLimits (`limit`, e.g.
    "int8_linear_isa") runs on here; None where it is not built for this CPU, or there
    is no native library."""
    native = native_library()
    return None if native is None else getattr(native.limits, limit)


def _load(path: Path) -> NativeLibrary:
    """Load a built library and declare its functions from the header's mirror."""
    lib = ctypes.CDLL(str(path))
    return NativeLibrary(lib, interface.declare(lib))
