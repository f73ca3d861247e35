/* tanh-approximated GELU over a tensor, in place or into another (tm_gelu_tanh,
 * kernels.h): the MLP activation of the SigLIP vision tower, applied after its fc1 matmul.
 *
 * A plain fc1 matmul and this pass over its product measured faster than the matmul
 * with oneDNN's own gelu_tanh post-op on the 896 px tower (fused_linear.py).
 *
 * gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), is x * sigmoid(2u)
 * = x / (1 + 2^t) with t = -2u log2(e): one exp2 and one division per value, no tanh.
 * With AVX-512, 2^t is a degree-4 polynomial of t - floor(t) (relative error 6.2e-6)
 * scaled by vscalefps, and 1 / (1 + 2^t) is vrcp14ps refined by one Newton step, so the
 * result is within about 1e-5 relative of the formula in fp32: well under the half-ulp
 * of bf16 (2^-9), and closer than PyTorch's fp32 tanh for x below about -5, where
 * 1 + tanh(u) loses its digits. Where t passes 126 (x below about -9.4; the true value
 * is under 1e-36) the result is -0, as PyTorch's is there: t is capped first so that 2^t
 * stays finite and the Newton step never multiplies 0 by infinity. NaN stays NaN.
 * Elsewhere (no AVX-512) activation.h's gelu_tanh_of.
 */
#include <stdint.h>

#include "activation.h"
#include "kernel_common.h"
#include "kernels.h"

/* A pass under this many values is too short to be worth waking threads. */
#define PARALLEL_MIN_ELEMENTS 16384

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_GELU_AVX512 1
#include <immintrin.h>

/* 2^f, f in [0, 1): p(0) = 1; least-squares coefficients of the relative error. */
static inline __m512 exp2_ps(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF);
    __m512 p = _mm512_set1_ps(1.3341537e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2352827e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4124981e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9304348e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, x);
}

static inline __m512 gelu_tanh_ps(__m512 x) {
    const float c = -1.5957691216057308f * 1.4426950408889634f; /* -2 sqrt(2/pi) log2(e) */
    const __m512 x2 = _mm512_mul_ps(x, x);
    __m512 t = _mm512_mul_ps(x, _mm512_fmadd_ps(x2, _mm512_set1_ps(c * 0.044715f),
                                                _mm512_set1_ps(c)));
    const __mmask16 finite = _mm512_cmp_ps_mask(t, _mm512_set1_ps(126.0f), _CMP_LE_OQ);
    t = _mm512_min_ps(t, _mm512_set1_ps(126.0f));
    const __m512 d = _mm512_add_ps(exp2_ps(t), _mm512_set1_ps(1.0f));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_maskz_mul_ps(finite, r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(x, r);
}

static inline __m512 load16(const void *x, int is_bf16, int64_t i, __mmask16 m) {
    if (!is_bf16) return _mm512_maskz_loadu_ps(m, (const float *)x + i);
    const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)x + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Rounded to nearest even, as f32_to_bf16 (and PyTorch) round. */
static inline void store16(void *out, int is_bf16, int64_t i, __m512 v, __mmask16 m) {
    if (!is_bf16) {
        _mm512_mask_storeu_ps((float *)out + i, m, v);
        return;
    }
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    _mm256_mask_storeu_epi16((uint16_t *)out + i, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
#endif

/* values [start, end) of x into out. */
static void gelu_span(const void *x, void *out, int is_bf16, int64_t start, int64_t end) {
#ifdef HAVE_GELU_AVX512
    for (int64_t i = start; i < end; i += 16) {
        const __mmask16 m = end - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (end - i)) - 1);
        store16(out, is_bf16, i, gelu_tanh_ps(load16(x, is_bf16, i, m)), m);
    }
#else
    for (int64_t i = start; i < end; i++) {
        if (is_bf16)
            ((uint16_t *)out)[i] = f32_to_bf16(gelu_tanh_of(bf16_to_f32(((const uint16_t *)x)[i])));
        else
            ((float *)out)[i] = gelu_tanh_of(((const float *)x)[i]);
    }
#endif
}

int tm_gelu_tanh(const tm_silu_args *a) {
    if (a->rows < 0 || a->dim < 1) return TM_UNSUPPORTED_SHAPE;
    const int64_t n = a->rows * a->dim, span = 4096;
    const int num_threads = a->num_threads > 0 ? a->num_threads : 1;
    /* spans of 4,096 values (a multiple of 16, so only the last is partial) */
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (num_threads > 1 && n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t start = 0; start < n; start += span)
        gelu_span(a->x, a->out, a->is_bf16, start, start + span < n ? start + span : n);
    return TM_OK;
}
