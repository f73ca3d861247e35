/* Decode attention straight over the paged KV cache.
 *
 * One query token per sequence attends to its whole context, read block by block
 * from the cache - no gathered copy of the keys and values is ever made. Each
 * (sequence, kv head) pair is one work item: its G query heads share every K and V
 * row loaded. Two passes: scores for all positions (K read once), then the
 * softmax-weighted sum of V (V read once). Storage is fp32 or bf16; math is fp32.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

/* Blocks sit at random places in the cache, so the hardware prefetcher cannot see the
 * next one coming: ask for it while the current one is being used. */
static inline void prefetch_bytes(const void *start, int64_t bytes) {
    const char *p = (const char *)start;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

static inline void load_row(const void *base, int64_t offset, int is_bf16, int64_t d, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)d * sizeof(float));
    }
}

/* q, out: [num_seqs, num_heads, head_dim]; k_cache: [num_blocks, num_kv_heads, head_dim,
 * block_size] (keys transposed within a block); v_cache: [num_blocks, num_kv_heads,
 * block_size, head_dim]; block_tables: [num_seqs, max_blocks]; context_lens: [num_seqs].
 * block_size <= MAX_BLOCK_SIZE, head_dim <= 256. */
#define MAX_BLOCK_SIZE 256
#define MAX_GROUP_SLACK 8

/* The two inner loops, written so that with head_dim and block_size known at compile
 * time (the common shapes are dispatched below) the accumulators live in registers. */
/* Scores of all `group` query heads against one key block. The query heads share
 * every key row loaded, and each head keeps two accumulators (even and odd head_dim
 * elements), so 2 * group independent FMA chains hide the FMA latency. */
static inline __attribute__((always_inline)) void score_block(
    const float *restrict q, const float *restrict kb, float *restrict out, int64_t out_stride,
    const int64_t group, const int64_t head_dim, const int64_t block_size) {
    float even[8][MAX_BLOCK_SIZE], odd[8][MAX_BLOCK_SIZE];
    for (int64_t g = 0; g < group; g++)
        for (int64_t t = 0; t < block_size; t++) even[g][t] = odd[g][t] = 0.f;
    for (int64_t i = 0; i + 1 < head_dim; i += 2) {
        const float *restrict k0 = kb + i * block_size;
        const float *restrict k1 = k0 + block_size;
        for (int64_t g = 0; g < group; g++) {
            const float q0 = q[g * head_dim + i], q1 = q[g * head_dim + i + 1];
            for (int64_t t = 0; t < block_size; t++) {
                even[g][t] += q0 * k0[t];
                odd[g][t] += q1 * k1[t];
            }
        }
    }
    if (head_dim % 2) {
        const float *restrict k0 = kb + (head_dim - 1) * block_size;
        for (int64_t g = 0; g < group; g++)
            for (int64_t t = 0; t < block_size; t++) even[g][t] += q[g * head_dim + head_dim - 1] * k0[t];
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t t = 0; t < block_size; t++) out[g * out_stride + t] = even[g][t] + odd[g][t];
}

/* One specialization per query-head group size for the common block size, so the
 * accumulators are registers; anything else takes the generic loop. */
#define SCORE_CASE(G) \
    case G: score_block(q, kb, out, out_stride, G, head_dim, 16); return;

static void score_block_any(const float *q, const float *kb, float *out, int64_t out_stride,
                            int64_t group, int64_t head_dim, int64_t block_size) {
    if (block_size == 16) {
        switch (group) {
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4)
            SCORE_CASE(5) SCORE_CASE(6) SCORE_CASE(7) SCORE_CASE(8)
            default: break;
        }
    }
    for (int64_t g0 = 0; g0 < group; g0 += 8) { /* generic: up to 8 heads at a time */
        const int64_t n = group - g0 < 8 ? group - g0 : 8;
        score_block(q + g0 * head_dim, kb, out + g0 * out_stride, out_stride, n, head_dim,
                    block_size);
    }
}

static inline __attribute__((always_inline)) void weigh_rows(
    const float *restrict p, const float *restrict v, int64_t n, int64_t row_stride,
    float *restrict out, const int64_t head_dim) {
    float acc[256];
    for (int64_t i = 0; i < head_dim; i++) acc[i] = out[i];
    for (int64_t j = 0; j < n; j++) {
        const float pj = p[j];
        const float *restrict vj = v + j * row_stride;
        for (int64_t i = 0; i < head_dim; i++) acc[i] += pj * vj[i];
    }
    for (int64_t i = 0; i < head_dim; i++) out[i] = acc[i];
}

static void weigh_rows_any(const float *p, const float *v, int64_t n, int64_t row_stride,
                           float *out, int64_t head_dim) {
    if (head_dim == 64) weigh_rows(p, v, n, row_stride, out, 64);
    else if (head_dim == 128) weigh_rows(p, v, n, row_stride, out, 128);
    else weigh_rows(p, v, n, row_stride, out, head_dim);
}

int tm_paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                              const int64_t *block_tables, const int64_t *context_lens,
                              void *out, int64_t num_seqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                              int64_t max_blocks, float scale, int is_bf16, int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_items = num_seqs * num_kv_heads;
    if (block_size > MAX_BLOCK_SIZE || head_dim > 256) return -2;
    int64_t max_ctx = 1;
    for (int64_t s = 0; s < num_seqs; s++) max_ctx = context_lens[s] > max_ctx ? context_lens[s] : max_ctx;
    const int64_t max_padded = (max_ctx + block_size - 1) / block_size * block_size;
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
    /* Scratch per thread, sized for the longest context, reused by all its items.
     * qf carries MAX_GROUP_SLACK spare heads, zeroed: GCC 12 at -O3 compiles the
     * specialized score_block cases into loads of q for up to 8 heads whatever the
     * group (found with a guard-page harness, tests/engine/test_kernel_bounds.py), so
     * without the slack a q buffer at the end of a heap page read past it and faulted. */
    float *qf = calloc((size_t)((group + MAX_GROUP_SLACK) * head_dim), sizeof(float));
    float *acc = malloc(sizeof(float) * (size_t)(group * head_dim));
    float *kblock = is_bf16 ? malloc(sizeof(float) * (size_t)(head_dim * block_size)) : NULL;
    float *scores = malloc(sizeof(float) * (size_t)(group * max_padded));
    const int ok = qf && acc && scores && (!is_bf16 || kblock);
    if (!ok) {
#pragma omp atomic write
        failed = 1;
    }

#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; item++) {
        if (!ok) continue;
        const int64_t s = item / num_kv_heads;
        const int64_t kh = item % num_kv_heads;
        const int64_t ctx = context_lens[s];
        const int64_t num_blocks = (ctx + block_size - 1) / block_size;
        const int64_t padded = num_blocks * block_size;
        memset(acc, 0, sizeof(float) * (size_t)(group * head_dim));
        for (int64_t g = 0; g < group; g++) {
            load_row(q, (s * num_heads + kh * group + g) * head_dim, is_bf16, head_dim,
                     qf + g * head_dim);
            for (int64_t i = 0; i < head_dim; i++) qf[g * head_dim + i] *= scale;
        }
        const int64_t *table = block_tables + s * max_blocks;

        /* Pass 1: scores of a whole block at once. Keys are [head_dim, block_size] per
         * block, so each q element scales one contiguous row of positions. */
        const int64_t elem = is_bf16 ? 2 : 4;
        const int64_t key_block_bytes = head_dim * block_size * elem;
        for (int64_t b = 0; b < num_blocks; b++) {
            const int64_t base = (table[b] * num_kv_heads + kh) * head_dim * block_size;
            if (b + 1 < num_blocks)
                prefetch_bytes((const char *)k_cache +
                                   (table[b + 1] * num_kv_heads + kh) * head_dim * block_size * elem,
                               key_block_bytes);
            const float *kb = (const float *)k_cache + base;
            if (is_bf16) { /* widen the block once; every query head reuses it */
                load_row(k_cache, base, 1, head_dim * block_size, kblock);
                kb = kblock;
            }
            score_block_any(qf, kb, scores + b * block_size, padded, group, head_dim, block_size);
        }
        /* Softmax per query head, over the ctx real positions. */
        for (int64_t g = 0; g < group; g++) {
            float *sg = scores + g * padded;
            float max = -INFINITY;
            for (int64_t t = 0; t < ctx; t++) max = sg[t] > max ? sg[t] : max;
            float sum = 0.f;
            for (int64_t t = 0; t < ctx; t++) {
                sg[t] = expf(sg[t] - max);
                sum += sg[t];
            }
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            for (int64_t t = 0; t < ctx; t++) sg[t] *= inv;
        }
        /* Pass 2: acc[g] = sum_t p[g][t] * v_t */
        const int64_t value_block_bytes = block_size * head_dim * elem;
        for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {
            const int64_t b = t0 / block_size;
            const int64_t base = (table[b] * num_kv_heads + kh) * block_size * head_dim;
            const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;
            if (t0 + block_size < ctx)
                prefetch_bytes((const char *)v_cache +
                                   (table[b + 1] * num_kv_heads + kh) * block_size * head_dim * elem,
                               value_block_bytes);
            const float *vb = (const float *)v_cache + base;
            if (is_bf16) { /* widen the block's rows once for all query heads */
                load_row(v_cache, base, 1, n * head_dim, kblock);
                vb = kblock;
            }
            for (int64_t g = 0; g < group; g++)
                weigh_rows_any(scores + g * padded + t0, vb, n, head_dim, acc + g * head_dim,
                               head_dim);
        }
        for (int64_t g = 0; g < group; g++) {
            const int64_t offset = (s * num_heads + kh * group + g) * head_dim;
            if (is_bf16) {
                uint16_t *dst = (uint16_t *)out + offset;
                for (int64_t i = 0; i < head_dim; i++) dst[i] = f32_to_bf16(acc[g * head_dim + i]);
            } else {
                memcpy((float *)out + offset, acc + g * head_dim, sizeof(float) * (size_t)head_dim);
            }
        }
    }
    free(qf), free(acc), free(scores), free(kblock);
    }
    return failed ? -1 : 0;
}
