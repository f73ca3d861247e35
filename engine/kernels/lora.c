/* LoRA terms of every run of rows in a step, in one call per layer
 * (engine/lora/layers.py).
 *
 * A step holds runs of rows that share an adapter; the base layer has computed y for all
 * of them. Done as two matmuls per run, each costs tens of microseconds of dispatch
 * whatever its size, which outweighs the few rows' arithmetic (docs/design.md,
 * "LoRA adapters"). Here each run (slot, first, end) gets
 *
 *     t = x[first:end] @ A[slot][:, :rank]                         (the shrink)
 *     y[first:end, out_lo:out_hi] += t[:, col_lo:col_hi] @ B[slot][col_lo:col_hi, out_lo:out_hi]
 *
 * for each of the slot's blocks (one per PEFT target the adapter has in the layer): the
 * expand touches only the output columns each target owns, not the zero blocks a fused
 * layer's B holds for the others. Sums are fp32. bf16 rounds t to bf16, as the matmul it
 * replaces would, and y once, after its add.
 *
 * An item is 16 rows of one run: their shrink, then their expand for each of the slot's
 * blocks, on one thread - t stays in that core's cache, and no barrier waits between
 * the two (items of different runs touch different rows). bf16 multiplies pairs of k
 * (vdpbf16ps and AMX both take them), so its right operands are stored in pairs
 * (kernels.h). Where Linux grants AMX, bf16 items run on AMX tiles, configured for the
 * item's rows (a decode step has a few per adapter); elsewhere on vdpbf16ps, and on CPUs
 * with AVX-512 but not AVX512-BF16 (Skylake-X to Ice Lake) on two FMAs per pair of k, which
 * give vdpbf16ps's sums; fp32 is AVX-512 FMA. AVX2 builds (Zen 1 and 2) run the same
 * sums in 8-wide FMA tiles; builds with neither run plain loops that compute them.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "kernel_common.h"
#include "kernels.h"

#define MR 8 /* rows per vector tile */
#define ITEM_ROWS 16 /* rows per work item: one AMX tile, two vector tiles */
#define NC 32 /* columns per tile: two vectors of 16 */
/* Prefetch distance in the vector tiles, in rows of w (pairs of rows in bf16): a decode
 * step's few rows per adapter make each call stream its adapters' weights from L3 or
 * memory once, waiting on each load; asking ahead made such a step 1.4x faster
 * (docs/design.md, "LoRA adapters"). Within the last rows of a short k (an expand)
 * the same rows' next two tiles of columns are asked for instead. */
#define PREFETCH_ROWS 16

/* One product tile's operands: out[row, col] (+)= sum_k x[row, k] * w[k, col]. */
typedef struct {
    const void *x; /* row-major, ldx values a row */
    int64_t ldx;
    const void *w; /* fp32: [k][ldw]; bf16: [k / 2][ldw][2] */
    int64_t ldw;
    void *out; /* row-major, ldo values a row */
    int64_t ldo;
    int64_t k;
    int is_bf16;
    int add; /* 1: out += product; 0: out = product */
    int amx; /* 1: on AMX tiles (bf16, k % 16 == 0 or w zero past k) */
} operands;

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#ifdef __AVX512BF16__
#define LORA_ISA TM_LORA_ISA_AVX512_BF16
#else
#define LORA_ISA TM_LORA_ISA_AVX512

/* 16 fp32 values rounded to bf16 (nearest even) as vcvtneps2bf16 does, by integer ops for
 * CPUs without it: the bits in each lane's low half. A NaN stays a NaN (quiet, its top
 * bits), where the rounding add could carry its payload into an infinity. */
static inline __m512i bf16_bits(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x00400000));
    return _mm512_srli_epi32(rounded, 16);
}
#endif

static inline __mmask16 column_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* 16 values of row r at column c, stored (or added) from fp32 acc. */
static inline __attribute__((always_inline)) void finish16(const operands *o, int64_t r, int64_t c,
                                                           __mmask16 m, __m512 acc) {
    if (!m) return;
    if (o->is_bf16) {
        uint16_t *p = (uint16_t *)o->out + r * o->ldo + c;
        if (o->add) { /* AVX-512BW's 512-bit load: no AVX-512VL needed */
            const __m512i old = _mm512_cvtepu16_epi32(
                _mm512_castsi512_si256(_mm512_maskz_loadu_epi16((__mmask32)m, p)));
            acc = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(old, 16)), acc);
        }
#ifdef __AVX512BF16__
        _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(acc));
#else
        _mm512_mask_cvtepi32_storeu_epi16(p, m, bf16_bits(acc));
#endif
    } else {
        float *p = (float *)o->out + r * o->ldo + c;
        if (o->add) acc = _mm512_add_ps(_mm512_maskz_loadu_ps(m, p), acc);
        _mm512_mask_storeu_ps(p, m, acc);
    }
}

/* Named accumulators, not an array: GCC moves an array of vectors through the stack. */
#define ACC(r) __m512 c##r##0 = _mm512_setzero_ps(), c##r##1 = _mm512_setzero_ps()
#define FMA_ROW(r)                                                             \
    if (mr > r) {                                                              \
        const __m512 xv = _mm512_set1_ps(x[(row + r) * ldx + i]);              \
        c##r##0 = _mm512_fmadd_ps(xv, w0, c##r##0);                            \
        if (nv > 1) c##r##1 = _mm512_fmadd_ps(xv, w1, c##r##1);                \
    }
#ifdef __AVX512BF16__
#define DOT_ROW(r)                                                             \
    if (mr > r) {                                                              \
        int32_t pair;                                                          \
        __builtin_memcpy(&pair, xb + (row + r) * ldx + 2 * i, 4);              \
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                 \
        c##r##0 = _mm512_dpbf16_ps(c##r##0, xv, (__m512bh)w0);                 \
        if (nv > 1) c##r##1 = _mm512_dpbf16_ps(c##r##1, xv, (__m512bh)w1);     \
    }
#else
/* vdpbf16ps's sums by two FMAs: acc + x_odd * w_odd, then + x_even * w_even (a product of
 * two bf16 is exact in fp32, so each FMA rounds where vdpbf16ps does). A pair's even k
 * is its low half: shifted up, it is that bf16's fp32 value; the odd one is the pair
 * with the low half cleared. */
#define DOT_ROW(r)                                                             \
    if (mr > r) {                                                              \
        int32_t pair;                                                          \
        __builtin_memcpy(&pair, xb + (row + r) * ldx + 2 * i, 4);              \
        const __m512 xo = _mm512_castsi512_ps(_mm512_set1_epi32(pair & (int32_t)0xFFFF0000)); \
        const __m512 xe = _mm512_castsi512_ps(_mm512_set1_epi32((int32_t)((uint32_t)pair << 16))); \
        c##r##0 = _mm512_fmadd_ps(xe, w0e, _mm512_fmadd_ps(xo, w0o, c##r##0));  \
        if (nv > 1) c##r##1 = _mm512_fmadd_ps(xe, w1e, _mm512_fmadd_ps(xo, w1o, c##r##1)); \
    }
#endif
#define FINISH_ROW(r)                                                          \
    if (mr > r) {                                                              \
        finish16(o, row + r, col, m0, c##r##0);                                \
        if (nv > 1) finish16(o, row + r, col + 16, m1, c##r##1);               \
    }

/* Rows [row, row + mr) x columns [col, col + 32) cut at `end`; mr and nv are constants at
 * every call (tile_any's switch), so the unused rows and vector fold away. */
static inline __attribute__((always_inline)) void tile(const operands *o, int64_t row, int64_t col,
                                                       int64_t end, const int mr, const int nv) {
    ACC(0); ACC(1); ACC(2); ACC(3); ACC(4); ACC(5); ACC(6); ACC(7);
    const __mmask16 m0 = column_mask(end - col), m1 = column_mask(end - col - 16);
    const int64_t ldx = o->ldx, ldw = o->ldw;
    if (o->is_bf16) {
        const uint16_t *xb = (const uint16_t *)o->x, *w = (const uint16_t *)o->w;
        const int64_t k2 = o->k / 2;
        for (int64_t i = 0; i < k2; i++) {
            const uint16_t *ahead = i + PREFETCH_ROWS < k2 ? w + ((i + PREFETCH_ROWS) * ldw + col) * 2
                                                           : w + (i * ldw + col + 2 * NC) * 2;
            __builtin_prefetch(ahead);
            if (nv > 1) __builtin_prefetch(ahead + 32); /* 32 columns: two lines of pairs */
            const __m512i w0 = _mm512_maskz_loadu_epi32(m0, w + (i * ldw + col) * 2);
            const __m512i w1 = nv > 1 ? _mm512_maskz_loadu_epi32(m1, w + (i * ldw + col + 16) * 2)
                                      : _mm512_setzero_si512();
#ifndef __AVX512BF16__
            const __m512i odd = _mm512_set1_epi32((int32_t)0xFFFF0000);
            const __m512 w0o = _mm512_castsi512_ps(_mm512_and_si512(w0, odd));
            const __m512 w0e = _mm512_castsi512_ps(_mm512_slli_epi32(w0, 16));
            const __m512 w1o = _mm512_castsi512_ps(_mm512_and_si512(w1, odd));
            const __m512 w1e = _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16));
#endif
            DOT_ROW(0) DOT_ROW(1) DOT_ROW(2) DOT_ROW(3) DOT_ROW(4) DOT_ROW(5) DOT_ROW(6) DOT_ROW(7)
        }
    } else {
        const float *x = (const float *)o->x, *w = (const float *)o->w;
        for (int64_t i = 0; i < o->k; i++) {
            __builtin_prefetch(i + PREFETCH_ROWS < o->k ? w + (i + PREFETCH_ROWS) * ldw + col
                                                        : w + i * ldw + col + 2 * NC);
            const __m512 w0 = _mm512_maskz_loadu_ps(m0, w + i * ldw + col);
            const __m512 w1 = nv > 1 ? _mm512_maskz_loadu_ps(m1, w + i * ldw + col + 16)
                                     : _mm512_setzero_ps();
            FMA_ROW(0) FMA_ROW(1) FMA_ROW(2) FMA_ROW(3) FMA_ROW(4) FMA_ROW(5) FMA_ROW(6) FMA_ROW(7)
        }
    }
    FINISH_ROW(0) FINISH_ROW(1) FINISH_ROW(2) FINISH_ROW(3) FINISH_ROW(4) FINISH_ROW(5) FINISH_ROW(6)
    FINISH_ROW(7)
}

#define TILE_ROWS(nv)                                        \
    switch (mr) {                                            \
    case 8: tile(o, row, col, end, 8, nv); break;            \
    case 7: tile(o, row, col, end, 7, nv); break;            \
    case 6: tile(o, row, col, end, 6, nv); break;            \
    case 5: tile(o, row, col, end, 5, nv); break;            \
    case 4: tile(o, row, col, end, 4, nv); break;            \
    case 3: tile(o, row, col, end, 3, nv); break;            \
    case 2: tile(o, row, col, end, 2, nv); break;            \
    default: tile(o, row, col, end, 1, nv); break;           \
    }

static void tile_any(const operands *o, int64_t row, int mr, int64_t col, int64_t end) {
    if (end - col > 16) {
        TILE_ROWS(2);
    } else {
        TILE_ROWS(1);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define LORA_AMX 1
#define AMX_ROWS 16

/* Tiles for items of m rows (1-16): 0-3 accumulate m rows x 16 fp32; 4 holds m rows x 32 k
 * of x and 5 the 16 pair rows of w that meet them; 6 and 7 the same for k's last 16. A
 * decode step's runs are a few rows each: their tiles carry only those rows, so that AMX
 * serves them too rather than vdpbf16ps, whose one product per cycle makes a few rows'
 * terms compute-bound (docs/design.md, "LoRA adapters"). */
static void configure_tiles(int m) {
    const uint8_t rows[8] = {m, m, m, m, m, 16, m, 8};
    const uint16_t bytes[8] = {64, 64, 64, 64, 64, 64, 32, 64};
    tm_configure_tiles(rows, bytes);
}

/* One step of k from kk into accumulator tiles 0-3: x's rows into tile xt, w's pair rows
 * into tile wt (tile numbers must be constants: 4 and 5 for 32 k, 6 and 7 for 16). */
#define AMX_K_STEP(kk, xt, wt)                                                           \
    do {                                                                                 \
        const uint16_t *pairs = w + (((kk) / 2) * o->ldw + col) * 2;                     \
        _tile_loadd(xt, x + (kk), x_bytes);                                              \
        _tile_loadd(wt, pairs, w_bytes);                                                 \
        _tile_dpbf16ps(0, xt, wt);                                                       \
        if (left > 16) { _tile_loadd(wt, pairs + 32, w_bytes); _tile_dpbf16ps(1, xt, wt); } \
        if (left > 32) { _tile_loadd(wt, pairs + 64, w_bytes); _tile_dpbf16ps(2, xt, wt); } \
        if (left > 48) { _tile_loadd(wt, pairs + 96, w_bytes); _tile_dpbf16ps(3, xt, wt); } \
    } while (0)

/* 16 x 16 identity in w's pair layout (8 pair rows of 16 columns x 2 k), bf16 ones: y's
 * 16-column blocks times it put y into the accumulator tiles exactly, so that a whole
 * 64-column band adds its terms to y on the tiles and the vector work left is one
 * two-vector conversion per 32 outputs - the add into the base's output was most of a
 * prompt step's expand (docs/design.md, "LoRA adapters"). */
static const uint16_t IDENTITY16[8][16][2] __attribute__((aligned(64))) = {
#define ONE(p, c) {(2 * (p) == (c)) ? 0x3F80 : 0, (2 * (p) + 1 == (c)) ? 0x3F80 : 0}
#define ROW(p) {ONE(p, 0), ONE(p, 1), ONE(p, 2), ONE(p, 3), ONE(p, 4), ONE(p, 5), ONE(p, 6), \
                ONE(p, 7), ONE(p, 8), ONE(p, 9), ONE(p, 10), ONE(p, 11), ONE(p, 12),          \
                ONE(p, 13), ONE(p, 14), ONE(p, 15)}
    ROW(0), ROW(1), ROW(2), ROW(3), ROW(4), ROW(5), ROW(6), ROW(7),
#undef ROW
#undef ONE
};

/* Rows [0, rows) x columns [first, end) on AMX tiles configured for `rows` rows, 64
 * columns (four fp32 accumulator tiles, 0-3) at a time: tile 4 holds 32 k of x, tile 5 a
 * block of w's pair rows; k is read in whole 16s. Past `end` the tiles read w's next
 * columns (tm_lora_args's padding keeps them inside w) and the finish leaves those sums
 * out. */
static void amx_band(const operands *o, int64_t rows, int64_t first, int64_t end) {
    float acc[AMX_ROWS][64] __attribute__((aligned(64)));
    const uint16_t *x = (const uint16_t *)o->x, *w = (const uint16_t *)o->w;
    const int64_t x_bytes = o->ldx * 2, w_bytes = o->ldw * 4;
    const int64_t k = (o->k + 15) / 16 * 16, whole = k / 32 * 32;
    for (int64_t col = first; col < end; col += 64) {
        const int64_t left = end - col;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        const int whole_add = left >= 64 && o->add; /* an expand into y (bf16 on AMX) */
        if (whole_add) { /* the accumulators start from y (IDENTITY16) */
            const uint16_t *y = (const uint16_t *)o->out + col;
            const int64_t y_bytes = o->ldo * 2;
            _tile_loadd(7, IDENTITY16, 64);
            _tile_loadd(6, y, y_bytes); _tile_dpbf16ps(0, 6, 7);
            _tile_loadd(6, y + 16, y_bytes); _tile_dpbf16ps(1, 6, 7);
            _tile_loadd(6, y + 32, y_bytes); _tile_dpbf16ps(2, 6, 7);
            _tile_loadd(6, y + 48, y_bytes); _tile_dpbf16ps(3, 6, 7);
        }
        for (int64_t kk = 0; kk < whole; kk += 32) AMX_K_STEP(kk, 4, 5);
        if (k > whole) AMX_K_STEP(whole, 6, 7);
        _tile_stored(0, acc[0], sizeof acc[0]);
        if (left > 16) _tile_stored(1, acc[0] + 16, sizeof acc[0]);
        if (left > 32) _tile_stored(2, acc[0] + 32, sizeof acc[0]);
        if (left > 48) _tile_stored(3, acc[0] + 48, sizeof acc[0]);
        if (whole_add) {
            for (int64_t r = 0; r < rows; r++) {
                uint16_t *p = (uint16_t *)o->out + r * o->ldo + col;
                const float *a = acc[r];
                const __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_load_ps(a + 16), _mm512_load_ps(a));
                const __m512bh hi = _mm512_cvtne2ps_pbh(_mm512_load_ps(a + 48), _mm512_load_ps(a + 32));
                _mm512_storeu_si512(p, (__m512i)lo);
                _mm512_storeu_si512(p + 32, (__m512i)hi);
            }
            continue;
        }
        for (int64_t r = 0; r < rows; r++)
            for (int g = 0; g < 4 && 16 * g < left; g++)
                finish16(o, r, col + 16 * g, column_mask(left - 16 * g),
                         _mm512_load_ps(acc[r] + 16 * g));
    }
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LORA_ISA TM_LORA_ISA_AVX2
/* Rows per AVX2 tile: 4 rows x 16 columns of accumulators (8 registers), with bf16's four
 * halves of w and two of x, fit AVX2's 16 vector registers; 8 rows would spill. */
#define SUB_ROWS 4

/* maskload's mask for the first n (0-8) of 8 lanes: 8 - n entries into this table. */
static const int32_t LANE_MASKS[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

static inline __m256i lane_mask(int64_t left) {
    const int64_t n = left < 0 ? 0 : left > 8 ? 8 : left;
    return _mm256_loadu_si256((const __m256i *)(LANE_MASKS + 8 - n));
}

/* 8 fp32 values rounded to bf16 (nearest even, a NaN kept a quiet NaN), as AVX-512's
 * bf16_bits: 8 bf16 in order. */
static inline __m128i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
    const __m256i bits = _mm256_srli_epi32(rounded, 16); /* each <= 0xFFFF: packus keeps it */
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

/* The first `left` (at most 8) values of row r at column c, stored (or added) from fp32
 * acc; m is lane_mask(left). AVX2 has no 16-bit masked moves: a bf16 tail goes through
 * a buffer. */
static inline __attribute__((always_inline)) void finish8(const operands *o, int64_t r, int64_t c,
                                                          int64_t left, __m256i m, __m256 acc) {
    if (left <= 0) return;
    if (o->is_bf16) {
        uint16_t *p = (uint16_t *)o->out + r * o->ldo + c;
        uint16_t part[8] = {0};
        const size_t bytes = (size_t)(left < 8 ? left : 8) * 2;
        if (o->add) {
            __m128i old;
            if (left >= 8) {
                old = _mm_loadu_si128((const __m128i *)p);
            } else {
                memcpy(part, p, bytes);
                old = _mm_loadu_si128((const __m128i *)part);
            }
            const __m256i widened = _mm256_slli_epi32(_mm256_cvtepu16_epi32(old), 16);
            acc = _mm256_add_ps(_mm256_castsi256_ps(widened), acc);
        }
        if (left >= 8) {
            _mm_storeu_si128((__m128i *)p, bf16_bits8(acc));
        } else {
            _mm_storeu_si128((__m128i *)part, bf16_bits8(acc));
            memcpy(p, part, bytes);
        }
    } else {
        float *p = (float *)o->out + r * o->ldo + c;
        if (o->add) acc = _mm256_add_ps(_mm256_maskload_ps(p, m), acc);
        _mm256_maskstore_ps(p, m, acc);
    }
}

#define ACC8(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps()
#define FMA8_ROW(r)                                                            \
    if (mr > r) {                                                              \
        const __m256 xv = _mm256_broadcast_ss(x + (row + r) * ldx + i);        \
        c##r##0 = _mm256_fmadd_ps(xv, w0, c##r##0);                            \
        if (nv > 1) c##r##1 = _mm256_fmadd_ps(xv, w1, c##r##1);                \
    }
/* A pair of k by two FMAs, odd then even, as the AVX-512 build's DOT_ROW. */
#define DOT8_ROW(r)                                                            \
    if (mr > r) {                                                              \
        int32_t pair;                                                          \
        __builtin_memcpy(&pair, xb + (row + r) * ldx + 2 * i, 4);              \
        const __m256 xo = _mm256_castsi256_ps(_mm256_set1_epi32(pair & (int32_t)0xFFFF0000)); \
        const __m256 xe = _mm256_castsi256_ps(_mm256_set1_epi32((int32_t)((uint32_t)pair << 16))); \
        c##r##0 = _mm256_fmadd_ps(xe, w0e, _mm256_fmadd_ps(xo, w0o, c##r##0));  \
        if (nv > 1) c##r##1 = _mm256_fmadd_ps(xe, w1e, _mm256_fmadd_ps(xo, w1o, c##r##1)); \
    }
#define FINISH8_ROW(r)                                                         \
    if (mr > r) {                                                              \
        finish8(o, row + r, col, end - col, m0, c##r##0);                      \
        if (nv > 1) finish8(o, row + r, col + 8, end - col - 8, m1, c##r##1);  \
    }

/* Rows [row, row + mr) x columns [col, col + 16) cut at `end`, mr (1-4) and nv (vectors
 * of 8 columns, 1-2) constants at every call (tile_any's switch). */
static inline __attribute__((always_inline)) void tile8(const operands *o, int64_t row, int64_t col,
                                                        int64_t end, const int mr, const int nv) {
    ACC8(0); ACC8(1); ACC8(2); ACC8(3);
    const __m256i m0 = lane_mask(end - col), m1 = lane_mask(end - col - 8);
    const int64_t ldx = o->ldx, ldw = o->ldw;
    if (o->is_bf16) {
        const uint16_t *xb = (const uint16_t *)o->x, *w = (const uint16_t *)o->w;
        const int64_t k2 = o->k / 2;
        const __m256i odd = _mm256_set1_epi32((int32_t)0xFFFF0000);
        for (int64_t i = 0; i < k2; i++) {
            __builtin_prefetch(i + PREFETCH_ROWS < k2 ? w + ((i + PREFETCH_ROWS) * ldw + col) * 2
                                                      : w + (i * ldw + col + NC) * 2);
            const int *pairs = (const int *)(w + (i * ldw + col) * 2); /* a column's pair */
            const __m256i w0 = _mm256_maskload_epi32(pairs, m0);
            const __m256i w1 = nv > 1 ? _mm256_maskload_epi32(pairs + 8, m1) : _mm256_setzero_si256();
            const __m256 w0o = _mm256_castsi256_ps(_mm256_and_si256(w0, odd));
            const __m256 w0e = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
            const __m256 w1o = _mm256_castsi256_ps(_mm256_and_si256(w1, odd));
            const __m256 w1e = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
            DOT8_ROW(0) DOT8_ROW(1) DOT8_ROW(2) DOT8_ROW(3)
        }
    } else {
        const float *x = (const float *)o->x, *w = (const float *)o->w;
        for (int64_t i = 0; i < o->k; i++) {
            __builtin_prefetch(i + PREFETCH_ROWS < o->k ? w + (i + PREFETCH_ROWS) * ldw + col
                                                        : w + i * ldw + col + NC);
            const __m256 w0 = _mm256_maskload_ps(w + i * ldw + col, m0);
            const __m256 w1 =
                nv > 1 ? _mm256_maskload_ps(w + i * ldw + col + 8, m1) : _mm256_setzero_ps();
            FMA8_ROW(0) FMA8_ROW(1) FMA8_ROW(2) FMA8_ROW(3)
        }
    }
    FINISH8_ROW(0) FINISH8_ROW(1) FINISH8_ROW(2) FINISH8_ROW(3)
}

#define TILE8_ROWS(nv)                                       \
    switch (rows) {                                          \
    case 4: tile8(o, row + part, c, end, 4, nv); break;      \
    case 3: tile8(o, row + part, c, end, 3, nv); break;      \
    case 2: tile8(o, row + part, c, end, 2, nv); break;      \
    default: tile8(o, row + part, c, end, 1, nv); break;     \
    }

/* The 8 x 32 tile of the AVX-512 builds as AVX2 tiles of 4 rows x 16 columns: the second
 * rows' pass reads the same columns of w, by then in cache. */
static void tile_any(const operands *o, int64_t row, int mr, int64_t col, int64_t end) {
    for (int64_t c = col; c < end && c < col + NC; c += 16) {
        for (int part = 0; part < mr; part += SUB_ROWS) {
            const int rows = mr - part < SUB_ROWS ? mr - part : SUB_ROWS;
            if (end - c > 8) {
                TILE8_ROWS(2);
            } else {
                TILE8_ROWS(1);
            }
        }
    }
}
#else
#define LORA_ISA TM_LORA_ISA_GENERIC

/* The same sums in plain loops (k in order, fp32), for builds without AVX-512 or AVX2. */
static void tile_any(const operands *o, int64_t row, int mr, int64_t col, int64_t end) {
    float acc[MR][NC] = {{0}};
    const int64_t nc = end - col < NC ? end - col : NC;
    for (int64_t i = 0; i < o->k; i++) {
        for (int r = 0; r < mr; r++) {
            float xv;
            float *a = acc[r];
            if (o->is_bf16) {
                const uint16_t *w = (const uint16_t *)o->w + ((i / 2) * o->ldw + col) * 2 + i % 2;
                xv = bf16_to_f32(((const uint16_t *)o->x)[(row + r) * o->ldx + i]);
                for (int64_t c = 0; c < nc; c++) a[c] += xv * bf16_to_f32(w[2 * c]);
            } else {
                const float *w = (const float *)o->w + i * o->ldw + col;
                xv = ((const float *)o->x)[(row + r) * o->ldx + i];
                for (int64_t c = 0; c < nc; c++) a[c] += xv * w[c];
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        for (int64_t c = 0; c < nc; c++) {
            const int64_t at = (row + r) * o->ldo + col + c;
            if (o->is_bf16) {
                uint16_t *p = (uint16_t *)o->out + at;
                *p = f32_to_bf16((o->add ? bf16_to_f32(*p) : 0.0f) + acc[r][c]);
            } else {
                float *p = (float *)o->out + at;
                *p = (o->add ? *p : 0.0f) + acc[r][c];
            }
        }
    }
}
#endif

/* 1 where this build has AMX tiles and Linux grants them: bf16 calls then use them. */
static int amx_usable(void) {
#ifdef LORA_AMX
    return tm_internal_amx_permitted();
#else
    return 0;
#endif
}

int tm_lora_isa(void) {
    return LORA_ISA == TM_LORA_ISA_AVX512_BF16 && amx_usable() ? TM_LORA_ISA_AMX : LORA_ISA;
}

/* Rows [0, rows) (at most ITEM_ROWS) of one product over columns [first, end): AMX tiles
 * where this build and call have them, else vector tiles. *tile_rows: the rows the
 * thread's tiles are configured for, changed only when an item's count differs. */
static void row_band(const operands *o, int64_t rows, int64_t first, int64_t end, int *tile_rows) {
#ifdef LORA_AMX
    if (o->amx) {
        if (*tile_rows != rows) {
            configure_tiles((int)rows);
            *tile_rows = (int)rows;
        }
        amx_band(o, rows, first, end);
        return;
    }
#else
    (void)tile_rows;
#endif
    for (int64_t part = 0; part < rows; part += MR) {
        const int mr = (int)(rows - part < MR ? rows - part : MR);
        for (int64_t col = first; col < end; col += NC) tile_any(o, part, mr, col, end);
    }
}

static int64_t items_in(int64_t rows) { return (rows + ITEM_ROWS - 1) / ITEM_ROWS; }

/* The run an item falls in: item_starts[run] <= t < item_starts[run + 1]. */
static int64_t run_of(const int64_t *item_starts, int64_t num_runs, int64_t t) {
    int64_t lo = 0, hi = num_runs - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (item_starts[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

static int check(const tm_lora_args *a) {
    const int amx = a->is_bf16 && amx_usable();
    if (a->num_runs < 0 || a->num_slots <= 0 || a->in_features <= 0 || a->out_features <= 0 ||
        a->a_cols <= 0 || a->b_rows <= 0 || a->b_cols < a->out_features)
        return TM_UNSUPPORTED_SHAPE;
    if (a->is_bf16 && (a->in_features % 2 || a->b_rows % 2)) return TM_UNSUPPORTED_SHAPE;
    if (amx && a->b_cols < a->out_features + 16) return TM_UNSUPPORTED_SHAPE;
    for (int64_t s = 0; s < a->num_slots; s++) {
        const int64_t rank = a->slot_ranks[s], blocks = a->slot_num_blocks[s];
        if (rank < 0 || rank > a->a_cols || blocks < 0 || blocks > TM_LORA_MAX_BLOCKS)
            return TM_UNSUPPORTED_SHAPE;
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t *blk = a->slot_blocks + (s * TM_LORA_MAX_BLOCKS + b) * 4;
            const int64_t k_read = amx ? round16(blk[1] - blk[0]) : blk[1] - blk[0];
            if (blk[0] < 0 || blk[0] > blk[1] || blk[1] > rank || blk[0] + k_read > a->b_rows ||
                blk[2] < 0 || blk[2] > blk[3] || blk[3] > a->out_features ||
                (a->is_bf16 && (blk[0] % 2 || blk[1] % 2)))
                return TM_UNSUPPORTED_SHAPE;
            /* Blocks write their own output columns: tiles of two blocks run at once. */
            for (int64_t other = 0; other < b; other++) {
                const int64_t *prev = a->slot_blocks + (s * TM_LORA_MAX_BLOCKS + other) * 4;
                if (blk[2] < prev[3] && prev[2] < blk[3]) return TM_UNSUPPORTED_SHAPE;
            }
        }
    }
    for (int64_t r = 0; r < a->num_runs; r++) {
        const int64_t *run = a->runs + r * 3;
        if (run[0] < 0 || run[0] >= a->num_slots || run[1] < 0 || run[1] > run[2] ||
            run[2] > a->rows)
            return TM_UNSUPPORTED_SHAPE;
    }
    return TM_OK;
}

int tm_lora(const tm_lora_args *a) {
    const int status = check(a);
    if (status != TM_OK || a->num_runs == 0) return status;
    const int64_t num_runs = a->num_runs, in = a->in_features, out = a->out_features;
    const int64_t a_cols = a->a_cols, b_rows = a->b_rows, b_cols = a->b_cols;
    const int64_t value_bytes = a->is_bf16 ? 2 : 4;
    /* item_starts[r]: items before run r (none for a run whose adapter has no term here). */
    int64_t *item_starts = malloc((size_t)(num_runs + 1) * sizeof(int64_t));
    if (!item_starts) return TM_OUT_OF_MEMORY;
    item_starts[0] = 0;
    for (int64_t r = 0; r < num_runs; r++) {
        const int64_t *run = a->runs + r * 3;
        item_starts[r + 1] = item_starts[r] + (a->slot_ranks[run[0]] ? items_in(run[2] - run[1]) : 0);
    }
    const int64_t items = item_starts[num_runs];
    const int threads = items > 1 ? a->num_threads : 1;
    const int amx = a->is_bf16 && amx_usable();
    /* Each item's t = x @ A (ITEM_ROWS x b_rows) stays in its thread's own buffer, hot for
     * the expand that reads it straight after. */
    const size_t t_bytes = (size_t)(ITEM_ROWS * b_rows * value_bytes);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        char *t_rows = malloc(t_bytes);
        int tile_rows = 0;
        if (!t_rows) {
#pragma omp atomic write
            failed = 1;
        }
        /* Each thread a contiguous share of the items: its rows of y and its runs'
         * weights in one stretch, a little faster than items dealt out one at a time
         * (docs/design.md, "LoRA adapters"). */
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t lo = items * tid / nt, hi = t_rows ? items * (tid + 1) / nt : lo;
        for (int64_t t = lo; t < hi; t++) {
            const int64_t r = run_of(item_starts, num_runs, t);
            const int64_t *run = a->runs + r * 3;
            const int64_t slot = run[0], row = run[1] + (t - item_starts[r]) * ITEM_ROWS;
            const int64_t rows = run[2] - row < ITEM_ROWS ? run[2] - row : ITEM_ROWS;
            /* Zeros past the rank: AMX tiles read a block's rank columns in whole 16s, and
             * what an earlier item left there must not meet B's zero padding as inf * 0.
             * Tiles and vector tiles read the item's rows only. */
            memset(t_rows, 0, (size_t)(rows * b_rows * value_bytes));
            const operands shrink = {
                .x = (const char *)a->x + row * in * value_bytes, .ldx = in,
                .w = (const char *)a->a + slot * in * a_cols * value_bytes, .ldw = a_cols,
                .out = t_rows, .ldo = b_rows,
                .k = in, .is_bf16 = a->is_bf16, .add = 0, .amx = amx && in % 16 == 0,
            };
            row_band(&shrink, rows, 0, a->slot_ranks[slot], &tile_rows);
            for (int64_t b = 0; b < a->slot_num_blocks[slot]; b++) {
                const int64_t *blk = a->slot_blocks + (slot * TM_LORA_MAX_BLOCKS + b) * 4;
                /* t's columns [col_lo, col_hi) are the k of this block's product; B's rows
                 * from col_lo (pairs of them in bf16: the same element offset). */
                const operands expand = {
                    .x = t_rows + blk[0] * value_bytes, .ldx = b_rows,
                    .w = (const char *)a->b + (slot * b_rows + blk[0]) * b_cols * value_bytes,
                    .ldw = b_cols,
                    .out = (char *)a->y + row * out * value_bytes, .ldo = out,
                    .k = blk[1] - blk[0], .is_bf16 = a->is_bf16, .add = 1, .amx = amx,
                };
                row_band(&expand, rows, blk[2], blk[3], &tile_rows);
            }
        }
#ifdef LORA_AMX
        if (tile_rows) _tile_release();
#endif
        free(t_rows);
    }
    free(item_starts);
    return failed ? TM_OUT_OF_MEMORY : TM_OK;
}
