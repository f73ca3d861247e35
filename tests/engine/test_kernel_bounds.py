"""The native kernels never read or write outside their buffers.

The kernel is compiled with the engine's own flags into a small C program whose malloc
puts every allocation flush against a PROT_NONE page, so one byte read past any buffer
(the kernel's scratch or the caller's tensors) is a segfault rather than silent
garbage. Every query-head group size 1-9 (so every register-block remainder), both
storage types, both head-dim paths and both block-size paths are run over prompt
chunks, a shared-prefix decode group and lone decodes. This is how an
optimizer-generated over-read of q in an earlier decode kernel was found: it crashed
real jobs whenever a thread's scratch happened to end at the edge of its heap. The
store of each step's keys and values into the cache runs first, into the cache's last
block. The fused elementwise ops (RMSNorm with and without a residual, rotary over
strided q/k/v views of one qkv row, SiLU-and-mul) get the same treatment, and so does
the 4-bit GGUF linear (its activation scratch, the packed blocks, the output) and its
bf16 expansion, and the load's passes: int4's quantize-and-pack (with its per-thread
scratch), GGUF blocks decoded to fp32 and to bf16, and GGUF 4-bit rows moved into the
4-bit layout.
"""

from __future__ import annotations

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
#include "kernels.h"
static int64_t *ints(int n, const int64_t *values) {
    int64_t *p = malloc(sizeof(int64_t) * n);  /* each array ends at a guard page */
    for (int i = 0; i < n; i++) p[i] = values[i];
    return p;
}
int main(int argc, char **argv) {
    const int64_t group = atoi(argv[1]), is_bf16 = atoi(argv[2]);
    const int64_t head_dim = atoi(argv[3]), bs = atoi(argv[4]), window = atoi(argv[5]);
    const int64_t kv_heads = 2, heads = kv_heads * group, blocks = 24, max_blocks = 6;
    const int64_t elem = is_bf16 ? 2 : 4;
    /* A prompt chunk over several tiles after cached context, a one-token chunk, then
     * two decoding sequences sharing two blocks as a group, and one alone. */
    const int64_t queries[5] = {2 * bs + 3, 1, 1, 1, 1};
    const int64_t contexts[5] = {3 * bs + 5, 1, 2 * bs, 4 * bs + 1, 6 * bs};
    int64_t row_values[5], tokens = 0;
    for (int i = 0; i < 5; i++) row_values[i] = tokens, tokens += queries[i];
    int64_t table_values[5 * 6];
    for (int i = 0; i < 5 * 6; i++) table_values[i] = (i * 5) % blocks;
    for (int j = 0; j < 2; j++) table_values[3 * 6 + j] = table_values[2 * 6 + j];
    const int64_t starts[5] = {0, 1, 2, 4, 5}, shared[4] = {0, 0, 2, 0};
    void *k = calloc(blocks * kv_heads * head_dim * bs, elem);
    void *v = calloc(blocks * kv_heads * head_dim * bs, elem);
    void *q = calloc(tokens * heads * head_dim, elem);
    void *out = malloc(tokens * heads * head_dim * elem);
    /* Store this step's keys and values first, into the last block (the guard page
     * sits right after it), as the engine does. */
    void *k_new = calloc(tokens * kv_heads * head_dim, elem);
    void *v_new = calloc(tokens * kv_heads * head_dim, elem);
    int64_t *slot_blocks = malloc(sizeof(int64_t) * tokens);
    int64_t *slot_offsets = malloc(sizeof(int64_t) * tokens);
    for (int64_t t = 0; t < tokens; t++) slot_blocks[t] = blocks - 1, slot_offsets[t] = t % bs;
    const tm_kv_write_args write = {k_new, v_new, k, v, slot_blocks, slot_offsets, tokens,
                                     kv_heads, head_dim, bs, (int32_t)is_bf16, 2};
    if (tm_write_kv_cache(&write) != TM_OK) return 3;
    float *sinks = calloc(heads, sizeof(float)); /* one per query head, at a guard page */
    const tm_attention_args args = {q, k, v, out, ints(5, row_values), ints(5, queries),
                                    ints(5, contexts), ints(30, table_values), ints(5, starts),
                                    ints(4, shared), sinks, 4, heads, kv_heads, head_dim, bs,
                                    max_blocks, window, 0.125f, (int32_t)is_bf16, 2};
    int rc = tm_paged_attention(&args);
    printf("%d\n", rc);
    return rc;
}
"""


_ELEMENTWISE_DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "kernels.h"
int main(int argc, char **argv) {
    const int64_t rows = atoi(argv[1]), dim = atoi(argv[2]), is_bf16 = atoi(argv[3]);
    const int64_t head_dim = atoi(argv[4]), heads = 9, kv_heads = 3, elem = is_bf16 ? 2 : 4;
    /* Every buffer is its own allocation, flush against a guard page. */
    void *x = calloc(rows * dim, elem), *residual = calloc(rows * dim, elem);
    void *out = malloc(rows * dim * elem), *weight = calloc(dim, elem);
    tm_rms_norm_args norm = {x, NULL, out, weight, rows, dim, 1e-6f, (int32_t)is_bf16, 2};
    int rc = tm_rms_norm(&norm);
    norm.residual = residual;
    rc |= tm_rms_norm(&norm);
    const int64_t row = (heads + 2 * kv_heads) * head_dim;  /* q, k, v views of one qkv row */
    char *qkv = calloc(rows * row, elem);
    void *q_out = malloc(rows * heads * head_dim * elem);
    void *k_out = malloc(rows * kv_heads * head_dim * elem);
    void *v_out = malloc(rows * kv_heads * head_dim * elem);
    void *cos = calloc(rows * head_dim, elem), *sin = calloc(rows * head_dim, elem);
    const tm_rotary_args rotary = {qkv, qkv + heads * head_dim * elem,
                                   qkv + (heads + kv_heads) * head_dim * elem, row, row, row,
                                   q_out, k_out, v_out, cos, sin, rows, heads, kv_heads,
                                   head_dim, (int32_t)is_bf16, 2};
    rc |= tm_rotary_qkv(&rotary);
    void *gate_up = calloc(rows * 2 * dim, elem), *act = malloc(rows * dim * elem);
    const tm_silu_args silu = {gate_up, act, rows, dim, (int32_t)is_bf16, 2};
    rc |= tm_silu_and_mul(&silu);
    printf("%d\n", rc);
    return rc;
}
"""


_Q4_DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels.h"
int main(int argc, char **argv) {
    const int64_t rows = atoi(argv[1]), n = atoi(argv[2]), k = atoi(argv[3]);
    const int32_t is_bf16 = atoi(argv[4]), affine = atoi(argv[5]);
    const int64_t nb = k / 32, block = affine ? 320 : 288, elem = is_bf16 ? 2 : 4;
    /* Every buffer is its own allocation, flush against a guard page. */
    char *x = calloc(rows * k, elem);
    for (int64_t i = 0; i < rows * k * elem; i++) x[i] = (char)(i * 7 % 61);  /* finite */
    int8_t *qx = malloc(rows * k);
    float *x_scales = malloc(rows * nb * sizeof(float));
    int32_t *x_sums = malloc(rows * nb * sizeof(int32_t));
    uint8_t *w = malloc(n / 16 * nb * block);
    memset(w, 0x3C, n / 16 * nb * block);  /* fp16 scales of 1.06 */
    float *bias = calloc(n, sizeof(float));
    void *out = malloc(rows * n * elem), *expanded = malloc(n * k * 2);
    const tm_q4_linear_args args = {x, qx, x_scales, x_sums, w, bias, out, rows, n, k,
                                    is_bf16, 2, affine};
    int rc = tm_q4_linear(&args);
    const tm_q4_unpack_args unpack = {w, expanded, n, k, affine, 2};
    rc |= tm_q4_unpack_bf16(&unpack);
    if (is_bf16) { /* the AMX tiles' product, where this CPU has it */
        const int tiles = tm_q4_linear_tiles(&args);
        rc |= tiles == TM_UNSUPPORTED_ISA ? 0 : tiles;
    }
    printf("%d\n", rc);
    return rc;
}
"""


_LOAD_DRIVER = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include "kernels.h"
int main(int argc, char **argv) {
    const int64_t n = atoi(argv[1]), k = atoi(argv[2]), group = atoi(argv[3]);
    const int32_t is_bf16 = atoi(argv[4]);
    const int64_t elem = is_bf16 ? 2 : 4;
    /* Every buffer is its own allocation, flush against a guard page. */
    char *weight = malloc(n * k * elem);
    for (int64_t i = 0; i < n * k * elem; i++) weight[i] = (char)(i * 7 % 61); /* finite */
    uint8_t *packed = malloc(n * k / 2);
    float *scale = malloc(n * (k / group) * sizeof(float));
    float *minimum = malloc(n * (k / group) * sizeof(float));
    int64_t *nonfinite = malloc(sizeof(int64_t));
    const tm_int4_pack_args pack = {weight, packed, scale, minimum, nonfinite, n, k, group,
                                    is_bf16, 2};
    int rc = tm_int4_pack(&pack);
    static const int64_t block_bytes[] = {18, 20, 34};
    for (int32_t kind = TM_GGUF_Q4_0; kind <= TM_GGUF_Q8_0; kind++) {
        const int64_t blocks = n * k / 32;
        uint8_t *raw = malloc(blocks * block_bytes[kind]);
        for (int64_t i = 0; i < blocks * block_bytes[kind]; i++) raw[i] = (uint8_t)(i * 5);
        float *values = malloc(blocks * 32 * sizeof(float));
        const tm_gguf_dequantize_args decode = {raw, values, blocks, kind, 2, 0};
        rc |= tm_gguf_dequantize(&decode);
        uint16_t *narrow = malloc(blocks * 32 * sizeof(uint16_t)); /* bf16 output */
        const tm_gguf_dequantize_args decode_bf16 = {raw, narrow, blocks, kind, 2, 1};
        rc |= tm_gguf_dequantize(&decode_bf16);
        if (kind != TM_GGUF_Q8_0) {
            const int64_t out_bytes = n / 16 * (k / 32) * (kind == TM_GGUF_Q4_1 ? 320 : 288);
            uint8_t *moved = malloc(out_bytes);
            const tm_q4_pack_gguf_args move = {raw, moved, n, k, kind == TM_GGUF_Q4_1, 2};
            rc |= tm_q4_pack_gguf(&move);
        }
    }
    printf("%d\n", rc);
    return rc;
}
"""


def _build_guarded(work: Path, name: str, driver: str, *kernel_files: str) -> Path:
    """driver (which includes kernels.h) + the guarded malloc + the kernel sources, each
    compiled with the engine's flags for it (the driver and guard with the first's)."""
    compiler, _identity = kernels.c_compiler()
    (work / "guard.c").write_text(_GUARDED_MALLOC)
    (work / f"{name}.c").write_text(driver)

    def flags(kernel_file: str) -> list[str]:
        return [f for f in kernels.compile_flags(kernel_file) if f != "-fPIC"]

    with resources.as_file(resources.files(kernels)) as source_dir:
        sources = [(work / f"{name}.c", kernel_files[0]), (work / "guard.c", kernel_files[0])]
        sources += [(source_dir / kernel_file, kernel_file) for kernel_file in kernel_files]
        objects = []
        for source, flags_of in sources:
            objects.append(work / f"{source.stem}.o")
            command = [compiler, *flags(flags_of), f"-I{source_dir}", "-c", str(source)]
            _compile_step(command, objects[-1])
        _compile_step(
            [
                compiler,
                "-fopenmp",
                "-Wl,--wrap=malloc,--wrap=calloc,--wrap=free",
                *map(str, objects),
            ],
            work / name,
            "-lm",
        )
    return work / name


def _compile_step(command: list[str], output: Path, *libraries: str) -> None:
    done = subprocess.run([*command, "-o", str(output), *libraries], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def guarded_kernel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("kernel-bounds")
    # amx.c: Linux's AMX permission, which attention asks for where it runs on tiles
    return _build_guarded(work, "driver", _DRIVER, "paged_attention.c", "amx.c")


@pytest.fixture(scope="module")
def guarded_elementwise(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("elementwise-bounds")
    return _build_guarded(work, "elementwise_driver", _ELEMENTWISE_DRIVER, "elementwise.c")


@pytest.fixture(scope="module")
def guarded_q4(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("q4-bounds")
    return _build_guarded(work, "q4_driver", _Q4_DRIVER, "q4_linear.c", "q4_tiles.c", "amx.c")


@pytest.fixture(scope="module")
def guarded_load(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("load-bounds")
    return _build_guarded(work, "load_driver", _LOAD_DRIVER, "int4_unpack.c", "gguf_dequantize.c")


def _assert_stays_inside(binary: Path, *args: int) -> None:
    done = subprocess.run([str(binary), *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 0, (
        f"{binary.name} {' '.join(map(str, args))}: exit {done.returncode} "
        "(-11 = read or wrote past a buffer)"
    )


# Rows x width: one row, an odd count, and one large enough for the threaded branch.
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (3, 576), (33, 1000), (70, 1536)])
@pytest.mark.parametrize("is_bf16", [0, 1])
def test_fused_elementwise_ops_stay_inside_their_buffers(guarded_elementwise, rows, dim, is_bf16):
    for head_dim in (64, 128):
        _assert_stays_inside(guarded_elementwise, rows, dim, is_bf16, head_dim)


@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 16), (256, 16), (64, 8)])
@pytest.mark.parametrize("is_bf16", [0, 1])
def test_every_group_size_stays_inside_its_buffers(guarded_kernel, head_dim, block_size, is_bf16):
    for group in range(1, 10):
        _assert_stays_inside(guarded_kernel, group, is_bf16, head_dim, block_size, 0)


@pytest.mark.parametrize("window", [1, 3, 17, 40])
@pytest.mark.parametrize("is_bf16", [0, 1])
def test_sliding_windows_stay_inside_their_buffers(guarded_kernel, window, is_bf16):
    """Windows shorter than a block, across block edges, and past the shared prefix."""
    for group in (1, 3, 7):
        _assert_stays_inside(guarded_kernel, group, is_bf16, 64, 16, window)


# Rows at every register tile remainder and past a 96-row block; one panel (an odd last
# panel per thread), the model's shapes; both block kinds and output types.
@pytest.mark.parametrize(("n", "k"), [(16, 32), (48, 64), (960, 576), (576, 1536)])
@pytest.mark.parametrize("is_bf16", [0, 1])
def test_the_4bit_linear_stays_inside_its_buffers(guarded_q4, n, k, is_bf16):
    for rows in (1, 2, 3, 5, 97):
        for affine in (0, 1):
            _assert_stays_inside(guarded_q4, rows, n, k, is_bf16, affine)


@pytest.mark.parametrize(("n", "k", "group"), [(64, 32, 32), (128, 96, 32), (192, 512, 256)])
@pytest.mark.parametrize("is_bf16", [0, 1])
def test_the_loads_packing_and_decoding_stay_inside_their_buffers(
    guarded_load, n, k, group, is_bf16
):
    _assert_stays_inside(guarded_load, n, k, group, is_bf16)
