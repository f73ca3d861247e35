/* A mixture-of-experts layer's expert compute, every (token, expert) pair of a step in one
 * call (engine/models/moe.py; the router has chosen each row's experts and weights).
 *
 *     out[t] = sum over t's experts e, in ascending e, of w[t, e] * down_e(act(gate_e(x[t])) * up_e(x[t]))
 *
 * (each projection with its expert's bias added where the layer has biases: gpt-oss, whose
 * act(gate, up) is its clamped SwiGLU, TM_GATED_CLAMPED_SWIGLU).
 *
 * The pairs are counting-sorted by expert, so that each expert's rows are one contiguous
 * run (its tokens in ascending order), and gathered; then three phases, each one OpenMP
 * loop, with a barrier between:
 *   A  h = act(xs @ gate^T) * (xs @ up^T)  - an item is one expert and one panel of its
 *      gate_up weights (32 intermediate columns of gate and of up), over all of the
 *      expert's rows: the panel is read once per call whatever the rows (a decode step
 *      reads each expert it uses once), and stays in L2 while a prompt's rows pass over it;
 *   B  y = h @ down^T (fp32)               - an item is one expert and one panel of its
 *      down weights (64 hidden columns);
 *   C  out[t] = the weighted sum of t's rows of y, in ascending expert order (as
 *      transformers' loop over experts adds them), rounded once to out's type.
 * Where the down panels deal out evenly over the threads (fuse_down: always on one
 * thread), B and C are one phase with no y: an item is one panel of down columns over
 * every used expert in ascending order, each row's products weighted and added into its
 * token's fp32 row at once (down_panel) - the same additions in the same order.
 * No expert is padded to the busiest one's rows, and no item exists for an expert no row
 * chose. Items differ in rows, so they are dealt out dynamically.
 *
 * Weights, packed once at load (engine/kernels/moe.py), in panels of TM_MOE_PANEL_COLS (64)
 * output columns: gate_up's panel j holds gate columns [32j, 32j + 32) then the same up
 * columns, down's panel j hidden columns [64j, 64j + 64); pads are zero weights. Each
 * panel's k-rows are one contiguous block, so an item streams one block of memory (rows of
 * every column put an item's next k-row pages away, where the prefetchers do not follow,
 * and a decode step ran at a fraction of the memory's bandwidth). An expert's panels
 * follow each other; a panel of k rows is
 *   fp32  [k][64];
 *   bf16  [k / 2][64][2]: pairs of k, as vdpbf16ps and AMX tiles take them;
 *   int8  (weight_format TM_MOE_INT8, x fp32 or bf16) [k][64] int8, each column with its
 *         fp32 scale (scales [E][panel][64]): a weight is q * scale. The products sum q in
 *         fp32 and the column's scale multiplies the sum once.
 *   int4  (TM_MOE_INT4, x fp32 or bf16) [k][32] bytes, two columns a byte (the even one in
 *         the low nibble); each group of 32 k-rows keeps a bf16 scale and minimum per
 *         column (scales [E][panel][k / 32][2][64]: the scale row, then the minimum row):
 *         a weight is q * scale + minimum, formed in fp32 before its product.
 *   mxfp4 (TM_MOE_MXFP4, x fp32 or bf16; the OCP MX format gpt-oss ships) int4's layout of
 *         nibbles, each an e2m1 code (sign, two exponent bits, one mantissa bit: 0, 0.5, 1,
 *         1.5, 2, 3, 4, 6 and their negatives), and per group of 32 k-rows one e8m0 byte
 *         per column (scales [E][panel][k / 32][64]): a weight is e2m1(q) * 2^(e - 127),
 *         exact in fp32, so the sums are the fp32 path's over the dequantized weights.
 * Sums are fp32. bf16 rounds gate and up to bf16 before the activation, and h after it,
 * as transformers' bf16 forward does; y stays fp32 until the weighted sum.
 *
 * Builds with AVX-512 multiply on vector tiles (AVX-512 FMA; bf16 on vdpbf16ps, or, without
 * AVX512-BF16 - Ice Lake, Cascade Lake - on FMAs of each pair's halves widened to fp32, the
 * same sums), and bf16 runs of 16 rows or more on AMX tiles where Linux grants them. Builds
 * with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel before Skylake-X) multiply on AVX2
 * tiles over chunks of k, each chunk's weights widened to fp32 in L1 (moe_avx2.h): the
 * same products in the same order, so the same bits. Other builds run plain loops that
 * compute the same sums. With bf16 activations, quantized weights of an expert with runs
 * of 16 rows are widened to bf16 once per item (a panel, in L2) and taken by AMX tiles too:
 * int8 codes exactly (their scales multiply the sums after), int4 and mxfp4 weights
 * rounded to bf16 (a relative 2^-9, below bf16 activations' own rounding). A prompt's rows
 * then run at the matmul peak instead of converting every weight once per 6 rows. A run of 4-16 rows (a decode step's) takes one pass of the tiles:
 * its panel is widened 32 k-rows at a time into L1 as the tiles take them, not whole into
 * L2 first. Every pass over a panel prefetches its stream ahead (PREFETCH_BYTES).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "activation.h"
#include "amx.h"
#include "kernel_common.h"
#include "kernels.h"

#define NB 32 /* output columns per item: two vectors of 16 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define MR 6 /* rows per vector tile: 4 accumulators a row in phase A, 24 in all */
#else
/* rows per call of `tile`: on AVX2, register tiles of up to 6 rows each over the chunk of
 * weights widened once in L1 (moe_avx2.h) */
#define MR 12
#endif
#define AMX_ROWS 16
/* Runs this long go on AMX tiles: a tile takes 16 rows (the run's, then the following
 * rows of xs or h, or their zeroed slack, whose sums are dropped); fewer rows than this
 * use the vector path, which reads the weights at the same bandwidth without widening a
 * quantized panel first. */
#define AMX_MIN_ROWS 4
#define TILE_ROWS_MAX 16 /* at least MR and AMX_ROWS: rows of a tile's sums */

/* One product's operands: rows [row, row + mr) of x times columns of w. */
typedef struct {
    const void *x; /* row-major, ldx values a row */
    int64_t ldx;
    const void *w; /* fp32 and int8: [k][ldw]; bf16: [k / 2][ldw][2] */
    int64_t ldw;
    int64_t k;
    int is_bf16;       /* x (and float weights) are bf16 */
    const float *scales; /* int8 weights: each column's scale; NULL: float weights */
    const uint16_t *groups; /* int4 weights: [k / 32][2][ldw] bf16 scales, minimums */
    const uint8_t *e8m0;    /* mxfp4 weights: [k / 32][ldw] power-of-two scales */
} operands;

/* e2m1 codes' values (OCP MX: sign bit, then 2 exponent bits and 1 mantissa bit). */
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* An e8m0 scale, 2^(e - 127), as fp32: e = 0 is the denormal 2^-127. */
static inline float e8m0_value(uint8_t e) {
    const uint32_t bits = e ? (uint32_t)e << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float value_at(const void *base, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* The weight at column c of k-row i (fp32 or pair layout). */
static inline float weight_at(const operands *o, int64_t i, int64_t c) {
    if (o->scales) return (float)((const int8_t *)o->w)[i * o->ldw + c]; /* scaled after the sum */
    if (o->e8m0) {
        const uint8_t pair = ((const uint8_t *)o->w)[i * (o->ldw / 2) + c / 2];
        return E2M1[c % 2 ? pair >> 4 : pair & 15] * e8m0_value(o->e8m0[(i / 32) * o->ldw + c]);
    }
    if (o->groups) {
        const uint8_t pair = ((const uint8_t *)o->w)[i * (o->ldw / 2) + c / 2];
        const uint16_t *group = o->groups + (i / 32) * 2 * o->ldw;
        const float q = (float)(c % 2 ? pair >> 4 : pair & 15);
        return q * bf16_to_f32(group[c]) + bf16_to_f32(group[o->ldw + c]);
    }
    if (o->is_bf16) return bf16_to_f32(((const uint16_t *)o->w)[((i / 2) * o->ldw + c) * 2 + i % 2]);
    return ((const float *)o->w)[i * o->ldw + c];
}

/* Software prefetch distance, in bytes of a panel's stream. An item streams one panel
 * (256 KB of bf16 gate_up at OLMoE's hidden 2,048) across a page every few k-rows; the
 * hardware prefetchers restart at each page, and runs of a few decode rows - a few
 * multiplies per weight loaded - left each new page's first loads waiting on memory. */
#define PREFETCH_BYTES 4096

/* The lines that start in [at, at + bytes) of a panel, PREFETCH_BYTES on; none past the
 * panel's `end`: the next panel is another item's, likely another thread's. */
static inline __attribute__((always_inline)) void prefetch_ahead(const char *at, int64_t bytes, const char *end) {
    const char *from = at + PREFETCH_BYTES;
    if (from + bytes > end) return;
    const uintptr_t first = ((uintptr_t)from + 63) & ~(uintptr_t)63;
    for (uintptr_t line = first; line < (uintptr_t)(from + bytes); line += 64) __builtin_prefetch((const char *)line, 0, 3);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#ifdef __AVX512BF16__
#define MOE_ISA TM_MOE_ISA_AVX512_BF16
#else
#define MOE_ISA TM_MOE_ISA_AVX512
#endif

/* 16 bf16 values from p, as fp32. */
static inline __m512 bf16x16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* int4 codes of columns [c, c + 16) of k-row i, as fp32. */
static inline __m512 codes_x16(const operands *o, int64_t i, int64_t c) {
    const uint8_t *bytes = (const uint8_t *)o->w + i * (o->ldw / 2) + c / 2;
    const __m128i packed = _mm_loadl_epi64((const __m128i *)bytes);
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high)));
}

/* int4 weights of columns [c, c + 16) of k-row i, as fp32 (q * scale + minimum). */
static inline __m512 int4x16(const operands *o, int64_t i, int64_t c) {
    const uint16_t *group = o->groups + (i / 32) * 2 * o->ldw;
    return _mm512_fmadd_ps(codes_x16(o, i, c), bf16x16(group + c), bf16x16(group + o->ldw + c));
}

/* mxfp4 weights of columns [c, c + 16) of k-row i, as fp32 (e2m1(q) * 2^(e - 127)). */
static inline __m512 mxfp4x16(const operands *o, int64_t i, int64_t c) {
    const uint8_t *bytes = (const uint8_t *)o->w + i * (o->ldw / 2) + c / 2;
    const __m128i packed = _mm_loadl_epi64((const __m128i *)bytes);
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(15));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(15));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(low, high));
    const __m512 values = _mm512_permutexvar_ps(q, _mm512_loadu_ps(E2M1));
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(o->e8m0 + (i / 32) * o->ldw + c)));
    const __mmask16 zero = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
    const __m512i bits = _mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), zero, _mm512_set1_epi32(0x00400000));
    return _mm512_mul_ps(values, _mm512_castsi512_ps(bits));
}

static inline __mmask16 column_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
}

/* Row r's accumulators, named, not an array: GCC kept an array of them in registers but
 * also stored all 24 to the stack at every k, and the store port, not the FMAs, set the
 * pace (38% of oneDNN's fp32 matmul at a prompt's rows). */
#define ACC_ROW(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0, a##r##3 = a##r##0;
#define EACH_ROW(STEP) STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
/* Row r += xv times the 2 * nw weight vectors w[0..4). */
#define FMA_ROW(r, xv, w)                                                                    \
    {                                                                                        \
        a##r##0 = _mm512_fmadd_ps(xv, w[0], a##r##0);                                        \
        a##r##1 = _mm512_fmadd_ps(xv, w[1], a##r##1);                                        \
        if (nw > 1) {                                                                        \
            a##r##2 = _mm512_fmadd_ps(xv, w[2], a##r##2);                                    \
            a##r##3 = _mm512_fmadd_ps(xv, w[3], a##r##3);                                    \
        }                                                                                    \
    }
/* Quantized weights: x's value (fp32 or bf16) broadcast. */
#define X_ROW(r)                                                                             \
    if (mr > r) {                                                                            \
        const __m512 xv = _mm512_set1_ps(value_at(o->x, (row + r) * ldx + i, o->is_bf16));   \
        FMA_ROW(r, xv, wv)                                                                   \
    }
#define F32_ROW(r)                                                                           \
    if (mr > r) {                                                                            \
        const __m512 xv = _mm512_set1_ps(x[r * ldx + i]);                                    \
        FMA_ROW(r, xv, wv)                                                                   \
    }
#define DPBF16_ROW(r)                                                                        \
    if (mr > r) {                                                                            \
        int32_t pair;                                                                        \
        __builtin_memcpy(&pair, x + r * ldx + 2 * i, 4);                                     \
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);                               \
        a##r##0 = _mm512_dpbf16_ps(a##r##0, xv, (__m512bh)wv[0]);                            \
        a##r##1 = _mm512_dpbf16_ps(a##r##1, xv, (__m512bh)wv[1]);                            \
        if (nw > 1) {                                                                        \
            a##r##2 = _mm512_dpbf16_ps(a##r##2, xv, (__m512bh)wv[2]);                        \
            a##r##3 = _mm512_dpbf16_ps(a##r##3, xv, (__m512bh)wv[3]);                        \
        }                                                                                    \
    }
/* bf16 without vdpbf16ps: the pair's odd value (its top half as an fp32), then its even
 * value (the low half shifted up), times that half of the weight pairs (`half`). */
#define ODD_ROW(r)                                                                           \
    if (mr > r) {                                                                            \
        const __m512 xv = _mm512_castsi512_ps(_mm512_set1_epi32((int)((uint32_t)x[r * ldx + 2 * i + 1] << 16))); \
        FMA_ROW(r, xv, half)                                                                 \
    }
#define EVEN_ROW(r)                                                                          \
    if (mr > r) {                                                                            \
        const __m512 xv = _mm512_castsi512_ps(_mm512_set1_epi32((int)((uint32_t)x[r * ldx + 2 * i] << 16))); \
        FMA_ROW(r, xv, half)                                                                 \
    }
#define STORE_ROW(r)                                                                         \
    if (mr > r) {                                                                            \
        _mm512_storeu_ps(sums[r], a##r##0);                                                  \
        _mm512_storeu_ps(sums[r] + 16, a##r##1);                                             \
        if (nw > 1) {                                                                        \
            _mm512_storeu_ps(sums[r] + 32, a##r##2);                                         \
            _mm512_storeu_ps(sums[r] + 48, a##r##3);                                         \
        }                                                                                    \
    }

/* sums[r][b * 32 + j] = sum over k of x[row + r, k] * w[k, b's column j] for r < mr, for
 * each of the `nw` column blocks, at `col` and `second` (gate and up: 2; down: 1); columns
 * from `left` on are not loaded. mr and nw are constants at every call (the switch below),
 * so the unused rows fold away. */
static inline __attribute__((always_inline)) void tile_sums(const operands *o, int64_t row, int64_t col,
                                                            int64_t second, int64_t left, const int mr,
                                                            const int nw, float (*sums)[2 * NB]) {
    EACH_ROW(ACC_ROW)
    const __mmask16 m0 = column_mask(left), m1 = column_mask(left - 16);
    const int64_t ldx = o->ldx, ldw = o->ldw;
    const char *panel = (const char *)o->w;
    if (o->scales) {
        const char *end = panel + o->k * ldw;
        for (int64_t i = 0; i < o->k; i++) {
            prefetch_ahead(panel + i * ldw, ldw, end);
            const int8_t *wi = (const int8_t *)o->w + i * ldw + col;
            __m512 wv[4];
            wv[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m0, wi)));
            wv[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m1, wi + 16)));
            if (nw > 1) {
                wv[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m0, wi + second - col)));
                wv[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m1, wi + second - col + 16)));
            }
            EACH_ROW(X_ROW)
        }
    } else if (o->e8m0) { /* whole panels, as int4's below */
        const char *end = panel + o->k * (ldw / 2);
        for (int64_t i = 0; i < o->k; i++) {
            prefetch_ahead(panel + i * (ldw / 2), ldw / 2, end);
            __m512 wv[4];
            wv[0] = mxfp4x16(o, i, col);
            wv[1] = mxfp4x16(o, i, col + 16);
            if (nw > 1) {
                wv[2] = mxfp4x16(o, i, second);
                wv[3] = mxfp4x16(o, i, second + 16);
            }
            EACH_ROW(X_ROW)
        }
    } else if (o->groups) {
        /* Panels are whole 64 columns: no masks needed; columns past `left` are computed
         * and not used. */
        const int64_t at[4] = {col, col + 16, second, second + 16};
        for (int64_t g = 0; g < o->k; g += 32) { /* a group's scales and minimums, read once */
            const uint16_t *group = o->groups + (g / 32) * 2 * ldw;
            __m512 scale[4], minimum[4];
            for (int v = 0; v < 2 * nw; v++)
                scale[v] = bf16x16(group + at[v]), minimum[v] = bf16x16(group + ldw + at[v]);
            for (int64_t i = g; i < g + 32; i++) {
                prefetch_ahead(panel + i * (ldw / 2), ldw / 2, panel + o->k * (ldw / 2));
                __m512 wv[4];
                for (int v = 0; v < 2 * nw; v++) wv[v] = _mm512_fmadd_ps(codes_x16(o, i, at[v]), scale[v], minimum[v]);
                EACH_ROW(X_ROW)
            }
        }
    } else if (o->is_bf16) {
        const uint16_t *x = (const uint16_t *)o->x + row * ldx;
        const uint16_t *w = (const uint16_t *)o->w;
        const char *end = panel + (o->k / 2) * ldw * 4;
        for (int64_t i = 0; i < o->k / 2; i++) {
            prefetch_ahead(panel + i * ldw * 4, ldw * 4, end);
            const uint16_t *wi = w + (i * ldw + col) * 2;
            __m512i wv[4];
            wv[0] = _mm512_maskz_loadu_epi32(m0, wi);
            wv[1] = _mm512_maskz_loadu_epi32(m1, wi + 32);
            if (nw > 1) {
                wv[2] = _mm512_maskz_loadu_epi32(m0, wi + (second - col) * 2);
                wv[3] = _mm512_maskz_loadu_epi32(m1, wi + (second - col) * 2 + 32);
            }
#ifdef __AVX512BF16__
            EACH_ROW(DPBF16_ROW)
#else
            /* vdpbf16ps's sums without it: the odd k's products, then the even k's, each
             * product of two bf16 exact in fp32 (so an FMA adds what vdpbf16ps adds); one
             * half's four weight vectors are live at a time. */
            const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
            __m512 half[4];
            for (int v = 0; v < 2 * nw; v++) half[v] = _mm512_castsi512_ps(_mm512_and_si512(wv[v], high));
            EACH_ROW(ODD_ROW)
            for (int v = 0; v < 2 * nw; v++) half[v] = _mm512_castsi512_ps(_mm512_slli_epi32(wv[v], 16));
            EACH_ROW(EVEN_ROW)
#endif
        }
    } else {
        const float *x = (const float *)o->x + row * ldx;
        const float *w = (const float *)o->w;
        const char *end = panel + o->k * ldw * 4;
        for (int64_t i = 0; i < o->k; i++) {
            prefetch_ahead(panel + i * ldw * 4, ldw * 4, end);
            const float *wi = w + i * ldw + col;
            __m512 wv[4];
            wv[0] = _mm512_maskz_loadu_ps(m0, wi);
            wv[1] = _mm512_maskz_loadu_ps(m1, wi + 16);
            if (nw > 1) {
                wv[2] = _mm512_maskz_loadu_ps(m0, wi + second - col);
                wv[3] = _mm512_maskz_loadu_ps(m1, wi + second - col + 16);
            }
            EACH_ROW(F32_ROW)
        }
    }
    EACH_ROW(STORE_ROW)
}

#define TILE_CASES(nw)                                                                       \
    switch (mr) {                                                                            \
    case 6: tile_sums(o, row, col, second, left, 6, nw, sums); break;                        \
    case 5: tile_sums(o, row, col, second, left, 5, nw, sums); break;                        \
    case 4: tile_sums(o, row, col, second, left, 4, nw, sums); break;                        \
    case 3: tile_sums(o, row, col, second, left, 3, nw, sums); break;                        \
    case 2: tile_sums(o, row, col, second, left, 2, nw, sums); break;                        \
    default: tile_sums(o, row, col, second, left, 1, nw, sums); break;                       \
    }

/* sums[r][b * 32 + j]: row r's sum for column j of block b (b = 0: at col, 1: at second). */
static void tile(const operands *o, int64_t row, int mr, int64_t col, int64_t second, int64_t left,
                 int nw, float (*sums)[2 * NB]) {
    if (nw > 1) {
        TILE_CASES(2);
    } else {
        TILE_CASES(1);
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define MOE_AMX 1
#endif

#elif defined(__AVX2__) && defined(__FMA__)
#define MOE_ISA TM_MOE_ISA_AVX2
#include "moe_avx2.h"

#else
#define MOE_ISA TM_MOE_ISA_GENERIC

/* The same sums in plain loops (k in order, fp32). */
static void tile(const operands *o, int64_t row, int mr, int64_t col, int64_t second, int64_t left,
                 int nw, float (*sums)[2 * NB]) {
    for (int r = 0; r < mr; r++) {
        for (int b = 0; b < nw; b++) {
            const int64_t first = b ? second : col;
            for (int64_t j = 0; j < NB; j++) {
                float acc = 0.0f;
                if (j < left)
                    for (int64_t i = 0; i < o->k; i++)
                        acc += value_at(o->x, (row + r) * o->ldx + i, o->is_bf16) * weight_at(o, i, first + j);
                sums[r][b * NB + j] = acc;
            }
        }
    }
}
#endif

/* 1 where this build has AMX tiles and Linux grants them: bf16 runs of 16 rows use them. */
static int amx_usable(void) {
#ifdef MOE_AMX
    return tm_internal_amx_permitted();
#else
    return 0;
#endif
}

int tm_moe_isa(void) {
    return MOE_ISA == TM_MOE_ISA_AVX512_BF16 && amx_usable() ? TM_MOE_ISA_AMX : MOE_ISA;
}

#ifdef MOE_AMX
/* Tiles: 0-3 accumulate 16 rows x 16 fp32 each (64 columns: two blocks of 32, or gate's
 * and up's 32 in phase A); 4 holds 16 rows x 32 k of x; 5 the 16 pair rows of w that meet
 * them. k is read 32 at a time; a k that is not a multiple of 32 takes the vector path. */
static void configure_full_tiles(void) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    const uint16_t bytes[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    tm_configure_tiles(rows, bytes);
}

/* sums[r][0..64) for 16 rows from `row`: columns [col, col + 16) and [col + 16, col + 32),
 * then [second, second + 32); the callers pass a whole panel (col 0, second 32), so every
 * column read is in it (pads included). */
static void amx_tile(const operands *o, int64_t row, int64_t col, int64_t second, float (*sums)[2 * NB]) {
    const uint16_t *x = (const uint16_t *)o->x + row * o->ldx;
    const uint16_t *w = (const uint16_t *)o->w;
    const int64_t x_bytes = o->ldx * 2, w_bytes = o->ldw * 4;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kk = 0; kk < o->k; kk += 32) {
        const uint16_t *pairs = w + ((kk / 2) * o->ldw) * 2;
        _tile_loadd(4, x + kk, x_bytes);
        _tile_loadd(5, pairs + col * 2, w_bytes); _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, pairs + (col + 16) * 2, w_bytes); _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, pairs + second * 2, w_bytes); _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, pairs + (second + 16) * 2, w_bytes); _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, sums[0], sizeof sums[0]);
    _tile_stored(1, sums[0] + 16, sizeof sums[0]);
    _tile_stored(2, sums[0] + 32, sizeof sums[0]);
    _tile_stored(3, sums[0] + 48, sizeof sums[0]);
}

/* 16 quantized weights of columns [c, c + 16) of k-row i, as fp32: int8 codes (unscaled),
 * int4 and mxfp4 values. */
static inline __m512 quantized_x16(const operands *o, int64_t i, int64_t c) {
    if (o->scales)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)o->w + i * o->ldw + c))));
    return o->groups ? int4x16(o, i, c) : mxfp4x16(o, i, c);
}

/* A quantized panel's k-rows [from, to) as bf16 pairs, [(to - from) / 2][64][2] (AMX's
 * layout, into `out`): int8 codes exactly, int4 and mxfp4 values rounded to nearest even. */
static void widen_rows(const operands *o, int64_t from, int64_t to, uint16_t *out) {
    /* [row i's 16 values, row i + 1's 16] -> i's and i + 1's side by side, column by column */
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i order = _mm512_loadu_si512(interleave);
    if (o->scales) { /* int8: codes are exact in bf16, so a pair is two fp32s' top halves */
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
        for (int64_t i = from; i < to; i += 2)
            for (int64_t c = 0; c < TM_MOE_PANEL_COLS; c += 16) {
                const __m512i even = _mm512_castps_si512(quantized_x16(o, i, c));
                const __m512i odd = _mm512_castps_si512(quantized_x16(o, i + 1, c));
                /* (odd & high) | (even >> 16) */
                _mm512_storeu_si512(out + (((i - from) / 2) * TM_MOE_PANEL_COLS + c) * 2,
                                    _mm512_ternarylogic_epi32(high, odd, _mm512_srli_epi32(even, 16), 0xEA));
            }
        return;
    }
    for (int64_t i = from; i < to; i += 2)
        for (int64_t c = 0; c < TM_MOE_PANEL_COLS; c += 16) {
            const __m512bh both = _mm512_cvtne2ps_pbh(quantized_x16(o, i + 1, c), quantized_x16(o, i, c));
            _mm512_storeu_si512(out + (((i - from) / 2) * TM_MOE_PANEL_COLS + c) * 2,
                                _mm512_permutexvar_epi16(order, (__m512i)both));
        }
}

static void widen_panel(const operands *o, uint16_t *out) { widen_rows(o, 0, o->k, out); }

/* Bytes of a quantized panel's codes per k-row, and of its scales per group of 32 k-rows
 * (int8: none there; its scales are one row per panel). */
static int64_t code_row_bytes(const operands *o) { return o->scales ? o->ldw : o->ldw / 2; }
static int64_t group_bytes(const operands *o) { return o->groups ? 2 * o->ldw * 2 : o->e8m0 ? o->ldw : 0; }

/* The sums of amx_quantized_tile for one pass of at most 16 rows (a decode step's run),
 * without the widened panel: 32 k-rows at a time are widened into `block` ([16][64][2],
 * 4 KB, in L1) and taken by the tiles, the same bf16 values in the same tile operations,
 * so the same bits. Widening the whole panel first wrote it to L2 and read it back (2x
 * its codes' bytes in int8, 4x in int4 and mxfp4) for the one pass that uses it. */

static void amx_quantized_stream(const operands *o, int64_t row, uint16_t *block, float (*sums)[2 * NB]) {
    const uint16_t *x = (const uint16_t *)o->x + row * o->ldx;
    const int64_t x_bytes = o->ldx * 2, w_bytes = TM_MOE_PANEL_COLS * 4;
    const char *codes = (const char *)o->w;
    const char *groups = o->groups ? (const char *)o->groups : (const char *)o->e8m0;
    const int64_t row_bytes = code_row_bytes(o), g_bytes = group_bytes(o);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kk = 0; kk < o->k; kk += 32) {
        prefetch_ahead(codes + kk * row_bytes, 32 * row_bytes, codes + o->k * row_bytes);
        if (g_bytes) prefetch_ahead(groups + (kk / 32) * g_bytes, g_bytes, groups + (o->k / 32) * g_bytes);
        widen_rows(o, kk, kk + 32, block);
        _tile_loadd(4, x + kk, x_bytes);
        _tile_loadd(5, block, w_bytes); _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, block + 16 * 2, w_bytes); _tile_dpbf16ps(1, 4, 5);
        _tile_loadd(5, block + NB * 2, w_bytes); _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(5, block + (NB + 16) * 2, w_bytes); _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, sums[0], sizeof sums[0]);
    _tile_stored(1, sums[0] + 16, sizeof sums[0]);
    _tile_stored(2, sums[0] + 32, sizeof sums[0]);
    _tile_stored(3, sums[0] + 48, sizeof sums[0]);
}

/* sums[r][0..64) for 16 rows from `row` over a quantized panel, `rows` of the run left
 * from there: a run of one pass streamed (amx_quantized_stream), a longer one's panel
 * widened into `wide` once per item (*widened), then on AMX tiles; int8's scales still to
 * multiply (scale_sums). */
static void amx_quantized_tile(const operands *o, int64_t row, int64_t rows, uint16_t *wide, int *widened,
                               float (*sums)[2 * NB]) {
    if (!*widened && rows <= AMX_ROWS) {
        amx_quantized_stream(o, row, wide, sums);
        return;
    }
    if (!*widened) widen_panel(o, wide), *widened = 1;
    const operands bf16 = {.x = o->x, .ldx = o->ldx, .w = wide, .ldw = TM_MOE_PANEL_COLS, .k = o->k, .is_bf16 = 1};
    amx_tile(&bf16, row, 0, NB, sums);
}
#endif

/* ---- the call ------------------------------------------------------------------------ */

typedef struct {
    int64_t expert, panel;
} item;

typedef struct {
    const tm_moe_args *a;
    int64_t *starts;    /* [E + 1] each expert's first sorted row */
    int64_t *pair_of;   /* [R] the (token, slot) pair, token * top_k + slot, of each sorted row */
    int64_t *sorted_of; /* [rows * top_k] the sorted row of each (token, slot) */
    void *xs;           /* [R][hidden] the gathered rows, x's type */
    void *h;            /* [R][inter], x's type */
    float *y;           /* [R][hidden]: phases B and C apart only (fuse_down), else NULL */
    int amx;            /* bf16 runs of 16 rows on AMX tiles */
    int amx_quantized;  /* the same over quantized panels widened to bf16 */
} problem;

/* A thread's state across items: whether its AMX tiles are configured, and its buffer for
 * a quantized panel widened to bf16 ([max(hidden, inter) / 2][64][2], or NULL). */
typedef struct {
    int tiles_on;
    uint16_t *wide;
} worker;

static int64_t value_bytes(const tm_moe_args *a) { return a->is_bf16 ? 2 : 4; }

static int is_int8(const tm_moe_args *a) { return a->weight_format == TM_MOE_INT8; }
static int is_int4(const tm_moe_args *a) { return a->weight_format == TM_MOE_INT4; }
static int is_mxfp4(const tm_moe_args *a) { return a->weight_format == TM_MOE_MXFP4; }
/* Two columns a byte, in groups of 32 k-rows. */
static int is_nibbles(const tm_moe_args *a) { return is_int4(a) || is_mxfp4(a); }

/* Bytes of one panel of k rows. */
static int64_t panel_bytes(const tm_moe_args *a, int64_t k) {
    if (is_nibbles(a)) return k * TM_MOE_PANEL_COLS / 2;
    return k * TM_MOE_PANEL_COLS * (is_int8(a) ? 1 : value_bytes(a));
}

/* The operands of expert e's panel j of a projection of k rows (panels of them each). */
static operands panel_operands(const tm_moe_args *a, const void *x, int64_t ldx, const void *w,
                               const void *scales, int64_t k, int64_t panels, int64_t e, int64_t j) {
    const int64_t at = e * panels + j, groups = k / 32;
    return (operands){
        .x = x, .ldx = ldx,
        .w = (const char *)w + at * panel_bytes(a, k), .ldw = TM_MOE_PANEL_COLS,
        .k = k, .is_bf16 = a->is_bf16,
        .scales = is_int8(a) ? (const float *)scales + at * TM_MOE_PANEL_COLS : NULL,
        .groups = is_int4(a) ? (const uint16_t *)scales + at * groups * 2 * TM_MOE_PANEL_COLS : NULL,
        .e8m0 = is_mxfp4(a) ? (const uint8_t *)scales + at * groups * TM_MOE_PANEL_COLS : NULL,
    };
}

static int64_t gate_up_panels(const tm_moe_args *a) { return (a->inter + NB - 1) / NB; }
static int64_t down_panels(const tm_moe_args *a) { return (a->hidden + 2 * NB - 1) / (2 * NB); }

/* Int8 weights: sums[r][b * NB + j] times the scale of its column (b = 0: from col, 1:
 * from second). */
static void scale_sums(const operands *o, int mr, int64_t col, int64_t second, int64_t left, int nw,
                       float (*sums)[2 * NB]) {
    if (!o->scales) return;
    for (int r = 0; r < mr; r++)
        for (int b = 0; b < nw; b++)
            for (int64_t j = 0; j < left; j++) sums[r][b * NB + j] *= o->scales[(b ? second : col) + j];
}

/* gpt-oss's clamped SwiGLU, in transformers' order of operations. */
static inline float clamped_swiglu(const tm_moe_args *a, float gate, float up) {
    const float limit = a->swiglu_limit;
    gate = gate < limit ? gate : limit;
    up = up < -limit ? -limit : up > limit ? limit : up;
    const float glu = gate * (1.0f / (1.0f + expf(-(gate * a->swiglu_alpha))));
    return (up + 1.0f) * glu;
}

static inline float bf16_rounded(float v) { return bf16_to_f32(f32_to_bf16(v)); }

/* out[j] = the activation of gate[j], times up[j], as x's type rounds them (bf16: gate, up
 * and the activation each rounded to bf16, as transformers' bf16 forward does), for j < n.
 * One loop per case, without branches inside, so that each vectorises and calls glibc's
 * vector expf (activation.h): per element, a scalar expf was most of phase A's time at a
 * prompt's rows. gpt-oss's clamped SwiGLU stays a plain loop. */
static void gated_row(const tm_moe_args *a, const float *gate, const float *up, int64_t n, float *out) {
    const int gelu = a->activation == TM_GATED_GELU_TANH;
    if (a->activation == TM_GATED_CLAMPED_SWIGLU) {
        for (int64_t j = 0; j < n; j++)
            out[j] = a->is_bf16 ? clamped_swiglu(a, bf16_rounded(gate[j]), bf16_rounded(up[j]))
                                : clamped_swiglu(a, gate[j], up[j]);
    } else if (a->is_bf16 && gelu) {
        for (int64_t j = 0; j < n; j++) out[j] = bf16_rounded(gelu_tanh_of(bf16_rounded(gate[j]))) * bf16_rounded(up[j]);
    } else if (a->is_bf16) {
        for (int64_t j = 0; j < n; j++) out[j] = bf16_rounded(silu_of(bf16_rounded(gate[j]))) * bf16_rounded(up[j]);
    } else if (gelu) {
        for (int64_t j = 0; j < n; j++) out[j] = gelu_tanh_of(gate[j]) * up[j];
    } else {
        for (int64_t j = 0; j < n; j++) out[j] = silu_of(gate[j]) * up[j];
    }
}

/* A 16-row AMX tile of sums over panel o from `row`, where this problem takes it: returns
 * the rows of the run it computed (at most 16), or 0 where the vector path must (a shorter
 * run, k no multiple of 32). */
static int64_t amx_rows(const problem *p, const operands *o, int64_t row, int64_t rows, worker *wk,
                        int *widened, float (*sums)[2 * NB]) {
#ifdef MOE_AMX
    if (rows < AMX_MIN_ROWS || o->k % 32) return 0;
    if (p->amx || (p->amx_quantized && wk->wide)) {
        if (!wk->tiles_on) configure_full_tiles(), wk->tiles_on = 1;
        if (p->amx)
            amx_tile(o, row, 0, NB, sums);
        else
            amx_quantized_tile(o, row, rows, wk->wide, widened, sums);
        return rows < AMX_ROWS ? rows : AMX_ROWS;
    }
#endif
    (void)p, (void)o, (void)row, (void)rows, (void)wk, (void)widened, (void)sums;
    return 0;
}

/* Phase A for one item: every row of its expert, its panel's 32 intermediate columns. */
static void gate_up_item(const problem *p, item it, worker *wk) {
    const tm_moe_args *a = p->a;
    const int64_t e = it.expert, col = it.panel * NB, inter = a->inter;
    const int64_t left = inter - col < NB ? inter - col : NB;
    const operands o = panel_operands(a, p->xs, a->hidden, a->gate_up, a->gate_up_scales, a->hidden,
                                      gate_up_panels(a), e, it.panel);
    float sums[TILE_ROWS_MAX][2 * NB];
    int widened = 0;
    for (int64_t row = p->starts[e]; row < p->starts[e + 1];) {
        int64_t rows = p->starts[e + 1] - row;
        const int64_t on_tiles = amx_rows(p, &o, row, rows, wk, &widened, sums);
        if (on_tiles) {
            rows = on_tiles;
        } else {
            rows = rows < MR ? rows : MR;
            tile(&o, row, (int)rows, 0, NB, left, 2, sums);
        }
        scale_sums(&o, (int)rows, 0, NB, left, 2, sums);
        const float *bias = a->gate_up_bias ? a->gate_up_bias + e * 2 * inter : NULL;
        for (int64_t r = 0; r < rows; r++) {
            float out[NB];
            if (bias)
                for (int64_t j = 0; j < left; j++) sums[r][j] += bias[col + j], sums[r][NB + j] += bias[inter + col + j];
            gated_row(a, sums[r], sums[r] + NB, left, out);
            store_row(p->h, (row + r) * inter + col, a->is_bf16, left, out);
        }
        row += rows;
    }
}

/* Phase B for one item: every row of its expert, its panel's 64 hidden columns - into y,
 * or, where `acc` is given (phases B and C in one: down_panel), each row's sums weighted
 * and added into its token's row of acc ([rows][64], the panel's columns). */
static void down_item(const problem *p, item it, worker *wk, float *acc) {
    const tm_moe_args *a = p->a;
    const int64_t e = it.expert, col = it.panel * 2 * NB, hidden = a->hidden;
    const int64_t left = hidden - col < 2 * NB ? hidden - col : 2 * NB;
    const operands o = panel_operands(a, p->h, a->inter, a->down, a->down_scales, a->inter,
                                      down_panels(a), e, it.panel);
    float sums[TILE_ROWS_MAX][2 * NB];
    int widened = 0;
    for (int64_t row = p->starts[e]; row < p->starts[e + 1];) {
        int64_t rows = p->starts[e + 1] - row;
        const int64_t on_tiles = amx_rows(p, &o, row, rows, wk, &widened, sums);
        if (on_tiles) {
            rows = on_tiles;
        } else {
            rows = rows < MR ? rows : MR;
            /* A whole panel in one pass, as phase A's: two passes over its halves took
             * every other pair of lines each, and a few rows' pass waited on each. */
            if (left == 2 * NB) {
                tile(&o, row, (int)rows, 0, NB, 2 * NB, 2, sums);
            } else {
                for (int64_t half = 0; half < left; half += NB) {
                    float part[MR][2 * NB];
                    const int64_t cols = left - half < NB ? left - half : NB;
                    tile(&o, row, (int)rows, half, half, cols, 1, part);
                    for (int64_t r = 0; r < rows; r++) memcpy(sums[r] + half, part[r], (size_t)cols * 4);
                }
            }
        }
        scale_sums(&o, (int)rows, 0, 0, left, 1, sums);
        const float *bias = a->down_bias ? a->down_bias + e * hidden + col : NULL;
        for (int64_t r = 0; r < rows; r++) {
            if (bias)
                for (int64_t j = 0; j < left; j++) sums[r][j] += bias[j];
            if (!acc) {
                memcpy(p->y + (row + r) * hidden + col, sums[r], (size_t)left * 4);
                continue;
            }
            const int64_t pair = p->pair_of[row + r];
            const float w = a->expert_weights[pair];
            float *into = acc + (pair / a->top_k) * 2 * NB;
            for (int64_t j = 0; j < left; j++) {
                const float term = w * sums[r][j]; /* rounded, then added, as combine_token */
                into[j] += term;
            }
        }
        row += rows;
    }
}

/* Phases B and C in one, for one panel of 64 hidden columns: every used expert's item, in
 * ascending expert order, adding into the thread's acc ([rows][64] fp32); then those
 * columns of out. Each token's terms are added in ascending expert order, as combine_token
 * adds them: the same bits, without y - which at a prompt's rows is rows * top_k * hidden
 * fp32 values written once and read once (a 2,048-token chunk of OLMoE: 134 MB) - or a
 * pass of its own. The panel's weights of every expert are still read once. */
static void down_panel(const problem *p, int64_t panel, worker *wk, float *acc) {
    const tm_moe_args *a = p->a;
    const int64_t col = panel * 2 * NB, hidden = a->hidden;
    const int64_t left = hidden - col < 2 * NB ? hidden - col : 2 * NB;
    memset(acc, 0, (size_t)(a->rows * 2 * NB) * sizeof(float));
    for (int64_t e = 0; e < a->num_experts; e++)
        if (p->starts[e + 1] > p->starts[e]) down_item(p, (item){e, panel}, wk, acc);
    for (int64_t t = 0; t < a->rows; t++) store_row(a->out, t * hidden + col, a->is_bf16, left, acc + t * 2 * NB);
}

/* Whether phases B and C run as one (down_panel): an item is then a whole panel of down
 * columns, so there are only hidden / 64 of them (32 for OLMoE's 2,048), all of the same
 * size. They are dealt out in rounds of `threads`; where a last, partial round would idle
 * more than a quarter of the panels' share of threads, the items stay one expert and one
 * panel each, through y. */
static int fuse_down(int64_t panels, int threads) {
    const int64_t rounds = (panels + threads - 1) / threads;
    return 4 * (rounds * threads - panels) <= panels;
}

/* Phase C for token t: its rows of y weighted and summed in ascending expert order. */
static void combine_token(const problem *p, int64_t t, float *acc) {
    const tm_moe_args *a = p->a;
    const int64_t k = a->top_k, hidden = a->hidden;
    int64_t slots[TM_MOE_MAX_TOP_K];
    for (int64_t j = 0; j < k; j++) { /* insertion sort by expert id: k is small */
        int64_t at = j;
        while (at > 0 && a->expert_ids[t * k + slots[at - 1]] > a->expert_ids[t * k + j]) {
            slots[at] = slots[at - 1];
            at--;
        }
        slots[at] = j;
    }
    for (int64_t c = 0; c < hidden; c++) acc[c] = 0.0f;
    for (int64_t j = 0; j < k; j++) {
        const int64_t slot = slots[j];
        const float w = a->expert_weights[t * k + slot];
        const float *y = p->y + p->sorted_of[t * k + slot] * hidden;
        for (int64_t c = 0; c < hidden; c++) {
            const float term = w * y[c]; /* rounded, then added: no contraction (flags) */
            acc[c] += term;
        }
    }
    store_row(a->out, t * hidden, a->is_bf16, hidden, acc);
}

static int check(const tm_moe_args *a) {
    if (a->rows < 0 || a->top_k < 1 || a->top_k > TM_MOE_MAX_TOP_K || a->top_k > a->num_experts ||
        a->hidden <= 0 || a->inter <= 0 || a->hidden > TM_MAX_ROW_DIM || a->panel_cols != TM_MOE_PANEL_COLS)
        return TM_UNSUPPORTED_SHAPE;
    if (a->is_bf16 && (a->hidden % 2 || a->inter % 2)) return TM_UNSUPPORTED_SHAPE;
    if (a->activation < TM_GATED_SILU || a->activation > TM_GATED_CLAMPED_SWIGLU) return TM_UNSUPPORTED_SHAPE;
    if (a->weight_format != TM_MOE_FLOAT && !is_int8(a) && !is_nibbles(a)) return TM_UNSUPPORTED_SHAPE;
    if ((is_int8(a) || is_nibbles(a)) && (!a->gate_up_scales || !a->down_scales)) return TM_UNSUPPORTED_SHAPE;
    /* int4, mxfp4: groups of 32 k-rows. */
    if (is_nibbles(a) && (a->hidden % 32 || a->inter % 32)) return TM_UNSUPPORTED_SHAPE;
    for (int64_t i = 0; i < a->rows * a->top_k; i++)
        if (a->expert_ids[i] < 0 || a->expert_ids[i] >= a->num_experts) return TM_UNSUPPORTED_SHAPE;
    return TM_OK;
}

/* The calling thread's buffers for the gathered rows, h and y, kept from call to call (as
 * q4_tiles.c keeps its own) and grown to the largest call: at a prompt chunk's rows they
 * are tens of megabytes, and fresh ones cost the kernel a page fault per 4 KB at every
 * call, a tenth of a prefill's time. Never freed; one set per thread that calls tm_moe. */
static _Thread_local char *kept;
static _Thread_local size_t kept_bytes;

static char *kept_scratch(size_t bytes) {
    if (bytes > kept_bytes) {
        free(kept);
        kept = malloc(bytes);
        kept_bytes = kept ? bytes : 0;
    }
    return kept;
}

int tm_moe(const tm_moe_args *a) {
    const int status = check(a);
    if (status != TM_OK || a->rows == 0) return status;
    const int64_t E = a->num_experts, k = a->top_k, pairs = a->rows * k;
    const int64_t hidden = a->hidden, inter = a->inter, vb = value_bytes(a);
    const int amx = a->is_bf16 && amx_usable();
    const int threads = a->num_threads > 1 && pairs * hidden * inter >= (1 << 16) ? a->num_threads : 1;
    const int64_t blocks_a = gate_up_panels(a), blocks_b = down_panels(a);
    const int fused = fuse_down(blocks_b, threads);
    problem p = {.a = a, .amx = amx && a->weight_format == TM_MOE_FLOAT,
                 .amx_quantized = amx && a->weight_format != TM_MOE_FLOAT};
    p.starts = calloc((size_t)(E + 1), sizeof(int64_t));
    p.pair_of = malloc((size_t)pairs * sizeof(int64_t));
    p.sorted_of = malloc((size_t)pairs * sizeof(int64_t));
    /* AMX_ROWS rows of slack after xs and h, zeroed: a tile over a run's last rows reads
     * 16 rows. */
    const size_t xs_bytes = (size_t)((pairs + AMX_ROWS) * hidden * vb), h_bytes = (size_t)((pairs + AMX_ROWS) * inter * vb);
    const size_t y_bytes = fused ? 0 : (size_t)(pairs * hidden) * sizeof(float);
    char *scratch = kept_scratch(xs_bytes + h_bytes + y_bytes);
    if (scratch) {
        p.xs = scratch;
        p.h = scratch + xs_bytes;
        p.y = fused ? NULL : (float *)(scratch + xs_bytes + h_bytes);
        memset((char *)p.xs + pairs * hidden * vb, 0, (size_t)(AMX_ROWS * hidden * vb));
        memset((char *)p.h + pairs * inter * vb, 0, (size_t)(AMX_ROWS * inter * vb));
    }
    item *items = malloc((size_t)(E * (blocks_a + blocks_b) + 1) * sizeof(item));
    int failed = !p.starts || !p.pair_of || !p.sorted_of || !scratch || !items;
    if (!failed) {
        /* Counting sort: each expert's rows in ascending token order. */
        for (int64_t i = 0; i < pairs; i++) p.starts[a->expert_ids[i] + 1]++;
        for (int64_t e = 0; e < E; e++) p.starts[e + 1] += p.starts[e];
        int64_t *next = malloc((size_t)E * sizeof(int64_t));
        if (!next) {
            failed = 1;
        } else {
            memcpy(next, p.starts, (size_t)E * sizeof(int64_t));
            for (int64_t i = 0; i < pairs; i++) {
                const int64_t at = next[a->expert_ids[i]]++;
                p.sorted_of[i] = at;
                p.pair_of[at] = i;
            }
            free(next);
        }
    }
    int64_t num_a = 0, num_b = 0;
    if (!failed) {
        for (int64_t e = 0; e < E; e++)
            if (p.starts[e + 1] > p.starts[e])
                for (int64_t b = 0; b < blocks_a; b++) items[num_a++] = (item){e, b};
        item *down_items = items + num_a;
        for (int64_t e = 0; e < E && !fused; e++)
            if (p.starts[e + 1] > p.starts[e])
                for (int64_t b = 0; b < blocks_b; b++) down_items[num_b++] = (item){e, b};
#pragma omp parallel num_threads(threads)
        {
            worker wk = {0};
            if (p.amx_quantized) /* NULL on failure: the vector path serves */
                wk.wide = malloc((size_t)((hidden > inter ? hidden : inter) * TM_MOE_PANEL_COLS) * sizeof(uint16_t));
            /* fused: a panel's columns of every token; else one token's row (combine_token) */
            float *acc = malloc((size_t)(fused ? a->rows * 2 * NB : hidden) * sizeof(float));
#pragma omp for schedule(static)
            for (int64_t r = 0; r < pairs; r++)
                memcpy((char *)p.xs + r * hidden * vb, (const char *)a->x + (p.pair_of[r] / k) * hidden * vb,
                       (size_t)(hidden * vb));
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < num_a; i++) gate_up_item(&p, items[i], &wk);
            if (fused) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t b = 0; b < blocks_b; b++)
                    if (acc) down_panel(&p, b, &wk, acc);
            } else {
#pragma omp for schedule(dynamic, 1)
                for (int64_t i = 0; i < num_b; i++) down_item(&p, down_items[i], &wk, NULL);
#pragma omp for schedule(static)
                for (int64_t t = 0; t < a->rows; t++)
                    if (acc) combine_token(&p, t, acc);
            }
            if (!acc) {
#pragma omp atomic write
                failed = 1;
            }
#ifdef MOE_AMX
            if (wk.tiles_on) _tile_release();
#endif
            free(wk.wide);
            free(acc);
        }
    }
    free(p.starts);
    free(p.pair_of);
    free(p.sorted_of);
    free(items);
    return failed ? TM_OUT_OF_MEMORY : TM_OK;
}
