/* GGUF's Q4_0, Q4_1 and Q8_0 blocks decoded to fp32 (engine/loader/gguf_tensors.py): the
 * float tensors a GGUF stores in them - the embedding and often the output head, the
 * largest tensors of a model with a big vocabulary - at every start.
 *
 * Each block holds 32 weights and an fp16 scale d (Q4_1: and an fp16 minimum m):
 *   Q4_0 (18 bytes): d, 16 bytes of nibbles; weight j = d * ((byte j & 15) - 8) and
 *                    weight 16 + j = d * ((byte j >> 4) - 8), j < 16
 *   Q4_1 (20 bytes): d, m, 16 bytes; weight = d * q + m, the nibbles placed as Q4_0's
 *   Q8_0 (34 bytes): d, 32 int8 q; weight = d * q
 * Each product (and Q4_1's sum) is one fp32 rounding, as gguf.quants and gguf_blocks.py
 * compute them (the flags forbid contracting d * q + m into one fused rounding).
 */
#include <stdint.h>
#include <string.h>

#include "kernels.h"

/* IEEE half to single, exactly (normal, subnormal, zero, infinity and NaN). */
static inline float f16_to_f32(const uint8_t *bytes) {
    const uint16_t h = (uint16_t)(bytes[0] | (bytes[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0) {
        const float magnitude = (float)mantissa * 0x1p-24f; /* exact: mantissa < 2^10 */
        memcpy(&bits, &magnitude, sizeof bits);
        bits |= sign;
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline void q4_block(const uint8_t *b, int affine, float *out) {
    const float d = f16_to_f32(b);
    const float m = affine ? f16_to_f32(b + 2) : 0.0f;
    const uint8_t *nibbles = b + (affine ? 4 : 2);
    const int shift = affine ? 0 : 8;
    for (int j = 0; j < 16; j++) {
        const float low = d * (float)((nibbles[j] & 15) - shift);
        const float high = d * (float)((nibbles[j] >> 4) - shift);
        out[j] = affine ? low + m : low;
        out[16 + j] = affine ? high + m : high;
    }
}

static inline void q8_block(const uint8_t *b, float *out) {
    const float d = f16_to_f32(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) out[j] = d * (float)q[j];
}

int tm_gguf_dequantize(const tm_gguf_dequantize_args *a) {
    static const int64_t block_bytes[] = {18, 20, 34}; /* TM_GGUF_Q4_0, Q4_1, Q8_0 */
    if (a->kind < 0 || a->kind > TM_GGUF_Q8_0 || a->num_blocks < 0) return TM_UNSUPPORTED_SHAPE;
    const int64_t nbytes = block_bytes[a->kind];
    const uint8_t *blocks = (const uint8_t *)a->blocks;
#pragma omp parallel for schedule(static) num_threads(a->num_threads)
    for (int64_t i = 0; i < a->num_blocks; i++) {
        if (a->kind == TM_GGUF_Q8_0)
            q8_block(blocks + i * nbytes, a->out + i * 32);
        else
            q4_block(blocks + i * nbytes, a->kind == TM_GGUF_Q4_1, a->out + i * 32);
    }
    return TM_OK;
}
