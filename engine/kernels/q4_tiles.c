/* The GGUF 4-bit layers' forward on AMX bf16 tiles, for calls of many bf16 rows
 * (engine/quant/gguf_linear.py chooses it by row count): exactly the float product of
 * the rows with the blocks' dequantized weights, summed in fp32.
 *
 * Why: at a decode batch of a few dozen rows the VNNI integer product (q4_linear.c) is
 * bound by its multiply-adds, and expanding the whole weight to bf16 for one matmul
 * writes and reads four times the blocks' bytes per call; AMX tiles multiply 16 rows x
 * 16 channels x 32 k in one instruction (docs/design.md, "4-bit GGUF layers in integer
 * dot products").
 *
 * Exactness: a block's integers (q - 8 for Q4_0, q for Q4_1: at most 4 bits) are exact
 * in bf16, so a tile's products with the bf16 rows are exact in fp32 and summed in fp32;
 * the block's fp16 scale d then multiplies that sum in fp32, and Q4_1's minimum m adds
 * m times the row's fp32 sum over the block: out = sum over blocks of d * (x . q) + m *
 * sum(x), the product with the dequantized weights to fp32 summation, plus bias, rounded
 * once to bf16.
 *
 * Layout: q4_linear.c's (engine/kernels/q4_linear.py packs it). Each thread owns a run
 * of 16-channel panels; a panel's blocks are expanded once per call into the thread's
 * scratch as B tiles ([block][16 k-pairs][16 channels][2] bf16) and the rows pass over
 * them in groups of 16 rows, four blocks' tiles at a time.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "kernel_common.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512VBMI__) && defined(__F16C__)
#define Q4_TILES 1
#include <immintrin.h>
#else
#define Q4_TILES 0
#endif

#define TILE_BLOCK 32      /* k-values per GGUF block, and per bf16 tile row */
#define TILE_NIBBLES 256   /* nibble bytes of one panel's block (q4_linear.c) */
#define TILE_BYTES 1024    /* one B tile: 16 k-pairs x 16 channels x 2 bf16 */

int tm_q4_tiles_available(void) {
#if Q4_TILES
    return tm_internal_amx_permitted();
#else
    return 0;
#endif
}

#if Q4_TILES
/* One line (64 bytes: 4 bytes per channel, line i of q4_linear.c's block) reordered as
 * the two B rows it feeds from each nibble: k-pair (4i, 4i + 1) for channels 0-15, then
 * k-pair (4i + 2, 4i + 3) (in the low nibbles; k + 16 in the high ones). */
static const uint8_t PAIR_ORDER[64] = {
    0,  1,  4,  5,  8,  9,  12, 13, 16, 17, 20, 21, 24, 25, 28, 29,
    32, 33, 36, 37, 40, 41, 44, 45, 48, 49, 52, 53, 56, 57, 60, 61,
    2,  3,  6,  7,  10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31,
    34, 35, 38, 39, 42, 43, 46, 47, 50, 51, 54, 55, 58, 59, 62, 63,
};

/* A panel's block as one B tile ([16 k-pairs][16 channels][2] bf16) of its integers:
 * q - 8 (symmetric) or q (affine), exact in bf16, looked up by nibble. */
static inline void expand_block(const uint8_t *block, __m512i table, uint16_t *dst) {
    const __m512i order = _mm512_loadu_si512(PAIR_ORDER), nibble = _mm512_set1_epi8(15);
    for (int line = 0; line < 4; line++) {
        const __m512i v = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(block + 64 * line));
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        const __m512i rows[4] = {
            _mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo)),
            _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
            _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi)),
            _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1)),
        };
        for (int i = 0; i < 4; i++) { /* B row: k-pair 2 * line + i % 2 (+ 8 for hi) */
            const int row = 8 * (i >> 1) + 2 * line + (i & 1);
            _mm512_storeu_si512(dst + 32 * row, _mm512_permutexvar_epi16(rows[i], table));
        }
    }
}

/* acc[r] += sums[r] * d (+ min * x_sums[r]) for the 16 rows of a group. */
#define TILE_FOLD(sums, d, m, xs)                                                      \
    _Pragma("GCC unroll 16") for (int r = 0; r < 16; r++) {                           \
        acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(sums[r]), d, acc[r]);                 \
        if (affine) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps((xs)[r * nb]), acc[r]); \
    }

/* Rows [row, row + 16) of x (whole: the caller pads) against one expanded panel, into
 * out's 16 columns at col (rows past `rows` not written). */
static void group_rows(const uint16_t *x, const float *x_sums, int64_t k, const uint8_t *w,
                       int64_t block_bytes, int affine, const uint16_t *expanded, int64_t row,
                       int64_t rows, const float *bias, int64_t col, uint16_t *out, int64_t n) {
    const int64_t nb = k / TILE_BLOCK, stride = k * 2;
    __m512 acc[16];
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    float sums[4][16][16] __attribute__((aligned(64)));
    const float *xs = x_sums ? x_sums + row * nb : NULL;
    int64_t b = 0;
    /* Four blocks at a time, each into its own accumulator tile, so that the tiles'
     * products overlap the folding of the previous ones. */
    for (; b + 4 <= nb; b += 4) {
        const uint16_t *xb = x + row * k + b * TILE_BLOCK, *wb = expanded + b * (TILE_BYTES / 2);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, xb, stride); _tile_loadd(6, wb, 64); _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, xb + 32, stride); _tile_loadd(7, wb + 512, 64); _tile_dpbf16ps(1, 5, 7);
        _tile_loadd(4, xb + 64, stride); _tile_loadd(6, wb + 1024, 64); _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(5, xb + 96, stride); _tile_loadd(7, wb + 1536, 64); _tile_dpbf16ps(3, 5, 7);
        _tile_stored(0, sums[0], 64); _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64); _tile_stored(3, sums[3], 64);
        for (int j = 0; j < 4; j++) {
            const uint8_t *block = w + (b + j) * block_bytes;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + TILE_NIBBLES)));
            const __m512 m = affine
                ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + TILE_NIBBLES + 32)))
                : _mm512_setzero_ps();
            TILE_FOLD(sums[j], d, m, xs ? xs + b + j : NULL)
        }
    }
    for (; b < nb; b++) {
        _tile_zero(0);
        _tile_loadd(4, x + row * k + b * TILE_BLOCK, stride);
        _tile_loadd(6, expanded + b * (TILE_BYTES / 2), 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_stored(0, sums[0], 64);
        const uint8_t *block = w + b * block_bytes;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + TILE_NIBBLES)));
        const __m512 m = affine
            ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(block + TILE_NIBBLES + 32)))
            : _mm512_setzero_ps();
        TILE_FOLD(sums[0], d, m, xs ? xs + b : NULL)
    }
    const __m512 bias16 = bias ? _mm512_loadu_ps(bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < 16 && row + r < rows; r++)
        _mm256_storeu_si256((__m256i *)(out + (row + r) * n + col),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r], bias16)));
}

/* The thread's scratch, kept between calls (OpenMP threads persist) and never freed: one
 * panel's B tiles, 32 bytes per input (k / 32 kilobytes), per thread that ever ran the call. */
static _Thread_local uint16_t *scratch;
static _Thread_local size_t scratch_bytes;

static uint16_t *thread_scratch(size_t bytes) {
    if (bytes > scratch_bytes) {
        free(scratch);
        scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
        scratch_bytes = scratch ? bytes : 0;
    }
    return scratch;
}

/* The sum of a block's 32 bf16 values, in fp32 (any order: fp32 summation rounding). */
static inline float block_sum(const uint16_t *x) {
    const __m512i v = _mm512_loadu_si512(x);
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
    return _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
}

/* bf16 bits of 0..15 (affine) or -8..7 (symmetric), by nibble. */
static __m512i nibble_table(int affine) {
    uint16_t values[32] = {0};
    for (int q = 0; q < 16; q++) {
        const float f = (float)(affine ? q : q - 8);
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        values[q] = (uint16_t)(bits >> 16); /* small integers: exact in bf16 */
    }
    return _mm512_loadu_si512(values);
}
#endif

int tm_q4_linear_tiles(const tm_q4_linear_args *a) {
#if Q4_TILES
    if (!a->is_bf16 || a->n % 16 || a->k % TILE_BLOCK || a->k > TM_MAX_INT8_K || a->rows < 0 ||
        a->n <= 0)
        return TM_UNSUPPORTED_SHAPE;
    if (!tm_internal_amx_permitted()) return TM_UNSUPPORTED_ISA;
    const int64_t rows = a->rows, k = a->k, n = a->n, nb = k / TILE_BLOCK, panels = n / 16;
    if (rows == 0) return TM_OK;
    const int64_t block_bytes = a->affine ? TILE_NIBBLES + 64 : TILE_NIBBLES + 32;
    /* Whole 16-row groups for the tiles: the last group padded with zero rows. */
    const int64_t padded = (rows + 15) / 16 * 16;
    const uint16_t *x = (const uint16_t *)a->x;
    uint16_t *copy = NULL;
    float *x_sums = NULL; /* affine: each row's block sums, for the minimums */
    if (padded != rows) {
        copy = calloc((size_t)(padded * k), sizeof *copy);
        if (!copy) return TM_OUT_OF_MEMORY;
        memcpy(copy, x, (size_t)(rows * k) * sizeof *copy);
        x = copy;
    }
    if (a->affine) {
        x_sums = malloc((size_t)(padded * nb) * sizeof *x_sums);
        if (!x_sums) {
            free(copy);
            return TM_OUT_OF_MEMORY;
        }
#pragma omp parallel for num_threads(a->num_threads) schedule(static)
        for (int64_t i = 0; i < padded * nb; i++) x_sums[i] = block_sum(x + i * TILE_BLOCK);
    }
    const __m512i table = nibble_table(a->affine);
    int failed = 0;
#pragma omp parallel num_threads(a->num_threads) reduction(| : failed)
    {
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        uint16_t *expanded = thread_scratch((size_t)(nb * TILE_BYTES));
        if (!expanded) {
            failed = 1;
        } else {
            tm_configure_full_tiles();
            for (int64_t panel = panels * t / threads; panel < panels * (t + 1) / threads; panel++) {
                const uint8_t *w = a->w + panel * nb * block_bytes;
                for (int64_t b = 0; b < nb; b++)
                    expand_block(w + b * block_bytes, table, expanded + b * (TILE_BYTES / 2));
                for (int64_t row = 0; row < padded; row += 16)
                    group_rows(x, x_sums, k, w, block_bytes, a->affine, expanded, row, rows,
                               a->bias, panel * 16, (uint16_t *)a->out, n);
            }
            _tile_release();
        }
    }
    free(copy);
    free(x_sums);
    return failed ? TM_OUT_OF_MEMORY : TM_OK;
#else
    (void)a;
    return TM_UNSUPPORTED_ISA;
#endif
}
