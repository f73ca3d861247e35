/* The int8 KV cache, for paged_attention.c: how a block is stored, quantized and read.
 *
 * Decoding reads every key and value it attends to from memory once per step, and on a
 * CPU that read is the step's attention time: it runs at the memory's bandwidth. Storing
 * them as int8 halves the bytes. Each position's head_dim values are cut into groups of
 * TM_KV_INT8_GROUP (32) with one fp32 scale each, max|x| / 127, and stored as
 * round(x / scale); whole-head scales lose too much for head_dim 256 (Gemma 3). Why 32:
 * docs/design.md, "The int8 KV cache, scaled per 32 values".
 *
 * A kv head's block is its block_size * head_dim int8 values, in the plain or the pair
 * layout of the float caches (kernels.h, tm_write_kv_cache; which one: kv_int8_pairs),
 * followed by its scales, fp32 [head_dim / 32][block_size] (a group's scales
 * for the block's positions side by side, one vector for 16 positions).
 *
 * Two ways to read it:
 * - widened: a few blocks at a time into a float block of that layout in scratch (L1),
 *   where the float path - vector, AMX or fp32 - runs unchanged. Every build and row
 *   count can take it, but widening costs about as much as the dot products it feeds,
 *   so a decode step is slower than over the bf16 cache;
 * - direct, for pair-layout blocks where the CPU has AVX512-VNNI or AVX2 (HAVE_INT8_DOT),
 *   fp32 or bf16, for the rows AMX does not take (attention_int8.h): `vpdpwssd` sums
 *   products of int16 pairs into int32, as `vdpbf16ps` does bf16 pairs, so sign-extending
 *   a block's int8 values to int16 (one instruction per 32) is all the widening it needs.
 *   The other operand is the query rows quantized to int16 per group of 32 (error ~1.5e-5
 *   of the largest), or, for the weighted sum, a row's weights times the block's value
 *   scales, quantized to int16 against their largest. The scales apply to the int32 sums.
 */
#ifndef TOKENMILL_KV_INT8_H
#define TOKENMILL_KV_INT8_H

#include <math.h>
#include <stdint.h>

#include "attention_bf16.h"
#include "kernel_common.h"
#include "kernels.h"

/* The int16 dot products that read pair-layout blocks directly (attention_int8.h). */
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
#define HAVE_INT8_DOT 1
#endif

/* Whether an int8 cache of this shape keeps its blocks in the pair layout: wherever the
 * int16 dot products can read it directly, whatever the compute type, and else where the
 * bf16 float path would (so widened blocks are in the layout that path reads). */
static inline int kv_int8_pairs(int is_bf16, int64_t block_size, int64_t head_dim) {
#ifdef HAVE_INT8_DOT
    (void)is_bf16;
    return block_size == 16 && (head_dim == 64 || head_dim == 128 || head_dim == 256);
#else
    return uses_bf16_pairs(is_bf16, block_size, head_dim);
#endif
}

/* Bytes of one kv head's block: values, then scales. */
static inline int64_t kv_int8_head_bytes(int64_t head_dim, int64_t block_size) {
    return block_size * head_dim + block_size * (head_dim / TM_KV_INT8_GROUP) * (int64_t)sizeof(float);
}

/* Where element d of position t sits in a key block, a value block: the float caches'
 * layouts (kernels.h, tm_write_kv_cache). */
static inline int64_t key_index(int pairs, int64_t t, int64_t d, int64_t block_size) {
    return pairs ? (d >> 1) * 32 + t * 2 + (d & 1) : d * block_size + t;
}

static inline int64_t value_index(int pairs, int64_t t, int64_t c, int64_t head_dim) {
    return pairs ? (t >> 1) * 2 * head_dim + c * 2 + (t & 1) : t * head_dim + c;
}

/* One position's head_dim values (fp32 or bf16) quantized: the group scales into
 * scales[0 .. head_dim / 32) and the int8 values into q[0 .. head_dim). */
static inline void quantize_kv_row(const void *src, int is_bf16, int64_t head_dim, int8_t *q,
                                   float *scales) {
    float x[TM_MAX_HEAD_DIM];
    load_row(src, 0, is_bf16, head_dim, x);
    for (int64_t g = 0; g < head_dim / TM_KV_INT8_GROUP; g++) {
        const float *xg = x + g * TM_KV_INT8_GROUP;
        float amax = 0.f;
        for (int i = 0; i < TM_KV_INT8_GROUP; i++) amax = fmaxf(amax, fabsf(xg[i]));
        const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        scales[g] = scale;
        for (int i = 0; i < TM_KV_INT8_GROUP; i++) {
            const float r = nearbyintf(xg[i] * inv);
            q[g * TM_KV_INT8_GROUP + i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
        }
    }
}

/* Stores position t's key and value rows into one kv head's int8 blocks. */
static inline void write_kv_int8(const void *k, const void *v, int is_bf16, int pairs,
                                 int64_t t, int64_t head_dim, int64_t block_size,
                                 int8_t *k_block, int8_t *v_block) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP, values = block_size * head_dim;
    int8_t q[TM_MAX_HEAD_DIM];
    float *k_scales = (float *)(k_block + values), *v_scales = (float *)(v_block + values);
    float scales[TM_MAX_HEAD_DIM / TM_KV_INT8_GROUP];
    quantize_kv_row(k, is_bf16, head_dim, q, scales);
    for (int64_t d = 0; d < head_dim; d++) k_block[key_index(pairs, t, d, block_size)] = q[d];
    for (int64_t g = 0; g < groups; g++) k_scales[g * block_size + t] = scales[g];
    quantize_kv_row(v, is_bf16, head_dim, q, scales);
    for (int64_t c = 0; c < head_dim; c++) v_block[value_index(pairs, t, c, head_dim)] = q[c];
    for (int64_t g = 0; g < groups; g++) v_scales[g * block_size + t] = scales[g];
}

/* n values times their scales, into fp32 or bf16 (rounded to nearest even). Kept to one
 * simple loop so that the compiler vectorizes it. */
static inline void scale_run(const int8_t *q, const float *scale, int64_t n, int is_bf16, void *out) {
    if (is_bf16) {
        uint16_t *o = (uint16_t *)out;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16((float)q[i] * scale[i]);
    } else {
        float *o = (float *)out;
        for (int64_t i = 0; i < n; i++) o[i] = (float)q[i] * scale[i];
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_WIDEN_PAIRS 1

/* 32 int8 values times 32 scales (two vectors), rounded to bf16 (nearest even). */
static inline void widen32_bf16(const int8_t *q, __m512 scale_lo, __m512 scale_hi, uint16_t *out) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)q);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, scale_hi), _mm512_mul_ps(lo, scale_lo));
    _mm512_storeu_si512(out, (__m512i)both);
}

/* A pair-layout key block ([head_dim / 2][16][2]): the 32 values of each pair-row are
 * positions 0-15 twice over, so one pair of scale vectors serves a group's 16 rows. */
static inline void widen_key_pairs(const int8_t *block, int64_t head_dim, uint16_t *out) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP;
    const float *scales = (const float *)(block + 16 * head_dim);
    const __m512i lo_index = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_index = _mm512_add_epi32(lo_index, _mm512_set1_epi32(8));
    for (int64_t g = 0; g < groups; g++) {
        /* lane i: position i / 2 (lo) or 8 + i / 2 (hi) */
        const __m512 group_scales = _mm512_loadu_ps(scales + g * 16);
        const __m512 scale_lo = _mm512_permutexvar_ps(lo_index, group_scales);
        const __m512 scale_hi = _mm512_permutexvar_ps(hi_index, group_scales);
        for (int64_t r = 0; r < 16; r++) {
            const int64_t off = (g * 16 + r) * 32;
            widen32_bf16(block + off, scale_lo, scale_hi, out + off);
        }
    }
}

/* A pair-layout value block ([8][head_dim][2]): each 64 values of a pair of positions
 * alternate between the two positions' scales for one group. */
static inline void widen_value_pairs(const int8_t *block, int64_t head_dim, uint16_t *out) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP;
    const float *scales = (const float *)(block + 16 * head_dim);
    for (int64_t t = 0; t < 16; t += 2)
        for (int64_t g = 0; g < groups; g++) {
            const __m512 scale = _mm512_mask_blend_ps(0xAAAA, _mm512_set1_ps(scales[g * 16 + t]),
                                                      _mm512_set1_ps(scales[g * 16 + t + 1]));
            const int64_t off = t * head_dim + g * 2 * TM_KV_INT8_GROUP;
            widen32_bf16(block + off, scale, scale, out + off);
            widen32_bf16(block + off + 32, scale, scale, out + off + 32);
        }
}
#endif

/* One kv head's int8 key block widened into `out` (fp32 or bf16, same layout). Each run
 * of block_size (plain) or 32 (pairs: 16 positions x 2 elements) values shares one group,
 * so a row of per-position scales for that group serves the whole run. */
static inline void widen_key_block(const int8_t *block, int pairs, int is_bf16, int64_t head_dim,
                                   int64_t block_size, void *out) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP, elem = is_bf16 ? 2 : 4;
    const float *scales = (const float *)(block + block_size * head_dim);
#ifdef HAVE_WIDEN_PAIRS
    if (pairs && is_bf16) {
        widen_key_pairs(block, head_dim, (uint16_t *)out);
        return;
    }
#endif
    const int64_t run = pairs ? 32 : block_size;
    float row[TM_MAX_BLOCK_SIZE > 32 ? TM_MAX_BLOCK_SIZE : 32]; /* >= run */
    for (int64_t g = 0; g < groups; g++) {
        for (int64_t i = 0; i < run; i++) row[i] = scales[g * block_size + (pairs ? i >> 1 : i)];
        /* group g's elements: d in [32g, 32g + 32) - 16 pair runs, or 32 plain runs */
        const int64_t first = g * TM_KV_INT8_GROUP * block_size, count = TM_KV_INT8_GROUP * block_size;
        for (int64_t off = first; off < first + count; off += run)
            scale_run(block + off, row, run, is_bf16, (char *)out + off * elem);
    }
}

/* One kv head's int8 value block widened into `out` (fp32 or bf16, same layout). */
static inline void widen_value_block(const int8_t *block, int pairs, int is_bf16, int64_t head_dim,
                                     int64_t block_size, void *out) {
    const int64_t groups = head_dim / TM_KV_INT8_GROUP, elem = is_bf16 ? 2 : 4;
    const float *scales = (const float *)(block + block_size * head_dim);
    float row[2 * TM_KV_INT8_GROUP];
#ifdef HAVE_WIDEN_PAIRS
    if (pairs && is_bf16) {
        widen_value_pairs(block, head_dim, (uint16_t *)out);
        return;
    }
#endif
    if (pairs) { /* runs of 32 channels x positions t, t + 1 alternating */
        for (int64_t t = 0; t < block_size; t += 2)
            for (int64_t g = 0; g < groups; g++) {
                const float even = scales[g * block_size + t], odd = scales[g * block_size + t + 1];
                for (int i = 0; i < 2 * TM_KV_INT8_GROUP; i += 2) row[i] = even, row[i + 1] = odd;
                const int64_t off = t * head_dim + g * 2 * TM_KV_INT8_GROUP;
                scale_run(block + off, row, 2 * TM_KV_INT8_GROUP, is_bf16, (char *)out + off * elem);
            }
        return;
    }
    for (int64_t t = 0; t < block_size; t++) /* runs of 32 channels of one position */
        for (int64_t g = 0; g < groups; g++) {
            const float s = scales[g * block_size + t];
            for (int i = 0; i < TM_KV_INT8_GROUP; i++) row[i] = s;
            const int64_t off = t * head_dim + g * TM_KV_INT8_GROUP;
            scale_run(block + off, row, TM_KV_INT8_GROUP, is_bf16, (char *)out + off * elem);
        }
}

#endif
