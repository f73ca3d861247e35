/* The experts' vector tiles on AVX2 and FMA without AVX-512 (AMD Zen 1-3, Intel before
 * Skylake-X: a -march=x86-64-v3 build), for moe.c: `tile`'s sums, each the same products
 * added in the same order as the AVX-512 tiles add them, so the same bits.
 *
 * AVX2 has 16 registers of 8 fp32 columns: the AVX-512 tile's 6 rows x 64 columns would be
 * 48 accumulators. So k goes in chunks of KC rows, and each chunk in register tiles of R
 * rows x V vectors (8V columns) that add into `sums`, which stay in L1 from chunk to chunk
 * (a store and a load of a sum are exact): at most 12 accumulators, the V weight vectors
 * and one broadcast of x. A tile's shape follows the run's rows: one row takes all 64
 * columns (8 accumulators, each weight used once, so loaded by its FMA); 2-3 rows 32
 * columns, 4-6 rows 16 - 8 to 12 independent sums, enough to keep both FMA pipes busy.
 *
 * A chunk's weights are read once from memory, then from L1 by each tile over its columns:
 * fp32 in place; other formats widened to fp32 into an L1 buffer first (the conversion
 * once per chunk, not once per tile): bf16 pairs ([k / 2][64][2]) as the odd k's row then
 * the even k's, each pair's top half and its low half shifted up, with x's values swapped
 * to match, so each sum takes the odd k's product first, as vdpbf16ps adds them; int8
 * codes as they are (their scales multiply the sums after: scale_sums); int4 q * scale +
 * minimum in one FMA, as AVX-512's; mxfp4 an e2m1 table's value times 2^(e - 127), exact.
 * bf16 activations are widened to fp32 per chunk the same way. The widening pass (fp32
 * weights: a chunk's first tile) prefetches the panel's stream ahead (PREFETCH_BYTES), as
 * the AVX-512 tiles do.
 */
#ifndef TOKENMILL_MOE_AVX2_H
#define TOKENMILL_MOE_AVX2_H

#include <immintrin.h>

#define KC 64 /* k-rows per chunk: a chunk's 64 columns of fp32 weights are 16 KB */
#define TILE_ROWS 6 /* rows of a register tile: 12 accumulators at 16 columns */

/* sums[r][at + 0..8V) += sum over i < kc of x[r * ldx + i] * w[i * ldw + 0..8V), r < R.
 * R and V are constants at every call, so the loops unroll into registers. Where `ahead`
 * is given, each k-row also prefetches its `ahead_bytes` of the stream (prefetch_ahead). */
static inline __attribute__((always_inline)) void avx2_tile(const float *w, int64_t ldw, const float *x,
                                                            int64_t ldx, int64_t kc, const int R, const int V,
                                                            float (*sums)[2 * NB], int64_t at, const char *ahead,
                                                            int64_t ahead_bytes, const char *end) {
    __m256 acc[TILE_ROWS][8];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm256_loadu_ps(sums[r] + at + 8 * v);
    for (int64_t i = 0; i < kc; i++) {
        if (ahead) prefetch_ahead(ahead + i * ahead_bytes, ahead_bytes, end);
        __m256 wv[8];
        for (int v = 0; v < V; v++) wv[v] = _mm256_loadu_ps(w + i * ldw + 8 * v);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + i);
            for (int v = 0; v < V; v++) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) _mm256_storeu_ps(sums[r] + at + 8 * v, acc[r][v]);
}

/* sums[r][at + 0..n) for r < mr over one chunk: w's columns [0, n) (n = 32 or 64) in tiles
 * shaped by mr. */
static void avx2_columns(const float *w, int64_t ldw, const float *x, int64_t ldx, int64_t kc, int mr,
                         int64_t n, float (*sums)[2 * NB], int64_t at, const char *ahead, int64_t ahead_bytes,
                         const char *end) {
    switch (mr) {
    case 1:
        if (n == 2 * NB)
            avx2_tile(w, ldw, x, ldx, kc, 1, 8, sums, at, ahead, ahead_bytes, end);
        else
            avx2_tile(w, ldw, x, ldx, kc, 1, 4, sums, at, ahead, ahead_bytes, end);
        return;
    case 2:
        for (int64_t c = 0; c < n; c += 32, ahead = NULL)
            avx2_tile(w + c, ldw, x, ldx, kc, 2, 4, sums, at + c, ahead, ahead_bytes, end);
        return;
    case 3:
        for (int64_t c = 0; c < n; c += 32, ahead = NULL)
            avx2_tile(w + c, ldw, x, ldx, kc, 3, 4, sums, at + c, ahead, ahead_bytes, end);
        return;
    case 4:
        for (int64_t c = 0; c < n; c += 16, ahead = NULL)
            avx2_tile(w + c, ldw, x, ldx, kc, 4, 2, sums, at + c, ahead, ahead_bytes, end);
        return;
    case 5:
        for (int64_t c = 0; c < n; c += 16, ahead = NULL)
            avx2_tile(w + c, ldw, x, ldx, kc, 5, 2, sums, at + c, ahead, ahead_bytes, end);
        return;
    default:
        for (int64_t c = 0; c < n; c += 16, ahead = NULL)
            avx2_tile(w + c, ldw, x, ldx, kc, 6, 2, sums, at + c, ahead, ahead_bytes, end);
        return;
    }
}

/* 16 bytes of nibbles (32 columns, the even one in the low nibble) as their codes in
 * column order: columns 0-15, then 16-31. */
static inline void avx2_nibbles(const uint8_t *bytes, __m128i *first, __m128i *second) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)bytes);
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
    *first = _mm_unpacklo_epi8(low, high);
    *second = _mm_unpackhi_epi8(low, high);
}

/* 8 bf16 values from p, as fp32. */
static inline __m256 avx2_bf16x8(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* avx2_widen's int4 (int4 = 1: q * scale + minimum) and mxfp4 (0: e2m1(q) * 2^(e - 127))
 * panels, whole groups of 32 k-rows (KC is a multiple of 32). */
static inline __attribute__((always_inline)) void avx2_widen_nibbles(const operands *o, int64_t k0, int64_t kc,
                                                                     float *out, const int int4) {
    const int64_t ldw = o->ldw;
    const char *panel = (const char *)o->w, *end = panel + o->k * (ldw / 2);
    /* e2m1: the magnitude's 3 bits index the table's first 8 values; bit 3 is the sign */
    const __m256 table = _mm256_loadu_ps(E2M1);
    for (int64_t g = k0; g < k0 + kc; g += 32) {
        /* the group's 64 scales (and int4's minimums) as fp32, read once */
        float scale[TM_MOE_PANEL_COLS], minimum[TM_MOE_PANEL_COLS];
        for (int64_t c = 0; c < TM_MOE_PANEL_COLS; c += 8) {
            if (int4) {
                const uint16_t *group = o->groups + (g / 32) * 2 * ldw;
                _mm256_storeu_ps(scale + c, avx2_bf16x8(group + c));
                _mm256_storeu_ps(minimum + c, avx2_bf16x8(group + ldw + c));
            } else {
                const uint8_t *bytes = o->e8m0 + (g / 32) * ldw + c;
                const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
                const __m256i zero = _mm256_cmpeq_epi32(e, _mm256_setzero_si256());
                const __m256i bits = _mm256_blendv_epi8(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(0x00400000), zero);
                _mm256_storeu_ps(scale + c, _mm256_castsi256_ps(bits));
            }
        }
        for (int64_t i = g; i < g + 32; i++) {
            prefetch_ahead(panel + i * (ldw / 2), ldw / 2, end);
            const uint8_t *bytes = (const uint8_t *)o->w + i * (ldw / 2);
            float *row = out + (i - k0) * TM_MOE_PANEL_COLS;
            for (int64_t half = 0; half < TM_MOE_PANEL_COLS; half += 32) {
                __m128i codes[2];
                avx2_nibbles(bytes + half / 2, &codes[0], &codes[1]);
                for (int64_t c = 0; c < 32; c += 8) {
                    const __m128i eight = (c & 8) ? _mm_srli_si128(codes[c / 16], 8) : codes[c / 16];
                    const __m256i q = _mm256_cvtepu8_epi32(eight);
                    const int64_t at = half + c;
                    __m256 value;
                    if (int4) {
                        value = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(scale + at),
                                                _mm256_loadu_ps(minimum + at));
                    } else {
                        const __m256 magnitude = _mm256_permutevar8x32_ps(table, q);
                        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(8)), 28);
                        const __m256 signed_value = _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
                        value = _mm256_mul_ps(signed_value, _mm256_loadu_ps(scale + at));
                    }
                    _mm256_storeu_ps(row + at, value);
                }
            }
        }
    }
}

/* The 64 columns of k-rows [k0, k0 + kc) of a bf16, int8, int4 or mxfp4 panel as fp32 into
 * out ([kc][64]; bf16: each pair's odd k first), prefetching the stream ahead. */
static void avx2_widen(const operands *o, int64_t k0, int64_t kc, float *out) {
    const int64_t ldw = o->ldw;
    const char *panel = (const char *)o->w;
    if (o->scales) {
        const char *end = panel + o->k * ldw;
        for (int64_t i = 0; i < kc; i++) {
            prefetch_ahead(panel + (k0 + i) * ldw, ldw, end);
            const int8_t *codes = (const int8_t *)o->w + (k0 + i) * ldw;
            for (int64_t c = 0; c < TM_MOE_PANEL_COLS; c += 8) {
                const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + c)));
                _mm256_storeu_ps(out + i * TM_MOE_PANEL_COLS + c, _mm256_cvtepi32_ps(q));
            }
        }
    } else if (o->groups) {
        avx2_widen_nibbles(o, k0, kc, out, 1);
    } else if (o->e8m0) {
        avx2_widen_nibbles(o, k0, kc, out, 0);
    } else { /* bf16 pairs: a pair row's odd k's values, then its even k's */
        const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
        const char *end = panel + o->k * ldw * 2;
        for (int64_t i = 0; i < kc; i += 2) {
            const int64_t pair_row = (k0 + i) / 2;
            prefetch_ahead(panel + pair_row * ldw * 4, ldw * 4, end);
            const uint32_t *pairs = (const uint32_t *)o->w + pair_row * ldw;
            for (int64_t c = 0; c < TM_MOE_PANEL_COLS; c += 8) {
                const __m256i both = _mm256_loadu_si256((const __m256i *)(pairs + c));
                float *odd = out + i * TM_MOE_PANEL_COLS + c, *even = odd + TM_MOE_PANEL_COLS;
                _mm256_storeu_ps(odd, _mm256_castsi256_ps(_mm256_and_si256(both, high)));
                _mm256_storeu_ps(even, _mm256_castsi256_ps(_mm256_slli_epi32(both, 16)));
            }
        }
    }
}

/* sums[r][b * 32 + j]: row r's sum for column j of block b (b = 0: at col, 1: at second).
 * Pads are zero weights, so every block is read whole: columns from `left` on sum to zero
 * and the callers drop them. */
static void tile(const operands *o, int64_t row, int mr, int64_t col, int64_t second, int64_t left, int nw,
                 float (*sums)[2 * NB]) {
    (void)left;
    float wide[KC * TM_MOE_PANEL_COLS] __attribute__((aligned(32)));
    float xs[MR * KC];
    for (int r = 0; r < mr; r++) memset(sums[r], 0, (size_t)(nw * NB) * sizeof(float));
    const int fp32 = !o->is_bf16 && !o->scales && !o->groups && !o->e8m0;
    const int pairs = o->is_bf16 && !o->scales && !o->groups && !o->e8m0;
    const int whole = nw == 2 && second == col + NB; /* the two blocks: one run of 64 columns */
    const int64_t row_bytes = o->ldw * 4; /* an fp32 panel's k-row */
    for (int64_t k0 = 0; k0 < o->k; k0 += KC) {
        const int64_t kc = o->k - k0 < KC ? o->k - k0 : KC;
        const float *w = wide;
        const char *ahead = NULL;
        int64_t ldw = TM_MOE_PANEL_COLS;
        if (fp32) {
            w = (const float *)o->w + k0 * o->ldw, ldw = o->ldw;
            ahead = (const char *)w;
        } else {
            avx2_widen(o, k0, kc, wide);
        }
        const float *x = xs;
        int64_t ldx = KC;
        if (!o->is_bf16) {
            x = (const float *)o->x + row * o->ldx + k0, ldx = o->ldx;
        } else {
            for (int r = 0; r < mr; r++) {
                const uint16_t *from = (const uint16_t *)o->x + (row + r) * o->ldx + k0;
                for (int64_t i = 0; i < kc; i++) xs[r * KC + i] = bf16_to_f32(from[pairs ? i ^ 1 : i]);
            }
        }
        const char *end = (const char *)o->w + o->k * row_bytes;
        for (int r0 = 0; r0 < mr; r0 += TILE_ROWS) { /* each over the chunk, in L1 */
            const int rows = mr - r0 < TILE_ROWS ? mr - r0 : TILE_ROWS;
            const float *xr = x + r0 * ldx;
            if (whole) {
                avx2_columns(w + col, ldw, xr, ldx, kc, rows, 2 * NB, sums + r0, 0, ahead, row_bytes, end);
            } else {
                for (int b = 0; b < nw; b++, ahead = NULL)
                    avx2_columns(w + (b ? second : col), ldw, xr, ldx, kc, rows, NB, sums + r0, b * NB, ahead,
                                 row_bytes, end);
            }
            ahead = NULL;
        }
    }
}

#endif
