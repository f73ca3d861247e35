/* fp32 micro-kernels of the paged attention (paged_attention.c): a key block's scores for
 * up to SCORE_ROWS query rows, and a value block's weighted sum for a tile's rows,
 * register-blocked with AVX-512 where the shapes allow (16-token blocks; head_dim 64, 128
 * or 256 for values) and as plain loops for every other shape and CPU.
 */
#ifndef TOKENMILL_ATTENTION_FP32_H
#define TOKENMILL_ATTENTION_FP32_H

#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Rows per register block of the scoring micro-kernel: 12 independent FMA chains
 * cover the FMA latency on both pipes. */
#define SCORE_ROWS 12

/* Scores of n (<= SCORE_ROWS) query rows against one key block:
 * s[r * stride + t] = q[r] . k[:, t]. The block is [head_dim, block_size]. */
static inline __attribute__((always_inline)) void score_rows_generic(
    const float *restrict q, int64_t n, const float *restrict kb, float *restrict s,
    int64_t stride, int64_t head_dim, int64_t block_size) {
    for (int64_t r = 0; r < n; r++) {
        float *restrict sr = s + r * stride;
        for (int64_t t = 0; t < block_size; t++) sr[t] = 0.f;
        for (int64_t d = 0; d < head_dim; d++) {
            const float qd = q[r * head_dim + d];
            const float *restrict kd = kb + d * block_size;
            for (int64_t t = 0; t < block_size; t++) sr[t] += qd * kd[t];
        }
    }
}

#ifdef __AVX512F__
/* One key block of 16 positions is one vector per head_dim element: each row keeps one
 * accumulator, fed by a broadcast of its q element. N is a compile-time constant in
 * every call, so the accumulators are registers. */
static inline __attribute__((always_inline)) void score_rows_16(
    const float *restrict q, const int N, const float *restrict kb, float *restrict s,
    int64_t stride, const int64_t head_dim) {
    __m512 acc[SCORE_ROWS];
    for (int r = 0; r < N; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d++) {
        const __m512 k = _mm512_loadu_ps(kb + d * 16);
        for (int r = 0; r < N; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * head_dim + d]), k, acc[r]);
    }
    for (int r = 0; r < N; r++) _mm512_storeu_ps(s + r * stride, acc[r]);
}

/* acc[r] += sum_t p[r * stride + t] * v[t] over the m positions of a value block
 * ([block_size, head_dim], token-major), for N rows, head_dim = 16 * DV. Each row's
 * output is DV vectors held in registers across the block. */
static inline __attribute__((always_inline)) void weigh_rows_vec(
    const float *restrict p, int64_t stride, const float *restrict vb, int64_t m,
    float *restrict acc, const int N, const int DV) {
    __m512 o[24];
    for (int r = 0; r < N; r++)
        for (int c = 0; c < DV; c++) o[r * DV + c] = _mm512_loadu_ps(acc + (r * DV + c) * 16);
    for (int64_t t = 0; t < m; t++) {
        const float *restrict vt = vb + t * DV * 16;
        for (int c = 0; c < DV; c++) {
            const __m512 v = _mm512_loadu_ps(vt + c * 16);
            for (int r = 0; r < N; r++)
                o[r * DV + c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * stride + t]), v, o[r * DV + c]);
        }
    }
    for (int r = 0; r < N; r++)
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(acc + (r * DV + c) * 16, o[r * DV + c]);
}
#endif

static inline __attribute__((always_inline)) void weigh_rows_generic(
    const float *restrict p, int64_t stride, const float *restrict vb, int64_t m,
    float *restrict acc, int64_t n, int64_t head_dim) {
    for (int64_t r = 0; r < n; r++) {
        float *restrict ar = acc + r * head_dim;
        for (int64_t t = 0; t < m; t++) {
            const float pt = p[r * stride + t];
            const float *restrict vt = vb + t * head_dim;
            for (int64_t i = 0; i < head_dim; i++) ar[i] += pt * vt[i];
        }
    }
}

/* The weighted sum for all `rows` rows of a tile over one value block, in register
 * blocks of as many rows as 24 vector accumulators hold. */
static void weigh_block(const float *p, int64_t stride, const float *vb, int64_t m, float *acc,
                        int64_t rows, int64_t head_dim) {
#ifdef __AVX512F__
    if (head_dim == 64 || head_dim == 128 || head_dim == 256) {
        const int dv = (int)(head_dim / 16), step = 24 / dv;
        int64_t r = 0;
        for (; r + step <= rows; r += step) {
            if (dv == 4) weigh_rows_vec(p + r * stride, stride, vb, m, acc + r * head_dim, 6, 4);
            else if (dv == 8) weigh_rows_vec(p + r * stride, stride, vb, m, acc + r * head_dim, 3, 8);
            else weigh_rows_vec(p + r * stride, stride, vb, m, acc + r * head_dim, 1, 16);
        }
        for (; r < rows; r++) { /* the tile's last few rows */
            if (dv == 4) weigh_rows_vec(p + r * stride, stride, vb, m, acc + r * head_dim, 1, 4);
            else if (dv == 8) weigh_rows_vec(p + r * stride, stride, vb, m, acc + r * head_dim, 1, 8);
        }
        return;
    }
#endif
    weigh_rows_generic(p, stride, vb, m, acc, rows, head_dim);
}

#define SCORE_CASE(N) \
    case N: score_rows_16(q, N, kb, s, stride, head_dim); return;

/* Scores of n (<= SCORE_ROWS) rows against one key block, register-blocked where the
 * shape allows. */
static void score_rows(const float *q, int64_t n, const float *kb, float *s, int64_t stride,
                       int64_t head_dim, int64_t block_size) {
#ifdef __AVX512F__
    if (block_size == 16) {
        switch (n) {
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4)
            SCORE_CASE(5) SCORE_CASE(6) SCORE_CASE(7) SCORE_CASE(8)
            SCORE_CASE(9) SCORE_CASE(10) SCORE_CASE(11) SCORE_CASE(12)
            default: break;
        }
    }
#endif
    score_rows_generic(q, n, kb, s, stride, head_dim, block_size);
}

#endif
