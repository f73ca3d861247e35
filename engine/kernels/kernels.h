/* The native kernels' interface: every exported function, the one struct each takes, and
 * the limits the code assumes.
 *
 * Python mirrors each struct with one ctypes.Structure (engine/kernels/interface.py) and
 * reads the limits from tm_limits() at load, so nothing here is written a second time;
 * tm_limits() also reports each struct's size, and a mirror that drifted from this header
 * is refused at load rather than passing garbage.
 *
 * Conventions: tensors are contiguous unless a stride says otherwise; "fp32 or bf16" means
 * every tensor of the call has the one storage type `is_bf16` names; num_threads is an
 * upper bound for the OpenMP team (small calls run on one thread). Every entry point
 * returns a TM_* status.
 */
#ifndef TOKENMILL_KERNELS_H
#define TOKENMILL_KERNELS_H

#include <stdint.h>

/* Raised whenever a struct below changes. */
#define TM_ABI_VERSION 24

/* Limits. head_dim and block_size bound the attention kernel's per-thread scratch; a tile
 * holds TM_TILE_ROWS query rows (tokens x query heads of one kv head), so a kv head may
 * serve at most that many query heads. Elementwise rows live on the stack of an OpenMP
 * thread (whose stack may be as small as 2 MiB): TM_MAX_ROW_DIM floats at most. */
#define TM_MAX_HEAD_DIM 256
#define TM_MAX_BLOCK_SIZE 256
#define TM_TILE_ROWS 48
#define TM_MAX_HEADS_PER_KV_HEAD TM_TILE_ROWS
#define TM_MAX_ROW_DIM 65536
/* int8 KV caches keep one scale per this many values of a position's head (kv_int8.h);
 * head_dim must be a multiple of it. */
#define TM_KV_INT8_GROUP 32
/* A LoRA layer's blocks per adapter: one per PEFT target a fused layer holds (q, k, v). */
#define TM_LORA_MAX_BLOCKS 4
/* Quantization: values stored as uint8 around a zero point, so qmax + zero_point <= 255. */
#define TM_MAX_QMAX 127
/* int8 products sum u8 x s8 pairs in int32: 255 * 127 * k stays below 2^31 up to here. */
#define TM_MAX_INT8_K 65536

enum {
    TM_OK = 0,
    TM_OUT_OF_MEMORY = -1,    /* scratch could not be allocated */
    TM_UNSUPPORTED_SHAPE = -2, /* a size beyond the limits above */
    TM_UNSUPPORTED_ISA = -3    /* the library was built for a CPU without the instructions */
};

/* The instructions tm_int8_linear was built with (tm_limits_t.int8_linear_isa). */
enum {
    TM_INT8_ISA_NONE = 0,
    TM_INT8_ISA_AVX512_VNNI = 1,
    TM_INT8_ISA_AMX = 2, /* AMX tiles from 8 rows on (k % 64 == 0), AVX512-VNNI below */
    TM_INT8_ISA_AVX2 = 3,    /* vpmaddubsw on signed pairs (int8_avx2.h) */
    TM_INT8_ISA_AVX_VNNI = 4 /* AVX2 with 256-bit vpdpbusd (int8_avx2.h) */
};

typedef struct {
    int64_t abi_version;
    int64_t max_head_dim;
    int64_t max_block_size;
    int64_t max_heads_per_kv_head;
    int64_t max_row_dim;
    int64_t max_qmax;
    int64_t max_int8_k;
    int64_t kv_int8_group;
    int64_t kv_int8_direct; /* 1: this build reads int8 caches (16-token blocks, head_dim 64,
                               128 or 256) in int16 dot products rather than widened */
    int64_t int8_linear_isa; /* TM_INT8_ISA_*: which int8 linear this build has */
    int64_t bf16_attention_amx; /* 1: attention over pair-layout bf16 caches runs whole
                                   groups of 16 query rows on AMX tiles (granted here) */
    int64_t q4_linear_isa; /* TM_INT8_ISA_* (never AMX): which 4-bit linear this build has */
    int64_t q4_linear_tiles; /* 1: tm_q4_linear_tiles runs here (AMX bf16, granted) */
    int64_t lora_isa;      /* TM_LORA_ISA_*: how tm_lora computes here */
    int64_t lora_max_blocks;
    int64_t packed_matvec_vector; /* 1: tm_packed_matvec runs vdpbf16ps; 0: plain loops */
    /* sizeof each argument struct, in the order they are declared below */
    int64_t attention_args_size;
    int64_t kv_write_args_size;
    int64_t rms_norm_args_size;
    int64_t rotary_args_size;
    int64_t silu_args_size;
    int64_t quantize_args_size;
    int64_t int8_linear_args_size;
    int64_t argmax_args_size;
    int64_t int4_unpack_args_size;
    int64_t q4_linear_args_size;
    int64_t q4_unpack_args_size;
    int64_t lora_args_size;
    int64_t packed_matvec_args_size;
    /* moe.c */
    int64_t moe_isa;       /* TM_MOE_ISA_*: how tm_moe computes here */
    int64_t moe_max_top_k;
    int64_t moe_args_size;
    /* fp8_linear.c */
    int64_t fp8_linear_isa; /* TM_FP8_ISA_*: the vectors tm_fp8_linear's sums compile to */
    int64_t fp8_linear_args_size;
    /* vision_attention.c */
    int64_t vision_attention_amx; /* 1: tm_vision_attention runs here (AMX bf16, granted) */
    int64_t vision_attention_args_size;
    /* layer_norm.c */
    int64_t layer_norm_args_size;
    /* int4_unpack.c's packing */
    int64_t int4_pack_args_size;
    /* gguf_dequantize.c */
    int64_t gguf_dequantize_args_size;
    int64_t q4_pack_gguf_args_size;
} tm_limits_t;

/* Fills *out with the constants above. */
void tm_limits(tm_limits_t *out);

/* ---- paged_attention.c ---------------------------------------------------------------
 * Attention for every query token of a step, straight over the paged KV cache. Each entry
 * is a sequence's chunk of `queries[e]` tokens whose keys and values are already in the
 * cache; its token i sits at position contexts[e] - queries[e] + i and sees the positions
 * up to its own - only the last `sliding_window` of them when that is > 0 (position p sees
 * (p - sliding_window, p], as transformers' sliding-window masks do). Entries come in
 * groups [group_starts[k], group_starts[k + 1]): a group of one is cut into tiles; a larger
 * group holds decoding sequences whose first group_shared_blocks[k] blocks are the same
 * blocks, read once for all of them. Rows of `out` no entry covers are left unset. With
 * `sinks`, query head h's softmax has one more term in its denominator, exp(sinks[h]), a
 * logit no value goes with (gpt-oss's attention sinks). */
typedef struct {
    const void *q;                      /* [num_tokens, num_heads, head_dim] fp32 or bf16 */
    const void *k_cache;                /* [num_blocks, num_kv_heads, head_dim, block_size] */
    const void *v_cache;                /* [num_blocks, num_kv_heads, block_size, head_dim] */
    void *out;                          /* like q */
    const int64_t *rows;                /* [num_entries] the entry's first token in q */
    const int64_t *queries;             /* [num_entries] its query tokens */
    const int64_t *contexts;            /* [num_entries] positions its last token sees */
    const int64_t *block_tables;        /* [num_entries, max_blocks] */
    const int64_t *group_starts;        /* [num_groups + 1] */
    const int64_t *group_shared_blocks; /* [num_groups] */
    const float *sinks;                 /* [num_heads] fp32, or NULL: no sinks */
    int64_t num_groups;
    int64_t num_heads;    /* a multiple of num_kv_heads, <= its TM_MAX_HEADS_PER_KV_HEAD times */
    int64_t num_kv_heads;
    int64_t head_dim;     /* <= TM_MAX_HEAD_DIM */
    int64_t block_size;   /* <= TM_MAX_BLOCK_SIZE */
    int64_t max_blocks;   /* columns of block_tables */
    int64_t sliding_window; /* 0: every earlier position is seen */
    float scale;          /* multiplies q . k */
    int32_t is_bf16;
    int32_t num_threads;
    int32_t kv_int8;      /* 1: the caches are int8 (kv_int8.h); q and out stay is_bf16's */
} tm_attention_args;

int tm_paged_attention(const tm_attention_args *args);

/* Stores each new token's key and value in its cache slot (block slot_blocks[t], offset
 * slot_offsets[t]), keys transposed within the block as tm_paged_attention reads them.
 * Where tm_stores_bf16_pairs says so for its shape, a bf16 cache is laid out for bf16 dot
 * products instead: within a block, key element d of
 * position t at (d / 2) * 32 + t * 2 + d % 2, value element c of position t at
 * (t / 2) * 2 * head_dim + c * 2 + t % 2. Caches of that kind are written and read only
 * by these two functions. An int8 cache (kv_int8) holds int8 values at the positions the
 * float cache of is_bf16's type would use, each kv head's block followed by its fp32 group
 * scales: [num_blocks, num_kv_heads, kv_int8_head_bytes] bytes (kv_int8.h). */
typedef struct {
    const void *k;              /* [num_tokens, num_kv_heads, head_dim], the cache's type */
    const void *v;              /* like k */
    void *k_cache;              /* [num_blocks, num_kv_heads, head_dim, block_size] */
    void *v_cache;              /* [num_blocks, num_kv_heads, block_size, head_dim] */
    const int64_t *slot_blocks;  /* [num_tokens] */
    const int64_t *slot_offsets; /* [num_tokens] */
    int64_t num_tokens;
    int64_t num_kv_heads;
    int64_t head_dim;
    int64_t block_size;
    int32_t is_bf16;      /* k and v's type (and the cache's, unless kv_int8) */
    int32_t num_threads;
    int32_t kv_int8;      /* 1: quantize into int8 caches (kv_int8.h) */
} tm_kv_write_args;

int tm_write_kv_cache(const tm_kv_write_args *args);

/* ---- elementwise.c: bit-exact with PyTorch's CPU ops (SiLU: to the last bit or so) ---- */

/* RMSNorm of `rows` rows of `dim` (<= TM_MAX_ROW_DIM), after residual += x (in place) when
 * residual is not NULL: out = rmsnorm(residual or x) * weight. */
typedef struct {
    const void *x;      /* [rows, dim] fp32 or bf16 */
    void *residual;     /* like x, or NULL */
    void *out;          /* like x */
    const void *weight; /* [dim], like x, or fp32 where fp32_weight */
    int64_t rows;
    int64_t dim;
    float eps;
    int32_t is_bf16;
    int32_t num_threads;
    int32_t fp32_weight; /* bf16 rows, fp32 weight: normalised and scaled in fp32, rounded
                            to bf16 once (Gemma's (1 + weight)); 0 otherwise */
} tm_rms_norm_args;

int tm_rms_norm(const tm_rms_norm_args *args);

/* Rotary (rotate-halves layout, even head_dim) on q and k, and a contiguous copy of v, in
 * one pass over the tokens. q, k, v rows are `*_stride` elements apart (views into the qkv
 * projection's output), each token's heads contiguous. */
typedef struct {
    const void *q;   /* [num_tokens, num_heads, head_dim], rows q_stride apart */
    const void *k;   /* [num_tokens, num_kv_heads, head_dim], rows k_stride apart */
    const void *v;   /* like k, rows v_stride apart */
    int64_t q_stride;
    int64_t k_stride;
    int64_t v_stride;
    void *q_out;     /* contiguous */
    void *k_out;
    void *v_out;
    const void *cos; /* [num_tokens, head_dim] full-width tables */
    const void *sin; /* signed for the swapped halves */
    int64_t num_tokens;
    int64_t num_heads;
    int64_t num_kv_heads;
    int64_t head_dim;
    int32_t is_bf16;
    int32_t num_threads;
} tm_rotary_args;

int tm_rotary_qkv(const tm_rotary_args *args);

/* out = act(gate) * up for x = [gate | up] on each row: [rows, 2 * dim] -> [rows, dim],
 * dim <= TM_MAX_ROW_DIM; act is SiLU (tm_silu_and_mul) or tanh-approximated GELU
 * (tm_gelu_tanh_and_mul, Gemma's GeGLU). */
typedef struct {
    const void *x;
    void *out;
    int64_t rows;
    int64_t dim;
    int32_t is_bf16;
    int32_t num_threads;
} tm_silu_args;

int tm_silu_and_mul(const tm_silu_args *args);
int tm_gelu_tanh_and_mul(const tm_silu_args *args);

/* ---- gelu.c: out = gelu(x, approximate="tanh") over rows * dim values (dim unbounded;
 * out may be x) ---- */
int tm_gelu_tanh(const tm_silu_args *args);

/* ---- layer_norm.c: sum = x + residual (rounded to the dtype), out = LayerNorm(sum) *
 * weight + bias over rows of dim <= TM_MAX_ROW_DIM; sum may be x ---- */
typedef struct {
    const void *x;        /* [rows, dim] fp32 or bf16 */
    const void *residual; /* like x */
    void *sum;            /* like x */
    void *out;            /* like x */
    const void *weight;   /* [dim], like x */
    const void *bias;     /* [dim], like x */
    int64_t rows;
    int64_t dim;
    float eps;
    int32_t is_bf16;
    int32_t num_threads;
} tm_layer_norm_args;

int tm_add_layer_norm(const tm_layer_norm_args *args);

/* ---- quantize.c ----------------------------------------------------------------------
 * Dynamic per-row int8 quantization: with y = x * inv_smooth, scales[r] = max|y[r]| / qmax
 * (1 for an all-zero row) and out[r, i] = round(y[r, i] / scales[r]) + zero_point, clamped
 * to +-qmax first. qmax <= TM_MAX_QMAX, qmax + zero_point <= 255. full_range: the scale
 * max|y[r]| / (qmax + 0.5) and the codes clamped to -(qmax + 1)..qmax (compressed-tensors'
 * rounding of a token; zero_point > qmax). */
typedef struct {
    const void *x;            /* [rows, dim] fp32 or bf16 */
    const float *inv_smooth;  /* [dim], or NULL for all ones */
    uint8_t *out;             /* [rows, dim] */
    float *scales;            /* [rows] */
    int64_t rows;
    int64_t dim;
    int32_t is_bf16;
    int32_t qmax;
    int32_t zero_point;
    int32_t num_threads;
    int32_t full_range;
} tm_quantize_args;

int tm_quantize_rows_u8(const tm_quantize_args *args);

/* ---- int8_linear.c -------------------------------------------------------------------
 * An int8 linear layer's forward: each row of x quantized as tm_quantize_rows_u8 does with
 * qmax 127 and zero point 128 (into qx and x_scales, which the caller provides), then
 * out[m, n] = (sum_k qx[m, k] * w[n, k] - 128 * w_col_sums[n]) * x_scales[m]
 *             * w_scales[n] + bias[n],
 * the sums exact in int32. The s8 weights are packed in panels of 16 output channels, each
 * [k / 4][16][4] (engine/kernels/int8_linear.py packs them). n % 16 == 0, k % 4 == 0,
 * k <= TM_MAX_INT8_K. Built where the compiler targets AVX512-VNNI (with AMX tiles where
 * it targets those too) or AVX2 and FMA (with AVX-VNNI where it targets that); elsewhere
 * it returns TM_UNSUPPORTED_ISA and tm_limits says so. Every build gives the same bits.
 *
 * With `activation` set (a gated MLP's gate and up projections in one weight; every
 * build that has the product), the weight's panels alternate gate and up
 * (panel 2i: gate channels 16i.., panel 2i + 1: the up channels for them; n % 32 == 0) and
 * out is [rows, n / 2]: act(gate) * up, computed from the fp32 epilogue values and rounded
 * once - SiLU-and-mul in the product's epilogue, with no gate_up tensor written. */
typedef struct {
    const void *x;             /* [rows, k] fp32 or bf16 */
    const float *inv_smooth;   /* [k] per-channel factors applied first, or NULL */
    uint8_t *qx;               /* [rows, k] out: the quantized rows */
    float *x_scales;           /* [rows] out: their scales */
    const int8_t *w;           /* [n / 16, k / 4, 16, 4] */
    const int32_t *w_col_sums; /* [n] sum over k of w[n, k] */
    const float *w_scales;     /* [n] */
    const float *bias;         /* [n], or NULL */
    void *out;                 /* [rows, n] (n / 2 with an activation), x's type */
    int64_t rows;
    int64_t n;
    int64_t k;
    int32_t is_bf16;
    int32_t num_threads;
    int32_t activation; /* TM_GATED_*: 0 for a plain product */
    int32_t x_full_range; /* 1: rows quantized with full_range (tm_quantize_args); not on
                             plain AVX2 builds (TM_UNSUPPORTED_SHAPE), where -128 has no
                             sign to flip */
} tm_int8_linear_args;

enum {
    TM_GATED_NONE = 0,
    TM_GATED_SILU = 1,     /* silu(gate) * up */
    TM_GATED_GELU_TANH = 2, /* gelu_tanh(gate) * up (Gemma) */
    /* tm_moe only (gpt-oss): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
     * g = min(gate, limit); alpha and limit are tm_moe_args' swiglu_alpha, swiglu_limit */
    TM_GATED_CLAMPED_SWIGLU = 3
};

int tm_int8_linear(const tm_int8_linear_args *args);
/* Internal (tm_limits reports them): the TM_INT8_ISA_* this build of int8_linear.c has,
 * whether it attends to pair-layout bf16 caches on AMX tiles, and whether it reads int8
 * caches directly. */
int tm_int8_linear_isa(void);
int tm_internal_bf16_attention_amx(void);
int tm_internal_kv_int8_direct(void);

/* 1 where this build keeps a bf16 cache of this block size and head_dim in the pair layout
 * (tm_write_kv_cache), else 0: the one statement of that rule, which Python asks. */
int tm_stores_bf16_pairs(int64_t block_size, int64_t head_dim);

/* ---- argmax.c: exact (comparisons only) ---- */

/* out[r] = torch.argmax(x[r]) for each of `rows` rows of `n` fp32 values: the first
 * largest value's index, or the first NaN's where a row has one. */
typedef struct {
    const float *x; /* [rows, n], contiguous */
    int64_t *out;   /* [rows] */
    int64_t rows;
    int64_t n;
    int32_t num_threads;
} tm_argmax_args;

int tm_argmax_rows(const tm_argmax_args *args);

/* ---- int4_unpack.c: exact (each weight computed in fp32, rounded once) ---- */

/* out[k][n] = bf16((q[n][k] - 8) * scale[k / group][n] + zero[k / group][n]) for int4
 * weights in PyTorch's CPU int4pack layout (n % 64 == 0; the layout: int4_unpack.c). */
typedef struct {
    const void *packed;           /* uint8 [n / 64][k][32] */
    const void *scales_and_zeros; /* bf16 [k / group][n][2] */
    void *out;                    /* bf16 [k][n] */
    int64_t n;
    int64_t k;
    int64_t group;
    int32_t num_threads;
} tm_int4_unpack_args;

int tm_int4_unpack_bf16(const tm_int4_unpack_args *args);

/* The inverse's first half: a float weight [n][k] quantized in groups of `group` inputs
 * (scale = (max - min) / 15, q = round((w - min) / scale) in 0..15, all in fp32) straight
 * into the layout above (n % 64 == 0, group <= TM_INT4_MAX_GROUP). */
#define TM_INT4_MAX_GROUP 256
typedef struct {
    const void *weight; /* [n][k] fp32 or bf16 (is_bf16) */
    void *packed;       /* uint8 [n / 64][k][32] */
    float *scale;       /* [n][k / group] */
    float *minimum;     /* [n][k / group] */
    int64_t *num_nonfinite; /* out: groups whose scale or minimum is not finite */
    int64_t n;
    int64_t k;
    int64_t group;
    int32_t is_bf16;
    int32_t num_threads;
} tm_int4_pack_args;

int tm_int4_pack(const tm_int4_pack_args *args);

/* ---- gguf_dequantize.c: exact (each weight one fp32 product, Q4_1 plus its minimum) ---- */

/* GGUF blocks of 32 weights decoded to fp32, block after block (the formats:
 * gguf_dequantize.c); with bf16, each fp32 value rounded to bf16 as torch rounds it
 * (to nearest, ties to even; NaN to 0x7fc0), with no fp32 copy of the tensor. */
enum { TM_GGUF_Q4_0 = 0, TM_GGUF_Q4_1 = 1, TM_GGUF_Q8_0 = 2 };
typedef struct {
    const void *blocks; /* num_blocks blocks of `kind`, back to back */
    void *out;          /* [num_blocks * 32] fp32, or bf16 (uint16 bits) with bf16 */
    int64_t num_blocks;
    int32_t kind;       /* TM_GGUF_* */
    int32_t num_threads;
    int32_t bf16;       /* 1: write bf16 */
} tm_gguf_dequantize_args;

int tm_gguf_dequantize(const tm_gguf_dequantize_args *args);

/* GGUF Q4_0 or Q4_1 rows (n rows of k / 32 blocks) moved into tm_q4_linear's layout, the
 * codes and fp16 scales (and minimums) as they are; n % 16 == 0, k % 32 == 0. */
typedef struct {
    const void *raw; /* [n][k / 32 blocks of 18 (Q4_0) or 20 (Q4_1) bytes] */
    void *out;       /* [n / 16][k / 32][288 or 320] as tm_q4_linear_args.w */
    int64_t n;
    int64_t k;
    int32_t affine; /* 1: Q4_1 */
    int32_t num_threads;
} tm_q4_pack_gguf_args;

int tm_q4_pack_gguf(const tm_q4_pack_gguf_args *args);

/* ---- q4_linear.c: integer dot products on 4-bit GGUF blocks ---------------------------
 * A Q4_0 or Q4_1 layer's forward as llama.cpp computes it: each row of x quantized in
 * blocks of 32 values (x_scales[m, b] = max|block| / 127, qx = round(x * 127 / max|block|),
 * to nearest even; a block with a NaN or infinity gets a NaN scale), then
 * out[m, n] = sum over blocks b, in order, of
 *     xs[m, b] * (d[n, b] * sum_j q[n, 32b + j] * qx[m, 32b + j] + min[n, b] * sum_j qx[m, 32b + j])
 *     + bias[n],
 * q in 0..15 and min = -8 * d for symmetric (Q4_0) blocks; the integer sums exact, the
 * float steps fixed by q4_linear.c's contract (the same bits on every build). Weights in
 * q4_linear.c's layout: [n / 16][k / 32][block bytes] (engine/kernels/q4_linear.py packs
 * them). n % 16 == 0, k % 32 == 0, k <= TM_MAX_INT8_K. Built where the compiler targets
 * AVX512-VNNI, or AVX2 with FMA (AVX-VNNI where it targets that); elsewhere it returns
 * TM_UNSUPPORTED_ISA and tm_limits says so. */
typedef struct {
    const void *x;       /* [rows, k] fp32 or bf16 */
    int8_t *qx;          /* [rows, k] out: the quantized rows */
    float *x_scales;     /* [rows, k / 32] out: their block scales */
    int32_t *x_sums;     /* [rows, k / 32] out: each block's sum of qx */
    const uint8_t *w;    /* [n / 16, k / 32, 288 (symmetric) or 320 (affine) bytes] */
    const float *bias;   /* [n], or NULL */
    void *out;           /* [rows, n], x's type */
    int64_t rows;
    int64_t n;
    int64_t k;
    int32_t is_bf16;
    int32_t num_threads;
    int32_t affine;      /* 1: blocks carry fp16 minimums (Q4_1); 0: min = -8 * d (Q4_0) */
} tm_q4_linear_args;

int tm_q4_linear(const tm_q4_linear_args *args);

/* The weights of a tm_q4_linear layout expanded to bf16, out[n][k] = bf16(d * q + min)
 * (symmetric: bf16(d * (q - 8))), each computed in fp32 - where the CPU's bf16 matmul
 * outruns the integer product at a call's row count (engine/quant/gguf_linear.py). Every
 * build has it. */
typedef struct {
    const uint8_t *w; /* as tm_q4_linear_args.w */
    void *out;        /* bf16 [n, k] */
    int64_t n;
    int64_t k;
    int32_t affine;
    int32_t num_threads;
} tm_q4_unpack_args;

int tm_q4_unpack_bf16(const tm_q4_unpack_args *args);
/* Internal (tm_limits reports it): the TM_INT8_ISA_* this build of q4_linear.c has. */
int tm_q4_linear_isa(void);

/* ---- q4_tiles.c: the same blocks on AMX bf16 tiles, exactly ---------------------------
 * out[m, n] = sum over k of x[m, k] * w[n, k] + bias[n], w = d * q + min in fp32 (the
 * blocks' dequantized values, exact), products exact and summed in fp32 in the tiles'
 * order, rounded once to bf16. Takes tm_q4_linear_args with is_bf16 = 1 (qx, x_scales and
 * x_sums unused); n % 16 == 0, k % 32 == 0, k <= TM_MAX_INT8_K. Built where the compiler
 * targets AMX-BF16 and AVX512-BF16/VBMI and Linux grants the tiles (tm_limits_t
 * .q4_linear_tiles); elsewhere TM_UNSUPPORTED_ISA. */
int tm_q4_linear_tiles(const tm_q4_linear_args *args);
/* Internal (tm_limits reports it): 1 where tm_q4_linear_tiles runs. */
int tm_q4_tiles_available(void);

/* ---- lora.c: every run of rows' LoRA terms in one call --------------------------------
 * For each run (slot, first, end) of `runs`:
 *     t = x[first:end] @ a[slot][:, :rank]
 *     y[first:end, out_lo:out_hi] += t[:, col_lo:col_hi]
 *                                    @ b[slot][col_lo:col_hi, out_lo:out_hi]
 * for each (col_lo, col_hi, out_lo, out_hi) of the slot's blocks (their output ranges
 * disjoint), with rank = slot_ranks[slot]. Sums in fp32; bf16 rounds t to bf16 and
 * y once after its add. Layouts: fp32 a [num_slots][in][a_cols], b
 * [num_slots][b_rows][b_cols]; bf16 in pairs of k, a [num_slots][in / 2][a_cols][2], b
 * [num_slots][b_rows / 2][b_cols][2], with in, b_rows and every col_lo, col_hi even.
 * Runs cover disjoint rows. Where bf16 runs on AMX (lora_isa) the tiles read k in whole
 * 16s and 16 columns past a block, so there b_cols >= out + 16, col_lo + (col_hi - col_lo)
 * rounded up to 16 <= b_rows, and b is zero outside the blocks' rows and columns. Every
 * build has it. */
typedef struct {
    const void *x;                 /* [rows, in] fp32 or bf16 */
    void *y;                       /* [rows, out], x's type: added to */
    const void *a;                 /* as above, x's type */
    const void *b;
    const int64_t *runs;           /* [num_runs][3]: slot, first row, end row */
    const int64_t *slot_ranks;     /* [num_slots] */
    const int64_t *slot_blocks;    /* [num_slots][TM_LORA_MAX_BLOCKS][4] */
    const int64_t *slot_num_blocks; /* [num_slots] */
    int64_t rows;
    int64_t num_runs;
    int64_t num_slots;
    int64_t in_features;
    int64_t out_features;
    int64_t a_cols;
    int64_t b_rows;
    int64_t b_cols;
    int32_t is_bf16;
    int32_t num_threads;
} tm_lora_args;

enum {
    TM_LORA_ISA_GENERIC = 0,     /* plain loops */
    TM_LORA_ISA_AVX512_BF16 = 1, /* AVX-512 FMA in fp32, vdpbf16ps in bf16 */
    TM_LORA_ISA_AMX = 2,         /* the same, and bf16 items of 16 rows on AMX tiles */
    TM_LORA_ISA_AVX512 = 3,      /* AVX-512 FMA in fp32 and bf16 (two per pair of k) */
    TM_LORA_ISA_AVX2 = 4         /* the same in AVX2 FMA */
};

int tm_lora(const tm_lora_args *args);
/* Internal (tm_limits reports it). */
int tm_lora_isa(void);

/* ---- packed_matvec.c: one row through a bf16 weight as oneDNN packs it ----------------
 *     y[o] = bf16(sum_k x[k] * w[o, k] + bias[o])
 * with the sum in fp32 and bias optional, for w in the layout oneDNN gives a packed bf16
 * linear weight on AVX-512 and AMX CPUs: output blocks of block_cols (16, 32 or 64) in
 * order, each [in / 2][block_cols][2], so that element (o, k) lies at
 *     ((o / block_cols) * (in / 2) + k / 2) * block_cols * 2 + (o % block_cols) * 2 + k % 2.
 * in_features even, out_features a multiple of block_cols. The caller establishes that a
 * packed weight has this layout (engine/quant/packed_linear.py checks each against
 * oneDNN's own product). Every build has it. */
typedef struct {
    const void *x;    /* bf16 [in_features] */
    const void *w;    /* bf16, as above */
    const void *bias; /* bf16 [out_features], or NULL */
    void *y;          /* bf16 [out_features] */
    int64_t in_features;
    int64_t out_features;
    int64_t block_cols;
    int32_t num_threads;
} tm_packed_matvec_args;

int tm_packed_matvec(const tm_packed_matvec_args *args);
/* Internal (tm_limits reports it). */
int tm_packed_matvec_vector(void);

/* ---- moe.c: a mixture-of-experts layer's experts, one call per layer -----------------
 * Every row's top_k experts' gated MLPs, weighted and summed back into the row:
 *     out[t] = sum_j expert_weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t])),
 * e = expert_ids[t, j] (distinct within a row), the terms added in ascending e. Weights
 * packed as moe.c's header states (engine/kernels/moe.py packs them): each projection's
 * output columns in panels of TM_MOE_PANEL_COLS, each panel's k-rows contiguous. */
#define TM_MOE_MAX_TOP_K 32
#define TM_MOE_PANEL_COLS 64
enum {
    TM_MOE_ISA_GENERIC = 0,     /* plain loops */
    TM_MOE_ISA_AVX512_BF16 = 1, /* AVX-512 FMA in fp32, vdpbf16ps in bf16 */
    TM_MOE_ISA_AMX = 2,         /* the same, and bf16 runs of 16 rows on AMX tiles */
    TM_MOE_ISA_AVX512 = 3,      /* AVX-512 FMA, bf16 pairs widened to fp32 (no AVX512-BF16) */
    TM_MOE_ISA_AVX2 = 4         /* AVX2 FMA on weights widened to fp32 (moe_avx2.h) */
};
/* tm_moe_args.weight_format: the experts in x's type, int8 with a scale per column,
 * int4 with a bf16 scale and minimum per column and group of 32 k-rows, or mxfp4 (e2m1
 * values with an e8m0 scale per column and group of 32 k-rows) (moe.c) */
enum { TM_MOE_FLOAT = 0, TM_MOE_INT8 = 1, TM_MOE_INT4 = 2, TM_MOE_MXFP4 = 3 };
typedef struct {
    const void *x;               /* [rows, hidden] fp32 or bf16 */
    const int64_t *expert_ids;   /* [rows, top_k] */
    const float *expert_weights; /* [rows, top_k] */
    const void *gate_up;         /* packed [num_experts] gate and up projections */
    const void *down;            /* packed [num_experts] down projections */
    const void *gate_up_scales;  /* TM_MOE_INT8, INT4, MXFP4: per panel, moe.c's */
    const void *down_scales;
    const float *gate_up_bias;   /* [num_experts][2 * inter] (gate's, then up's), or NULL */
    const float *down_bias;      /* [num_experts][hidden], or NULL */
    void *out;                   /* [rows, hidden], x's type */
    int64_t rows;
    int64_t top_k;               /* <= TM_MOE_MAX_TOP_K and num_experts */
    int64_t num_experts;
    int64_t hidden;              /* <= TM_MAX_ROW_DIM; even in bf16 */
    int64_t inter;               /* each expert's intermediate size; even in bf16 */
    int64_t panel_cols;          /* TM_MOE_PANEL_COLS: the packing's panel width */
    int32_t is_bf16;
    int32_t weight_format;       /* TM_MOE_* */
    int32_t activation;          /* TM_GATED_SILU, TM_GATED_GELU_TANH or TM_GATED_CLAMPED_SWIGLU */
    float swiglu_alpha;          /* TM_GATED_CLAMPED_SWIGLU's alpha and limit */
    float swiglu_limit;
    int32_t num_threads;
} tm_moe_args;

int tm_moe(const tm_moe_args *args);
/* Internal (tm_limits reports it). */
int tm_moe_isa(void);

/* ---- fp8_linear.c: a linear layer on FP8 (e4m3) weights ------------------------------
 *     out[r, o] = sum_i x[r, i] * (e4m3(w[o, i]) * scales[o / block_n, i / block_k]) + bias[o]
 * each weight one fp32 product of its code's value and its block's scale, the sums in
 * fp32. The scales cover blocks of block_n outputs by block_k inputs (the last ones
 * shorter): per tensor (n x k), per output channel (1 x k) or DeepSeek's 128 x 128. */
enum {
    TM_FP8_ISA_GENERIC = 0,     /* plain loops */
    TM_FP8_ISA_AVX2 = 1,        /* the same loops, compiled to AVX2 FMA */
    TM_FP8_ISA_AVX512 = 2,      /* ... to AVX-512 FMA */
    TM_FP8_ISA_AVX512_BF16 = 3, /* bf16 inputs: codes decoded to bf16, vdpbf16ps (fp8_bf16.h) */
    TM_FP8_ISA_AMX = 4          /* the same, and calls of 3 rows or more on AMX tiles */
};
typedef struct {
    const void *x;        /* [rows, k] fp32 or bf16 */
    const uint8_t *w;     /* [n, k] e4m3 codes (no NaN codes: the caller checks) */
    const float *scales;  /* [ceil(n / block_n), ceil(k / block_k)] */
    const float *bias;    /* fp32 [n], or NULL */
    void *out;            /* [rows, n], x's type */
    int64_t rows;
    int64_t n;
    int64_t k;
    int64_t block_n;
    int64_t block_k;
    int32_t is_bf16;
    int32_t num_threads;
    int32_t max_isa;      /* TM_FP8_ISA_*: the fastest path this call may take (tests pin
                           * the plain loops or the vector path with it) */
} tm_fp8_linear_args;

int tm_fp8_linear(const tm_fp8_linear_args *args);
/* Internal (tm_limits reports it). */
int tm_fp8_linear_isa(void);

/* ---- vision_attention.c: a vision tower's attention, every patch seeing its image's ----
 * For each image i, head h and patch t:
 *     out[i, t, h] = sum_u softmax_u(scale * q[i, t, h] . k[i, u, h]) * v[i, u, h]
 * over the image's seq_len patches u (bidirectional, no mask), in bf16 with fp32 sums and
 * softmax, the weights rounded to bf16 before they multiply v (as PyTorch's CPU flash
 * attention does). Token t of image i is row i * seq_len + t of q, k and v, rows
 * *_stride elements apart, each row's heads contiguous (views into one qkv projection's
 * output are fine); out is contiguous [num_images, seq_len, num_heads, head_dim].
 * head_dim <= TM_MAX_HEAD_DIM. Built where the compiler targets AMX-BF16 and
 * AVX512-BF16 and Linux grants the tiles (tm_limits_t.vision_attention_amx); elsewhere
 * TM_UNSUPPORTED_ISA, and the towers keep PyTorch's attention. */
typedef struct {
    const void *q;  /* bf16 [num_images * seq_len rows, q_stride] */
    const void *k;  /* bf16, like q, k_stride */
    const void *v;  /* bf16, like q, v_stride */
    void *out;      /* bf16 [num_images, seq_len, num_heads * head_dim] */
    int64_t num_images;
    int64_t seq_len;
    int64_t num_heads;
    int64_t head_dim;
    int64_t q_stride;
    int64_t k_stride;
    int64_t v_stride;
    float scale;    /* multiplies q . k */
    int32_t num_threads;
} tm_vision_attention_args;

int tm_vision_attention(const tm_vision_attention_args *args);
/* Internal (tm_limits reports it): 1 where tm_vision_attention runs. */
int tm_internal_vision_attention_amx(void);

#endif
