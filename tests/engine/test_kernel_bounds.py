"""The native decode kernel never reads or writes outside its buffers.

The kernel is compiled with the engine's own flags into a small C program whose malloc
puts every allocation flush against a PROT_NONE page, so one byte read past any buffer
(the kernel's scratch or the caller's tensors) is a segfault rather than silent
garbage. Every query-head group size 1-9 (each specialized case and the generic
loop), both storage types and both block-size paths are run. This is how an
optimizer-generated over-read of q for GQA groups 2-8 was found: it crashed real jobs
whenever a thread's scratch happened to end at the edge of its heap.
"""

from __future__ import annotations

import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest

from tokenmill.engine import kernels

_GUARDED_MALLOC = r"""
#define _GNU_SOURCE
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
void *__wrap_malloc(size_t n) {
    size_t pages = (n + 4095) / 4096 + 1;
    char *base = mmap(NULL, pages * 4096, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return NULL;
    mprotect(base + (pages - 1) * 4096, 4096, PROT_NONE);
    return base + (pages - 1) * 4096 - n;
}
void *__wrap_calloc(size_t count, size_t size) {
    void *p = __wrap_malloc(count * size);
    if (p) memset(p, 0, count * size);
    return p;
}
void __wrap_free(void *p) { (void)p; }  /* leaked on purpose: the process is short */
"""

_DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
int tm_paged_decode_attention(const void *, const void *, const void *, const int64_t *,
                              const int64_t *, void *, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, float, int, int);
int main(int argc, char **argv) {
    const int64_t group = atoi(argv[1]), is_bf16 = atoi(argv[2]);
    const int64_t head_dim = atoi(argv[3]), block_size = atoi(argv[4]);
    const int64_t kv_heads = 2, heads = kv_heads * group, seqs = 3, blocks = 12;
    const int64_t max_blocks = 4, elem = is_bf16 ? 2 : 4;
    const int64_t lens[3] = {1, block_size + 3, 4 * block_size};
    int64_t *tables = malloc(sizeof(int64_t) * seqs * max_blocks);
    for (int64_t i = 0; i < seqs * max_blocks; i++) tables[i] = (i * 5) % blocks;
    int64_t *ctx = malloc(sizeof lens);
    for (int i = 0; i < 3; i++) ctx[i] = lens[i];
    void *k = calloc(blocks * kv_heads * head_dim * block_size, elem);
    void *v = calloc(blocks * kv_heads * head_dim * block_size, elem);
    void *q = calloc(seqs * heads * head_dim, elem);
    void *out = malloc(seqs * heads * head_dim * elem);
    int rc = tm_paged_decode_attention(q, k, v, tables, ctx, out, seqs, heads, kv_heads,
                                       head_dim, block_size, max_blocks, 0.125f,
                                       (int)is_bf16, 2);
    printf("%d\n", rc);
    return rc;
}
"""


@pytest.fixture(scope="module")
def guarded_kernel(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("no C compiler on PATH: the engine's native kernel needs one too")
    work = tmp_path_factory.mktemp("kernel-bounds")
    (work / "guard.c").write_text(_GUARDED_MALLOC)
    (work / "driver.c").write_text(_DRIVER)
    flags = [f for f in kernels._FLAGS if f not in ("-shared", "-fPIC")]
    source = resources.files(kernels).joinpath("paged_attention.c")
    with resources.as_file(source) as source_path:
        subprocess.run(
            [
                compiler,
                *flags,
                "-Wl,--wrap=malloc,--wrap=calloc,--wrap=free",
                str(work / "driver.c"),
                str(work / "guard.c"),
                str(source_path),
                "-o",
                str(work / "driver"),
                "-lm",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    return work / "driver"


@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 16), (64, 8)])
@pytest.mark.parametrize("is_bf16", [0, 1])
def test_every_group_size_stays_inside_its_buffers(guarded_kernel, head_dim, block_size, is_bf16):
    for group in range(1, 10):
        done = subprocess.run(
            [str(guarded_kernel), str(group), str(is_bf16), str(head_dim), str(block_size)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, (
            f"group {group}, bf16={is_bf16}, head_dim {head_dim}, block_size {block_size}: "
            f"exit {done.returncode} (-11 = read or wrote past a buffer)"
        )
