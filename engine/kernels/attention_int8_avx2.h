/* attention_int8.h's direct path for CPUs with AVX2 and FMA but no AVX512-VNNI (the Zen 1
 * to Zen 3 class): the same functions with the same results, in 256-bit vectors, where
 * `vpmaddwd` multiplies the int16 pairs and a `vpaddd` sums them (what vpdpwssd fuses).
 * Included by attention_int8.h only; see it and kv_int8.h for the format.
 */
#ifndef TOKENMILL_ATTENTION_INT8_AVX2_H
#define TOKENMILL_ATTENTION_INT8_AVX2_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kv_int8.h"

static inline __m256i broadcast_pair16(const int16_t *p) {
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    return _mm256_set1_epi32(pair);
}

/* 16 values of a fp32 or bf16 array, from element i, as fp32 (two vectors). */
static inline void load16(const void *p, int is_bf16, int64_t i, __m256 *lo, __m256 *hi) {
    if (!is_bf16) {
        *lo = _mm256_loadu_ps((const float *)p + i);
        *hi = _mm256_loadu_ps((const float *)p + i + 8);
        return;
    }
    const __m128i *h = (const __m128i *)((const uint16_t *)p + i);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h)), 16));
    *hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(h + 1)), 16));
}

static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* 16 fp32 values (two vectors) times `factor`, rounded to int16 (saturating) into out. */
static inline void store_int16(__m256 lo, __m256 hi, __m256 factor, int16_t *out) {
    const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(lo, factor));
    const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(hi, factor));
    /* packs works within 128-bit lanes: a0-3 b0-3 a4-7 b4-7; put them back in order */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    _mm256_storeu_si256((__m256i *)out, packed);
}

static void quantize_queries_int16(const void *q, int is_bf16, int64_t rows, int64_t head_dim,
                                   int16_t *q16, float *scales) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t i = 0; i < rows * (head_dim / TM_KV_INT8_GROUP); i++) {
        __m256 v[4];
        load16(q, is_bf16, i * 32, &v[0], &v[1]);
        load16(q, is_bf16, i * 32 + 16, &v[2], &v[3]);
        __m256 m = _mm256_andnot_ps(sign, v[0]);
        for (int j = 1; j < 4; j++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
        const float amax = max8(m);
        const __m256 factor = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        scales[i] = amax / 32767.f;
        store_int16(v[0], v[1], factor, q16 + i * 32);
        store_int16(v[2], v[3], factor, q16 + i * 32 + 16);
    }
}

/* N <= 4 rows of attention_int8.h's score_rows_int8: each pair-row's 32 int8 values are
 * positions 0-7 and 8-15 as two vectors of int16 pairs. */
static inline __attribute__((always_inline)) void score_rows_int8_avx2(
    const int16_t *restrict q, const float *restrict q_scales, const int N,
    const int8_t *restrict block, float *restrict s, int64_t stride, const int64_t head_dim) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP;
    const float *k_scales = (const float *)(block + 16 * head_dim);
    __m256 acc[8];
    for (int i = 0; i < 2 * N; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256i dot[8];
        for (int i = 0; i < 2 * N; i++) dot[i] = _mm256_setzero_si256();
        for (int64_t d = g * 32; d < g * 32 + 32; d += 2) {
            const __m128i *row = (const __m128i *)(block + d * 16);
            const __m256i k0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(row));
            const __m256i k1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(row + 1));
            for (int r = 0; r < N; r++) {
                const __m256i qp = broadcast_pair16(q + r * head_dim + d);
                dot[2 * r] = _mm256_add_epi32(dot[2 * r], _mm256_madd_epi16(k0, qp));
                dot[2 * r + 1] = _mm256_add_epi32(dot[2 * r + 1], _mm256_madd_epi16(k1, qp));
            }
        }
        const __m256 ks0 = _mm256_loadu_ps(k_scales + g * 16), ks1 = _mm256_loadu_ps(k_scales + g * 16 + 8);
        for (int r = 0; r < N; r++) {
            const __m256 qs = _mm256_set1_ps(q_scales[r * groups + g]);
            acc[2 * r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[2 * r]), _mm256_mul_ps(ks0, qs), acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[2 * r + 1]), _mm256_mul_ps(ks1, qs), acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < N; r++) {
        _mm256_storeu_ps(s + r * stride, acc[2 * r]);
        _mm256_storeu_ps(s + r * stride + 8, acc[2 * r + 1]);
    }
}

static void score_rows_int8_any(const int16_t *q, const float *q_scales, int64_t n,
                                const int8_t *block, float *s, int64_t stride, int64_t head_dim) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP;
    for (int64_t r = 0; r < n; r += 4) {
        const int64_t m = n - r < 4 ? n - r : 4;
        const int16_t *qr = q + r * head_dim;
        const float *sr = q_scales + r * groups;
        switch (m) {
        case 1: score_rows_int8_avx2(qr, sr, 1, block, s + r * stride, stride, head_dim); break;
        case 2: score_rows_int8_avx2(qr, sr, 2, block, s + r * stride, stride, head_dim); break;
        case 3: score_rows_int8_avx2(qr, sr, 3, block, s + r * stride, stride, head_dim); break;
        default: score_rows_int8_avx2(qr, sr, 4, block, s + r * stride, stride, head_dim); break;
        }
    }
}

/* N rows (N <= 4) of the weighted sum over one int8 value block, from wq and w_scales as
 * weigh_block_int8 fills them: each 16 channels of a pair-row are two vectors of int16
 * pairs (channels 0-7 and 8-15, positions t and t + 1), widened once for all N rows. */
static inline __attribute__((always_inline)) void weigh_rows_int8_avx2(
    const int16_t *restrict wq, const float *restrict w_scales, const int8_t *restrict block,
    float *restrict acc, const int N, int64_t head_dim) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP;
    for (int64_t c = 0; c < head_dim / 16; c++) { /* channels 16c..16c + 15, group c / 2 */
        __m256i s0[4], s1[4];
        for (int r = 0; r < N; r++) s0[r] = s1[r] = _mm256_setzero_si256();
        for (int t = 0; t < 16; t += 2) {
            const __m128i *v = (const __m128i *)(block + t * head_dim + c * 32);
            const __m256i v0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(v));
            const __m256i v1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(v + 1));
            for (int r = 0; r < N; r++) {
                const __m256i wp = broadcast_pair16(wq + (r * groups + c / 2) * 16 + t);
                s0[r] = _mm256_add_epi32(s0[r], _mm256_madd_epi16(v0, wp));
                s1[r] = _mm256_add_epi32(s1[r], _mm256_madd_epi16(v1, wp));
            }
        }
        for (int r = 0; r < N; r++) {
            const __m256 scale = _mm256_set1_ps(w_scales[r * groups + c / 2]);
            float *a = acc + r * head_dim + c * 16;
            _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[r]), scale, _mm256_loadu_ps(a)));
            _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[r]), scale, _mm256_loadu_ps(a + 8)));
        }
    }
}

/* attention_int8.h's weigh_block_int8, in AVX2: the weights quantized per row and group,
 * then the rows four at a time. */
static void weigh_block_int8(const void *w, int w_bf16, int64_t stride, const int8_t *block,
                             int64_t m, float *acc, int64_t rows, int64_t head_dim, int16_t *wq,
                             float *w_scales) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP;
    const float *v_scales = (const float *)(block + 16 * head_dim);
    __m256 scales[2 * TM_MAX_HEAD_DIM / TM_KV_INT8_GROUP];
    for (int64_t g = 0; g < groups; g++)
        for (int h = 0; h < 2; h++) { /* positions past m do not count */
            float valid[8];
            for (int i = 0; i < 8; i++) valid[i] = h * 8 + i < m ? v_scales[g * 16 + h * 8 + i] : 0.f;
            scales[2 * g + h] = _mm256_loadu_ps(valid);
        }
    for (int64_t r = 0; r < rows; r++) {
        __m256 lo, hi;
        load16(w, w_bf16, r * stride, &lo, &hi);
        for (int64_t g = 0; g < groups; g++) {
            const __m256 plo = _mm256_mul_ps(lo, scales[2 * g]), phi = _mm256_mul_ps(hi, scales[2 * g + 1]);
            const float largest = max8(_mm256_max_ps(plo, phi)); /* products >= 0 */
            w_scales[r * groups + g] = largest / 32767.f;
            store_int16(plo, phi, _mm256_set1_ps(largest > 0.f ? 32767.f / largest : 0.f),
                        wq + (r * groups + g) * 16);
        }
    }
    for (int64_t r = 0; r < rows; r += 4) {
        const int16_t *wr = wq + r * groups * 16;
        const float *sr = w_scales + r * groups;
        float *ar = acc + r * head_dim;
        switch (rows - r < 4 ? rows - r : 4) {
        case 1: weigh_rows_int8_avx2(wr, sr, block, ar, 1, head_dim); break;
        case 2: weigh_rows_int8_avx2(wr, sr, block, ar, 2, head_dim); break;
        case 3: weigh_rows_int8_avx2(wr, sr, block, ar, 3, head_dim); break;
        default: weigh_rows_int8_avx2(wr, sr, block, ar, 4, head_dim); break;
        }
    }
}

#endif
