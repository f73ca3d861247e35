/* GGUF's Q4_0, Q4_1 and Q8_0 blocks decoded to fp32 or bf16 (engine/loader/gguf_tensors.py): the
 * float tensors a GGUF stores in them - the embedding and often the output head, the
 * largest tensors of a model with a big vocabulary - at every start. And Q4_0 and Q4_1
 * decoder weights moved, codes and fp16 scales as they are, into q4_linear.c's layout
 * (tm_q4_pack_gguf), which the gguf mode runs them in.
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

/* q4_linear.c's layout, as q4_linear.py's pack_q4_weight writes it: per panel of 16 rows
 * and block of 32 inputs, 256 bytes of nibbles - byte (s * 16 + c) * 4 + j holds row c's
 * code s * 4 + j in its low nibble and code (s + 4) * 4 + j in its high one (s, j < 4) -
 * then the 16 rows' fp16 scales, then (affine) their fp16 minimums. A GGUF block's code w
 * is the low nibble of byte w (w < 16) or the high nibble of byte w - 16; Q4_0's value
 * d * (code - 8) is the layout's symmetric form, Q4_1's d * code + m its affine one. */
int tm_q4_pack_gguf(const tm_q4_pack_gguf_args *a) {
    const int64_t n = a->n, k = a->k;
    if (n <= 0 || k <= 0 || n % 16 || k % 32) return TM_UNSUPPORTED_SHAPE;
    const int64_t in_bytes = a->affine ? 20 : 18, out_bytes = a->affine ? 320 : 288;
    const int64_t blocks = k / 32, head = a->affine ? 4 : 2;
    const uint8_t *raw = (const uint8_t *)a->raw;
    uint8_t *out = (uint8_t *)a->out;
#pragma omp parallel for schedule(static) num_threads(a->num_threads)
    for (int64_t panel = 0; panel < n / 16; panel++) {
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *dst = out + (panel * blocks + b) * out_bytes;
            for (int c = 0; c < 16; c++) {
                const uint8_t *src = raw + ((panel * 16 + c) * blocks + b) * in_bytes;
                uint8_t code[32];
                for (int w = 0; w < 16; w++) {
                    code[w] = src[head + w] & 15;
                    code[16 + w] = src[head + w] >> 4;
                }
                for (int s = 0; s < 4; s++)
                    for (int j = 0; j < 4; j++)
                        dst[(s * 16 + c) * 4 + j] =
                            (uint8_t)(code[s * 4 + j] | (code[(s + 4) * 4 + j] << 4));
                dst[256 + 2 * c] = src[0];
                dst[256 + 2 * c + 1] = src[1];
                if (a->affine) {
                    dst[288 + 2 * c] = src[2];
                    dst[288 + 2 * c + 1] = src[3];
                }
            }
        }
    }
    return TM_OK;
}

/* torch's fp32 -> bf16 (c10's round_to_nearest_even): the same bits as decoding to fp32
 * and calling .to(torch.bfloat16). */
static inline uint16_t f32_to_bf16(float f) {
    if (f != f) return 0x7fc0;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

int tm_gguf_dequantize(const tm_gguf_dequantize_args *a) {
    static const int64_t block_bytes[] = {18, 20, 34}; /* TM_GGUF_Q4_0, Q4_1, Q8_0 */
    if (a->kind < 0 || a->kind > TM_GGUF_Q8_0 || a->num_blocks < 0) return TM_UNSUPPORTED_SHAPE;
    const int64_t nbytes = block_bytes[a->kind];
    const uint8_t *blocks = (const uint8_t *)a->blocks;
#pragma omp parallel for schedule(static) num_threads(a->num_threads)
    for (int64_t i = 0; i < a->num_blocks; i++) {
        /* bf16 output decodes a block into 32 fp32 values on the stack, then rounds. */
        float block[32];
        float *out = a->bf16 ? block : (float *)a->out + i * 32;
        if (a->kind == TM_GGUF_Q8_0)
            q8_block(blocks + i * nbytes, out);
        else
            q4_block(blocks + i * nbytes, a->kind == TM_GGUF_Q4_1, out);
        if (a->bf16) {
            uint16_t *dst = (uint16_t *)a->out + i * 32;
            for (int j = 0; j < 32; j++) dst[j] = f32_to_bf16(block[j]);
        }
    }
    return TM_OK;
}
