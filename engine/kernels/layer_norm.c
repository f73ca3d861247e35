/* Residual add then LayerNorm in one pass over the rows (tm_add_layer_norm, kernels.h):
 * the SigLIP tower's sum = matmul output + residual and the next LayerNorm of that sum.
 *
 * In the tower each sublayer's output is added to its residual and the sum normalised by
 * the next LayerNorm; as PyTorch ops that is the add (often a oneDNN post-op of the
 * matmul) and a LayerNorm that reads the sum back. Here a row is added, rounded to the
 * dtype as PyTorch's add rounds it, stored, and normalised from the fp32 copy of that
 * rounded row while it is in cache: one read of the two inputs, two writes.
 *
 * The normalisation runs in fp32 as PyTorch's CPU LayerNorm does for bf16 (mean, then the
 * variance of the centred row, two passes over the row in cache), (x - mean) * rstd *
 * weight + bias, rounded to the dtype once. Its sums add in another order than ATen's,
 * so results agree with PyTorch's to an ulp or so of the dtype, not bit for bit.
 */
#include <math.h>
#include <stdint.h>

#include "kernel_common.h"
#include "kernels.h"

/* A pass under this many values is too short to be worth waking threads. */
#define PARALLEL_MIN_ELEMENTS 16384

static inline float load_value(const void *p, int is_bf16, int64_t i) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_value(void *p, int is_bf16, int64_t i, float v) {
    if (is_bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* The sum of n floats in 16 interleaved lanes (vectorised without reassociation flags). */
static float lane_sum(const float *x, int64_t n) {
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] += x[i + l];
    float total = 0.0f;
    for (; i < n; i++) total += x[i];
    for (int l = 0; l < 16; l++) total += lanes[l];
    return total;
}

/* The sum of (x - mean)^2 over n floats, laned as lane_sum. */
static float lane_centred_squares(const float *x, int64_t n, float mean) {
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) {
            const float d = x[i + l] - mean;
            lanes[l] += d * d;
        }
    float total = 0.0f;
    for (; i < n; i++) total += (x[i] - mean) * (x[i] - mean);
    for (int l = 0; l < 16; l++) total += lanes[l];
    return total;
}

int tm_add_layer_norm(const tm_layer_norm_args *a) {
    const int64_t rows = a->rows, dim = a->dim;
    const int is_bf16 = a->is_bf16;
    if (rows < 0 || dim < 1 || dim > TM_MAX_ROW_DIM) return TM_UNSUPPORTED_SHAPE;
    const int num_threads = a->num_threads > 0 ? a->num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && rows > 1 && rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float sum[dim];
        const int64_t base = r * dim;
        for (int64_t i = 0; i < dim; i++) {
            const float v = load_value(a->x, is_bf16, base + i) +
                            load_value(a->residual, is_bf16, base + i);
            store_value(a->sum, is_bf16, base + i, v);
            sum[i] = load_value(a->sum, is_bf16, base + i); /* as rounded */
        }
        const float mean = lane_sum(sum, dim) / (float)dim;
        const float variance = lane_centred_squares(sum, dim, mean) / (float)dim;
        const float rstd = 1.0f / sqrtf(variance + a->eps);
        for (int64_t i = 0; i < dim; i++) {
            const float normed = (sum[i] - mean) * rstd;
            store_value(a->out, is_bf16, base + i,
                        normed * load_value(a->weight, is_bf16, i) +
                            load_value(a->bias, is_bf16, i));
        }
    }
    return TM_OK;
}
