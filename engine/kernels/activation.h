/* The gated MLPs' activations on one fp32 value, shared by elementwise.c's
 * SiLU/GELU-and-mul and int8_linear.c's gated epilogue, so that both compute them alike.
 *
 * Each file that includes this must be built without -ffast-math, without floating-point
 * contraction and with -fno-math-errno (engine/kernels/__init__.py, _FILE_FLAGS): then a
 * loop over these calls glibc's vector expf (libmvec), as it would under -ffast-math, and
 * the two files give the same bits. That exp is not PyTorch's, hence the odd last bit
 * against PyTorch's ops. */
#ifndef TOKENMILL_ACTIVATION_H
#define TOKENMILL_ACTIVATION_H

#pragma omp declare simd notinbranch
float expf(float);

/* silu(x) = x / (1 + exp(-x)). */
static inline float silu_of(float x) { return x / (1.0f + expf(-x)); }

/* GELU, tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3) -
 * which is x * sigmoid(2u) = x / (1 + exp(-2u)), so that it vectorises as SiLU does
 * (PyTorch evaluates tanh; the last bit may differ). */
static inline float gelu_tanh_of(float x) {
    const float two_sqrt_2_over_pi = 1.5957691216057308f; /* 2 * sqrt(2 / pi) */
    const float inner = x + 0.044715f * x * x * x;
    return x / (1.0f + expf(-two_sqrt_2_over_pi * inner));
}

#endif
