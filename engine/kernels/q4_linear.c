/* The GGUF 4-bit layers' forward (engine/quant/gguf_linear.py: Q4_0 and Q4_1 blocks) in
 * integer dot products on the file's own blocks - llama.cpp's arithmetic for these
 * formats: each row of x is quantized in blocks of 32 values to int8 with one scale per
 * block (llama.cpp's Q8_0 for activations), and each block's 32 products are summed
 * exactly in int32 before its two scales are applied.
 *
 * Why: the bf16 alternative expands the layer's weights on every call (about half of a
 * 32-64-row call) and PyTorch's int4 kernel computes far below the vector units' rate;
 * integer dot products on the 4-bit blocks read a quarter of bf16's bytes and run on the
 * VNNI units (docs/design.md, "4-bit GGUF layers in integer dot products").
 *
 * Layout (engine/kernels/q4_linear.py packs it): panels of 16 output channels, each a run
 * of k / 32 blocks of `block_bytes`: 256 bytes of nibbles - four 64-byte lines, line i
 * holding for channel c (bytes 4c..4c+3) the block's k-values 4i..4i+3 in its low nibbles
 * and 4i+16..4i+19 in its high ones, so one load and two masks give vpdpbusd two k-steps
 * for 16 channels - then 16 fp16 scales d, then (affine blocks, Q4_1) 16 fp16 minimums.
 * A weight is d * q + min (q in 0..15); a symmetric block (Q4_0) has min = -8 * d, which
 * is taken off in the integer sum (it starts at -8 * the activations' sum).
 *
 * Per block b of row m and channel n, with isum = sum q * qx over the block (exact):
 *   t = float(isum) * d;  acc = fma(t, xs, acc);  [affine: acc = fma(min, xs * sum(qx), acc)]
 * from acc = 0 over the blocks in order; out = acc + bias, rounded once to out's type.
 * Every build performs exactly these operations per channel, so AVX512-VNNI, AVX-VNNI and
 * AVX2 builds give the same bits. The AVX2 product sums u8 x s8 pairs in int16 first
 * (vpmaddubsw), which cannot saturate here: 2 * 15 * 127 < 2^15.
 *
 * Work split: each thread owns a contiguous run of panels for every row (a decode step
 * reads each weight once); rows go in blocks that stay in L2 while a thread's panels pass
 * over them.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernel_common.h"
#include "kernels.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__F16C__)
#define Q4_AVX512 1
#define Q4_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_AVX512 0
#define Q4_AVX2 1
#include <immintrin.h>
#else
#define Q4_AVX512 0
#define Q4_AVX2 0
#endif

#define Q4_BLOCK 32       /* k-values per block (GGUF's Q4_0 / Q4_1) */
#define Q4_NIBBLES 256    /* nibble bytes of one panel's block */
#define Q4_ROW_BLOCK 96   /* rows kept in L2 while a thread's panels pass over them */
/* As int8_linear.c: one thread below this many multiply-adds, unless the weights alone are
 * this many bytes' worth of values (a one-row call is bound by reading them). */
#define Q4_MATMUL_PARALLEL_MIN (1 << 20)
#define Q4_WEIGHT_PARALLEL_MIN (1 << 18)

int tm_q4_linear_isa(void) {
#if Q4_AVX512
    return TM_INT8_ISA_AVX512_VNNI;
#elif Q4_AVX2 && defined(__AVXVNNI__)
    return TM_INT8_ISA_AVX_VNNI;
#elif Q4_AVX2
    return TM_INT8_ISA_AVX2;
#else
    return TM_INT8_ISA_NONE;
#endif
}

#if Q4_AVX512 || Q4_AVX2
typedef struct {
    const int8_t *qx;      /* [rows, k] */
    const float *x_scales; /* [rows, k / 32] */
    const int32_t *x_sums; /* [rows, k / 32] */
    const uint8_t *w;
    const float *bias;
    void *out;
    int64_t n, k, nb, block_bytes;
    int is_bf16, affine;
} q4_problem;

/* Row r's block starting at x[offset] quantized into q[0..31]: returns its scale (0 for an
 * all-zero block, NaN where a value is not finite, so that the row's outputs are NaN) and
 * stores the sum of the 32 integers. The values are x * (127 / max|x|) rounded to nearest
 * even and clamped to +-127; the scale is max|x| / 127 (fp32 divisions, no fast math). */
static float quantize_block(const void *x, int64_t offset, int is_bf16, int8_t *q, int32_t *sum) {
    float v[Q4_BLOCK];
    load_row(x, offset, is_bf16, Q4_BLOCK, v);
#if Q4_AVX512
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    if (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) {
        memset(q, 0, Q4_BLOCK);
        *sum = 0;
        return NAN;
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
#else
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < Q4_BLOCK; i++) {
        const float m = fabsf(v[i]);
        finite &= !isnan(v[i]);
        amax = m > amax ? m : amax;
    }
    if (!finite) {
        memset(q, 0, Q4_BLOCK);
        *sum = 0;
        return NAN;
    }
#endif
    if (amax > FLT_MAX) { /* an infinite value */
        memset(q, 0, Q4_BLOCK);
        *sum = 0;
        return NAN;
    }
    if (amax == 0.0f) {
        memset(q, 0, Q4_BLOCK);
        *sum = 0;
        return 0.0f;
    }
    const float inv = 127.0f / amax;
#if Q4_AVX512
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    const __m512 vi = _mm512_set1_ps(inv);
    const __m512i qa = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, vi)), lo), hi);
    const __m512i qb = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, vi)), lo), hi);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
    int32_t s = 0;
    for (int i = 0; i < Q4_BLOCK; i++) {
        long r = lrintf(v[i] * inv); /* the current rounding mode: to nearest even */
        r = r < -127 ? -127 : r > 127 ? 127 : r;
        q[i] = (int8_t)r;
        s += (int32_t)r;
    }
    *sum = s;
#endif
    return amax / 127.0f;
}

/* The next panels' blocks fetched into L2 while a tile computes on the current ones.
 *
 * Why: the hardware prefetchers follow the loads, and a tile's loads of its panels' blocks
 * come from memory only while its first rows pass over them; the later row tiles read the
 * same blocks from L2, and memory sits idle meanwhile - at 8 rows the streamed call took
 * about the read time plus the compute time. So each tile asks for an equal share of the
 * bytes of the panels the thread computes next, spread over its blocks: memory streams
 * through every row tile, and the next panels are in L2 when their first tile starts. */
typedef struct {
    const uint8_t *at, *end; /* the share still to fetch */
    int64_t step;            /* bytes asked for per block */
} q4_prefetch;

static inline __attribute__((always_inline)) void q4_prefetch_step(q4_prefetch *pf) {
    for (int64_t i = 0; i < pf->step && pf->at < pf->end; i += 64, pf->at += 64)
        _mm_prefetch((const char *)pf->at, _MM_HINT_T1);
}

/* Tile `tile` of `tiles` over panels whose next run of blocks is [next, next + bytes). */
static inline q4_prefetch q4_prefetch_share(const uint8_t *next, int64_t bytes, int64_t tile,
                                            int64_t tiles, int64_t nb) {
    const int64_t from = bytes * tile / tiles, to = bytes * (tile + 1) / tiles;
    const int64_t lines = (to - from + 63) / 64;
    return (q4_prefetch){.at = next + (from & ~(int64_t)63),
                         .end = next + to,
                         .step = 64 * ((lines + nb - 1) / nb)};
}
#endif

#if Q4_AVX512
#define Q4_MR 4 /* rows per register tile */
#define Q4_NP 2 /* 16-channel panels per register tile */

#include "avx512_epilogue.h"

static inline void q4_store16(const q4_problem *p, int64_t row, int64_t col, __m512 v) {
    tm_store16(p->out, p->is_bf16, row * p->n + col, v);
}

#define Q4_ACC(r) __m512 f##r##0 = _mm512_setzero_ps(), f##r##1 = _mm512_setzero_ps()
#define Q4_INIT(r)                                                                       \
    __m512i a##r##0 = zero, a##r##1 = zero;                                              \
    if (mr > r && !p->affine) {                                                          \
        a##r##0 = _mm512_set1_epi32(-8 * p->x_sums[(row + r) * nb + b]);                 \
        a##r##1 = a##r##0;                                                               \
    }
/* In tm_dot4 the weights' nibbles are the unsigned operand, the activations the signed one. */
#define Q4_STEP(r, lo0, lo1, kstep)                                                      \
    if (mr > r) {                                                                        \
        int32_t four;                                                                    \
        __builtin_memcpy(&four, xb + r * k + (kstep) * 4, 4);                            \
        const __m512i xv = _mm512_set1_epi32(four);                                      \
        a##r##0 = tm_dot4(a##r##0, lo0, xv);                                             \
        if (np > 1) a##r##1 = tm_dot4(a##r##1, lo1, xv);                                 \
    }
#define Q4_FOLD(r)                                                                       \
    if (mr > r) {                                                                        \
        const float xs_s = p->x_scales[(row + r) * nb + b];                              \
        const __m512 xs = _mm512_set1_ps(xs_s);                                          \
        f##r##0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a##r##0), d0), xs, f##r##0); \
        if (np > 1)                                                                      \
            f##r##1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a##r##1), d1), xs, f##r##1); \
        if (p->affine) {                                                                 \
            const __m512 xsx = _mm512_set1_ps(xs_s * (float)p->x_sums[(row + r) * nb + b]); \
            f##r##0 = _mm512_fmadd_ps(m0, xsx, f##r##0);                                 \
            if (np > 1) f##r##1 = _mm512_fmadd_ps(m1, xsx, f##r##1);                     \
        }                                                                                \
    }
#define Q4_FINISH(r)                                                                     \
    if (mr > r) {                                                                        \
        q4_store16(p, row + r, col, _mm512_add_ps(f##r##0, bias0));                      \
        if (np > 1) q4_store16(p, row + r, col + 16, _mm512_add_ps(f##r##1, bias1));     \
    }

/* One register tile: rows [row, row + mr) x panels [panel, panel + np), over all of k.
 * mr and np are compile-time constants at every call (q4_tile_any), so the dead branches
 * fold away; accumulators are named variables, as in int8_linear.c. */
static inline __attribute__((always_inline)) void q4_tile(const q4_problem *p, int64_t row,
                                                          int64_t panel, const int mr,
                                                          const int np, q4_prefetch pf) {
    const __m512i zero = _mm512_setzero_si512(), nibble = _mm512_set1_epi8(15);
    Q4_ACC(0); Q4_ACC(1); Q4_ACC(2); Q4_ACC(3);
    const int64_t k = p->k, nb = p->nb, bb = p->block_bytes;
    const uint8_t *w0 = p->w + panel * nb * bb, *w1 = w0 + nb * bb;
    for (int64_t b = 0; b < nb; b++, w0 += bb, w1 += bb) {
        q4_prefetch_step(&pf);
        const int8_t *xb = p->qx + row * k + b * Q4_BLOCK;
        Q4_INIT(0) Q4_INIT(1) Q4_INIT(2) Q4_INIT(3)
        for (int i = 0; i < 4; i++) {
            const __m512i v0 = _mm512_loadu_si512(w0 + 64 * i);
            const __m512i v1 = np > 1 ? _mm512_loadu_si512(w1 + 64 * i) : zero;
            const __m512i lo0 = _mm512_and_si512(v0, nibble), lo1 = _mm512_and_si512(v1, nibble);
            Q4_STEP(0, lo0, lo1, i) Q4_STEP(1, lo0, lo1, i) Q4_STEP(2, lo0, lo1, i)
            Q4_STEP(3, lo0, lo1, i)
            const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), nibble);
            const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), nibble);
            Q4_STEP(0, hi0, hi1, i + 4) Q4_STEP(1, hi0, hi1, i + 4) Q4_STEP(2, hi0, hi1, i + 4)
            Q4_STEP(3, hi0, hi1, i + 4)
        }
        const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w0 + Q4_NIBBLES)));
        const __m512 d1 = np > 1
            ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w1 + Q4_NIBBLES)))
            : _mm512_setzero_ps();
        __m512 m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
        if (p->affine) {
            m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w0 + Q4_NIBBLES + 32)));
            if (np > 1)
                m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w1 + Q4_NIBBLES + 32)));
        }
        Q4_FOLD(0) Q4_FOLD(1) Q4_FOLD(2) Q4_FOLD(3)
    }
    const int64_t col = panel * 16;
    const __m512 bias0 = p->bias ? _mm512_loadu_ps(p->bias + col) : _mm512_setzero_ps();
    const __m512 bias1 = p->bias && np > 1 ? _mm512_loadu_ps(p->bias + col + 16) : _mm512_setzero_ps();
    Q4_FINISH(0) Q4_FINISH(1) Q4_FINISH(2) Q4_FINISH(3)
}

#define Q4_TILE_ROWS(np)                                     \
    switch (mr) {                                            \
    case 4: q4_tile(p, row, panel, 4, np, pf); break;        \
    case 3: q4_tile(p, row, panel, 3, np, pf); break;        \
    case 2: q4_tile(p, row, panel, 2, np, pf); break;        \
    default: q4_tile(p, row, panel, 1, np, pf); break;       \
    }

static void q4_tile_any(const q4_problem *p, int64_t row, int64_t panel, int mr, int np,
                        q4_prefetch pf) {
    if (np > 1) {
        Q4_TILE_ROWS(2);
    } else {
        Q4_TILE_ROWS(1);
    }
}
#endif

#if Q4_AVX2
#define Q4_MR 2 /* rows per register tile; a tile is one panel, as two 8-channel halves */
#define Q4_NP 1

/* acc += u8 x s8 dot products of four in each 32-bit lane: vpdpbusd where the compiler
 * targets AVX-VNNI, else vpmaddubsw's int16 pair sums (at most 2 * 15 * 127 here, no
 * saturation) widened by vpmaddwd - the same sums either way. */
static inline __attribute__((always_inline)) __m256i q4_dot4(__m256i acc, __m256i u8, __m256i s8) {
#if defined(__AVXVNNI__)
    __asm__("%{vex%} vpdpbusd %[s], %[u], %[acc]" : [acc] "+x"(acc) : [u] "x"(u8), [s] "x"(s8));
    return acc;
#else
    const __m256i pairs = _mm256_maddubs_epi16(u8, s8);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

static inline void q4_store8(const q4_problem *p, int64_t row, int64_t col, __m256 v) {
    if (p->is_bf16) {
        float f[8];
        uint16_t *dst = (uint16_t *)p->out + row * p->n + col;
        _mm256_storeu_ps(f, v);
        for (int i = 0; i < 8; i++) dst[i] = f32_to_bf16(f[i]);
    } else {
        _mm256_storeu_ps((float *)p->out + row * p->n + col, v);
    }
}

#define Q4_ACC(r) __m256 f##r##0 = _mm256_setzero_ps(), f##r##1 = _mm256_setzero_ps()
#define Q4_INIT(r)                                                                       \
    __m256i a##r##0 = zero, a##r##1 = zero;                                              \
    if (mr > r && !p->affine) {                                                          \
        a##r##0 = _mm256_set1_epi32(-8 * p->x_sums[(row + r) * nb + b]);                 \
        a##r##1 = a##r##0;                                                               \
    }
#define Q4_STEP(r, lo0, lo1, kstep)                                                      \
    if (mr > r) {                                                                        \
        int32_t four;                                                                    \
        __builtin_memcpy(&four, xb + r * k + (kstep) * 4, 4);                            \
        const __m256i xv = _mm256_set1_epi32(four);                                      \
        a##r##0 = q4_dot4(a##r##0, lo0, xv);                                             \
        a##r##1 = q4_dot4(a##r##1, lo1, xv);                                             \
    }
#define Q4_FOLD(r)                                                                       \
    if (mr > r) {                                                                        \
        const float xs_s = p->x_scales[(row + r) * nb + b];                              \
        const __m256 xs = _mm256_set1_ps(xs_s);                                          \
        f##r##0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a##r##0), d0), xs, f##r##0); \
        f##r##1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a##r##1), d1), xs, f##r##1); \
        if (p->affine) {                                                                 \
            const __m256 xsx = _mm256_set1_ps(xs_s * (float)p->x_sums[(row + r) * nb + b]); \
            f##r##0 = _mm256_fmadd_ps(m0, xsx, f##r##0);                                 \
            f##r##1 = _mm256_fmadd_ps(m1, xsx, f##r##1);                                 \
        }                                                                                \
    }
#define Q4_FINISH(r)                                                                     \
    if (mr > r) {                                                                        \
        q4_store8(p, row + r, col, _mm256_add_ps(f##r##0, bias0));                       \
        q4_store8(p, row + r, col + 8, _mm256_add_ps(f##r##1, bias1));                   \
    }

/* One register tile: rows [row, row + mr) x one panel (its channels 0-7 in a##r##0,
 * 8-15 in a##r##1), over all of k. */
static inline __attribute__((always_inline)) void q4_tile(const q4_problem *p, int64_t row,
                                                          int64_t panel, const int mr,
                                                          q4_prefetch pf) {
    const __m256i zero = _mm256_setzero_si256(), nibble = _mm256_set1_epi8(15);
    Q4_ACC(0); Q4_ACC(1);
    const int64_t k = p->k, nb = p->nb, bb = p->block_bytes;
    const uint8_t *w = p->w + panel * nb * bb;
    for (int64_t b = 0; b < nb; b++, w += bb) {
        q4_prefetch_step(&pf);
        const int8_t *xb = p->qx + row * k + b * Q4_BLOCK;
        Q4_INIT(0) Q4_INIT(1)
        for (int i = 0; i < 4; i++) {
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + 64 * i));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + 64 * i + 32));
            const __m256i lo0 = _mm256_and_si256(v0, nibble), lo1 = _mm256_and_si256(v1, nibble);
            Q4_STEP(0, lo0, lo1, i) Q4_STEP(1, lo0, lo1, i)
            const __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
            const __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
            Q4_STEP(0, hi0, hi1, i + 4) Q4_STEP(1, hi0, hi1, i + 4)
        }
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + Q4_NIBBLES)));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + Q4_NIBBLES + 16)));
        __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
        if (p->affine) {
            m0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + Q4_NIBBLES + 32)));
            m1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + Q4_NIBBLES + 48)));
        }
        Q4_FOLD(0) Q4_FOLD(1)
    }
    const int64_t col = panel * 16;
    const __m256 bias0 = p->bias ? _mm256_loadu_ps(p->bias + col) : _mm256_setzero_ps();
    const __m256 bias1 = p->bias ? _mm256_loadu_ps(p->bias + col + 8) : _mm256_setzero_ps();
    Q4_FINISH(0) Q4_FINISH(1)
}

static void q4_tile_any(const q4_problem *p, int64_t row, int64_t panel, int mr, int np,
                        q4_prefetch pf) {
    (void)np;
    if (mr > 1)
        q4_tile(p, row, panel, 2, pf);
    else
        q4_tile(p, row, panel, 1, pf);
}
#endif

#if Q4_AVX512 || Q4_AVX2
/* Rows [0, rows) x panels [first, last). */
static void q4_panels_all_rows(const q4_problem *p, int64_t rows, int64_t first, int64_t last) {
    for (int64_t block = 0; block < rows; block += Q4_ROW_BLOCK) {
        const int64_t block_end = block + Q4_ROW_BLOCK < rows ? block + Q4_ROW_BLOCK : rows;
        const int64_t tiles = (block_end - block + Q4_MR - 1) / Q4_MR;
        const int64_t panel_bytes = p->nb * p->block_bytes;
        for (int64_t panel = first; panel < last; panel += Q4_NP) {
            const int np = (int)(last - panel < Q4_NP ? last - panel : Q4_NP);
            const int64_t next = panel + np;
            const int64_t next_np = last - next < Q4_NP ? last - next : Q4_NP;
            const uint8_t *next_w = p->w + next * panel_bytes;
            for (int64_t row = block, tile = 0; row < block_end; row += Q4_MR, tile++) {
                const int mr = (int)(block_end - row < Q4_MR ? block_end - row : Q4_MR);
                q4_tile_any(p, row, panel, mr, np,
                            q4_prefetch_share(next_w, next_np * panel_bytes, tile, tiles, p->nb));
            }
        }
    }
}
#endif

int tm_q4_linear(const tm_q4_linear_args *a) {
#if Q4_AVX512 || Q4_AVX2
    if (a->n % 16 || a->k % Q4_BLOCK || a->k > TM_MAX_INT8_K || a->rows < 0 || a->n <= 0)
        return TM_UNSUPPORTED_SHAPE;
    const int64_t nb = a->k / Q4_BLOCK, rows = a->rows, k = a->k;
    const q4_problem p = {.qx = a->qx,
                          .x_scales = a->x_scales,
                          .x_sums = a->x_sums,
                          .w = a->w,
                          .bias = a->bias,
                          .out = a->out,
                          .n = a->n,
                          .k = k,
                          .nb = nb,
                          .block_bytes = a->affine ? Q4_NIBBLES + 64 : Q4_NIBBLES + 32,
                          .is_bf16 = a->is_bf16,
                          .affine = a->affine};
    const int64_t panels = a->n / 16;
    const int parallel =
        rows * a->n * k >= Q4_MATMUL_PARALLEL_MIN || a->n * k >= Q4_WEIGHT_PARALLEL_MIN;
#pragma omp parallel num_threads(a->num_threads) if (parallel)
    {
        const int64_t threads = omp_get_num_threads();
        const int64_t t = omp_get_thread_num();
        const int64_t blocks = rows * nb;
        for (int64_t i = blocks * t / threads; i < blocks * (t + 1) / threads; i++)
            a->x_scales[i] = quantize_block(a->x, i * Q4_BLOCK, a->is_bf16, a->qx + i * Q4_BLOCK,
                                            a->x_sums + i);
#pragma omp barrier
        q4_panels_all_rows(&p, rows, panels * t / threads, panels * (t + 1) / threads);
    }
    return TM_OK;
#else
    (void)a;
    return TM_UNSUPPORTED_ISA;
#endif
}

/* fp16 bits -> fp32 (exact), for builds without F16C. */
static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023;
    uint32_t bits;
    if (exponent == 31) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else { /* zero or subnormal: mantissa * 2^-24, exact in fp32 */
        const float f = (float)mantissa * 0x1p-24f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* One block's 32 weights of channel c, expanded to bf16: the channel's four bytes in
 * each of the block's lines hold its k-values 0..15 (low nibbles) and 16..31 (high
 * nibbles). d * q is exact in fp32 (11 by 4 significant bits), so a symmetric weight is
 * exact before its bf16 rounding and an affine one rounded once in the add. */
static inline void unpack_channel_block(const uint8_t *block, int c, int affine, uint16_t *dst) {
    const uint16_t *scales = (const uint16_t *)(block + Q4_NIBBLES);
    const float d = f16_to_f32(scales[c]);
    const float m = affine ? f16_to_f32(scales[16 + c]) : 0.0f;
#if Q4_AVX512 && defined(__AVX512BF16__)
    int32_t lines[4];
    for (int i = 0; i < 4; i++) memcpy(&lines[i], block + 64 * i + 4 * c, 4);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)lines);
    const __m128i nibble = _mm_set1_epi8(15);
    __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, nibble));
    __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
    if (!affine) {
        lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
    }
    const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
    const __m512 wlo = _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(lo)), vm);
    const __m512 whi = _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(hi)), vm);
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(whi, wlo));
#else
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            const uint8_t byte = block[64 * i + 4 * c + j];
            const int lo = byte & 15, hi = byte >> 4;
            dst[4 * i + j] = f32_to_bf16(affine ? d * (float)lo + m : d * (float)(lo - 8));
            dst[16 + 4 * i + j] = f32_to_bf16(affine ? d * (float)hi + m : d * (float)(hi - 8));
        }
#endif
}

int tm_q4_unpack_bf16(const tm_q4_unpack_args *a) {
    if (a->n % 16 || a->k % Q4_BLOCK || a->n <= 0) return TM_UNSUPPORTED_SHAPE;
    const int64_t nb = a->k / Q4_BLOCK, panels = a->n / 16;
    const int64_t bb = a->affine ? Q4_NIBBLES + 64 : Q4_NIBBLES + 32;
    uint16_t *out = (uint16_t *)a->out;
#pragma omp parallel for num_threads(a->num_threads) schedule(static)
    for (int64_t panel = 0; panel < panels; panel++)
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *block = a->w + (panel * nb + b) * bb;
            for (int c = 0; c < 16; c++)
                unpack_channel_block(block, c, a->affine,
                                     out + (panel * 16 + c) * a->k + b * Q4_BLOCK);
        }
    return TM_OK;
}
