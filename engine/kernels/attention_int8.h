/* Attention straight over int8 KV blocks in int16 dot products (AVX512-VNNI; the same
 * functions for AVX2 in attention_int8_avx2.h), for paged_attention.c. The block format
 * and why this path exists: kv_int8.h. The blocks are in the pair layout
 * (attention_bf16.h), so each 32 int8 values sign-extended to int16 are 16 lanes of
 * pairs, as `vpdpwssd` wants them - the same loop shapes as the bf16 path.
 */
#ifndef TOKENMILL_ATTENTION_INT8_H
#define TOKENMILL_ATTENTION_INT8_H

#include "kv_int8.h"

#if defined(HAVE_INT8_DOT) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <string.h>

/* acc += products of int16 pairs (vpdpwssd). Inline assembly for the reason dot4 in
 * int8_linear.c gives: GCC 12's intrinsic copies the accumulator at every use. */
static inline __attribute__((always_inline)) __m512i dot_pairs16(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

static inline __m512 bf16x16_to_ps(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* 16 values of a fp32 or bf16 array, from element i, as fp32. */
static inline __m512 load16(const void *p, int is_bf16, int64_t i) {
    return is_bf16 ? bf16x16_to_ps((const uint16_t *)p + i) : _mm512_loadu_ps((const float *)p + i);
}

static inline __m512i broadcast_pair16(const int16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return _mm512_set1_epi32(pair);
}

/* 16 fp32 values times `factor`, rounded to int16 (saturating) into out. */
static inline void store_int16(__m512 x, __m512 factor, int16_t *out) {
    const __m256i packed = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x, factor)));
    _mm256_storeu_si256((__m256i *)out, packed);
}

/* Query rows [rows, head_dim] (fp32 or bf16) as int16 per group of 32 values: q16 and,
 * per row and group, the scale that gives them back (q ~ q16 * scale, |q16| <= 32767). */
static void quantize_queries_int16(const void *q, int is_bf16, int64_t rows, int64_t head_dim,
                                   int16_t *q16, float *scales) {
    for (int64_t i = 0; i < rows * (head_dim / TM_KV_INT8_GROUP); i++) {
        const __m512 lo = load16(q, is_bf16, i * 32), hi = load16(q, is_bf16, i * 32 + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const __m512 factor = _mm512_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        scales[i] = amax / 32767.f;
        store_int16(lo, factor, q16 + i * 32);
        store_int16(hi, factor, q16 + i * 32 + 16);
    }
}

/* s[r * stride + t] = q[r] . k[:, t] for N int16 query rows over one int8 key block (raw:
 * the softmax applies the attention scale). A group's 16 pair-rows sum in int32; its key
 * scales (one per position) and the row's query scale then apply in fp32. */
static inline __attribute__((always_inline)) void score_rows_int8(
    const int16_t *restrict q, const float *restrict q_scales, const int N,
    const int8_t *restrict block, float *restrict s, int64_t stride, const int64_t head_dim) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP;
    const float *k_scales = (const float *)(block + 16 * head_dim);
    __m512 acc[12];
    for (int r = 0; r < N; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i dot[12];
        for (int r = 0; r < N; r++) dot[r] = _mm512_setzero_si512();
        for (int64_t d = g * 32; d < g * 32 + 32; d += 2) { /* pair-row d / 2: 32 bytes */
            const __m512i k = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(block + d * 16)));
            for (int r = 0; r < N; r++) dot[r] = dot_pairs16(dot[r], k, broadcast_pair16(q + r * head_dim + d));
        }
        const __m512 k_scale = _mm512_loadu_ps(k_scales + g * 16);
        for (int r = 0; r < N; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]),
                                     _mm512_mul_ps(k_scale, _mm512_set1_ps(q_scales[r * groups + g])), acc[r]);
    }
    for (int r = 0; r < N; r++) _mm512_storeu_ps(s + r * stride, acc[r]);
}

#define SCORE_INT8_CASE(N) \
    case N: score_rows_int8(q, q_scales, N, block, s, stride, head_dim); break;

static void score_rows_int8_any(const int16_t *q, const float *q_scales, int64_t n,
                                const int8_t *block, float *s, int64_t stride, int64_t head_dim) {
    switch (n) { /* n <= 12 */
        SCORE_INT8_CASE(1) SCORE_INT8_CASE(2) SCORE_INT8_CASE(3) SCORE_INT8_CASE(4)
        SCORE_INT8_CASE(5) SCORE_INT8_CASE(6) SCORE_INT8_CASE(7) SCORE_INT8_CASE(8)
        SCORE_INT8_CASE(9) SCORE_INT8_CASE(10) SCORE_INT8_CASE(11) SCORE_INT8_CASE(12)
        default: break;
    }
}

/* acc[r] += sum_t w[r][t] v[t] over one int8 value block for N rows, head_dim = 16 * DV.
 * wq holds each row's weights times the value scales as int16, [N][groups][16];
 * w_scales[r * groups + g] turns row r's group g int32 sums back into values. */
static inline __attribute__((always_inline)) void weigh_rows_int8(
    const int16_t *restrict wq, const float *restrict w_scales, const int8_t *restrict block,
    float *restrict acc, const int N, const int DV) {
    const int groups = DV / 2;
    __m512i o[24];
    for (int i = 0; i < N * DV; i++) o[i] = _mm512_setzero_si512();
    for (int t = 0; t < 16; t += 2) /* positions t, t + 1: a pair-row of 2 * head_dim bytes */
        for (int c = 0; c < DV; c++) { /* channels 16c..16c + 15, group c / 2 */
            const __m512i v = _mm512_cvtepi8_epi16(
                _mm256_loadu_si256((const __m256i *)(block + t * DV * 16 + c * 32)));
            for (int r = 0; r < N; r++)
                o[r * DV + c] = dot_pairs16(o[r * DV + c], v, broadcast_pair16(wq + (r * groups + c / 2) * 16 + t));
        }
    for (int r = 0; r < N; r++)
        for (int c = 0; c < DV; c++) {
            float *a = acc + (r * DV + c) * 16;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(o[r * DV + c]),
                                                _mm512_set1_ps(w_scales[r * groups + c / 2]),
                                                _mm512_loadu_ps(a)));
        }
}

/* The weighted sum for `rows` rows of weights (fp32 or bf16, row r at w + r * stride, the
 * block's 16 positions) over one int8 value block whose first m positions are valid (the weights
 * past them are zero). Per row and group, weight x value scale is quantized against its
 * largest over the block, so the block's weights keep ~15 bits however small they are
 * (bf16 weights have 8), and each int32 lane sums at most 16 * 32767 * 127. Scratch: wq
 * for rows * head_dim / 2 int16, w_scales for rows * head_dim / 32 floats. */
static void weigh_block_int8(const void *w, int w_bf16, int64_t stride, const int8_t *block,
                             int64_t m, float *acc, int64_t rows, int64_t head_dim, int16_t *wq,
                             float *w_scales) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP;
    const float *v_scales = (const float *)(block + 16 * head_dim);
    const __mmask16 valid = m >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << m) - 1);
    __m512 scales[TM_MAX_HEAD_DIM / TM_KV_INT8_GROUP];
    for (int64_t g = 0; g < groups; g++) scales[g] = _mm512_maskz_loadu_ps(valid, v_scales + g * 16);
    for (int64_t r = 0; r < rows; r++) {
        const __m512 weights = load16(w, w_bf16, r * stride);
        for (int64_t g = 0; g < groups; g++) {
            const __m512 products = _mm512_mul_ps(weights, scales[g]); /* >= 0 */
            const float largest = _mm512_reduce_max_ps(products);
            w_scales[r * groups + g] = largest / 32767.f;
            store_int16(products, _mm512_set1_ps(largest > 0.f ? 32767.f / largest : 0.f),
                        wq + (r * groups + g) * 16);
        }
    }
    const int dv = (int)(head_dim / 16), step = 24 / dv;
#define WEIGH_INT8(N, DV) \
    weigh_rows_int8(wq + r * groups * 16, w_scales + r * groups, block, acc + r * head_dim, N, DV)
    int64_t r = 0;
    for (; r + step <= rows; r += step) {
        if (dv == 4) WEIGH_INT8(6, 4);
        else if (dv == 8) WEIGH_INT8(3, 8);
        else WEIGH_INT8(1, 16);
    }
    /* The rest - often all of a decoding sequence's G query heads - in one pass too: a
     * pass per row widened the block's values once per row. */
    const int64_t left = rows - r; /* < step; none for dv 16 */
    if (dv == 4) {
        switch (left) {
        case 5: WEIGH_INT8(5, 4); break;
        case 4: WEIGH_INT8(4, 4); break;
        case 3: WEIGH_INT8(3, 4); break;
        case 2: WEIGH_INT8(2, 4); break;
        case 1: WEIGH_INT8(1, 4); break;
        default: break;
        }
    } else if (dv == 8) {
        if (left == 2) WEIGH_INT8(2, 8);
        else if (left == 1) WEIGH_INT8(1, 8);
    }
#undef WEIGH_INT8
}
#elif defined(HAVE_INT8_DOT) /* AVX2 and FMA */
#include "attention_int8_avx2.h"
#endif

#endif
