/* bf16 attention in bf16 dot products (AVX512-BF16), for paged_attention.c.
 *
 * `vdpbf16ps` multiplies pairs of bf16 values and adds both products to an fp32 lane:
 * twice the work of an fp32 FMA per instruction. Its operands must hold the pairs that
 * are summed next to each other, so a bf16 cache that this path reads stores each key
 * block not as [head_dim, 16] but as [head_dim / 2, 16, 2] - elements d and d + 1 of one
 * position side by side - and each value block not as [16, head_dim] but as
 * [8, head_dim, 2] - positions t and t + 1 of one element side by side. The cache writer
 * lays them out so (uses_bf16_pairs says when), and no step re-lays a block it reads
 * (why: docs/design.md, "bf16 attention: the pair layout and AMX tiles"). Scores
 * and the softmax stay fp32; the weights are rounded to bf16 for the weighted sum, as
 * HF's eager attention rounds them. Used for 16-token blocks and head_dim 64, 128 or 256;
 * everything else widens to fp32 from the plain layout.
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
    return is_bf16 && block_size == 16 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
#else
    (void)is_bf16, (void)block_size, (void)head_dim;
    return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16_DOT 1
#include <immintrin.h>
#include <math.h>
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

/* Rows up to which score_blocks scores two key blocks per pass (score_rows_bf16):
 * 2 x 6 accumulators, and from 6 rows one block alone has chains enough. */
#define SCORE_TWO_ROWS 6

static inline __m512bh broadcast_pair(const uint16_t *p) {
    uint32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32((int)pair);
}

/* s[r * stride + t] = q[r] . k[:, t] for N rows of bf16 q ([N, head_dim]) against NB key
 * blocks (1 or 2): pairs0's scores at s, pairs1's at s + 16 (the next block's columns);
 * the softmax applies the scale (softmax_row_bf16). Each score is one chain of head_dim / 2
 * dot products, in the same order either way, so the same bits. Two blocks a pass are for
 * a decoding sequence's few rows (its query heads per kv head: 3 in SmolLM2): one block
 * alone gives the core that many chains of dependent vdpbf16ps, too few to cover the
 * instruction's latency. */
static inline __attribute__((always_inline)) void score_rows_bf16(
    const uint16_t *restrict q, const int N, const int NB, const uint16_t *restrict pairs0,
    const uint16_t *restrict pairs1, float *restrict s, int64_t stride, const int64_t head_dim) {
    const uint16_t *pairs[2] = {pairs0, pairs1};
    __m512 acc[2][12];
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < N; r++) acc[b][r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 2) {
        __m512bh k[2];
        for (int b = 0; b < NB; b++) k[b] = (__m512bh)_mm512_loadu_si512(pairs[b] + d * 16);
        for (int r = 0; r < N; r++) {
            const __m512bh qr = broadcast_pair(q + r * head_dim + d);
            for (int b = 0; b < NB; b++) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], k[b], qr);
        }
    }
    for (int b = 0; b < NB; b++)
        for (int r = 0; r < N; r++) _mm512_storeu_ps(s + r * stride + b * 16, acc[b][r]);
}

#define SCORE_BF16_CASE(N) \
    case N: score_rows_bf16(q, N, 1, pairs, pairs, s, stride, head_dim); break;

static void score_rows_bf16_any(const uint16_t *q, int64_t n, const uint16_t *pairs, float *s,
                                int64_t stride, int64_t head_dim) {
    switch (n) { /* n <= 12 */
        SCORE_BF16_CASE(1) SCORE_BF16_CASE(2) SCORE_BF16_CASE(3) SCORE_BF16_CASE(4)
        SCORE_BF16_CASE(5) SCORE_BF16_CASE(6) SCORE_BF16_CASE(7) SCORE_BF16_CASE(8)
        SCORE_BF16_CASE(9) SCORE_BF16_CASE(10) SCORE_BF16_CASE(11) SCORE_BF16_CASE(12)
        default: break;
    }
}

#define SCORE_TWO_CASE(N) \
    case N: score_rows_bf16(q, N, 2, pairs0, pairs1, s, stride, head_dim); break;

/* score_rows_bf16_any over two adjacent blocks of a walk, for n <= SCORE_TWO_ROWS. */
static void score_two_blocks_bf16_any(const uint16_t *q, int64_t n, const uint16_t *pairs0,
                                      const uint16_t *pairs1, float *s, int64_t stride,
                                      int64_t head_dim) {
    switch (n) {
        SCORE_TWO_CASE(1) SCORE_TWO_CASE(2) SCORE_TWO_CASE(3)
        SCORE_TWO_CASE(4) SCORE_TWO_CASE(5) SCORE_TWO_CASE(6)
        default: break;
    }
}

/* The largest of s[lo, hi): four running maxima, so the loads are not one dependency
 * chain (scores just stored by the tiles come from L2). hi > lo. */
static inline float max_of(const float *s, int64_t lo, int64_t hi) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int64_t t = lo;
    for (; t + 64 <= hi; t += 64) {
        m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + t));
        m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + t + 16));
        m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + t + 32));
        m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + t + 48));
    }
    for (; t + 16 <= hi; t += 16) m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + t));
    if (t < hi) {
        const __mmask16 tail = (__mmask16)((1u << (hi - t)) - 1);
        m1 = _mm512_mask_max_ps(m1, tail, m1, _mm512_maskz_loadu_ps(tail, s + t));
    }
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

/* One row's exact softmax over the raw scores s[lo, seen), times `scale` first, as the
 * bf16 weights w[from, padded): zero outside [lo, seen); `sink` is one more logit in the
 * denominator (-INFINITY: none). s[lo, seen) is left holding the
 * unnormalised exponentials. Scaling here rather than in every score saves the tiles'
 * scores a pass, and each weight is normalised and rounded to bf16 in one step, with no
 * fp32 probabilities written back. */
static void softmax_row_bf16(float *restrict s, uint16_t *restrict w, int64_t from, int64_t lo,
                             int64_t seen, int64_t padded, float scale, float sink) {
    const float scaled_max = max_of(s, lo, seen) * scale;
    const float shift = sink > scaled_max ? sink : scaled_max;
    float sum = expf(sink - shift); /* 0 without a sink */
    for (int64_t t = lo; t < seen; t++) { /* vectorised, with glibc's vector expf */
        const float e = expf(s[t] * scale - shift);
        s[t] = e;
        sum += e;
    }
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    memset(w + from, 0, sizeof(uint16_t) * (size_t)(lo - from));
    int64_t t = lo;
    for (; t + 16 <= seen; t += 16)
        _mm256_storeu_si256((__m256i *)(w + t),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + t), inv)));
    if (t < seen) {
        const __mmask16 tail = (__mmask16)((1u << (seen - t)) - 1);
        const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + t), inv);
        _mm256_mask_storeu_epi16(w + t, tail, (__m256i)_mm512_cvtneps_pbh(p));
    }
    memset(w + seen, 0, sizeof(uint16_t) * (size_t)(padded - seen));
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
        else if (dv == 8) weigh_rows_bf16(p + r * stride, stride, pairs, acc + r * head_dim, 3, 8);
        else weigh_rows_bf16(p + r * stride, stride, pairs, acc + r * head_dim, 1, 16);
    }
    for (; r < rows; r++) {
        if (dv == 4) weigh_rows_bf16(p + r * stride, stride, pairs, acc + r * head_dim, 1, 4);
        else if (dv == 8) weigh_rows_bf16(p + r * stride, stride, pairs, acc + r * head_dim, 1, 8);
    }
}
#endif

#endif
