/* Fused elementwise ops of the Llama forward pass: residual add + RMSNorm, rotary on
 * the qkv projection's output, and SiLU- (or Gemma's GELU-) and-mul. Each is one pass
 * over its rows where PyTorch makes several, with a temporary per pass.
 *
 * RMSNorm, the residual add and rotary reproduce PyTorch's CPU rounding step for step,
 * so a bf16 run gives the bits the PyTorch path gives (and fp32 RMSNorm and rotary do
 * too): every product and sum is rounded to fp32 on its own (no FMA contraction, no
 * reassociation, true division and square root), bf16 is rounded where PyTorch rounds
 * it, and RMSNorm's sum of squares adds in the order of ATen's vectorised sum. The exp
 * of SiLU and GELU is not PyTorch's, so those may differ from it in the last bit.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "activation.h"
#include "kernel_common.h"
#include "kernels.h"

/* This file must round like PyTorch: the build compiles it without -ffast-math and with
 * -ffp-contract=off (engine/kernels/__init__.py, _FILE_FLAGS), and refuses a compiler it
 * does not know to honour those flags. */

/* Below this many elements a pass is too short to be worth waking threads; a decode
 * step's 64 x 576 RMSNorm is above it (docs/design.md, "Fused elementwise ops and
 * the native argmax"). Each row's arithmetic is the same either way. */
#define PARALLEL_MIN_ELEMENTS 16384

/* ATen's CPU sum over a contiguous row (SumKernel.cpp: vectorized_inner_sum, row_sum,
 * multi_row_sum): 4 interleaved vector accumulators, cascaded through 4 levels every 16
 * steps, folded into the first, then the scalar tail and the vector's lanes added one by
 * one. Its vectors are 8 floats even on AVX-512 machines (ATen dispatches sum to its AVX2
 * kernel there; tests/engine/test_elementwise.py checks the bits). A single row of over
 * 32K elements, which ATen splits across threads, is not matched. */
#define SUM_LANES 8
#define SUM_ILP 4
#define SUM_LEVELS 4

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    return 64 - __builtin_clzll((uint64_t)x - 1);
}

static inline void add_squares(float *acc, const float *x) {
    for (int k = 0; k < SUM_ILP * SUM_LANES; k++) acc[k] += x[k] * x[k];
}

static float sum_of_squares(const float *x, int64_t n) {
    const int64_t num_vecs = n / SUM_LANES;
    const int64_t size = num_vecs / SUM_ILP; /* steps of SUM_ILP vectors */
    const int64_t level_power = ceil_log2(size) / SUM_LEVELS > 4 ? ceil_log2(size) / SUM_LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power;
    const int64_t level_mask = level_step - 1;
    const int width = SUM_ILP * SUM_LANES;
    float acc[SUM_LEVELS][SUM_ILP * SUM_LANES];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; j++, i++) add_squares(acc[0], x + i * width);
        for (int j = 1; j < SUM_LEVELS; j++) {
            for (int k = 0; k < width; k++) {
                acc[j][k] += acc[j - 1][k];
                acc[j - 1][k] = 0.0f;
            }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; i++) add_squares(acc[0], x + i * width);
    for (int j = 1; j < SUM_LEVELS; j++)
        for (int k = 0; k < width; k++) acc[0][k] += acc[j][k];
    /* Vectors left over from the SUM_ILP-wide steps go to the first accumulator. */
    for (int64_t v = size * SUM_ILP; v < num_vecs; v++)
        for (int l = 0; l < SUM_LANES; l++) acc[0][l] += x[v * SUM_LANES + l] * x[v * SUM_LANES + l];
    for (int k = 1; k < SUM_ILP; k++)
        for (int l = 0; l < SUM_LANES; l++) acc[0][l] += acc[0][k * SUM_LANES + l];
    float total = 0.0f;
    for (int64_t t = num_vecs * SUM_LANES; t < n; t++) total += x[t] * x[t];
    for (int l = 0; l < SUM_LANES; l++) total += acc[0][l];
    return total;
}

/* RMSNorm of `rows` rows of `dim`, optionally after adding them to a residual:
 *   residual != NULL: residual += x (in place), out = rmsnorm(residual) * weight
 *   residual == NULL: out = rmsnorm(x) * weight
 * As PyTorch computes it: fp32 throughout for fp32; for bf16 the sum is rounded to bf16,
 * normalised in fp32, rounded to bf16, then multiplied by the bf16 weight and rounded -
 * or, with an fp32 weight (Gemma's), normalised and scaled in fp32 as for fp32 rows and
 * rounded to bf16 once: F.rms_norm(x.float(), ..., weight).to(bf16).
 * x, residual, out, weight: contiguous, all fp32 or all bf16 (tm_rms_norm_args). */
int tm_rms_norm(const tm_rms_norm_args *a) {
    const void *x = a->x, *weight = a->weight;
    void *residual = a->residual, *out = a->out;
    const int64_t rows = a->rows, dim = a->dim;
    const int is_bf16 = a->is_bf16, num_threads = a->num_threads;
    const float eps = a->eps;
    if (dim < 1 || dim > TM_MAX_ROW_DIM) return TM_UNSUPPORTED_SHAPE;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && rows > 1 && rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float h[dim]; /* the row to normalise, in fp32 */
        const int64_t base = r * dim;
        if (is_bf16) {
            const uint16_t *xr = (const uint16_t *)x + base;
            if (residual) {
                uint16_t *res = (uint16_t *)residual + base;
                for (int64_t i = 0; i < dim; i++) {
                    res[i] = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(xr[i]));
                    h[i] = bf16_to_f32(res[i]);
                }
            } else {
                for (int64_t i = 0; i < dim; i++) h[i] = bf16_to_f32(xr[i]);
            }
        } else {
            const float *xr = (const float *)x + base;
            if (residual) {
                float *res = (float *)residual + base;
                for (int64_t i = 0; i < dim; i++) h[i] = res[i] = res[i] + xr[i];
            } else {
                memcpy(h, xr, (size_t)dim * sizeof(float));
            }
        }
        /* rsqrt(mean(x^2) + eps), each step rounded as ATen rounds it. */
        const float mean = sum_of_squares(h, dim) / (float)dim;
        const float scale = 1.0f / sqrtf(mean + eps);
        if (is_bf16 && a->fp32_weight) {
            const float *w = (const float *)weight;
            uint16_t *o = (uint16_t *)out + base;
            for (int64_t i = 0; i < dim; i++) {
                const float normed = h[i] * scale;
                o[i] = f32_to_bf16(normed * w[i]);
            }
        } else if (is_bf16) {
            const uint16_t *w = (const uint16_t *)weight;
            uint16_t *o = (uint16_t *)out + base;
            for (int64_t i = 0; i < dim; i++) {
                const float normed = bf16_to_f32(f32_to_bf16(h[i] * scale));
                o[i] = f32_to_bf16(normed * bf16_to_f32(w[i]));
            }
        } else {
            const float *w = (const float *)weight;
            float *o = (float *)out + base;
            for (int64_t i = 0; i < dim; i++) {
                const float normed = h[i] * scale;
                o[i] = normed * w[i];
            }
        }
    }
    return TM_OK;
}

/* One head of rotary, rotate-halves layout: out = x * cos + swap_halves(x) * sin, each
 * product and the sum rounded to the storage type (PyTorch's three ops). */
static void rotate_head_f32(const float *x, const float *cos, const float *sin, float *out,
                            int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int64_t i = half; i < head_dim; i++) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

static inline uint16_t rotate_bf16(uint16_t x, uint16_t cos, uint16_t swapped, uint16_t sin) {
    const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(x) * bf16_to_f32(cos)));
    const float b = bf16_to_f32(f32_to_bf16(bf16_to_f32(swapped) * bf16_to_f32(sin)));
    return f32_to_bf16(a + b);
}

static void rotate_head_bf16(const uint16_t *x, const uint16_t *cos, const uint16_t *sin,
                             uint16_t *out, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < half; i++) out[i] = rotate_bf16(x[i], cos[i], x[i + half], sin[i]);
    for (int64_t i = half; i < head_dim; i++)
        out[i] = rotate_bf16(x[i], cos[i], x[i - half], sin[i]);
}

static void rotate_heads(const void *src, int64_t src_offset, void *dst, int64_t dst_offset,
                         const void *cos, const void *sin, int64_t table_offset,
                         int64_t num_heads, int64_t head_dim, int is_bf16) {
    for (int64_t h = 0; h < num_heads; h++) {
        const int64_t s = src_offset + h * head_dim, d = dst_offset + h * head_dim;
        if (is_bf16) {
            rotate_head_bf16((const uint16_t *)src + s, (const uint16_t *)cos + table_offset,
                             (const uint16_t *)sin + table_offset, (uint16_t *)dst + d, head_dim);
        } else {
            rotate_head_f32((const float *)src + s, (const float *)cos + table_offset,
                            (const float *)sin + table_offset, (float *)dst + d, head_dim);
        }
    }
}

/* Rotary on q and k and a contiguous copy of v, token by token, in one pass.
 * q, k, v: [num_tokens, heads, head_dim] with heads contiguous in a token's row and rows
 * `*_stride` elements apart (views into the qkv projection's output, say).
 * q_out, k_out, v_out: contiguous. cos, sin: [num_tokens, head_dim] contiguous (the
 * full-width tables, sin signed for the swapped halves). All fp32 or all bf16. */
int tm_rotary_qkv(const tm_rotary_args *a) {
    const void *q = a->q, *k = a->k, *v = a->v, *cos = a->cos, *sin = a->sin;
    void *q_out = a->q_out, *k_out = a->k_out, *v_out = a->v_out;
    const int64_t q_stride = a->q_stride, k_stride = a->k_stride, v_stride = a->v_stride;
    const int64_t num_tokens = a->num_tokens, num_heads = a->num_heads;
    const int64_t num_kv_heads = a->num_kv_heads, head_dim = a->head_dim;
    const int is_bf16 = a->is_bf16, num_threads = a->num_threads;
    if (head_dim % 2) return TM_UNSUPPORTED_SHAPE;
    const int64_t row_elements = (num_heads + 2 * num_kv_heads) * head_dim;
    const size_t elem = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && num_tokens > 1 && num_tokens * row_elements >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_tokens; t++) {
        rotate_heads(q, t * q_stride, q_out, t * num_heads * head_dim, cos, sin, t * head_dim,
                     num_heads, head_dim, is_bf16);
        rotate_heads(k, t * k_stride, k_out, t * num_kv_heads * head_dim, cos, sin,
                     t * head_dim, num_kv_heads, head_dim, is_bf16);
        const size_t v_bytes = (size_t)(num_kv_heads * head_dim) * elem;
        memcpy((char *)v_out + (size_t)t * v_bytes, (const char *)v + (size_t)(t * v_stride) * elem,
               v_bytes);
    }
    return TM_OK;
}

/* silu(x) over n floats (activation.h). */
static void silu_row(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = silu_of(x[i]);
}

/* GELU, tanh approximation, over n floats (activation.h). */
static void gelu_tanh_row(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = gelu_tanh_of(x[i]);
}

/* out = act(gate) * up, gate and up the two halves of each row of x ([rows, 2 * dim] ->
 * [rows, dim]). bf16 rounds act(gate) before the multiply, as PyTorch's
 * F.silu(gate).mul_(up) does. */
static int gated_and_mul(const tm_silu_args *a, void (*act)(const float *, float *, int64_t)) {
    const void *x = a->x;
    void *out = a->out;
    const int64_t rows = a->rows, dim = a->dim;
    const int is_bf16 = a->is_bf16, num_threads = a->num_threads;
    if (dim < 1 || dim > TM_MAX_ROW_DIM) return TM_UNSUPPORTED_SHAPE;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && rows > 1 && rows * dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) {
        float gated[dim];
        if (is_bf16) {
            const uint16_t *gate = (const uint16_t *)x + r * 2 * dim, *up = gate + dim;
            uint16_t *o = (uint16_t *)out + r * dim;
            for (int64_t i = 0; i < dim; i++) gated[i] = bf16_to_f32(gate[i]);
            act(gated, gated, dim);
            for (int64_t i = 0; i < dim; i++)
                o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(gated[i])) * bf16_to_f32(up[i]));
        } else {
            const float *gate = (const float *)x + r * 2 * dim, *up = gate + dim;
            float *o = (float *)out + r * dim;
            act(gate, gated, dim);
            for (int64_t i = 0; i < dim; i++) o[i] = gated[i] * up[i];
        }
    }
    return TM_OK;
}

int tm_silu_and_mul(const tm_silu_args *a) { return gated_and_mul(a, silu_row); }

int tm_gelu_tanh_and_mul(const tm_silu_args *a) { return gated_and_mul(a, gelu_tanh_row); }
