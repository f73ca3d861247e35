/* fp32 micro-kernels of the paged attention (paged_attention.c): a key block's scores for
 * up to SCORE_ROWS query rows, and a value block's weighted sum for a tile's rows,
 * register-blocked with AVX-512 where the shapes allow (16-token blocks; head_dim 64, 128
 * or 256 for values), with AVX2 and FMA on CPUs without AVX-512 (16-token blocks; head_dim
 * a multiple of 32 for values), and as plain loops for every other shape and CPU.
 *
 * The plain loops keep their sums in memory, which left an AVX2 build (x86-64-v3, the
 * Zen 1 class) far behind the portable path's oneDNN matmuls; the register-blocked AVX2
 * kernels below keep every sum in a register across the block (docs/design.md,
 * "AVX2 attention kernels").
 */
#ifndef TOKENMILL_ATTENTION_FP32_H
#define TOKENMILL_ATTENTION_FP32_H

#include <stdint.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define TM_ATTENTION_AVX2 1
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

#ifdef TM_ATTENTION_AVX2
/* AVX2 has 16 vector registers of 8 floats: a 16-position key block is two vectors per
 * head_dim element, so up to 6 rows (12 accumulators) score it at once. */
#define SCORE_ROWS_AVX2 6

static inline __attribute__((always_inline)) void score_rows_16_avx2(
    const float *restrict q, const int N, const float *restrict kb, float *restrict s,
    int64_t stride, const int64_t head_dim) {
    __m256 acc[2 * SCORE_ROWS_AVX2];
    for (int r = 0; r < 2 * N; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; d++) {
        const __m256 k0 = _mm256_loadu_ps(kb + d * 16), k1 = _mm256_loadu_ps(kb + d * 16 + 8);
        for (int r = 0; r < N; r++) {
            const __m256 qd = _mm256_set1_ps(q[r * head_dim + d]);
            acc[2 * r] = _mm256_fmadd_ps(qd, k0, acc[2 * r]);
            acc[2 * r + 1] = _mm256_fmadd_ps(qd, k1, acc[2 * r + 1]);
        }
    }
    for (int r = 0; r < N; r++) {
        _mm256_storeu_ps(s + r * stride, acc[2 * r]);
        _mm256_storeu_ps(s + r * stride + 8, acc[2 * r + 1]);
    }
}

/* acc[r] += sum_t p[r * stride + t] * v[t] over the m positions of a value block, for N
 * (1 or 2) rows and the 32 channels (four vectors) from `channel`: up to eight
 * accumulators, each of the block's value vectors loaded once for both rows. */
static inline __attribute__((always_inline)) void weigh_rows_avx2(
    const float *restrict p, int64_t stride, const float *restrict vb, int64_t m,
    float *restrict acc, const int N, int64_t head_dim, int64_t channel) {
    __m256 o[8];
    for (int r = 0; r < N; r++)
        for (int c = 0; c < 4; c++)
            o[r * 4 + c] = _mm256_loadu_ps(acc + r * head_dim + channel + c * 8);
    for (int64_t t = 0; t < m; t++) {
        const float *restrict vt = vb + t * head_dim + channel;
        const __m256 p0 = _mm256_set1_ps(p[t]);
        const __m256 p1 = _mm256_set1_ps(p[(N - 1) * stride + t]);
        for (int c = 0; c < 4; c++) {
            const __m256 v = _mm256_loadu_ps(vt + c * 8);
            o[c] = _mm256_fmadd_ps(p0, v, o[c]);
            if (N == 2) o[4 + c] = _mm256_fmadd_ps(p1, v, o[4 + c]);
        }
    }
    for (int r = 0; r < N; r++)
        for (int c = 0; c < 4; c++)
            _mm256_storeu_ps(acc + r * head_dim + channel + c * 8, o[r * 4 + c]);
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
#elif defined(TM_ATTENTION_AVX2)
    if (head_dim % 32 == 0) {
        for (int64_t channel = 0; channel < head_dim; channel += 32) {
            int64_t r = 0;
            for (; r + 2 <= rows; r += 2)
                weigh_rows_avx2(p + r * stride, stride, vb, m, acc + r * head_dim, 2, head_dim,
                                channel);
            if (r < rows)
                weigh_rows_avx2(p + r * stride, stride, vb, m, acc + r * head_dim, 1, head_dim,
                                channel);
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
#elif defined(TM_ATTENTION_AVX2)
    if (block_size == 16) {
        for (int64_t r = 0; r < n; r += SCORE_ROWS_AVX2) {
            const float *qr = q + r * head_dim;
            float *sr = s + r * stride;
            switch (n - r < SCORE_ROWS_AVX2 ? n - r : SCORE_ROWS_AVX2) {
                case 1: score_rows_16_avx2(qr, 1, kb, sr, stride, head_dim); break;
                case 2: score_rows_16_avx2(qr, 2, kb, sr, stride, head_dim); break;
                case 3: score_rows_16_avx2(qr, 3, kb, sr, stride, head_dim); break;
                case 4: score_rows_16_avx2(qr, 4, kb, sr, stride, head_dim); break;
                case 5: score_rows_16_avx2(qr, 5, kb, sr, stride, head_dim); break;
                default: score_rows_16_avx2(qr, 6, kb, sr, stride, head_dim); break;
            }
        }
        return;
    }
#endif
    score_rows_generic(q, n, kb, s, stride, head_dim, block_size);
}

#endif
