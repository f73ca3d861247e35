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
 * next one coming: ask for it while the current one is being used. */
static inline void prefetch_bytes(const void *start, int64_t bytes) {
    const char *p = (const char *)start;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
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
