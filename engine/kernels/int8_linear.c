/* The int8 linear layers' forward (engine/quant/int8.py) in one call, on AVX512-VNNI's
 * vpdpbusd: each row of x quantized to uint8 with its own scale (quantize_row.h), then
 * out[m, n] = (sum_k qx[m, k] w[n, k] - 128 * colsum[n]) * x_scales[m] * w_scales[n]
 *             + bias[n].
 *
 * Why our own and not oneDNN's (which the layers use where this is not built): oneDNN
 * takes one activation scale per tensor, so per-token scales cost a second pass over the
 * output (and a bf16 rounding before it); it JIT-builds a kernel for every new row
 * count, which forced padding decode steps to a few fixed sizes; and at the model's
 * shapes it ran well below the VNNI units' rate (docs/design.md, "Our own int8
 * kernel"). Here each row's scale is applied in the epilogue, rows are taken as they
 * come, and nothing is built at run time. Quantizing inside the same call saves a
 * second trip through Python and a second wake-up of the threads per layer.
 *
 * Layout: the weights are packed at load into panels of 16 output channels, each panel
 * [k / 4][16][4]: one 64-byte load gives vpdpbusd four k-values for 16 channels. A
 * register tile is MR rows x up to 4 panels (64 channels): 24 int32 accumulators, the
 * four panel loads and one broadcast of four activation bytes per k-step.
 *
 * Work split: each thread owns a contiguous run of panels (output channels) for every
 * row, so a decode step (tens of rows) reads each weight once. Rows go in blocks that
 * stay in L2 while the thread's panels pass over them.
 *
 * Where the CPU also has AMX, calls of 8 rows or more run on its tile units instead
 * (int8_amx.h), over the same packed panels and through the same epilogue. A build for
 * an AVX2-only CPU (no VNNI) runs int8_avx2.h's product on the same panels instead: the
 * same integer sums, so the same bits.
 *
 * A gated MLP's gate_up weight can be packed a gate panel and its up panel in turn; then
 * the epilogue takes each pair's fp32 values and stores act(gate) * up (SiLU, or Gemma's
 * GELU) once, instead of writing [gate, up] for a separate pass to read back; AVX2's
 * tile, one panel wide, runs a pair as two tiles (docs/design.md, "The gated MLP
 * in the int8 epilogue").
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "activation.h"
#include "kernel_common.h"
#include "kernels.h"
#include "quantize_row.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TM_HAVE_VNNI 1
#define TM_HAVE_INT8_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define TM_HAVE_VNNI 0
#define TM_HAVE_INT8_AVX2 1 /* int8_avx2.h */
#else
#define TM_HAVE_VNNI 0
#define TM_HAVE_INT8_AVX2 0
#endif

#if TM_HAVE_VNNI || TM_HAVE_INT8_AVX2
/* Below this many multiply-adds a call is a few microseconds: one thread - unless its
 * weights alone are this many bytes: a call of a row or two is bound by reading them
 * (from L3 or memory), and two threads read them nearly twice as fast. Why these
 * thresholds: docs/design.md, "Our own int8 kernel". */
#define MATMUL_PARALLEL_MIN (1 << 20)
#define WEIGHT_PARALLEL_MIN (1 << 18)

typedef struct {
    const uint8_t *x;
    const float *x_scales;
    const int8_t *w;
    const int32_t *w_col_sums;
    const float *w_scales;
    const float *bias;
    void *out;
    int64_t n, k;
    int64_t out_n; /* out's row length: n, or n / 2 with an activation */
    int32_t x_zero_point;
    int is_bf16;
    int activation; /* TM_GATED_* */
} problem;
#endif

#if TM_HAVE_VNNI || TM_HAVE_INT8_AVX2
/* g[i] = act(g[i]) * up[i] for n values (a compile-time constant at each use), with
 * activation.h's formulas - the ones elementwise.c's SiLU/GELU-and-mul use, so an fp32
 * layer gives that op's bits on the same gate and up values. The loops are marked simd so
 * that GCC calls the vector expf wherever they are inlined (unmarked, it vectorised them
 * in the VNNI tile and not in the AMX block). */
static inline __attribute__((always_inline)) void gated_in_place(int activation, float *g,
                                                                 const float *up, const int n) {
    if (activation == TM_GATED_SILU) {
#pragma omp simd
        for (int i = 0; i < n; i++) g[i] = silu_of(g[i]) * up[i];
    } else {
#pragma omp simd
        for (int i = 0; i < n; i++) g[i] = gelu_tanh_of(g[i]) * up[i];
    }
}
#endif

#if TM_HAVE_VNNI

#define MR 6          /* rows per register tile */
#define MAX_PANELS 4  /* 16-channel panels per register tile */
#define ROW_BLOCK 120 /* rows kept in L2 while a thread's panels pass over them */

#include "avx512_epilogue.h"

static inline void store16(const problem *p, int64_t row, int64_t col, __m512 v) {
    tm_store16(p->out, p->is_bf16, row * p->out_n + col, v);
}

/* The epilogue's terms for 16 output channels: the zero-point correction, the weights'
 * scales and the bias. The AMX path (int8_amx.h) loads them once for 16 rows. */
typedef struct {
    __m512i correction;
    __m512 w_scales, bias;
} channels16;

static inline __attribute__((always_inline)) channels16 load_channels16(const problem *p,
                                                                        int64_t col) {
    channels16 c;
    c.correction = _mm512_mullo_epi32(_mm512_set1_epi32(p->x_zero_point),
                                      _mm512_loadu_si512(p->w_col_sums + col));
    c.w_scales = _mm512_loadu_ps(p->w_scales + col);
    c.bias = p->bias ? _mm512_loadu_ps(p->bias + col) : _mm512_setzero_ps();
    return c;
}

/* The epilogue's arithmetic for 16 channels of one row, the one both paths run (so they
 * give the same bits): (acc - correction) * (w_scales * x_scale) + bias. */
static inline __attribute__((always_inline)) __m512 finish_value16(const channels16 *c,
                                                                   __m512 x_scale, __m512i acc) {
    __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, c->correction));
    return _mm512_fmadd_ps(v, _mm512_mul_ps(c->w_scales, x_scale), c->bias);
}

/* The epilogue of one row's 16 channels, rounded once into out. */
static inline __attribute__((always_inline)) void finish_row16(const problem *p,
                                                               const channels16 *c, int64_t row,
                                                               int64_t col, __m512i acc) {
    store16(p, row, col, finish_value16(c, _mm512_set1_ps(p->x_scales[row]), acc));
}

/* The epilogue of one accumulator: 16 channels of one row. */
static inline __attribute__((always_inline)) void finish16(const problem *p, int64_t row,
                                                           int64_t col, __m512i acc) {
    const channels16 c = load_channels16(p, col);
    finish_row16(p, &c, row, col, acc);
}

/* act(gate) * up over 16 channels, from their fp32 epilogue values (gated_in_place). */
static inline __attribute__((always_inline)) __m512 gated16(int activation, __m512 gate,
                                                            __m512 up) {
    float g[16] __attribute__((aligned(64))), u[16] __attribute__((aligned(64)));
    _mm512_store_ps(g, gate);
    _mm512_store_ps(u, up);
    gated_in_place(activation, g, u, 16);
    return _mm512_load_ps(g);
}

/* The epilogue of a gate panel's and its up panel's accumulators for one row (channels
 * col.. and col + 16.. of the product): 16 outputs at col / 2. Kept apart from the AMX
 * path's finish_row32, whose arithmetic it shares: a branch inside that function slowed
 * the gated AMX calls (docs/design.md, "The gated MLP in the int8 epilogue"). */
static inline __attribute__((always_inline)) void finish_gated16(const problem *p,
                                                                 const channels16 *gate_c,
                                                                 const channels16 *up_c,
                                                                 int64_t row, int64_t col,
                                                                 __m512i gate, __m512i up) {
    const __m512 x_scale = _mm512_set1_ps(p->x_scales[row]);
    store16(p, row, col / 2,
            gated16(p->activation, finish_value16(gate_c, x_scale, gate),
                    finish_value16(up_c, x_scale, up)));
}

/* The same, loading the channels' terms. */
static inline __attribute__((always_inline)) void finish_pair16(const problem *p, int64_t row,
                                                                int64_t col, __m512i gate,
                                                                __m512i up) {
    const channels16 gate_c = load_channels16(p, col), up_c = load_channels16(p, col + 16);
    finish_gated16(p, &gate_c, &up_c, row, col, gate, up);
}

/* One register tile: rows [row, row + mr) x panels [panel, panel + np), over all of k.
 * mr and np are compile-time constants at every call (the switch below), so the dead
 * branches fold away; the accumulators are named variables, not an array, because GCC
 * shuffles an array of vectors through extra moves and the stack. */
#define ACC_ROW(r) __m512i a##r##0 = zero, a##r##1 = zero, a##r##2 = zero, a##r##3 = zero
#define STEP_ROW(r)                                                             \
    if (mr > r) {                                                               \
        int32_t four;                                                           \
        __builtin_memcpy(&four, x + r * k + kk * 4, 4);                         \
        const __m512i xv = _mm512_set1_epi32(four);                             \
        a##r##0 = tm_dot4(a##r##0, xv, w0);                         \
        if (np > 1) a##r##1 = tm_dot4(a##r##1, xv, w1);             \
        if (np > 2) a##r##2 = tm_dot4(a##r##2, xv, w2);             \
        if (np > 3) a##r##3 = tm_dot4(a##r##3, xv, w3);             \
    }
#define FINISH_ROW(r)                                                           \
    if (mr > r && p->activation) { /* np is 2 or 4: gate and up panels in pairs */ \
        finish_pair16(p, row + r, col, a##r##0, a##r##1);                       \
        if (np > 2) finish_pair16(p, row + r, col + 32, a##r##2, a##r##3);      \
    } else if (mr > r) {                                                        \
        finish16(p, row + r, col, a##r##0);                                     \
        if (np > 1) finish16(p, row + r, col + 16, a##r##1);                    \
        if (np > 2) finish16(p, row + r, col + 32, a##r##2);                    \
        if (np > 3) finish16(p, row + r, col + 48, a##r##3);                    \
    }

static inline __attribute__((always_inline)) void tile(const problem *p, int64_t row,
                                                       int64_t panel, const int mr,
                                                       const int np) {
    const __m512i zero = _mm512_setzero_si512();
    ACC_ROW(0); ACC_ROW(1); ACC_ROW(2); ACC_ROW(3); ACC_ROW(4); ACC_ROW(5);
    const int64_t k = p->k, k4 = k / 4;
    const int8_t *w = p->w + panel * k4 * 64;
    const uint8_t *x = p->x + row * k;
    for (int64_t kk = 0; kk < k4; kk++) {
        const __m512i w0 = _mm512_loadu_si512(w + kk * 64);
        const __m512i w1 = np > 1 ? _mm512_loadu_si512(w + (k4 + kk) * 64) : zero;
        const __m512i w2 = np > 2 ? _mm512_loadu_si512(w + (2 * k4 + kk) * 64) : zero;
        const __m512i w3 = np > 3 ? _mm512_loadu_si512(w + (3 * k4 + kk) * 64) : zero;
        STEP_ROW(0) STEP_ROW(1) STEP_ROW(2) STEP_ROW(3) STEP_ROW(4) STEP_ROW(5)
    }
    const int64_t col = panel * 16;
    FINISH_ROW(0) FINISH_ROW(1) FINISH_ROW(2) FINISH_ROW(3) FINISH_ROW(4) FINISH_ROW(5)
}

#define TILE_ROWS(np)                                        \
    switch (mr) {                                            \
    case 6: tile(p, row, panel, 6, np); break;               \
    case 5: tile(p, row, panel, 5, np); break;               \
    case 4: tile(p, row, panel, 4, np); break;               \
    case 3: tile(p, row, panel, 3, np); break;               \
    case 2: tile(p, row, panel, 2, np); break;               \
    default: tile(p, row, panel, 1, np); break;              \
    }

static void tile_any(const problem *p, int64_t row, int64_t panel, int mr, int np) {
    switch (np) {
    case 4: TILE_ROWS(4); break;
    case 3: TILE_ROWS(3); break;
    case 2: TILE_ROWS(2); break;
    default: TILE_ROWS(1); break;
    }
}

/* Rows [0, rows) x panels [first, last). */
static void panels_all_rows(const problem *p, int64_t rows, int64_t first, int64_t last) {
    for (int64_t block = 0; block < rows; block += ROW_BLOCK) {
        const int64_t block_end = block + ROW_BLOCK < rows ? block + ROW_BLOCK : rows;
        for (int64_t panel = first; panel < last; panel += MAX_PANELS) {
            const int np = (int)(last - panel < MAX_PANELS ? last - panel : MAX_PANELS);
            for (int64_t row = block; row < block_end; row += MR) {
                const int mr = (int)(block_end - row < MR ? block_end - row : MR);
                tile_any(p, row, panel, mr, np);
            }
        }
    }
}
#endif

#include "int8_amx.h"
#if TM_HAVE_INT8_AVX2
#include "int8_avx2.h"
#endif

int tm_int8_linear_isa(void) {
#if TM_HAVE_AMX
    if (tm_internal_amx_permitted()) return TM_INT8_ISA_AMX;
#endif
#if TM_HAVE_INT8_AVX2
    return AVX2_TAKES_OFF_ZERO_POINT ? TM_INT8_ISA_AVX_VNNI : TM_INT8_ISA_AVX2;
#endif
    return TM_HAVE_VNNI ? TM_INT8_ISA_AVX512_VNNI : TM_INT8_ISA_NONE;
}

int tm_int8_linear(const tm_int8_linear_args *a) {
#if TM_HAVE_VNNI || TM_HAVE_INT8_AVX2
    if (a->n % 16 || a->k % 4 || a->k > TM_MAX_INT8_K || a->rows < 0) return TM_UNSUPPORTED_SHAPE;
    if (a->activation < TM_GATED_NONE || a->activation > TM_GATED_GELU_TANH ||
        (a->activation && a->n % 32))
        return TM_UNSUPPORTED_SHAPE;
    /* All 8 bits, as uint8 around 128. VNNI and AMX multiply those (u8 x s8) and take
     * 128 x each channel's weight sum off in the epilogue; AVX2 turns them back into
     * signed values first (int8_avx2.h), so its epilogue has nothing to take off. */
    const int qmax = 127, zero_point = 128;
#if !TM_HAVE_VNNI && !AVX2_TAKES_OFF_ZERO_POINT
    /* -128 has no sign to flip (vpsignb): plain AVX2 takes -127..127 only */
    if (a->x_full_range) return TM_UNSUPPORTED_SHAPE;
#endif
    const problem p = {.x = a->qx,
                       .x_scales = a->x_scales,
                       .w = a->w,
                       .w_col_sums = a->w_col_sums,
                       .w_scales = a->w_scales,
                       .bias = a->bias,
                       .out = a->out,
                       .n = a->n,
                       .k = a->k,
                       .out_n = a->activation ? a->n / 2 : a->n,
                       .x_zero_point = zero_point,
                       .is_bf16 = a->is_bf16,
                       .activation = a->activation};
    const int64_t panels = a->n / 16, rows = a->rows, k = a->k;
    const int parallel = rows * a->n * k >= MATMUL_PARALLEL_MIN || a->n * k >= WEIGHT_PARALLEL_MIN;
    uint8_t *tail = NULL; /* the rows past the last full 16, zero-padded, for AMX tiles */
#if TM_HAVE_AMX
    const int amx = rows >= AMX_MIN_ROWS && k % AMX_K == 0 && tm_internal_amx_permitted();
    if (amx && rows % 16 && !(tail = calloc(16, (size_t)k))) return TM_OUT_OF_MEMORY;
#else
    const int amx = 0;
#endif
#pragma omp parallel num_threads(a->num_threads) if (parallel)
    {
        const int64_t threads = omp_get_num_threads();
        const int64_t t = omp_get_thread_num();
        for (int64_t r = rows * t / threads; r < rows * (t + 1) / threads; r++)
            a->x_scales[r] = tm_internal_quantize_row_u8(a->x, r, k, a->is_bf16, a->inv_smooth,
                                                         qmax, zero_point, a->x_full_range,
                                                         a->qx + r * k);
#pragma omp barrier
        /* With an activation each thread takes whole gate/up pairs of panels. */
        const int64_t unit = a->activation ? 2 : 1, units = panels / unit;
        const int64_t first = units * t / threads * unit, last = units * (t + 1) / threads * unit;
        if (amx) {
#if TM_HAVE_AMX
#pragma omp single
            if (tail) memcpy(tail, a->qx + (rows - rows % 16) * k, (size_t)(rows % 16 * k));
            amx_panels_all_rows(&p, rows, first, last, tail);
#endif
        } else {
#if TM_HAVE_VNNI
            panels_all_rows(&p, rows, first, last);
#else
            panels_all_rows_avx2(&p, rows, first, last);
#endif
        }
    }
    free(tail);
    return TM_OK;
#else
    (void)a;
    return TM_UNSUPPORTED_ISA;
#endif
}
