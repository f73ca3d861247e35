/* int4 weights in PyTorch's CPU int4 layout, expanded to bf16 for one product
 * (engine/quant/int4.py) - and float weights quantized straight into that layout at load.
 *
 * torch._weight_int4pack_mm_for_cpu reads a quarter of bf16's bytes, which wins while a
 * call is bound by reading its weights (a decode step of a few sequences); from a few
 * tens of rows on it computes far below the bf16 units' rate (docs/design.md, "int4
 * and GGUF layers on expanded weights"). A prompt chunk's call is better
 * served by expanding the layer's weights to bf16 once - a pass over N x K values, while
 * the product costs rows x N x K - and running the bf16 matmul (AMX or AVX512-BF16 in
 * oneDNN) on them. The expanded copy lives for one call, so the model keeps int4's memory.
 *
 * Layout read (what _convert_weight_to_int4pack_for_cpu returns for N % 64 == 0, checked
 * against the unpacked weights on every layer's load by int4.py): [N / 64][K][32] bytes;
 * byte j of block nb, row k holds output channel nb * 64 + j in its low nibble and
 * nb * 64 + 32 + j in its high one. scales_and_zeros: [K / group][N][2] bf16 (scale, zero),
 * and a weight is (q - 8) * scale + zero, computed in fp32 as the int4 kernel does and
 * rounded once to bf16.
 *
 * Output: [K][N] bf16, the weight transposed - each k's row is N contiguous values, which
 * the matmul reads as x @ w without a transpose, and which a block's 32 bytes fill 64 at a
 * time.
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernel_common.h"
#include "kernels.h"

#define INT4_BLOCK_N 64

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
/* One block's 64 channels of one k: the same two roundings as the scalar loop (a
 * multiply, then an add; the flags forbid contracting them), then bf16 by
 * vcvtneps2bf16 (round to nearest even, as f32_to_bf16). GCC leaves the scalar loop
 * unvectorised (the speed-up: docs/design.md, "int4 and GGUF layers on expanded
 * weights"). */
static inline void unpack_block_avx512(const uint8_t *bytes, const uint16_t *sz, uint16_t *dst) {
    const __m256i raw = _mm256_loadu_si256((const __m256i *)bytes);
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i low = _mm256_and_si256(raw, nibble);                       /* channels 0..31 */
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble); /* 32..63 */
    const __m512 eight = _mm512_set1_ps(8.0f);
    const __m512i zero_bits = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int part = 0; part < 4; part++) { /* 16 channels each */
        const __m256i half = part < 2 ? low : high;
        const __m128i q8 = part % 2 ? _mm256_extracti128_si256(half, 1) : _mm256_castsi256_si128(half);
        const __m512 q = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q8)), eight);
        /* 16 (scale, zero) bf16 pairs: scale in each 32-bit lane's low half. */
        const __m512i pairs = _mm512_loadu_si512(sz + part * 32);
        const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, zero_bits));
        const __m512 w = _mm512_add_ps(_mm512_mul_ps(q, scale), zero);
        _mm256_storeu_si256((__m256i *)(dst + part * 16), (__m256i)_mm512_cvtneps_pbh(w));
    }
}
#define unpack_block unpack_block_avx512
#else
/* The same values, one at a time (CPUs without AVX512-BF16). */
static inline void unpack_block(const uint8_t *bytes, const uint16_t *sz, uint16_t *dst) {
    for (int j = 0; j < 32; j++) {
        const float lo = (float)((bytes[j] & 15) - 8) * bf16_to_f32(sz[2 * j]);
        const float hi = (float)((bytes[j] >> 4) - 8) * bf16_to_f32(sz[2 * (32 + j)]);
        dst[j] = f32_to_bf16(lo + bf16_to_f32(sz[2 * j + 1]));
        dst[32 + j] = f32_to_bf16(hi + bf16_to_f32(sz[2 * (32 + j) + 1]));
    }
}
#endif

int tm_int4_unpack_bf16(const tm_int4_unpack_args *a) {
    const int64_t n = a->n, k = a->k, group = a->group;
    if (n <= 0 || k <= 0 || n % INT4_BLOCK_N || group <= 0 || k % group) return TM_UNSUPPORTED_SHAPE;
    const uint8_t *packed = (const uint8_t *)a->packed;
    const uint16_t *scales_and_zeros = (const uint16_t *)a->scales_and_zeros;
    uint16_t *out = (uint16_t *)a->out;
    const int64_t blocks = n / INT4_BLOCK_N;
#pragma omp parallel for schedule(static) num_threads(a->num_threads)
    for (int64_t kk = 0; kk < k; kk++) {
        const uint16_t *sz_row = scales_and_zeros + kk / group * n * 2;
        uint16_t *out_row = out + kk * n;
        for (int64_t nb = 0; nb < blocks; nb++) {
            const uint8_t *bytes = packed + (nb * k + kk) * 32;
            const uint16_t *sz = sz_row + nb * INT4_BLOCK_N * 2;
            uint16_t *dst = out_row + nb * INT4_BLOCK_N;
            unpack_block(bytes, sz, dst);
        }
    }
    return TM_OK;
}

/* ---- quantizing a float weight into the layout ------------------------------------
 * int4.py's quantize_weight and _convert_weight_to_int4pack_for_cpu in one pass over the
 * weight, a block of 64 output channels per task: torch's version makes an fp32 copy and
 * runs seven more passes over it (min, max, subtract, divide, round, clamp, widen), then
 * packs. The arithmetic is the same fp32 steps in the same order (the flags forbid
 * contracting or reassociating them): span = max - min, scale = span / 15 (1 where the
 * span is 0), q = round-half-even((w - min) / scale) clamped to 0..15. A NaN anywhere in a
 * group makes its minimum NaN and an infinity its scale or minimum non-finite: such groups
 * are counted, and the caller refuses a weight with any rather than use garbage codes. */
/* One output channel's groups: codes into q[k], (scale, minimum) per group. Each step is
 * its own loop over the group, so that each vectorises. */
static int64_t quantize_channel(const void *weight, int is_bf16, int64_t row, int64_t k,
                                int64_t group, uint8_t *q, float *scale, float *minimum) {
    float values[TM_INT4_MAX_GROUP];
    int64_t nonfinite = 0;
    for (int64_t g = 0; g < k / group; g++) {
        const int64_t base = row * k + g * group;
        if (is_bf16) {
            const uint16_t *src = (const uint16_t *)weight + base;
            for (int64_t i = 0; i < group; i++) values[i] = bf16_to_f32(src[i]);
        } else {
            const float *src = (const float *)weight + base;
            for (int64_t i = 0; i < group; i++) values[i] = src[i];
        }
        /* The least and greatest value as integers that order as the floats do (a
         * negative float's magnitude bits flipped): integer min and max vectorise where
         * the float ones may not reorder (NaN and signed-zero rules). Only -0.0 against
         * 0.0 orders differently, and either is the same minimum to every step below. */
        int32_t lo_key = INT32_MAX, hi_key = INT32_MIN, nan = 0;
        for (int64_t i = 0; i < group; i++) {
            int32_t bits;
            __builtin_memcpy(&bits, &values[i], sizeof bits);
            const int32_t key = bits ^ ((bits >> 31) & INT32_MAX);
            lo_key = key < lo_key ? key : lo_key;
            hi_key = key > hi_key ? key : hi_key;
            nan |= (bits & INT32_MAX) > 0x7f800000;
        }
        lo_key ^= (lo_key >> 31) & INT32_MAX;
        hi_key ^= (hi_key >> 31) & INT32_MAX;
        float lo, hi;
        __builtin_memcpy(&lo, &lo_key, sizeof lo);
        __builtin_memcpy(&hi, &hi_key, sizeof hi);
        if (nan) lo = __builtin_nanf(""); /* as torch's amin propagates a NaN */
        const float span = hi - lo;
        const float s = span > 0.0f ? span / 15.0f : 1.0f;
        for (int64_t i = 0; i < group; i++) {
            float c = __builtin_nearbyintf((values[i] - lo) / s);
            c = c < 0.0f ? 0.0f : c;
            c = c > 15.0f ? 15.0f : c;
            q[g * group + i] = (uint8_t)(int32_t)c;
        }
        scale[row * (k / group) + g] = s;
        minimum[row * (k / group) + g] = lo;
        nonfinite += !(__builtin_isfinite(s) && __builtin_isfinite(lo));
    }
    return nonfinite;
}

int tm_int4_pack(const tm_int4_pack_args *a) {
    const int64_t n = a->n, k = a->k, group = a->group;
    if (n <= 0 || k <= 0 || n % INT4_BLOCK_N || group <= 0 || group > TM_INT4_MAX_GROUP ||
        k % group)
        return TM_UNSUPPORTED_SHAPE;
    uint8_t *packed = (uint8_t *)a->packed;
    const int64_t blocks = n / INT4_BLOCK_N;
    int status = TM_OK;
    int64_t nonfinite = 0;
#pragma omp parallel num_threads(a->num_threads) reduction(+ : nonfinite)
    {
        /* Two channels' codes: channel j and j + 32 share a byte. */
        uint8_t *low = malloc((size_t)k), *high = malloc((size_t)k);
        if (low == NULL || high == NULL) {
#pragma omp atomic write
            status = TM_OUT_OF_MEMORY;
        } else {
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < blocks; nb++) {
                uint8_t *block = packed + nb * k * 32;
                for (int64_t j = 0; j < 32; j++) {
                    const int64_t row = nb * INT4_BLOCK_N + j;
                    nonfinite += quantize_channel(a->weight, a->is_bf16, row, k, group, low,
                                                  a->scale, a->minimum);
                    nonfinite += quantize_channel(a->weight, a->is_bf16, row + 32, k, group,
                                                  high, a->scale, a->minimum);
                    for (int64_t kk = 0; kk < k; kk++)
                        block[kk * 32 + j] = (uint8_t)(low[kk] | (high[kk] << 4));
                }
            }
        }
        free(low);
        free(high);
    }
    *a->num_nonfinite = nonfinite;
    return status;
}
