/* Bidirectional attention over a vision tower's patches on AMX tiles (tm_vision_attention,
 * kernels.h): every patch of an image sees every patch of that image, no cache, no mask.
 *
 * A SigLIP tower at 896 px attends over 4,096 patches per image in 16 heads of 72
 * channels; PyTorch's CPU flash attention runs that well below the CPU's bf16 matmul rate
 * (docs/design.md, "Attention in the vision tower"). Here both products run on AMX tiles
 * (`tdpbf16ps`: 16 x 32 bf16 by 32 x 16 bf16 into 16 x 16 fp32 sums) and the softmax is
 * flash-style: an item is 32 query rows of one image's head, the keys are taken 128 at a
 * time, a row's running maximum is raised (and its sums rescaled) only when a chunk's
 * score passes it by more than HEADROOM, and the rows are divided by their sums once at
 * the end. An item's scores (two chunks', 32 KiB),
 * weights (8 KiB) and sums (10 KiB at head_dim 72) stay near L1's size; each head's packed
 * keys and values (1.4 MiB at 4,096 patches) stay in L2, read by every item of the head.
 * The next chunk's scores are computed between the rows of this chunk's softmax
 * (softmax_chunk), so the tile unit multiplies while the vector units exponentiate.
 *
 * Layouts the tiles read, built once per image and head (pack_head):
 * - keys [seq / 16][dq / 2][16][2]: a block of 16 keys is, for each 32 channels, one
 *   16 pair-row x 64 byte tile (the second operand of the scores);
 * - values [dv / 16][seq / 2][16][2]: for each 16 channels, 32 keys are one 16 pair-row
 *   x 64 byte tile (the second operand of the weighted sums);
 * with head_dim zero-padded to dq (a multiple of 32) and dv (a multiple of 16), and the
 * sequence to a multiple of 32: padded keys are masked out of the softmax, padded query
 * rows are computed and never stored.
 *
 * Arithmetic: q . k summed in fp32 on the tiles, the softmax in fp32 with exp2 from a
 * degree-3 polynomial (relative error below 8.6e-5, far under bf16's 2^-9), the weights
 * rounded to bf16 for the second product as PyTorch's own CPU flash attention does, and
 * each output row divided by its sum of weights and rounded to bf16 once. Where head_dim
 * leaves a padding channel (72 in 80) that channel of the values is 1, so the tiles sum
 * the bf16 weights the rows were weighed with, and the vector units skip an add per 16
 * scores; elsewhere the fp32 weights are summed. The sums run in another order than
 * PyTorch's, so results agree to rounding, not bit for bit.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_VISION_AMX 1
#include <immintrin.h>
#include <omp.h>

#define ITEM_ROWS 32  /* query rows per item: two row tiles */
#define CHUNK_KEYS 128 /* keys per softmax step */
#define MASKED_SCORE (-1e30f)

typedef struct {
    int64_t seq, seq_pad, dq, dv;
    int ones; /* dv > head_dim: channel head_dim of the values is 1 for every real key, so
                 the weighted sums' tile products also sum the weights */
} Shape;

/* A thread's scratch for one item, 64-byte aligned for the tiles. */
typedef struct {
    uint16_t *q;   /* [ITEM_ROWS][dq] the item's query rows, zero-padded */
    float *scores; /* [2][ITEM_ROWS][CHUNK_KEYS]: this chunk's, the next one's */
    uint16_t *weights; /* [ITEM_ROWS][CHUNK_KEYS] bf16 */
    float *sums;   /* [ITEM_ROWS][dv] the unnormalised weighted sums */
    float max[ITEM_ROWS], total[ITEM_ROWS]; /* running max (scaled, log2 units) and sum */
} Scratch;

static void *aligned(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* 2^x for x <= HEADROOM (softmax_row): 2^f from a degree-3 polynomial on [0, 1) (relative error 8.6e-5, over
 * twenty times under the half-ulp of the bf16 the weights are rounded to; p(0) = 1, so the
 * row's maximum weighs exactly 1), scaled by 2^n, x = n + f with n = floor(x). vreduceps
 * gives f = x - floor(x) in one instruction and vscalefps floors x itself, so n is never
 * formed; a very negative x gives 0 (a masked score's -1e30 has f = 0). A degree more
 * would cost a quarter more vector instructions in the exponentials, the softmax's
 * bottleneck, for accuracy the bf16 weights throw away. */
static inline __m512 exp2_ps(__m512 x) {
    const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF);
    __m512 p = _mm512_set1_ps(7.7065498e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2764668e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9511640e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, x);
}

static inline __mmask16 lanes_below(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF : count <= 0 ? 0 : (__mmask16)((1u << count) - 1);
}

/* One head's keys and values of one image into the tiles' layouts (header comment). Keys
 * move as pairs of channels (one 32-bit word each: the layout keeps a pair together);
 * values as 16 channels of two keys at a time, interleaved in one 512-bit store. */
static void pack_head(const tm_vision_attention_args *a, Shape s, int64_t image, int64_t head,
                      uint16_t *keys, uint16_t *values) {
    const int64_t d = a->head_dim;
    const uint16_t *k = (const uint16_t *)a->k + image * s.seq * a->k_stride + head * d;
    const uint16_t *v = (const uint16_t *)a->v + image * s.seq * a->v_stride + head * d;
    memset(keys, 0, (size_t)(s.seq_pad * s.dq) * 2);
    memset(values, 0, (size_t)(s.seq_pad * s.dv) * 2);
    for (int64_t t = 0; t < s.seq; t++) {
        const uint16_t *row = k + t * a->k_stride;
        uint16_t *block = keys + (t / 16) * (s.dq / 2) * 32 + (t % 16) * 2;
        int64_t c = 0;
        for (; c + 1 < d; c += 2) { /* memcpy: the row may sit at any 2-byte boundary */
            uint32_t pair;
            memcpy(&pair, row + c, 4);
            memcpy(block + (c / 2) * 32, &pair, 4);
        }
        if (c < d) block[(c / 2) * 32] = row[c];
    }
    const int64_t group_elems = (s.seq_pad / 2) * 32;
    for (int64_t t = 0; t < s.seq; t += 2) {
        const uint16_t *even = v + t * a->v_stride, *odd = even + a->v_stride;
        const int has_odd = t + 1 < s.seq;
        uint16_t *pairs = values + (t / 2) * 32;
        for (int64_t c = 0; c < d; c += 16) {
            const __mmask16 m = lanes_below(d - c);
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, even + c));
            const __m512i hi = has_odd ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, odd + c))
                                       : _mm512_setzero_si512();
            _mm512_storeu_si512(pairs + (c / 16) * group_elems, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        if (s.ones) {
            uint16_t *one = pairs + (d / 16) * group_elems + (d % 16) * 2;
            one[0] = 0x3F80; /* bf16 1.0 */
            one[1] = has_odd ? 0x3F80 : 0;
        }
    }
}

/* The scores of the item's 32 rows against one chunk of keys, computed a step at a time
 * so that the steps can be spread between the rows of the previous chunk's softmax: the
 * tile unit then multiplies while the vector units take exponentials (the tiles run
 * asynchronously to the instructions after them). A step is one 32-channel slice of 32
 * keys; the last slice of 32 keys stores their scores. Tiles: 0-3 sums (row tile x 16
 * keys), 4-5 query rows, 6-7 keys. */
typedef struct {
    const uint16_t *keys; /* the chunk's first key block */
    float *scores;        /* [ITEM_ROWS][CHUNK_KEYS] */
    int64_t steps, done;
} ScoreSteps;

static ScoreSteps score_steps(Shape s, const uint16_t *keys, float *scores, int64_t k0,
                              int64_t count) {
    ScoreSteps job = {keys + (k0 / 16) * (s.dq / 2) * 32, scores, (count / 32) * (s.dq / 32), 0};
    return job;
}

/* Runs the job's steps up to `until` (at most its count). */
static inline void score_until(Shape s, const uint16_t *q, ScoreSteps *job, int64_t until) {
    const int64_t slices = s.dq / 32, q_bytes = s.dq * 2, stride = CHUNK_KEYS * 4;
    const int64_t block_elems = (s.dq / 2) * 32;
    if (until > job->steps) until = job->steps;
    for (; job->done < until; job->done++) {
        const int64_t kb = (job->done / slices) * 32, c = (job->done % slices) * 32;
        const uint16_t *block0 = job->keys + (kb / 16) * block_elems;
        if (c == 0) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        }
        _tile_loadd(4, q + c, q_bytes);
        _tile_loadd(5, q + 16 * s.dq + c, q_bytes);
        _tile_loadd(6, block0 + c * 16, 64);
        _tile_loadd(7, block0 + block_elems + c * 16, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (c + 32 == s.dq) {
            float *out = job->scores + kb;
            _tile_stored(0, out, stride);
            _tile_stored(1, out + 16, stride);
            _tile_stored(2, out + 16 * CHUNK_KEYS, stride);
            _tile_stored(3, out + 16 * CHUNK_KEYS + 16, stride);
        }
    }
}

/* A row's weights over a chunk, 2^(scale * score - shift) rounded to bf16 (masked keys
 * zero), their fp32 sum added to *total unless the tiles sum them; returns the lanes'
 * largest exponent, scale * score - shift, over the real keys. `full` (a constant at each
 * call) says all `count` keys are real and drops the masks from the loop. */
static inline __m512 weigh_row(const float *row, __m512 scale, __m512 shift, uint16_t *out,
                               int64_t count, int64_t valid, const int full,
                               const int sum_on_tiles, __m512 *total) {
    __m512 top = _mm512_set1_ps(MASKED_SCORE);
    for (int64_t j = 0; j < count; j += 32) {
        const __m512 x0 = _mm512_fmsub_ps(_mm512_loadu_ps(row + j), scale, shift);
        const __m512 x1 = _mm512_fmsub_ps(_mm512_loadu_ps(row + j + 16), scale, shift);
        __m512 p0 = exp2_ps(x0), p1 = exp2_ps(x1);
        if (full) {
            top = _mm512_max_ps(top, _mm512_max_ps(x0, x1));
        } else {
            const __mmask16 m0 = lanes_below(valid - j), m1 = lanes_below(valid - j - 16);
            top = _mm512_mask_max_ps(top, m0, top, x0);
            top = _mm512_mask_max_ps(top, m1, top, x1);
            p0 = _mm512_maskz_mov_ps(m0, p0);
            p1 = _mm512_maskz_mov_ps(m1, p1);
        }
        if (!sum_on_tiles) *total = _mm512_add_ps(*total, _mm512_add_ps(p0, p1));
        _mm512_storeu_si512(out + j, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    return top;
}

/* One row's softmax step over a chunk's scores: the chunk's weights (bf16; masked keys
 * zero) and the row's running sum, against a running maximum that is raised only when a
 * score passes it by more than HEADROOM (log2 units). Below that the weights are at most
 * 2^HEADROOM, as exact relative to their size in fp32 and bf16 as weights below 1, so
 * most chunks take one pass over their scores (the exponentials and their maximum
 * together) and no rescale; a chunk that passes it is weighed again against its own
 * maximum and the sums so far rescaled. `valid` of the chunk's `count` keys are real;
 * `full` (a constant at each call) says all are. */
#define HEADROOM 8.0f
static inline void softmax_row(Shape s, float log2_scale, const float *scores, Scratch *w,
                               int64_t r, int64_t count, int64_t valid, const int full,
                               const int sum_on_tiles) {
    const float *row = scores + r * CHUNK_KEYS;
    const float old_max = w->max[r];
    const __m512 scale = _mm512_set1_ps(log2_scale);
    uint16_t *out = w->weights + r * CHUNK_KEYS;
    __m512 total = _mm512_setzero_ps();
    if (old_max != MASKED_SCORE) { /* every chunk after the row's first */
        const __m512 top = weigh_row(row, scale, _mm512_set1_ps(old_max), out, count, valid,
                                     full, sum_on_tiles, &total);
        if (!_mm512_cmp_ps_mask(top, _mm512_set1_ps(HEADROOM), _CMP_GT_OQ)) {
            if (!sum_on_tiles) w->total[r] += _mm512_reduce_add_ps(total);
            return;
        }
        total = _mm512_setzero_ps();
    }
    __m512 top = _mm512_set1_ps(MASKED_SCORE);
    for (int64_t j = 0; j < count; j += 16) {
        const __m512 x = _mm512_loadu_ps(row + j);
        top = full ? _mm512_max_ps(top, x) : _mm512_mask_max_ps(top, lanes_below(valid - j), top, x);
    }
    const float chunk_max = _mm512_reduce_max_ps(top) * log2_scale;
    const float new_max = chunk_max > old_max ? chunk_max : old_max;
    weigh_row(row, scale, _mm512_set1_ps(new_max), out, count, valid, full, sum_on_tiles, &total);
    const float chunk_total = sum_on_tiles ? 0.0f : _mm512_reduce_add_ps(total);
    /* the vector exp2 on one lane: a libm call here (per row and chunk) cost a fifth of
     * the kernel's time, with its vzeroupper and the overlap it cuts */
    const float rescale = _mm512_cvtss_f32(exp2_ps(_mm512_set1_ps(old_max - new_max)));
    w->total[r] = w->total[r] * rescale + chunk_total;
    w->max[r] = new_max;
    float *sums = w->sums + r * s.dv;
    const __m512 factor = _mm512_set1_ps(rescale);
    for (int64_t c = 0; c < s.dv; c += 16)
        _mm512_storeu_ps(sums + c, _mm512_mul_ps(_mm512_loadu_ps(sums + c), factor));
}

/* The softmax step of the item's rows over a chunk of `count` keys (`valid` of them
 * real), with the next chunk's score steps spread between its rows. */
static void softmax_chunk(Shape s, float log2_scale, const float *scores, Scratch *w,
                          int64_t count, int64_t valid, ScoreSteps *next) {
    const int full = count == CHUNK_KEYS && valid >= CHUNK_KEYS;
    for (int64_t r = 0; r < ITEM_ROWS; r++) {
        if (full && s.ones)
            softmax_row(s, log2_scale, scores, w, r, CHUNK_KEYS, valid, 1, 1);
        else if (full)
            softmax_row(s, log2_scale, scores, w, r, CHUNK_KEYS, valid, 1, 0);
        else /* the total counts in both cases; where the tiles sum, it is not read */
            softmax_row(s, log2_scale, scores, w, r, count, valid, 0, 0);
        score_until(s, w->q, next, (r + 1) * next->steps / ITEM_ROWS);
    }
}

/* sums += weights x values[k0, k0 + count). Tiles: 0-3 sums (row tile x 16 channels, two
 * channel groups at a time), 4-5 weights, 6-7 values. */
static void weigh_chunk(Shape s, const uint16_t *values, Scratch *w, int64_t k0, int64_t count) {
    const int64_t sum_bytes = s.dv * 4, weight_bytes = CHUNK_KEYS * 2;
    const int64_t group_elems = (s.seq_pad / 2) * 32, groups = s.dv / 16;
    float *lo = w->sums, *hi = w->sums + 16 * s.dv;
    for (int64_t g = 0; g < groups; g += 2) {
        const int two = g + 1 < groups;
        _tile_loadd(0, lo + g * 16, sum_bytes);
        _tile_loadd(2, hi + g * 16, sum_bytes);
        if (two) {
            _tile_loadd(1, lo + g * 16 + 16, sum_bytes);
            _tile_loadd(3, hi + g * 16 + 16, sum_bytes);
        }
        for (int64_t kb = 0; kb < count; kb += 32) {
            const uint16_t *pairs = values + g * group_elems + ((k0 + kb) / 2) * 32;
            _tile_loadd(4, w->weights + kb, weight_bytes);
            _tile_loadd(5, w->weights + 16 * CHUNK_KEYS + kb, weight_bytes);
            _tile_loadd(6, pairs, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
                _tile_loadd(7, pairs + group_elems, 64);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, lo + g * 16, sum_bytes);
        _tile_stored(2, hi + g * 16, sum_bytes);
        if (two) {
            _tile_stored(1, lo + g * 16 + 16, sum_bytes);
            _tile_stored(3, hi + g * 16 + 16, sum_bytes);
        }
    }
}

/* Query rows [row0, row0 + 32) of one image's head: gather, attend chunk by chunk, store
 * the rows that exist divided by their sums. */
static void attend_item(const tm_vision_attention_args *a, Shape s, const uint16_t *keys,
                        const uint16_t *values, int64_t image, int64_t head, int64_t row0,
                        Scratch *w) {
    const int64_t d = a->head_dim, rows = s.seq - row0 < ITEM_ROWS ? s.seq - row0 : ITEM_ROWS;
    const uint16_t *q = (const uint16_t *)a->q + (image * s.seq + row0) * a->q_stride + head * d;
    memset(w->q, 0, (size_t)(ITEM_ROWS * s.dq) * 2);
    for (int64_t r = 0; r < rows; r++) memcpy(w->q + r * s.dq, q + r * a->q_stride, (size_t)d * 2);
    memset(w->sums, 0, (size_t)(ITEM_ROWS * s.dv) * 4);
    for (int64_t r = 0; r < ITEM_ROWS; r++) w->max[r] = MASKED_SCORE, w->total[r] = 0.0f;
    const float log2_scale = a->scale * 1.44269504088896341f;
    const int64_t chunk_floats = ITEM_ROWS * CHUNK_KEYS;
#define CHUNK_COUNT(k0) (s.seq_pad - (k0) < CHUNK_KEYS ? s.seq_pad - (k0) : CHUNK_KEYS)
    ScoreSteps first = score_steps(s, keys, w->scores, 0, CHUNK_COUNT(0));
    score_until(s, w->q, &first, first.steps);
    for (int64_t k0 = 0, i = 0; k0 < s.seq_pad; k0 += CHUNK_KEYS, i++) {
        const int64_t count = CHUNK_COUNT(k0), next0 = k0 + CHUNK_KEYS;
        float *scores = w->scores + (i % 2) * chunk_floats;
        ScoreSteps next = score_steps(s, keys, w->scores + ((i + 1) % 2) * chunk_floats, next0,
                                      next0 < s.seq_pad ? CHUNK_COUNT(next0) : 0);
        softmax_chunk(s, log2_scale, scores, w, count, s.seq - k0, &next);
        score_until(s, w->q, &next, next.steps);
        weigh_chunk(s, values, w, k0, count);
    }
#undef CHUNK_COUNT
    const int64_t out_stride = a->num_heads * d;
    uint16_t *out = (uint16_t *)a->out + (image * s.seq + row0) * out_stride + head * d;
    for (int64_t r = 0; r < rows; r++) {
        const float total = s.ones ? w->sums[r * s.dv + d] : w->total[r];
        const __m512 inverse = _mm512_set1_ps(1.0f / total);
        for (int64_t c = 0; c < d; c += 16) {
            const __mmask16 m = lanes_below(d - c);
            const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w->sums + r * s.dv + c), inverse);
            _mm256_mask_storeu_epi16(out + r * out_stride + c, m, (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
}

static int vision_attention_amx(const tm_vision_attention_args *a) {
    Shape s = {a->seq_len, (a->seq_len + 31) / 32 * 32, (a->head_dim + 31) / 32 * 32,
               (a->head_dim + 15) / 16 * 16, a->head_dim % 16 != 0};
    const int64_t heads = a->num_heads, head_elems = s.seq_pad * (s.dq + s.dv);
    const int64_t items_per_head = (s.seq + ITEM_ROWS - 1) / ITEM_ROWS;
    uint16_t *packed = aligned((size_t)(heads * head_elems) * 2);
    if (!packed) return TM_OUT_OF_MEMORY;
    int status = TM_OK;
    const int threads = a->num_threads > 0 ? a->num_threads : 1;
#pragma omp parallel num_threads(threads)
    {
        Scratch w;
        w.q = aligned((size_t)(ITEM_ROWS * s.dq) * 2);
        w.scores = aligned((size_t)(2 * ITEM_ROWS * CHUNK_KEYS) * 4);
        w.weights = aligned((size_t)(ITEM_ROWS * CHUNK_KEYS) * 2);
        w.sums = aligned((size_t)(ITEM_ROWS * s.dv) * 4);
        const int ok = w.q && w.scores && w.weights && w.sums;
        if (!ok) {
#pragma omp atomic write
            status = TM_OUT_OF_MEMORY;
        }
#pragma omp barrier
        int failed;
#pragma omp atomic read
        failed = status;
        if (!failed) {
            tm_configure_full_tiles();
            for (int64_t image = 0; image < a->num_images; image++) {
#pragma omp for schedule(static)
                for (int64_t h = 0; h < heads; h++)
                    pack_head(a, s, image, h, packed + h * head_elems,
                              packed + h * head_elems + s.seq_pad * s.dq);
                /* head-major: the threads work through one head's keys together, so they
                 * stay in cache */
#pragma omp for schedule(dynamic, 1)
                for (int64_t item = 0; item < heads * items_per_head; item++) {
                    const int64_t h = item / items_per_head;
                    const uint16_t *keys = packed + h * head_elems;
                    attend_item(a, s, keys, keys + s.seq_pad * s.dq, image, h,
                                (item % items_per_head) * ITEM_ROWS, &w);
                }
            }
            _tile_release();
        }
        free(w.q);
        free(w.scores);
        free(w.weights);
        free(w.sums);
    }
    free(packed);
    return status;
}
#endif

int tm_internal_vision_attention_amx(void) {
#ifdef HAVE_VISION_AMX
    return tm_internal_amx_permitted();
#else
    return 0;
#endif
}

int tm_vision_attention(const tm_vision_attention_args *a) {
    if (a->num_images < 0 || a->seq_len < 1 || a->num_heads < 1 || a->head_dim < 1 ||
        a->head_dim > TM_MAX_HEAD_DIM)
        return TM_UNSUPPORTED_SHAPE;
    if (!tm_internal_vision_attention_amx()) return TM_UNSUPPORTED_ISA;
#ifdef HAVE_VISION_AMX
    return vision_attention_amx(a);
#else
    return TM_UNSUPPORTED_ISA;
#endif
}
