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
#include "quantize_row.h"

/* Below this many elements a pass is a few microseconds: not worth waking threads. */
#define QUANT_PARALLEL_MIN 65536

static inline float load_at(const void *x, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* Each row is read twice (its absolute maximum, then the rounding) while it is in L1. */
float tm_internal_quantize_row_u8(const void *x, int64_t r, int64_t dim, int is_bf16,
                                  const float *inv_smooth, int qmax, int zero_point,
                                  int full_range, uint8_t *out) {
    const int64_t base = r * dim;
    const float limit = (float)qmax, low = full_range ? -limit - 1.0f : -limit;
    const float divisor = full_range ? limit + 0.5f : limit;
    float absmax = 0.0f;
    for (int64_t i = 0; i < dim; i++) {
        float v = load_at(x, base + i, is_bf16);
        if (inv_smooth) v *= inv_smooth[i];
        v = fabsf(v);
        absmax = v > absmax ? v : absmax;
    }
    const float scale = absmax > 0.0f ? absmax / divisor : 1.0f;
    const float inv_scale = 1.0f / scale;
    for (int64_t i = 0; i < dim; i++) {
        float v = load_at(x, base + i, is_bf16);
        if (inv_smooth) v *= inv_smooth[i];
        /* compressed-tensors divides: a row's largest negative value lands on -127.5
         * exactly and rounds (half to even) to -128, where times 1 / scale may not */
        float q = nearbyintf(full_range ? v / scale : v * inv_scale);
        q = q > limit ? limit : (q < low ? low : q);
        out[i] = (uint8_t)((int)q + zero_point);
    }
    return scale;
}

/* See kernels.h: every row quantized by tm_internal_quantize_row_u8. qmax 127 / zero point 128 use all
 * 8 bits; 63 / 64 keep values in 0..127 for CPUs whose int8 products go through int16
 * sums that would saturate (AVX2's vpmaddubsw). */
int tm_quantize_rows_u8(const tm_quantize_args *a) {
    const int qmax = a->qmax, zero_point = a->zero_point;
    if (qmax < 1 || qmax > TM_MAX_QMAX || zero_point < qmax + (a->full_range != 0) ||
        zero_point + qmax > 255)
        return TM_UNSUPPORTED_SHAPE;
    const int64_t rows = a->rows, dim = a->dim;
#pragma omp parallel for schedule(static) num_threads(a->num_threads) \
    if (rows * dim >= QUANT_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++)
        a->scales[r] = tm_internal_quantize_row_u8(a->x, r, dim, a->is_bf16, a->inv_smooth,
                                                   qmax, zero_point, a->full_range,
                                                   a->out + r * dim);
    return TM_OK;
}
