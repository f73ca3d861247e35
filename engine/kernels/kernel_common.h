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

/* Asks for `bytes` from `start`, every 64-byte line, into L2 (T1). Blocks sit at random
 * places in the cache, so the hardware prefetcher cannot see the next one coming, and
 * decode spends most of its time waiting on these lines. Why L2 and every line:
 * docs/design.md, "Decode attention". */
static inline void prefetch_bytes(const void *start, int64_t bytes) {
    const char *p = (const char *)start;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* How many blocks ahead a walk over a kv head's blocks asks for: using a block takes a
 * fraction of the time memory needs to deliver the next one from a random place in the
 * cache, so one block ahead leaves the walk waiting on latency. Why 4:
 * docs/design.md, "Decode attention". */
#define BLOCK_PREFETCH_AHEAD 4

/* Before block b of a walk over [first, end) of table, in a cache laid out
 * [blocks][num_kv_heads][head_bytes]: at the walk's first block the next
 * BLOCK_PREFETCH_AHEAD - 1 of kv_head's are asked for, then at each block the one that
 * many on. Must stay inlined into the walk's loop: as a call it cost the int8 direct
 * decode path most of its gain (docs/design.md, "Decode attention"). */
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
