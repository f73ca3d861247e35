/* One row's dynamic int8 quantization, shared by tm_quantize_rows_u8 (quantize.c) and the
 * fused int8 linear (int8_linear.c). It is compiled once, in quantize.c, so the two round
 * alike by construction (inlined in each, GCC's -ffast-math may round a scale apart by
 * one ulp depending on the context). */
#ifndef TOKENMILL_QUANTIZE_ROW_H
#define TOKENMILL_QUANTIZE_ROW_H

#include <stdint.h>

/* Row r of x ([rows, dim] fp32 or bf16): with y = x[r] * inv_smooth (NULL: all ones),
 * returns max|y| / qmax (1 for an all-zero row) and writes out[i] = round(y[i] / scale)
 * + zero_point, clamped to +-qmax first. With full_range the scale is max|y| / (qmax +
 * 0.5) and the codes are clamped to -(qmax + 1)..qmax: every code of the range, as
 * compressed-tensors quantizes a token (127.5, -128..127). Not exported from the
 * library's interface. */
float tm_internal_quantize_row_u8(const void *x, int64_t r, int64_t dim, int is_bf16,
                                  const float *inv_smooth, int qmax, int zero_point,
                                  int full_range, uint8_t *out);

#endif
