/* The int8 product on AVX2 (CPUs without AVX512-VNNI, e.g. AMD Zen 1/2 and Intel before
 * Ice Lake), for int8_linear.c.
 *
 * AVX2 has no instruction that sums 8-bit products in int32. vpmaddubsw multiplies 32
 * u8 x s8 pairs and adds neighbours into 16 int16 sums (saturating), vpmaddwd by ones
 * widens those to 8 int32 sums of four, and vpaddd accumulates them. With the
 * activations as uint8 around 128 (what VNNI multiplies) a pair reaches 2 * 255 * 127
 * and saturates; oneDNN's AVX2 kernel avoids that with 7-bit activations, which miss the
 * int8 mode's 2% perplexity promise (docs/design.md, "int8 on AVX2: all 8 bits").
 * Here the activations keep all 8 bits: turned back into signed values (-127..127)
 * and multiplied as |w| x (x with w's sign) - vpsignb, then vpmaddubsw - a pair is at
 * most 2 * 127 * 127 = 32,258, which int16 holds. The sums are then exactly VNNI's
 * sum((x - 128) * w), so with the shared epilogue arithmetic every build gives the same
 * bits, and nothing is taken off for a zero point.
 *
 * The price is the sign: three multiply-port instructions per 32 products instead of
 * two. On Intel cores vpsignb shares those two ports, so the 8-bit form runs slower than
 * the 7-bit one there (figures: the same section); on AMD Zen 1/2 the integer multiplies
 * have one port and vpsignb does not use it.
 *
 * Where the compiler targets AVX-VNNI as well (AVX2 with a 256-bit vpdpbusd and no
 * AVX-512: Intel Alder Lake clients and Sierra Forest Xeons; -march=alderlake), one
 * vpdpbusd does the four instructions' work on u8 activations around 128, and the
 * epilogue takes the zero point off as AVX-512's does: the same sums, the same bits.
 *
 * The weights are int8_linear.c's panels ([k / 4][16][4]), read as two 32-byte halves of
 * 8 channels each. A register tile is up to 4 rows x one panel (16 channels): 8 int32
 * accumulators, the two weight halves and their absolute values, one broadcast of four
 * activation bytes, the ones, the sign flip and one temporary fill AVX2's 16 registers.
 * Rows go in L2-sized blocks while a thread's panels pass over them, as on VNNI.
 *
 * A gated MLP's gate_up (panels packed gate, up, gate, up...) runs each pair as two tiles
 * over the same rows: the gate panel's keeps its fp32 values, the up panel's stores
 * act(gate) * up from them (gated_in_place, as on AVX-512), so no
 * [rows, 2 x intermediate] tensor is written and read back.
 */
#ifndef TOKENMILL_INT8_AVX2_H
#define TOKENMILL_INT8_AVX2_H

#include <immintrin.h>

#define AVX2_MR 4          /* rows per register tile */
#define AVX2_ROW_BLOCK 120 /* rows kept in L2 while a thread's panels pass over them */

/* dot4_avx2(acc, x, w, abs_w, ones): acc += the four-term dot products of 8 channels'
 * weights w (|w| in abs_w) with the activations from activations4. Written as inline
 * assembly in both forms for the reason int8_linear.c's dot4 is: with intrinsics GCC 12
 * moved every accumulator through a copy each step and kept one on the stack. */
#if defined(__AVXVNNI__)
/* AVX-VNNI (Intel Alder Lake and Sierra Forest on: AVX2 with vpdpbusd on 256 bits, no
 * AVX-512): u8 activations around 128 times s8 weights, summed in int32 as on AVX-512,
 * with 128 x each channel's weight sum taken off in the epilogue. */
#define AVX2_TAKES_OFF_ZERO_POINT 1

/* Four activation bytes (uint8 around 128) in every 32-bit lane, as vpdpbusd takes them. */
static inline __attribute__((always_inline)) __m256i activations4(int32_t four) {
    return _mm256_set1_epi32(four);
}

/* u8 x s8 in int32 (abs_w and ones unused here). */
static inline __attribute__((always_inline)) __m256i dot4_avx2(__m256i acc, __m256i x,
                                                               __m256i w, __m256i abs_w,
                                                               __m256i ones) {
    (void)abs_w;
    (void)ones;
    __asm__("%{vex%} vpdpbusd %[w], %[x], %[acc]" : [acc] "+x"(acc) : [x] "x"(x), [w] "x"(w));
    return acc;
}
#else
#define AVX2_TAKES_OFF_ZERO_POINT 0

/* Four activation bytes (uint8 around 128) as signed values, in every 32-bit lane. */
static inline __attribute__((always_inline)) __m256i activations4(int32_t four) {
    return _mm256_xor_si256(_mm256_set1_epi32(four), _mm256_set1_epi8((char)0x80));
}

/* s8 x s8: |w| times x with w's sign, pairs summed in int16, then widened and added. */
static inline __attribute__((always_inline)) __m256i dot4_avx2(__m256i acc, __m256i x,
                                                               __m256i w, __m256i abs_w,
                                                               __m256i ones) {
    __m256i pairs;
    __asm__("vpsignb %[w], %[x], %[pairs]\n\t"
            "vpmaddubsw %[pairs], %[abs_w], %[pairs]\n\t"
            "vpmaddwd %[ones], %[pairs], %[pairs]\n\t"
            "vpaddd %[pairs], %[acc], %[acc]"
            : [acc] "+x"(acc), [pairs] "=&x"(pairs)
            : [x] "x"(x), [w] "x"(w), [abs_w] "x"(abs_w), [ones] "x"(ones));
    return acc;
}
#endif

/* 8 fp32 values into out[row, col..col + 8), in the output's type. */
static inline __attribute__((always_inline)) void store8(const problem *p, int64_t row,
                                                         int64_t col, __m256 v) {
    if (p->is_bf16) { /* round to nearest even, as f32_to_bf16 does */
        __m256i u = _mm256_castps_si256(v);
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        const __m256i half = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF));
        u = _mm256_srli_epi32(_mm256_add_epi32(u, half), 16);
        /* packus works within 128-bit lanes: gather the two lanes' halves */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(u, u), 0x08);
        _mm_storeu_si128((__m128i *)((uint16_t *)p->out + row * p->out_n + col),
                         _mm256_castsi256_si128(packed));
    } else {
        _mm256_storeu_ps((float *)p->out + row * p->out_n + col, v);
    }
}

/* One row's 8 channels in fp32: finish_value16's arithmetic, (acc - correction) *
 * (w_scale * x_scale) + bias. The signed sums need no correction; AVX-VNNI's take off 128
 * x each channel's weight sum, as AVX-512's do. */
static inline __attribute__((always_inline)) __m256 value8(const problem *p, int64_t row,
                                                           int64_t col, __m256i acc) {
    if (AVX2_TAKES_OFF_ZERO_POINT) {
        const __m256i sums = _mm256_loadu_si256((const __m256i *)(p->w_col_sums + col));
        acc = _mm256_sub_epi32(acc, _mm256_mullo_epi32(_mm256_set1_epi32(p->x_zero_point), sums));
    }
    const __m256 scales = _mm256_mul_ps(_mm256_loadu_ps(p->w_scales + col),
                                        _mm256_set1_ps(p->x_scales[row]));
    const __m256 bias = p->bias ? _mm256_loadu_ps(p->bias + col) : _mm256_setzero_ps();
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), scales, bias);
}

/* What a tile's epilogue does with its fp32 values. A tile holds one panel, so a gated
 * MLP's gate panel and its up panel (packed side by side) run as two tiles over the same
 * rows: the first keeps the gate values, the second stores act(gate) * up. */
enum { AVX2_STORE, AVX2_KEEP_GATE, AVX2_APPLY_GATE };

/* The epilogue of one row's 8 channels: rounded once into out (AVX2_STORE); kept in
 * `gate` (AVX2_KEEP_GATE); or, for the up panel, act(gate) * up computed in `gate`
 * (gated_in_place) and rounded once into out at the pair's output columns
 * (AVX2_APPLY_GATE: col is the up panel's, 16 past its gate panel's). */
static inline __attribute__((always_inline)) void finish8(const problem *p, int mode,
                                                          int64_t row, int64_t col,
                                                          __m256i acc, float *gate) {
    const __m256 v = value8(p, row, col, acc);
    if (mode == AVX2_STORE) {
        store8(p, row, col, v);
    } else if (mode == AVX2_KEEP_GATE) {
        _mm256_storeu_ps(gate, v);
    } else {
        float up[8];
        _mm256_storeu_ps(up, v);
        gated_in_place(p->activation, gate, up, 8);
        const int64_t half = col % 16, gate_col = col - half - 16;
        store8(p, row, gate_col / 2 + half, _mm256_loadu_ps(gate));
    }
}

#define AVX2_ACC_ROW(r) __m256i a##r##0 = zero, a##r##1 = zero
#define AVX2_STEP_ROW(r)                                          \
    if (mr > r) {                                                 \
        int32_t four;                                             \
        __builtin_memcpy(&four, x + r * k + kk * 4, 4);           \
        const __m256i xv = activations4(four);                    \
        a##r##0 = dot4_avx2(a##r##0, xv, w0, abs_w0, ones);       \
        a##r##1 = dot4_avx2(a##r##1, xv, w1, abs_w1, ones);       \
    }
#define AVX2_FINISH_ROW(r)                                        \
    if (mr > r) {                                                 \
        finish8(p, mode, row + r, col, a##r##0, gate + r * 16);   \
        finish8(p, mode, row + r, col + 8, a##r##1, gate + r * 16 + 8); \
    }

/* One register tile: rows [row, row + mr) x the 16 channels of `panel`, over all of k;
 * its epilogue as `mode` says (gate: [AVX2_MR][16] fp32 values, for the gated modes). */
static inline __attribute__((always_inline)) void tile_avx2(const problem *p, int64_t row,
                                                            int64_t panel, const int mr,
                                                            const int mode, float *gate) {
    const __m256i zero = _mm256_setzero_si256(), ones = _mm256_set1_epi16(1);
    AVX2_ACC_ROW(0); AVX2_ACC_ROW(1); AVX2_ACC_ROW(2); AVX2_ACC_ROW(3);
    const int64_t k = p->k, k4 = k / 4;
    const int8_t *w = p->w + panel * k4 * 64;
    const uint8_t *x = p->x + row * k;
    for (int64_t kk = 0; kk < k4; kk++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + kk * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + kk * 64 + 32));
        const __m256i abs_w0 = _mm256_abs_epi8(w0), abs_w1 = _mm256_abs_epi8(w1);
        AVX2_STEP_ROW(0) AVX2_STEP_ROW(1) AVX2_STEP_ROW(2) AVX2_STEP_ROW(3)
    }
    const int64_t col = panel * 16;
    AVX2_FINISH_ROW(0) AVX2_FINISH_ROW(1) AVX2_FINISH_ROW(2) AVX2_FINISH_ROW(3)
}

/* Rows [row, row + mr) of `panel` - or, with an activation, of the gate/up pair from
 * `panel` - for mr of 1 to AVX2_MR. */
static inline __attribute__((always_inline)) void rows_avx2(const problem *p, int64_t row,
                                                            int64_t panel, const int mr) {
    float gate[AVX2_MR * 16];
    if (p->activation) {
        tile_avx2(p, row, panel, mr, AVX2_KEEP_GATE, gate);
        tile_avx2(p, row, panel + 1, mr, AVX2_APPLY_GATE, gate);
    } else {
        tile_avx2(p, row, panel, mr, AVX2_STORE, gate);
    }
}

/* Rows [0, rows) x panels [first, last) (with an activation, whole gate/up pairs). */
static void panels_all_rows_avx2(const problem *p, int64_t rows, int64_t first, int64_t last) {
    const int64_t step = p->activation ? 2 : 1;
    for (int64_t block = 0; block < rows; block += AVX2_ROW_BLOCK) {
        const int64_t block_end = block + AVX2_ROW_BLOCK < rows ? block + AVX2_ROW_BLOCK : rows;
        for (int64_t panel = first; panel < last; panel += step) {
            int64_t row = block;
            for (; row + AVX2_MR <= block_end; row += AVX2_MR) rows_avx2(p, row, panel, AVX2_MR);
            switch (block_end - row) {
            case 3: rows_avx2(p, row, panel, 3); break;
            case 2: rows_avx2(p, row, panel, 2); break;
            case 1: rows_avx2(p, row, panel, 1); break;
            default: break;
            }
        }
    }
}

#endif
