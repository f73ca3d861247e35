/* y = x @ dequant(W)^T + bias for FP8 (e4m3) weights, dequantized here, on the fly, so
 * the weights stay in memory at one byte each (the checkpoint's size).
 *
 * Each weight is the value its code stands for times its block's fp32 scale, one fp32
 * multiply, so a tile of the weight holds exactly the fp32 values a dense model holding
 * the dequantized weights would: the result is that model's, up to the order of the fp32
 * sums. Per output tile of FP8_TILE_ROWS rows (one thread each), the tile is decoded into
 * fp32 once and every input row is multiplied with it; the sums run in FP8_LANES
 * independent lanes that the compiler maps onto its vector registers (AVX-512 or AVX2 by
 * -march). bf16 inputs are widened to fp32 first (exactly), and the output rounded to
 * bf16 once, so a bf16 engine gets the fp32 product of its own inputs.
 *
 * The codes decode through a 256-entry table built from the format's fields (sign,
 * 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 subnormal), never through the
 * CPU's handling of subnormal floats, which a process may have set to flush to zero.
 * e4m3fn has no infinities, and its NaN codes (0x7f, 0xff) are refused at load.
 *
 * Those plain loops are the fallback. Where the build has AVX512-BF16, bf16 inputs take
 * the CPU's bf16 dot products instead (fp8_bf16.h: the codes decoded to bf16 exactly, the
 * scales applied to each block's fp32 sums), on AMX tiles from 3 rows where Linux grants
 * them; tm_fp8_linear_isa says which, `tokenmill models info` shows it.
 */
#include <stdlib.h>
#include <string.h>

#include "kernel_common.h"
#include "kernels.h"

/* Output rows decoded at once: 16 x k fp32 stays in L2 for k up to 16K. */
#define FP8_TILE_ROWS 16
/* Independent sums per dot product (one 512-bit register of fp32). */
#define FP8_LANES 16
/* Below this many multiply-adds a call is too short to wake the threads for. */
#define FP8_PARALLEL_MIN_MACS (1 << 18)

#include "fp8_bf16.h"

static void e4m3_table(float table[256]) {
    for (int code = 0; code < 256; code++) {
        const int exponent = (code >> 3) & 15, mantissa = code & 7;
        /* 2^-9 = 2^(1 - 7) / 8: subnormals are mantissa * 2^-9; normals (8 + m) * 2^(e-10) */
        float value = exponent == 0 ? (float)mantissa * 0x1p-9f
                                    : (float)(8 + mantissa) * (float)(1 << exponent) * 0x1p-10f;
        table[code] = (code & 0x80) ? -value : value;
    }
}

static inline float dot(const float *x, const float *w, int64_t k) {
    float lanes[FP8_LANES] = {0};
    int64_t i = 0;
    for (; i + FP8_LANES <= k; i += FP8_LANES)
        for (int j = 0; j < FP8_LANES; j++) lanes[j] += x[i + j] * w[i + j];
    float sum = 0.0f;
    for (int j = 0; j < FP8_LANES; j++) sum += lanes[j];
    for (; i < k; i++) sum += x[i] * w[i];
    return sum;
}

/* Output rows [o0, o0 + count) of the weight in fp32 into tile [count][k]. */
static void decode_tile(const tm_fp8_linear_args *a, const float table[256], int64_t o0,
                        int64_t count, float *tile) {
    const int64_t k = a->k, k_blocks = (k + a->block_k - 1) / a->block_k;
    const uint8_t *codes = a->w;
    for (int64_t r = 0; r < count; r++) {
        const int64_t o = o0 + r;
        const uint8_t *row = codes + o * k;
        const float *scales = a->scales + (o / a->block_n) * k_blocks;
        float *dst = tile + r * k;
        for (int64_t b = 0; b < k_blocks; b++) {
            const float scale = scales[b];
            const int64_t end = b + 1 < k_blocks ? (b + 1) * a->block_k : k;
            for (int64_t i = b * a->block_k; i < end; i++) dst[i] = table[row[i]] * scale;
        }
    }
}

int tm_fp8_linear(const tm_fp8_linear_args *a) {
    const int64_t rows = a->rows, n = a->n, k = a->k;
    if (rows < 0 || n < 1 || k < 1 || a->block_n < 1 || a->block_k < 1)
        return TM_UNSUPPORTED_SHAPE;
    if (rows == 0) return TM_OK;
    float table[256];
    e4m3_table(table);
#if FP8_HAVE_BF16
    if (fast_path_takes(a)) return fp8_linear_bf16(a, table);
#endif
    const float *x = a->x;
    float *widened = NULL;
    if (a->is_bf16) {
        widened = malloc((size_t)(rows * k) * sizeof(float));
        if (!widened) return TM_OUT_OF_MEMORY;
        const uint16_t *xb = a->x;
        for (int64_t i = 0; i < rows * k; i++) widened[i] = bf16_to_f32(xb[i]);
        x = widened;
    }
    const int64_t tiles = (n + FP8_TILE_ROWS - 1) / FP8_TILE_ROWS;
    const int parallel = a->num_threads > 1 && tiles > 1 && rows * n * k >= FP8_PARALLEL_MIN_MACS;
    int failed = 0;
#pragma omp parallel num_threads(a->num_threads) if (parallel)
    {
        float *tile = malloc((size_t)(FP8_TILE_ROWS * k) * sizeof(float));
        if (!tile) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (!tile) continue;
            const int64_t o0 = t * FP8_TILE_ROWS;
            const int64_t count = n - o0 < FP8_TILE_ROWS ? n - o0 : FP8_TILE_ROWS;
            decode_tile(a, table, o0, count, tile);
            for (int64_t row = 0; row < rows; row++) {
                const float *xr = x + row * k;
                for (int64_t r = 0; r < count; r++) {
                    float sum = dot(xr, tile + r * k, k);
                    if (a->bias) sum += a->bias[o0 + r];
                    const int64_t at = row * n + o0 + r;
                    if (a->is_bf16)
                        ((uint16_t *)a->out)[at] = f32_to_bf16(sum);
                    else
                        ((float *)a->out)[at] = sum;
                }
            }
        }
        free(tile);
    }
    free(widened);
    return failed ? TM_OUT_OF_MEMORY : TM_OK;
}

int tm_fp8_linear_isa(void) {
#if FP8_HAVE_AMX
    if (tm_internal_amx_permitted()) return TM_FP8_ISA_AMX;
#endif
#if FP8_HAVE_BF16
    return TM_FP8_ISA_AVX512_BF16;
#elif defined(__AVX512F__)
    return TM_FP8_ISA_AVX512;
#elif defined(__AVX2__) && defined(__FMA__)
    return TM_FP8_ISA_AVX2;
#else
    return TM_FP8_ISA_GENERIC;
#endif
}
