"""The native library: loading it leaves the process's floating-point state alone; its
build (march, per-file flags, compiler check) and its interface (limits, mirror check)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_PROBE = """
import torch
from tokenmill.engine.kernels import native_library
tiny = torch.tensor([1e-39])  # a float32 denormal
assert (tiny * 0.5).item() > 0, "denormals flushed before loading"
assert native_library() is not None, "the kernels did not build"
print((tiny * 0.5).item())
"""


def test_loading_the_library_keeps_denormals(tmp_path):
    """Built with -ffast-math at link time, GCC adds a constructor that switches on
    flush-to-zero for the whole process: every float op of the user's, in torch or
    numpy, would then round denormals to zero."""
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path)}  # a fresh build
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout) > 0, "loading the kernels flushed denormals to zero"


def test_kernel_march_sets_the_flags_and_the_cache_key(monkeypatch):
    """TOKENMILL_KERNEL_MARCH builds another library (an AVX2-only CPU's, say) beside the
    native one, never mistaken for it in the cache."""
    from importlib import resources

    from tokenmill.engine import kernels

    monkeypatch.delenv("TOKENMILL_KERNEL_MARCH", raising=False)  # the suite may run with one
    with resources.as_file(resources.files(kernels)) as source_dir:
        sources = kernels._sources(source_dir)
    native = kernels._library_path(sources)
    assert "-march=native" in kernels.compile_flags("paged_attention.c")
    monkeypatch.setenv("TOKENMILL_KERNEL_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in kernels.compile_flags("paged_attention.c")
    assert kernels._library_path(sources) != native
    monkeypatch.setenv("TOKENMILL_KERNEL_MARCH", "native; rm -rf /")
    with pytest.raises(ValueError, match="TOKENMILL_KERNEL_MARCH"):
        kernels.compile_flags("paged_attention.c")


def test_each_source_says_how_it_rounds():
    """Exactness is per file, on the command line: the elementwise ops never get
    -ffast-math or FMA contraction, and a new source without an entry is refused."""
    from tokenmill.engine import kernels

    exact = kernels.compile_flags("elementwise.c")
    assert "-ffast-math" not in exact and {"-fno-fast-math", "-ffp-contract=off"} <= set(exact)
    with pytest.raises(RuntimeError, match="_FILE_FLAGS"):
        kernels.compile_flags("new_kernel.c")


def test_a_compiler_other_than_gcc_or_clang_is_refused(monkeypatch):
    from tokenmill.engine import kernels

    kernels.c_compiler.cache_clear()
    monkeypatch.setenv("CC", sys.executable)  # runs, but is no C compiler
    try:
        with pytest.raises(RuntimeError, match="need GCC or Clang"):
            kernels.c_compiler()
    finally:
        kernels.c_compiler.cache_clear()


def test_limits_come_from_the_library_and_the_mirror_is_checked(monkeypatch):
    """The Python side reads the limits from tm_limits(), and a ctypes mirror that no
    longer matches its header struct is refused at load instead of passing garbage."""
    import ctypes

    from tokenmill.engine.kernels import interface, native_library
    from tokenmill.engine.kernels.paged_attention import native_attention_fits

    native = native_library()
    limits = native.limits
    assert native_attention_fits(limits.max_heads_per_kv_head, 1, limits.max_head_dim, 16)
    assert not native_attention_fits(1, 1, limits.max_head_dim + 1, 16)
    assert not native_attention_fits(limits.max_heads_per_kv_head + 1, 1, 64, 16)
    assert not native_attention_fits(1, 1, 64, limits.max_block_size + 1)

    class Drifted(ctypes.Structure):
        _fields_ = [*interface.AttentionArgs._fields_, ("extra", ctypes.c_int64)]

    functions = {**interface.FUNCTIONS, "tm_paged_attention": (Drifted, "attention_args_size")}
    monkeypatch.setattr(interface, "FUNCTIONS", functions)
    with pytest.raises(RuntimeError, match="does not mirror"):
        interface.declare(native.lib)
