/* fp8_linear.c's product for bf16 inputs on the CPU's bf16 dot products: AVX512-BF16's
 * vdpbf16ps, and AMX's tdpbf16ps from AMX_MIN_ROWS rows where Linux grants the tiles.
 *
 * Every e4m3 value is exact in bf16 (at most 4 significant bits, exponents 2^-9..2^8), so
 * a tile's codes decode to bf16 without rounding, and the block scales multiply the
 * fp32 sums of each block instead of each weight:
 *     out[r, o] = sum_b scale[o / block_n, b] * (sum_{i in b} x[r, i] * e4m3(w[o, i])) + bias[o]
 * - the dequantized product, up to the order of the fp32 sums (and the dot products
 * reading bf16 subnormal inputs, below 1e-38, as zero). The inputs are the engine's own
 * bf16 values, so no input is rounded either; fp32 inputs stay on the plain loops.
 *
 * Decoding: 32 codes widen to 16 bits and index a 128-entry table of the magnitudes'
 * bf16 bits (two vpermt2w of 64 entries and a blend on bit 6); the sign bit moves to bit
 * 15. Per output tile of TILE_CHANNELS rows (one thread each) the decoded rows go to a
 * per-thread buffer [TILE_CHANNELS][kp] (kp: k rounded up to 32, zeros past k), read
 * by every input row. The inputs are copied once per call into the layout each path
 * reads, zero-padded the same way.
 *
 * The scale blocks must start at multiples of 32 inputs (block_k % 32 == 0) or be one
 * block across k (per tensor, per channel); other block sizes take the plain loops.
 *
 * Vector path (rows < AMX_MIN_ROWS, or no AMX): VEC_CHANNELS decoded rows by up to
 * VEC_ROWS input rows, one fp32 accumulator each (32 products per vdpbf16ps), multiplied
 * by its channel's scale at each block's end into a running total, and reduced across
 * its lanes at the end. With VEC_ROWS rows or fewer (a decode step) each weight is read
 * once, so the codes are decoded in registers instead of through the buffer.
 * AMX path: the decoded weights are the A operand (16 channels x 32 inputs a tile, rows
 * of the buffer as they are) and the inputs the B operand, packed in pairs per strip of
 * 16 rows ([kp / 2][16][2]); a block of 32 channels x 32 rows uses all eight tiles (two
 * A, two B, four sums), whose sums are stored and scaled at each block's end.
 */
#ifndef TOKENMILL_FP8_BF16_H
#define TOKENMILL_FP8_BF16_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512BF16__)
#define FP8_HAVE_BF16 1
#include <immintrin.h>

#include "amx.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define FP8_HAVE_AMX 1
#else
#define FP8_HAVE_AMX 0
#endif

#define TILE_CHANNELS 32 /* output rows decoded at once */
#define VEC_CHANNELS 4   /* channels per vector step: independent sums per input row */
#define VEC_ROWS 2       /* input rows per vector step */
/* From 3 rows tiles beat the vector path even mostly empty (decoding a tile's codes
 * costs more than either product); at 1-2 rows the codes decoded in registers win.
 * Measured in CPU time on one thread at SmolLM2's shapes, on Sapphire Rapids. */
#define AMX_MIN_ROWS 3

/* A call's operands as the fast paths read them. */
typedef struct {
    const tm_fp8_linear_args *a;
    int64_t kp;           /* k rounded up to 32 */
    int64_t k_blocks;     /* scale blocks along k */
    int64_t block_chunks; /* 32-input chunks per scale block */
    const uint16_t *xp;   /* vector path: [rows][kp] bf16; AMX: [strips][kp / 2][16][2] */
    __m512i table[4];     /* bf16 bits of magnitude codes 0..127, 32 per register */
} fast_problem;

static void bf16_magnitudes(const float table[256], __m512i out[4]) {
    uint16_t bits[128] __attribute__((aligned(64)));
    for (int code = 0; code < 128; code++) {
        uint32_t u;
        memcpy(&u, &table[code], 4);
        bits[code] = (uint16_t)(u >> 16); /* exact: the low 16 bits are zero */
    }
    for (int i = 0; i < 4; i++) out[i] = _mm512_load_si512(bits + 32 * i);
}

/* 32 codes (the first `count`, the rest +0) as bf16 bits. */
static inline __m512i decode32(const fast_problem *p, const uint8_t *codes, int count) {
    const __mmask32 mask = count >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << count) - 1);
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, codes));
    const __m512i low = _mm512_permutex2var_epi16(p->table[0], c, p->table[1]);
    const __m512i high = _mm512_permutex2var_epi16(p->table[2], c, p->table[3]);
    const __mmask32 upper = _mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40));
    const __m512i magnitude = _mm512_mask_blend_epi16(upper, low, high);
    /* bit 7 of the code to bit 15 (the shift brings the magnitude bits along: masked) */
    return _mm512_ternarylogic_epi32(_mm512_slli_epi16(c, 8), _mm512_set1_epi16((short)0x8000),
                                     magnitude, 0xEA); /* (a & b) | c */
}

/* Output rows [o0, o0 + count) into tile [TILE_CHANNELS][kp] bf16, rows past count zero. */
static void decode_tile_bf16(const fast_problem *p, int64_t o0, int64_t count, uint16_t *tile) {
    const int64_t k = p->a->k, kp = p->kp;
    for (int64_t c = 0; c < TILE_CHANNELS; c++) {
        uint16_t *dst = tile + c * kp;
        if (c >= count) {
            memset(dst, 0, (size_t)kp * 2);
            continue;
        }
        const uint8_t *row = p->a->w + (o0 + c) * k;
        for (int64_t i = 0; i < kp; i += 32)
            _mm512_store_si512(dst + i, decode32(p, row + i, (int)(k - i < 32 ? k - i : 32)));
    }
}

/* Channel o's scale for k-block b; 0 past the last channel (its sums are not stored). */
static inline float scale_of(const fast_problem *p, int64_t o, int64_t b) {
    const tm_fp8_linear_args *a = p->a;
    return o < a->n ? a->scales[(o / a->block_n) * p->k_blocks + b] : 0.0f;
}

static inline void store_out(const tm_fp8_linear_args *a, int64_t row, int64_t o, float sum) {
    if (a->bias) sum += a->bias[o];
    if (a->is_bf16)
        ((uint16_t *)a->out)[row * a->n + o] = f32_to_bf16(sum);
    else
        ((float *)a->out)[row * a->n + o] = sum;
}

/* Rows [row, row + mr) x tile channels [c0, c0 + VEC_CHANNELS); mr is a constant at each
 * call, so the loops over it unroll into named registers. */
static inline __attribute__((always_inline)) void vec_step(const fast_problem *p,
                                                           const uint16_t *tile, int64_t o0,
                                                           int64_t count, int64_t row,
                                                           int64_t c0, const int mr) {
    const int64_t kp = p->kp, k = p->a->k;
    __m512 total[VEC_ROWS][VEC_CHANNELS];
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < VEC_CHANNELS; c++) total[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < p->k_blocks; b++) {
        const int64_t first = b * p->block_chunks * 32;
        const int64_t end = b + 1 < p->k_blocks ? first + p->block_chunks * 32 : kp;
        __m512 acc[VEC_ROWS][VEC_CHANNELS];
        for (int r = 0; r < mr; r++)
            for (int c = 0; c < VEC_CHANNELS; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t i = first; i < end; i += 32) {
            __m512bh w[VEC_CHANNELS];
            for (int c = 0; c < VEC_CHANNELS; c++) {
                if (tile) {
                    w[c] = (__m512bh)_mm512_load_si512(tile + (c0 + c) * kp + i);
                } else { /* decoded here: the call's rows read each weight once */
                    const int left = c0 + c < count ? (int)(k - i < 32 ? k - i : 32) : 0;
                    w[c] = (__m512bh)decode32(p, p->a->w + (o0 + c0 + c) * k + i, left);
                }
            }
            for (int r = 0; r < mr; r++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(p->xp + (row + r) * kp + i);
                for (int c = 0; c < VEC_CHANNELS; c++)
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w[c]);
            }
        }
        for (int c = 0; c < VEC_CHANNELS; c++) {
            const __m512 scale = _mm512_set1_ps(scale_of(p, o0 + c0 + c, b));
            for (int r = 0; r < mr; r++) total[r][c] = _mm512_fmadd_ps(acc[r][c], scale, total[r][c]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < VEC_CHANNELS; c++)
            if (c0 + c < count) store_out(p->a, row + r, o0 + c0 + c, _mm512_reduce_add_ps(total[r][c]));
}

/* A tile's outputs for every row; tile NULL: the codes decoded in registers (a call of
 * VEC_ROWS rows or fewer, which reads each weight once anyway). */
static void vec_tile(const fast_problem *p, const uint16_t *tile, int64_t o0, int64_t count) {
    const int64_t rows = p->a->rows;
    for (int64_t row = 0; row < rows; row += VEC_ROWS)
        for (int64_t c0 = 0; c0 < count; c0 += VEC_CHANNELS) {
            /* each case its own inlined copy: tile's NULL-ness and mr fold away */
            if (tile && rows - row >= 2)
                vec_step(p, tile, o0, count, row, c0, 2);
            else if (tile)
                vec_step(p, tile, o0, count, row, c0, 1);
            else if (rows - row >= 2)
                vec_step(p, NULL, o0, count, row, c0, 2);
            else
                vec_step(p, NULL, o0, count, row, c0, 1);
        }
}

/* Row r of the vector path's inputs: [rows][kp] bf16, zeros past k. */
static void pack_row(const tm_fp8_linear_args *a, int64_t kp, int64_t r, uint16_t *xp) {
    memcpy(xp + r * kp, (const uint16_t *)a->x + r * a->k, (size_t)a->k * 2);
    memset(xp + r * kp + a->k, 0, (size_t)(kp - a->k) * 2);
}

#if FP8_HAVE_AMX
/* m[i] lane j -> m[j] lane i for 16 vectors of 16 floats. Unpacking pairs of rows, then
 * pairs of pairs, leaves m[4g + s]'s 128-bit lane L holding rows 4g..4g+3 of column
 * 4L + s; two rounds of 128-bit lane shuffles put each column's four lanes together. */
static inline __attribute__((always_inline)) void transpose16x16(__m512 m[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(m[i], m[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(m[i], m[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        m[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        m[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        m[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        m[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int s = 0; s < 4; s++) {
        const __m512 u0 = _mm512_shuffle_f32x4(m[s], m[4 + s], 0x44);
        const __m512 u1 = _mm512_shuffle_f32x4(m[s], m[4 + s], 0xEE);
        const __m512 u2 = _mm512_shuffle_f32x4(m[8 + s], m[12 + s], 0x44);
        const __m512 u3 = _mm512_shuffle_f32x4(m[8 + s], m[12 + s], 0xEE);
        t[s] = _mm512_shuffle_f32x4(u0, u2, 0x88);
        t[4 + s] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
        t[8 + s] = _mm512_shuffle_f32x4(u1, u3, 0x88);
        t[12 + s] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; i++) m[i] = t[i];
}

/* Strip `strip` of the AMX path's inputs: per strip of 16 rows, [kp / 2][16][2] bf16
 * (row r's inputs 2i and 2i + 1 side by side: the B operand's layout), zeros past k and
 * past the last row. Each 32 inputs of 16 rows are 16 x 16 pairs, transposed. */
static void pack_strip(const tm_fp8_linear_args *a, int64_t kp, int64_t strip, uint16_t *xp) {
    const uint16_t *x = a->x;
    uint16_t *dst = xp + strip * 16 * kp;
    for (int64_t i = 0; i < kp; i += 32) {
        const int left = (int)(a->k - i < 32 ? a->k - i : 32);
        const __mmask32 mask = left >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << left) - 1);
        __m512 lines[16];
        for (int r = 0; r < 16; r++) {
            const int64_t row = strip * 16 + r;
            lines[r] = row < a->rows ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(
                                           mask, x + row * a->k + i))
                                     : _mm512_setzero_ps();
        }
        transpose16x16(lines); /* [row][pair] -> [pair][row] */
        for (int q = 0; q < 16; q++) _mm512_store_ps((float *)(dst + i * 16 + q * 32), lines[q]);
    }
}

/* Tile channels [0, 32) x rows [row, row + 32) (rows past a->rows are padding). */
static void amx_block(const fast_problem *p, const uint16_t *tile, int64_t o0, int64_t count,
                      int64_t row) {
    const int64_t kp = p->kp, strip_values = 16 * kp;
    const uint16_t *b0 = p->xp + (row / 16) * strip_values, *b1 = b0 + strip_values;
    const uint16_t *a0 = tile, *a1 = tile + 16 * kp;
    /* [channel half * 2 + row half][channel][row] */
    float total[4][16][16] __attribute__((aligned(64)));
    float sums[16][16] __attribute__((aligned(64)));
    for (int64_t b = 0; b < p->k_blocks; b++) {
        const int64_t first = b * p->block_chunks * 32;
        const int64_t end = b + 1 < p->k_blocks ? first + p->block_chunks * 32 : kp;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t i = first; i < end; i += 32) {
            _tile_loadd(4, a0 + i, kp * 2);
            _tile_loadd(5, a1 + i, kp * 2);
            _tile_loadd(6, b0 + i * 16, 64);
            _tile_loadd(7, b1 + i * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        /* each channel's 16 rows times its scale, into the running totals */
#define FP8_SCALE_TILE(t)                                                                  \
    do {                                                                                   \
        _tile_stored(t, sums, 64);                                                         \
        for (int c = 0; c < 16; c++) {                                                     \
            const __m512 scale = _mm512_set1_ps(scale_of(p, o0 + (t / 2) * 16 + c, b));    \
            const __m512 before = b ? _mm512_load_ps(total[t][c]) : _mm512_setzero_ps();   \
            _mm512_store_ps(total[t][c], _mm512_fmadd_ps(_mm512_load_ps(sums[c]), scale, before)); \
        }                                                                                  \
    } while (0)
        FP8_SCALE_TILE(0);
        FP8_SCALE_TILE(1);
        FP8_SCALE_TILE(2);
        FP8_SCALE_TILE(3);
#undef FP8_SCALE_TILE
    }
    /* Each row's 16 channels (a column of a total), plus the bias, rounded once to bf16. */
    const int64_t rows = p->a->rows;
    for (int t = 0; t < 4; t++) {
        const int64_t channel = (t / 2) * 16;
        if (channel >= count) continue;
        const int64_t left = count - channel;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 bias = p->a->bias ? _mm512_maskz_loadu_ps(mask, p->a->bias + o0 + channel)
                                       : _mm512_setzero_ps();
        __m512 lines[16];
        for (int c = 0; c < 16; c++) lines[c] = _mm512_load_ps(total[t][c]);
        transpose16x16(lines); /* [channel][row] -> [row][channel] */
        for (int r = 0; r < 16; r++) {
            const int64_t at = row + (t % 2) * 16 + r;
            if (at >= rows) break;
            const __m512 v = _mm512_add_ps(lines[r], bias);
            uint16_t *dst = (uint16_t *)p->a->out + at * p->a->n + o0 + channel;
            _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}
#endif

/* 1 where this call can take the bf16 dot products (see the header). */
static int fast_path_takes(const tm_fp8_linear_args *a) {
    return a->is_bf16 && a->max_isa >= TM_FP8_ISA_AVX512_BF16 &&
           (a->block_k >= a->k || a->block_k % 32 == 0);
}

/* The product on the bf16 dot products; TM_OK or TM_OUT_OF_MEMORY. */
static int fp8_linear_bf16(const tm_fp8_linear_args *a, const float table[256]) {
    fast_problem p = {.a = a, .kp = (a->k + 31) / 32 * 32};
    p.k_blocks = (a->k + a->block_k - 1) / a->block_k;
    p.block_chunks = p.k_blocks == 1 ? p.kp / 32 : a->block_k / 32;
    bf16_magnitudes(table, p.table);
#if FP8_HAVE_AMX
    const int amx = a->rows >= AMX_MIN_ROWS && a->max_isa >= TM_FP8_ISA_AMX &&
                    tm_internal_amx_permitted();
#else
    const int amx = 0;
#endif
    const int64_t padded_rows = amx ? (a->rows + 31) / 32 * 32 : a->rows;
    uint16_t *xp = aligned_alloc(64, (size_t)(padded_rows * p.kp) * 2);
    if (!xp) return TM_OUT_OF_MEMORY;
    p.xp = xp;
    const int64_t n = a->n, tiles = (n + TILE_CHANNELS - 1) / TILE_CHANNELS;
    const int parallel =
        a->num_threads > 1 && tiles > 1 && a->rows * n * a->k >= FP8_PARALLEL_MIN_MACS;
    int failed = 0;
#pragma omp parallel num_threads(a->num_threads) if (parallel)
    {
        /* the inputs packed by all threads first (the loop's end is a barrier) */
#if FP8_HAVE_AMX
        if (amx) {
#pragma omp for schedule(static)
            for (int64_t strip = 0; strip < padded_rows / 16; strip++) pack_strip(a, p.kp, strip, xp);
        } else
#endif
        {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < a->rows; r++) pack_row(a, p.kp, r, xp);
        }
        uint16_t *tile = aligned_alloc(64, (size_t)(TILE_CHANNELS * p.kp) * 2);
        if (!tile) {
#pragma omp atomic write
            failed = 1;
        }
#if FP8_HAVE_AMX
        if (amx) tm_configure_full_tiles();
#endif
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!tile) continue;
            const int64_t o0 = t * TILE_CHANNELS;
            const int64_t count = n - o0 < TILE_CHANNELS ? n - o0 : TILE_CHANNELS;
            if (!amx && a->rows <= VEC_ROWS) {
                vec_tile(&p, NULL, o0, count);
                continue;
            }
            decode_tile_bf16(&p, o0, count, tile);
#if FP8_HAVE_AMX
            if (amx) {
                for (int64_t row = 0; row < a->rows; row += 32) amx_block(&p, tile, o0, count, row);
                continue;
            }
#endif
            vec_tile(&p, tile, o0, count);
        }
#if FP8_HAVE_AMX
        if (amx) _tile_release();
#endif
        free(tile);
    }
    free(xp);
    return failed ? TM_OUT_OF_MEMORY : TM_OK;
}

#else
#define FP8_HAVE_BF16 0
#define FP8_HAVE_AMX 0
#endif

#endif
