/* One row through a bf16 linear layer whose weight oneDNN has packed
 * (engine/quant/packed_linear.py; layout in kernels.h, tm_packed_matvec).
 *
 * A one-sequence decode step is 121 linear calls of one row each (SmolLM2): every call
 * reads its whole weight once, so the step is as fast as the weights stream from memory.
 * oneDNN's matmul reads the smaller ones at about 15 GB/s where the memory gives 22
 * (docs/design.md, "One-row linear layers"). This reads the weight oneDNN packed
 * where it lies - no second copy - front to back in one pass per thread: each thread
 * takes a contiguous range of output blocks, each block a contiguous
 * [k / 2][block_cols][2] run, and multiplies pairs of k with vdpbf16ps (the packed
 * layout is the pair layout that instruction takes). Builds without AVX512-BF16 run plain
 * loops that compute the same sums; the engine uses oneDNN there (tm_limits reports
 * which).
 */
#include <stdint.h>
#include <string.h>

#include "kernel_common.h"
#include "kernels.h"

/* Below this many weight bytes a call is a few microseconds: not worth waking threads. */
#define MATVEC_PARALLEL_MIN_BYTES (256 * 1024)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MATVEC_VECTOR 1
/* How far ahead of the loads the prefetches ask, in pairs of k: the hardware prefetcher
 * alone left a call waiting on each new page of the block. */
#define PREFETCH_PAIRS 16

/* x's pair of values (2p, 2p + 1) in all 16 lanes. */
static inline __m512bh pair_of(const uint16_t *x, int64_t p) {
    int32_t both;
    memcpy(&both, x + 2 * p, sizeof both);
    return (__m512bh)_mm512_set1_epi32(both);
}

/* One block of `vectors` x 16 outputs: two sets of sums (even and odd pairs of k) so
 * consecutive vdpbf16ps do not wait on each other. */
static inline __attribute__((always_inline)) void block_vector(
    const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t pairs,
    const int vectors) {
    const int64_t row = (int64_t)vectors * 32; /* values per pair of k */
    __m512 even[4], odd[4];
    for (int v = 0; v < vectors; v++) even[v] = odd[v] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 2 <= pairs; p += 2) {
        const uint16_t *at = w + p * row;
        for (int64_t b = 0; b < 2 * row; b += 32) _mm_prefetch((const char *)(at + PREFETCH_PAIRS * row + b), _MM_HINT_T0);
        const __m512bh x0 = pair_of(x, p), x1 = pair_of(x, p + 1);
        for (int v = 0; v < vectors; v++) {
            even[v] = _mm512_dpbf16_ps(even[v], x0, (__m512bh)_mm512_loadu_si512(at + v * 32));
            odd[v] = _mm512_dpbf16_ps(odd[v], x1, (__m512bh)_mm512_loadu_si512(at + row + v * 32));
        }
    }
    if (p < pairs) {
        const uint16_t *at = w + p * row;
        const __m512bh x0 = pair_of(x, p);
        for (int v = 0; v < vectors; v++)
            even[v] = _mm512_dpbf16_ps(even[v], x0, (__m512bh)_mm512_loadu_si512(at + v * 32));
    }
    for (int v = 0; v < vectors; v++) {
        __m512 sum = _mm512_add_ps(even[v], odd[v]);
        if (bias) {
            const __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(bias + v * 16)));
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)));
        }
        _mm256_storeu_si256((__m256i *)(y + v * 16), (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

static void block(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                  int64_t pairs, int64_t block_cols) {
    switch (block_cols) {
    case 16: block_vector(x, w, bias, y, pairs, 1); break;
    case 32: block_vector(x, w, bias, y, pairs, 2); break;
    default: block_vector(x, w, bias, y, pairs, 4); break;
    }
}
#else
#define MATVEC_VECTOR 0

static void block(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                  int64_t pairs, int64_t block_cols) {
    for (int64_t c = 0; c < block_cols; c++) {
        float sum = 0.0f;
        for (int64_t p = 0; p < pairs; p++) {
            const uint16_t *pair = w + (p * block_cols + c) * 2;
            sum += bf16_to_f32(x[2 * p]) * bf16_to_f32(pair[0]);
            sum += bf16_to_f32(x[2 * p + 1]) * bf16_to_f32(pair[1]);
        }
        if (bias) sum += bf16_to_f32(bias[c]);
        y[c] = f32_to_bf16(sum);
    }
}
#endif

int tm_packed_matvec_vector(void) { return MATVEC_VECTOR; }

int tm_packed_matvec(const tm_packed_matvec_args *a) {
    const int64_t bc = a->block_cols;
    if ((bc != 16 && bc != 32 && bc != 64) || a->in_features < 2 || a->in_features % 2 ||
        a->out_features < bc || a->out_features % bc)
        return TM_UNSUPPORTED_SHAPE;
    const uint16_t *x = a->x, *w = a->w, *bias = a->bias;
    uint16_t *y = a->y;
    const int64_t pairs = a->in_features / 2, blocks = a->out_features / bc;
    const int parallel = a->num_threads > 1 && blocks > 1 &&
                         a->in_features * a->out_features * 2 >= MATVEC_PARALLEL_MIN_BYTES;
    /* static: each thread one contiguous stretch of the weight, read front to back */
#pragma omp parallel for schedule(static) num_threads(a->num_threads) if (parallel)
    for (int64_t b = 0; b < blocks; b++)
        block(x, w + b * pairs * bc * 2, bias ? bias + b * bc : NULL, y + b * bc, pairs, bc);
    return TM_OK;
}
