/* Helpers shared by the native attention kernels: bf16 <-> fp32 and block prefetch. */
#ifndef TOKENMILL_KERNEL_COMMON_H
#define TOKENMILL_KERNEL_COMMON_H

#include <stdint.h>
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
 * next one coming: ask for it while the current one is being used. Into L2 (T1), not L1:
 * decode attention over 30 layers' caches ran 1.06x faster so (attention_kernel.py
 * --layers 30, two builds alternating; Emerald Rapids VM), as it spends most of its time
 * waiting on these lines. Every line: every other one (the adjacent-line prefetcher's
 * pairs) ran 0.87x. */
static inline void prefetch_bytes(const void *start, int64_t bytes) {
    const char *p = (const char *)start;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* How many blocks ahead a walk over a kv head's blocks asks for: using a block takes a
 * fraction of the time memory needs to deliver the next one from a random place in the
 * cache, so one block ahead left the walk waiting on latency (bf16 decode over 30
 * layers: 4 ahead ran 1.04x 1 ahead; the int8 direct path's earlier measure, below). */
#define BLOCK_PREFETCH_AHEAD 4

/* Before block b of a walk over [first, end) of table, in a cache laid out
 * [blocks][num_kv_heads][head_bytes]: at the walk's first block the next
 * BLOCK_PREFETCH_AHEAD - 1 of kv_head's are asked for, then at each block the one that
 * many on. Always inlined: as a call, it ran the int8 direct decode path 1.6x slower
 * (int8 cache 0.85-0.97x the bf16 cache against 1.35-1.42x inlined). */
static inline __attribute__((always_inline)) void prefetch_blocks_ahead(
    const void *cache, const int64_t *table, int64_t b, int64_t first, int64_t end,
    int64_t num_kv_heads, int64_t kv_head, int64_t head_bytes) {
    const char *base = (const char *)cache;
    if (b == first)
        for (int64_t f = first + 1; f < end && f < first + BLOCK_PREFETCH_AHEAD; f++)
            prefetch_bytes(base + (table[f] * num_kv_heads + kv_head) * head_bytes, head_bytes);
    if (b + BLOCK_PREFETCH_AHEAD < end)
        prefetch_bytes(base + (table[b + BLOCK_PREFETCH_AHEAD] * num_kv_heads + kv_head) * head_bytes,
                       head_bytes);
}

/* d elements of a fp32 or bf16 tensor, from element `offset`, widened to fp32. */
static inline void load_row(const void *base, int64_t offset, int is_bf16, int64_t d, float *dst) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + offset, (size_t)d * sizeof(float));
    }
}

/* d fp32 values into a fp32 or bf16 tensor at element `offset` (bf16 rounds to nearest
 * even). */
static inline void store_row(void *base, int64_t offset, int is_bf16, int64_t d, const float *src) {
    if (is_bf16) {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t i = 0; i < d; i++) dst[i] = f32_to_bf16(src[i]);
    } else {
        memcpy((float *)base + offset, src, (size_t)d * sizeof(float));
    }
}

#endif
