/* Greedy decoding's argmax over each row of fp32 logits (kernels.h, tm_argmax_rows).
 *
 * PyTorch's CPU argmax walks a row one value at a time, several times slower than
 * reading the row (docs/design.md, "Fused elementwise ops and the native argmax").
 * Here a row is scanned with vector max and compare: one pass for its largest value (and
 * whether it holds a NaN), then a pass for the first position of that value, which stops
 * there.
 * Only comparisons: exact, whatever the flags.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

/* Below this many values a call is a few microseconds: not worth waking threads. */
#define ARGMAX_PARALLEL_MIN 65536

/* torch.argmax's answer for one row: the first NaN if any, else the first largest value
 * (-0.0 and 0.0 tie; a row of -inf answers 0). */
static int64_t argmax_row(const float *x, int64_t n) {
    float best = -INFINITY;
    int has_nan = 0;
    int64_t i = 0;
#ifdef __AVX2__
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __m256 nan = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        const __m256 c = _mm256_loadu_ps(x + i + 16), d = _mm256_loadu_ps(x + i + 24);
        /* max_ps(v, m) keeps m where v is NaN; NaNs are tracked apart */
        m0 = _mm256_max_ps(a, m0), m1 = _mm256_max_ps(b, m1);
        m2 = _mm256_max_ps(c, m2), m3 = _mm256_max_ps(d, m3);
        nan = _mm256_or_ps(nan, _mm256_or_ps(_mm256_cmp_ps(a, b, _CMP_UNORD_Q),
                                             _mm256_cmp_ps(c, d, _CMP_UNORD_Q)));
    }
    m0 = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
    float lanes[8];
    _mm256_storeu_ps(lanes, m0);
    for (int l = 0; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    has_nan = _mm256_movemask_ps(nan) != 0;
#endif
    for (; i < n; i++) {
        if (x[i] != x[i]) has_nan = 1;
        else if (x[i] > best) best = x[i];
    }
    int64_t j = 0;
    if (has_nan) {
        while (x[j] == x[j]) j++;
        return j;
    }
#ifdef __AVX2__
    const __m256 target = _mm256_set1_ps(best);
    for (; j + 8 <= n; j += 8) {
        const __m256 equal = _mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ);
        const int hits = _mm256_movemask_ps(equal);
        if (hits) return j + __builtin_ctz((unsigned)hits);
    }
#endif
    while (x[j] != best) j++;
    return j;
}

int tm_argmax_rows(const tm_argmax_args *a) {
    if (a->n < 1) return TM_UNSUPPORTED_SHAPE;
#pragma omp parallel for schedule(static) num_threads(a->num_threads) \
    if (a->num_threads > 1 && a->rows > 1 && a->rows * a->n >= ARGMAX_PARALLEL_MIN)
    for (int64_t r = 0; r < a->rows; r++) a->out[r] = argmax_row(a->x + r * a->n, a->n);
    return TM_OK;
}
