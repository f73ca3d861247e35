/* Dynamic int8 quantization of activations for the int8 linear layers
 * (engine/quant/int8.py): one scale per row (token), values stored as uint8 with a zero
 * point, the layout oneDNN's int8 matmul reads (u8 activations x s8 weights, which
 * is what VNNI's vpdpbusd multiplies). An optional per-channel divisor (SmoothQuant's
 * smoothing factors, multiplied into the weights' columns at load) is applied on the
 * way, so it costs no pass of its own. Each row is read twice (its absolute maximum,
 * then the rounding) while it is in L1; the equivalent PyTorch ops read the whole
 * tensor five times with a temporary each.
 */
#include <math.h>
#include <stdint.h>

#include "kernel_common.h"
#include "kernels.h"

/* Below this many elements a pass is a few microseconds: not worth waking threads. */
#define QUANT_PARALLEL_MIN 65536

static inline float load_at(const void *x, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* x: [rows, dim] fp32 or bf16, contiguous; inv_smooth: [dim] fp32 or NULL (all ones).
 * With y = x * inv_smooth, writes scales[r] = max|y[r]| / qmax (1 for an all-zero row)
 * and out[r, i] = round(y[r, i] / scales[r]) + zero_point, clamped to +-qmax first.
 * qmax 127 / zero point 128 use all 8 bits; 63 / 64 keep values in 0..127 for CPUs
 * whose int8 products go through int16 sums that would saturate (AVX2's vpmaddubsw). */
int tm_quantize_rows_u8(const tm_quantize_args *a) {
    const void *x = a->x;
    const float *inv_smooth = a->inv_smooth;
    uint8_t *out = a->out;
    float *scales = a->scales;
    const int64_t rows = a->rows, dim = a->dim;
    const int is_bf16 = a->is_bf16, qmax = a->qmax, zero_point = a->zero_point;
    const int num_threads = a->num_threads;
    if (qmax < 1 || qmax > TM_MAX_QMAX || zero_point < qmax || zero_point + qmax > 255)
        return TM_UNSUPPORTED_SHAPE;
    const float limit = (float)qmax;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (rows * dim >= QUANT_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * dim;
        float absmax = 0.0f;
        for (int64_t i = 0; i < dim; i++) {
            float v = load_at(x, base + i, is_bf16);
            if (inv_smooth) v *= inv_smooth[i];
            v = fabsf(v);
            absmax = v > absmax ? v : absmax;
        }
        const float scale = absmax > 0.0f ? absmax / limit : 1.0f;
        const float inv_scale = 1.0f / scale;
        for (int64_t i = 0; i < dim; i++) {
            float v = load_at(x, base + i, is_bf16);
            if (inv_smooth) v *= inv_smooth[i];
            float q = nearbyintf(v * inv_scale);
            q = q > limit ? limit : (q < -limit ? -limit : q);
            out[base + i] = (uint8_t)((int)q + zero_point);
        }
        scales[r] = scale;
    }
    return TM_OK;
}
