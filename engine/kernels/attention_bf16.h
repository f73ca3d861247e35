/* bf16 attention in bf16 dot products (AVX512-BF16), for paged_attention.c.
 *
 * `vdpbf16ps` multiplies pairs of bf16 values and adds both products to an fp32 lane:
 * twice the work of an fp32 FMA per instruction. Its operands must hold the pairs that
 * are summed next to each other, so a bf16 cache that this path reads stores each key
 * block not as [head_dim, 16] but as [head_dim / 2, 16, 2] - elements d and d + 1 of one
 * position side by side - and each value block not as [16, head_dim] but as
 * [8, head_dim, 2] - positions t and t + 1 of one element side by side. The cache writer
 * lays them out so (uses_bf16_pairs says when); until 2026-12 every step re-laid every
 * block it read, about a third of a decode step's attention. Scores and the softmax stay
 * fp32; the weights are rounded to bf16 for the weighted sum, as HF's eager attention
 * rounds them. Used for 16-token blocks and head_dim 64 or 128; everything else widens
 * to fp32 from the plain layout.
 */
#ifndef TOKENMILL_ATTENTION_BF16_H
#define TOKENMILL_ATTENTION_BF16_H

#include <stdint.h>

/* Whether a cache of this type and shape is attended to with bf16 dot products - and so
 * stored in their pair layout (tm_write_kv_cache writes it; see paged_attention.c):
 * keys [head_dim / 2, 16, 2], values [8, head_dim, 2] per block, so that no step re-lays
 * a block before its dot products. */
static inline int uses_bf16_pairs(int is_bf16, int64_t block_size, int64_t head_dim) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    return is_bf16 && block_size == 16 && (head_dim == 64 || head_dim == 128);
#else
    (void)is_bf16, (void)block_size, (void)head_dim;
    return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16_DOT 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* A value block already stored as pairs whose positions at and past m (< 16) must read
 * as zeros (the cache past a sequence's last token holds whatever was there): copy it
 * with those positions cleared. */
static inline void value_pairs_head(const uint16_t *vp, int64_t m, int64_t head_dim,
                                    uint16_t *pairs) {
    for (int64_t t = 0; t < 16; t += 2) {
        const uint16_t *src = vp + t * head_dim;
        uint16_t *dst = pairs + t * head_dim;
        if (t + 1 < m) {
            memcpy(dst, src, sizeof(uint16_t) * (size_t)(2 * head_dim));
        } else if (t < m) { /* keep the even position of each pair, clear the odd one */
            for (int64_t c = 0; c < head_dim; c++) dst[2 * c] = src[2 * c], dst[2 * c + 1] = 0;
        } else {
            memset(dst, 0, sizeof(uint16_t) * (size_t)(2 * head_dim));
        }
    }
}

static inline __m512bh broadcast_pair(const uint16_t *p) {
    uint32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32((int)pair);
}

/* s[r * stride + t] = scale * q[r] . k[:, t] for N rows of bf16 q ([N, head_dim]). */
static inline __attribute__((always_inline)) void score_rows_bf16(
    const uint16_t *restrict q, const int N, const uint16_t *restrict pairs, float *restrict s,
    int64_t stride, const int64_t head_dim, float scale) {
    __m512 acc[12];
    for (int r = 0; r < N; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 2) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(pairs + d * 16);
        for (int r = 0; r < N; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], k, broadcast_pair(q + r * head_dim + d));
    }
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int r = 0; r < N; r++) _mm512_storeu_ps(s + r * stride, _mm512_mul_ps(acc[r], scaled));
}

#define SCORE_BF16_CASE(N) \
    case N: score_rows_bf16(q, N, pairs, s, stride, head_dim, scale); break;

static void score_rows_bf16_any(const uint16_t *q, int64_t n, const uint16_t *pairs, float *s,
                                int64_t stride, int64_t head_dim, float scale) {
    switch (n) { /* n <= 12 */
        SCORE_BF16_CASE(1) SCORE_BF16_CASE(2) SCORE_BF16_CASE(3) SCORE_BF16_CASE(4)
        SCORE_BF16_CASE(5) SCORE_BF16_CASE(6) SCORE_BF16_CASE(7) SCORE_BF16_CASE(8)
        SCORE_BF16_CASE(9) SCORE_BF16_CASE(10) SCORE_BF16_CASE(11) SCORE_BF16_CASE(12)
        default: break;
    }
}

/* acc[r] += sum_t p[r][t] v[t] over one value block's pairs, for N rows of bf16 weights
 * (row r at p + r * stride), head_dim = 16 * DV. */
static inline __attribute__((always_inline)) void weigh_rows_bf16(
    const uint16_t *restrict p, int64_t stride, const uint16_t *restrict pairs,
    float *restrict acc, const int N, const int DV) {
    __m512 o[24];
    for (int r = 0; r < N; r++)
        for (int c = 0; c < DV; c++) o[r * DV + c] = _mm512_loadu_ps(acc + (r * DV + c) * 16);
    for (int t = 0; t < 16; t += 2) {
        for (int c = 0; c < DV; c++) {
            const __m512bh v = (__m512bh)_mm512_loadu_si512(pairs + (t * DV * 16 + c * 32));
            for (int r = 0; r < N; r++)
                o[r * DV + c] = _mm512_dpbf16_ps(o[r * DV + c], v, broadcast_pair(p + r * stride + t));
        }
    }
    for (int r = 0; r < N; r++)
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(acc + (r * DV + c) * 16, o[r * DV + c]);
}

/* The weighted sum for `rows` rows over one value block's pairs. */
static void weigh_block_bf16(const uint16_t *p, int64_t stride, const uint16_t *pairs,
                             float *acc, int64_t rows, int64_t head_dim) {
    const int dv = (int)(head_dim / 16), step = 24 / dv;
    int64_t r = 0;
    for (; r + step <= rows; r += step) {
        if (dv == 4) weigh_rows_bf16(p + r * stride, stride, pairs, acc + r * head_dim, 6, 4);
        else weigh_rows_bf16(p + r * stride, stride, pairs, acc + r * head_dim, 3, 8);
    }
    for (; r < rows; r++) {
        if (dv == 4) weigh_rows_bf16(p + r * stride, stride, pairs, acc + r * head_dim, 1, 4);
        else weigh_rows_bf16(p + r * stride, stride, pairs, acc + r * head_dim, 1, 8);
    }
}
#endif

#endif
