/* AVX-512 pieces the integer linear kernels (int8_linear.c, q4_linear.c) share: the
 * vpdpbusd dot product and the store of 16 results in the output's dtype. Included after
 * <immintrin.h> by a file built for AVX512-VNNI. */
#ifndef TOKENMILL_AVX512_EPILOGUE_H
#define TOKENMILL_AVX512_EPILOGUE_H

#include <stdint.h>

/* acc += u8 x s8 dot products of four (vpdpbusd). Written as inline assembly because GCC
 * 12's intrinsic copies the accumulator through a spare register (or the stack) at every
 * use (docs/design.md, "Our own int8 kernel"); GCC and Clang both take this form. */
static inline __attribute__((always_inline)) __m512i tm_dot4(__m512i acc, __m512i u8, __m512i s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
    return acc;
}

/* 16 fp32 results stored at out[index..index + 16), as bf16 (rounded to nearest even, as
 * f32_to_bf16 does) when is_bf16, else as fp32. */
static inline void tm_store16(void *out, int is_bf16, int64_t index, __m512 v) {
    if (is_bf16) {
#if defined(__AVX512BF16__)
        __m256bh h = _mm512_cvtneps_pbh(v);
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + index), (__m256i)h);
#else
        __m512i u = _mm512_castps_si512(v);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
        __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + index), h);
#endif
    } else {
        _mm512_storeu_ps((float *)out + index, v);
    }
}

#endif
