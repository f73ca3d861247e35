/* Attention straight over the paged KV cache: decode tokens and prompt chunks alike.
 *
 * Every query token is part of an entry - a sequence's chunk of `queries` tokens whose
 * keys and values are already in the cache, after whatever context came before (earlier
 * chunks, a cached shared prefix, generated tokens). Token i of an entry with `context`
 * positions sits at position context - queries + i and sees positions 0 .. that, so a
 * decode step is an entry of one token and a prompt chunk is causal attention.
 *
 * Work is split into items of one kv head each. An item's rows are query tokens times
 * the kv head's G query heads, and every key and value row read from the cache serves
 * all the rows that see it:
 * - a prompt chunk is cut into tiles of up to 48 rows, each an item: a key block is then
 *   used 48 times per load, so the tile runs at the speed of its FMAs, not of memory;
 * - decoding sequences that share leading blocks (a prompt prefix served from the prefix
 *   cache, or siblings of one prompt) form one item, and the shared blocks are read once
 *   for all of them rather than once per sequence. Decode is bound by reading the cache,
 *   so this is where it saves.
 * Three passes per item: every row's scores, an exact softmax per row, then the
 * weighted sum of values. Rows see different lengths (causality, different sequences);
 * weights past a row's length are zero. Storage is fp32 or bf16. Math is fp32, except
 * that bf16 caches with 16-token blocks use bf16 dot products where the CPU has them
 * (attention_bf16.h).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_bf16.h"
#include "kernel_common.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Query rows per tile, before rounding down to whole tokens: the scores of a tile with
 * a 2,048-token context are then 48 * 2048 * 4 = 384 KiB, resident in L2. */
#define TILE_ROWS 48
/* Rows per register block of the scoring micro-kernel: 12 independent FMA chains
 * cover the FMA latency on both pipes. */
#define SCORE_ROWS 12

/* Scores of n (<= SCORE_ROWS) query rows against one key block:
 * s[r * stride + t] = q[r] . k[:, t]. The block is [head_dim, block_size]. */
static inline __attribute__((always_inline)) void score_rows_generic(
    const float *restrict q, int64_t n, const float *restrict kb, float *restrict s,
    int64_t stride, int64_t head_dim, int64_t block_size) {
    for (int64_t r = 0; r < n; r++) {
        float *restrict sr = s + r * stride;
        for (int64_t t = 0; t < block_size; t++) sr[t] = 0.f;
        for (int64_t d = 0; d < head_dim; d++) {
            const float qd = q[r * head_dim + d];
            const float *restrict kd = kb + d * block_size;
            for (int64_t t = 0; t < block_size; t++) sr[t] += qd * kd[t];
        }
    }
}

#ifdef __AVX512F__
/* One key block of 16 positions is one vector per head_dim element: each row keeps one
 * accumulator, fed by a broadcast of its q element. N is a compile-time constant in
 * every call, so the accumulators are registers. */
static inline __attribute__((always_inline)) void score_rows_16(
    const float *restrict q, const int N, const float *restrict kb, float *restrict s,
    int64_t stride, const int64_t head_dim) {
    __m512 acc[SCORE_ROWS];
    for (int r = 0; r < N; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d++) {
        const __m512 k = _mm512_loadu_ps(kb + d * 16);
        for (int r = 0; r < N; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * head_dim + d]), k, acc[r]);
    }
    for (int r = 0; r < N; r++) _mm512_storeu_ps(s + r * stride, acc[r]);
}

/* acc[r] += sum_t p[r * stride + t] * v[t] over the m positions of a value block
 * ([block_size, head_dim], token-major), for N rows, head_dim = 16 * DV. Each row's
 * output is DV vectors held in registers across the block. */
static inline __attribute__((always_inline)) void weigh_rows_vec(
    const float *restrict p, int64_t stride, const float *restrict vb, int64_t m,
    float *restrict acc, const int N, const int DV) {
    __m512 o[24];
    for (int r = 0; r < N; r++)
        for (int c = 0; c < DV; c++) o[r * DV + c] = _mm512_loadu_ps(acc + (r * DV + c) * 16);
    for (int64_t t = 0; t < m; t++) {
        const float *restrict vt = vb + t * DV * 16;
        for (int c = 0; c < DV; c++) {
            const __m512 v = _mm512_loadu_ps(vt + c * 16);
            for (int r = 0; r < N; r++)
                o[r * DV + c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * stride + t]), v, o[r * DV + c]);
        }
    }
    for (int r = 0; r < N; r++)
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(acc + (r * DV + c) * 16, o[r * DV + c]);
}
#endif

static inline __attribute__((always_inline)) void weigh_rows_generic(
    const float *restrict p, int64_t stride, const float *restrict vb, int64_t m,
    float *restrict acc, int64_t n, int64_t head_dim) {
    for (int64_t r = 0; r < n; r++) {
        float *restrict ar = acc + r * head_dim;
        for (int64_t t = 0; t < m; t++) {
            const float pt = p[r * stride + t];
            const float *restrict vt = vb + t * head_dim;
            for (int64_t i = 0; i < head_dim; i++) ar[i] += pt * vt[i];
        }
    }
}

/* The weighted sum for all `rows` rows of a tile over one value block, in register
 * blocks of as many rows as 24 vector accumulators hold. */
static void weigh_block(const float *p, int64_t stride, const float *vb, int64_t m, float *acc,
                        int64_t rows, int64_t head_dim) {
#ifdef __AVX512F__
    if (head_dim == 64 || head_dim == 128) {
        const int dv = (int)(head_dim / 16), step = 24 / dv;
        int64_t r = 0;
        for (; r + step <= rows; r += step) {
            if (dv == 4) weigh_rows_vec(p + r * stride, stride, vb, m, acc + r * head_dim, 6, 4);
            else weigh_rows_vec(p + r * stride, stride, vb, m, acc + r * head_dim, 3, 8);
        }
        for (; r < rows; r++) { /* the tile's last few rows */
            if (dv == 4) weigh_rows_vec(p + r * stride, stride, vb, m, acc + r * head_dim, 1, 4);
            else weigh_rows_vec(p + r * stride, stride, vb, m, acc + r * head_dim, 1, 8);
        }
        return;
    }
#endif
    weigh_rows_generic(p, stride, vb, m, acc, rows, head_dim);
}

#define SCORE_CASE(N) \
    case N: score_rows_16(q, N, kb, s, stride, head_dim); return;

/* Scores of n (<= SCORE_ROWS) rows against one key block, register-blocked where the
 * shape allows. */
static void score_rows(const float *q, int64_t n, const float *kb, float *s, int64_t stride,
                       int64_t head_dim, int64_t block_size) {
#ifdef __AVX512F__
    if (block_size == 16) {
        switch (n) {
            SCORE_CASE(1) SCORE_CASE(2) SCORE_CASE(3) SCORE_CASE(4)
            SCORE_CASE(5) SCORE_CASE(6) SCORE_CASE(7) SCORE_CASE(8)
            SCORE_CASE(9) SCORE_CASE(10) SCORE_CASE(11) SCORE_CASE(12)
            default: break;
        }
    }
#endif
    score_rows_generic(q, n, kb, s, stride, head_dim, block_size);
}

/* The group holding `item`: the last k with item_start[k] <= item (item_start ascends;
 * a step can hold hundreds of groups, so no linear scan per item). */
static int64_t group_of(const int64_t *item_start, int64_t num_groups, int64_t item) {
    int64_t lo = 0, hi = num_groups - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (item_start[mid] <= item) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* One entry's tokens [first, first + tokens) within an item; their rows are
 * [row, row + tokens * group), token-major. Its first token sees seen0 + 1 positions,
 * its last `visible`. */
typedef struct {
    int64_t entry, first, tokens, row, seen0, visible;
} Part;

/* Scores of rows [row0, row0 + rows) against the key blocks [b0, b1) of table. With
 * bf16 dot products (qb and pairs set, see attention_bf16.h) the bf16 q rows qb are
 * scored against each block's pairs, else the fp32 rows qf against fp32 (or widened)
 * keys; qf is pre-scaled, qb is not. */
static void score_blocks(const float *qf, const uint16_t *qb, float scale, int64_t row0,
                         int64_t rows, const int64_t *table, int64_t b0, int64_t b1,
                         const void *k_cache, int64_t kh, int64_t num_kv_heads,
                         int64_t head_dim, int64_t block_size, int is_bf16, float *widened,
                         uint16_t *pairs, float *scores, int64_t stride) {
    const int64_t block_elems = head_dim * block_size, elem = is_bf16 ? 2 : 4;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t base = (table[b] * num_kv_heads + kh) * block_elems;
        if (b + 1 < b1)
            prefetch_bytes((const char *)k_cache + (table[b + 1] * num_kv_heads + kh) * block_elems * elem,
                           block_elems * elem);
#ifdef HAVE_BF16_DOT
        if (qb) { /* re-lay the block once; every row reuses it */
            key_block_pairs((const uint16_t *)k_cache + base, head_dim, pairs);
            for (int64_t r = row0; r < row0 + rows; r += SCORE_ROWS) {
                const int64_t n = row0 + rows - r < SCORE_ROWS ? row0 + rows - r : SCORE_ROWS;
                score_rows_bf16_any(qb + r * head_dim, n, pairs, scores + r * stride + b * 16,
                                    stride, head_dim, scale);
            }
            continue;
        }
#endif
        (void)qb, (void)scale, (void)pairs;
        const float *kb = (const float *)k_cache + base;
        if (is_bf16) { /* widen the block once; every row reuses it */
            load_row(k_cache, base, 1, block_elems, widened);
            kb = widened;
        }
        for (int64_t r = row0; r < row0 + rows; r += SCORE_ROWS) {
            const int64_t n = row0 + rows - r < SCORE_ROWS ? row0 + rows - r : SCORE_ROWS;
            score_rows(qf + r * head_dim, n, kb, scores + r * stride + b * block_size, stride,
                       head_dim, block_size);
        }
    }
}

/* acc[rows] += weights x values over the value blocks [b0, b1) of table; positions at
 * and past `visible` are not read. With bf16 dot products (weights_bf16 set) the
 * weights are its bf16 copy of scores. */
static void weigh_blocks(const float *scores, const uint16_t *weights_bf16, int64_t stride,
                         int64_t row0, int64_t rows, const int64_t *table, int64_t b0,
                         int64_t b1, int64_t visible, const void *v_cache, int64_t kh,
                         int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                         int is_bf16, float *widened, uint16_t *pairs, const uint16_t *zeros,
                         float *acc) {
    const int64_t block_elems = head_dim * block_size, elem = is_bf16 ? 2 : 4;
    for (int64_t b = b0; b < b1; b++) {
        const int64_t base = (table[b] * num_kv_heads + kh) * block_elems;
        const int64_t m = visible - b * block_size < block_size ? visible - b * block_size : block_size;
        if (b + 1 < b1)
            prefetch_bytes((const char *)v_cache + (table[b + 1] * num_kv_heads + kh) * block_elems * elem,
                           block_elems * elem);
#ifdef HAVE_BF16_DOT
        if (weights_bf16) {
            value_block_pairs((const uint16_t *)v_cache + base, m, head_dim, pairs, zeros);
            weigh_block_bf16(weights_bf16 + row0 * stride + b * 16, stride, pairs,
                             acc + row0 * head_dim, rows, head_dim);
            continue;
        }
#endif
        (void)weights_bf16, (void)pairs, (void)zeros;
        const float *vb = (const float *)v_cache + base;
        if (is_bf16) {
            load_row(v_cache, base, 1, m * head_dim, widened);
            vb = widened;
        }
        weigh_block(scores + row0 * stride + b * block_size, stride, vb, m,
                    acc + row0 * head_dim, rows, head_dim);
    }
}

/* q, out: [num_tokens, num_heads, head_dim]; k_cache: [num_blocks, num_kv_heads,
 * head_dim, block_size] (keys transposed within a block); v_cache: [num_blocks,
 * num_kv_heads, block_size, head_dim].
 * Per entry: its first row in q and out, its query tokens, the positions its last token
 * sees, and its block table (a row of block_tables, [num_entries, max_blocks]).
 * Entries come in groups, [group_starts[k], group_starts[k + 1]): a group of one entry
 * is tiled; a larger group is one item per kv head, whose entries all hold the same
 * first group_shared_blocks[k] blocks, each fully visible to every one of them.
 * Returns 0, -1 when scratch could not be allocated, -2 for an unsupported shape. */
int tm_paged_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                       const int64_t *rows, const int64_t *queries, const int64_t *contexts,
                       const int64_t *block_tables, const int64_t *group_starts,
                       const int64_t *group_shared_blocks, int64_t num_groups,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int64_t max_blocks, float scale, int is_bf16,
                       int num_threads) {
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim > 256 || block_size > 256 || group > TILE_ROWS) return -2;
    const int64_t tile_tokens = TILE_ROWS / group;

    /* Items per group, in order; item_start[k] is group k's first. Scratch is sized for
     * the largest item and the longest context. */
    int64_t *item_start = malloc(sizeof(int64_t) * (size_t)(num_groups + 1));
    if (!item_start) return -1;
    int64_t max_context = 1, rows_max = tile_tokens * group, parts_max = 1;
    item_start[0] = 0;
    for (int64_t k = 0; k < num_groups; k++) {
        const int64_t first = group_starts[k], count = group_starts[k + 1] - first;
        int64_t items = 1, tokens = 0;
        for (int64_t e = first; e < first + count; e++) {
            tokens += queries[e];
            if (contexts[e] > max_context) max_context = contexts[e];
        }
        if (count == 1) items = (tokens + tile_tokens - 1) / tile_tokens;
        else if (tokens * group > rows_max) rows_max = tokens * group;
        if (count > parts_max) parts_max = count;
        item_start[k + 1] = item_start[k] + items * num_kv_heads;
    }
    const int64_t num_items = item_start[num_groups];
    const int64_t stride = (max_context + block_size - 1) / block_size * block_size;
#ifdef HAVE_BF16_DOT
    const int use_dot = is_bf16 && block_size == 16 && (head_dim == 64 || head_dim == 128);
#else
    const int use_dot = 0;
#endif
    int failed = 0;

#pragma omp parallel num_threads(num_threads)
    {
    float *acc = malloc(sizeof(float) * (size_t)(rows_max * head_dim));
    float *scores = malloc(sizeof(float) * (size_t)(rows_max * stride));
    Part *parts = malloc(sizeof(Part) * (size_t)parts_max);
    /* fp32 math: q rows in fp32, and bf16 blocks widened to fp32. bf16 dot products: q
     * rows and weights in bf16, a block's pairs, a zero row. */
    float *qf = NULL, *widened = NULL;
    uint16_t *qb = NULL, *weights_bf16 = NULL, *pairs = NULL, *zeros = NULL;
    int ok = acc && scores && parts;
    if (use_dot) {
        qb = malloc(sizeof(uint16_t) * (size_t)(rows_max * head_dim));
        weights_bf16 = malloc(sizeof(uint16_t) * (size_t)(rows_max * stride));
        pairs = malloc(sizeof(uint16_t) * (size_t)(head_dim * block_size));
        zeros = calloc((size_t)head_dim, sizeof(uint16_t));
        ok = ok && qb && weights_bf16 && pairs && zeros;
    } else {
        qf = malloc(sizeof(float) * (size_t)(rows_max * head_dim));
        widened = is_bf16 ? malloc(sizeof(float) * (size_t)(head_dim * block_size)) : NULL;
        ok = ok && qf && (!is_bf16 || widened);
    }
    if (!ok) {
#pragma omp atomic write
        failed = 1;
    }

#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; item++) {
        if (!ok) continue;
        const int64_t k = group_of(item_start, num_groups, item);
        const int64_t local = item - item_start[k];
        const int64_t kh = local % num_kv_heads, tile = local / num_kv_heads;
        const int64_t e0 = group_starts[k], count = group_starts[k + 1] - e0;
        int64_t num_parts = 0, total_rows = 0;
        if (count == 1) { /* one tile of a chunk */
            const int64_t first = tile * tile_tokens;
            const int64_t tokens = queries[e0] - first < tile_tokens ? queries[e0] - first : tile_tokens;
            const int64_t seen0 = contexts[e0] - queries[e0] + first;
            parts[num_parts++] = (Part){e0, first, tokens, 0, seen0, seen0 + tokens};
            total_rows = tokens * group;
        } else {
            for (int64_t e = e0; e < e0 + count; e++) {
                const int64_t seen0 = contexts[e] - queries[e];
                parts[num_parts++] = (Part){e, 0, queries[e], total_rows, seen0, contexts[e]};
                total_rows += queries[e] * group;
            }
        }
        const int64_t shared = count == 1 ? 0 : group_shared_blocks[k];

        for (int64_t p = 0; p < num_parts; p++) { /* token t's heads are adjacent in q */
            const Part *pt = &parts[p];
            for (int64_t t = 0; t < pt->tokens; t++) {
                const int64_t offset = ((rows[pt->entry] + pt->first + t) * num_heads + kh * group) * head_dim;
                const int64_t row = (pt->row + t * group) * head_dim;
                if (use_dot) memcpy(qb + row, (const uint16_t *)q + offset, sizeof(uint16_t) * (size_t)(group * head_dim));
                else load_row(q, offset, is_bf16, group * head_dim, qf + row);
            }
        }
        if (!use_dot)
            for (int64_t i = 0; i < total_rows * head_dim; i++) qf[i] *= scale;

        /* Pass 1: scores; the shared blocks once for all rows, then each part's own. */
        score_blocks(qf, qb, scale, 0, total_rows, block_tables + e0 * max_blocks, 0, shared,
                     k_cache, kh, num_kv_heads, head_dim, block_size, is_bf16, widened, pairs,
                     scores, stride);
        for (int64_t p = 0; p < num_parts; p++) {
            const Part *pt = &parts[p];
            score_blocks(qf, qb, scale, pt->row, pt->tokens * group,
                         block_tables + pt->entry * max_blocks, shared,
                         (pt->visible + block_size - 1) / block_size, k_cache, kh, num_kv_heads,
                         head_dim, block_size, is_bf16, widened, pairs, scores, stride);
        }
        /* Pass 2: softmax per row over the positions it sees; zero weight past them, up
         * to its part's last block, so pass 3 can treat a part's rows alike. */
        for (int64_t p = 0; p < num_parts; p++) {
            const Part *pt = &parts[p];
            const int64_t padded = (pt->visible + block_size - 1) / block_size * block_size;
            for (int64_t r = pt->row; r < pt->row + pt->tokens * group; r++) {
                float *sr = scores + r * stride;
                const int64_t seen = pt->seen0 + (r - pt->row) / group + 1;
                float max = -INFINITY;
                for (int64_t t = 0; t < seen; t++) max = sr[t] > max ? sr[t] : max;
                float sum = 0.f;
                for (int64_t t = 0; t < seen; t++) {
                    sr[t] = expf(sr[t] - max);
                    sum += sr[t];
                }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < seen; t++) sr[t] *= inv;
                for (int64_t t = seen; t < padded; t++) sr[t] = 0.f;
                if (use_dot)
                    for (int64_t t = 0; t < padded; t++) weights_bf16[r * stride + t] = f32_to_bf16(sr[t]);
            }
        }
        /* Pass 3: the weighted sum of values, shared blocks first, in the same way. */
        memset(acc, 0, sizeof(float) * (size_t)(total_rows * head_dim));
        weigh_blocks(scores, weights_bf16, stride, 0, total_rows, block_tables + e0 * max_blocks,
                     0, shared, shared * block_size, v_cache, kh, num_kv_heads, head_dim,
                     block_size, is_bf16, widened, pairs, zeros, acc);
        for (int64_t p = 0; p < num_parts; p++) {
            const Part *pt = &parts[p];
            weigh_blocks(scores, weights_bf16, stride, pt->row, pt->tokens * group,
                         block_tables + pt->entry * max_blocks, shared,
                         (pt->visible + block_size - 1) / block_size, pt->visible, v_cache, kh,
                         num_kv_heads, head_dim, block_size, is_bf16, widened, pairs, zeros,
                         acc);
        }
        for (int64_t p = 0; p < num_parts; p++) {
            const Part *pt = &parts[p];
            for (int64_t t = 0; t < pt->tokens; t++) {
                const int64_t offset = ((rows[pt->entry] + pt->first + t) * num_heads + kh * group) * head_dim;
                store_row(out, offset, is_bf16, group * head_dim, acc + (pt->row + t * group) * head_dim);
            }
        }
    }
    free(qf), free(acc), free(scores), free(widened), free(parts);
    free(qb), free(weights_bf16), free(pairs), free(zeros);
    }
    free(item_start);
    return failed ? -1 : 0;
}

/* Stores each new token's key and value in its cache slot (block slot_blocks[t], offset
 * slot_offsets[t]), keys transposed within the block as the attention above reads them.
 * k, v: [num_tokens, num_kv_heads, head_dim], contiguous, the cache's dtype. */
void tm_write_kv_cache(const void *k, const void *v, void *k_cache, void *v_cache,
                       const int64_t *slot_blocks, const int64_t *slot_offsets,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim,
                       int64_t block_size, int is_bf16, int num_threads) {
    const int64_t elem = is_bf16 ? 2 : 4;
    const int64_t row = num_kv_heads * head_dim;
    /* A decode step's few rows are not worth waking the other threads for. */
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_tokens >= 256)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t block = slot_blocks[t], offset = slot_offsets[t];
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t head = (block * num_kv_heads + h) * head_dim * block_size;
            const int64_t src = t * row + h * head_dim;
            memcpy((char *)v_cache + (head + offset * head_dim) * elem,
                   (const char *)v + src * elem, (size_t)(head_dim * elem));
            if (is_bf16) {
                const uint16_t *ks = (const uint16_t *)k + src;
                uint16_t *kd = (uint16_t *)k_cache + head + offset;
                for (int64_t d = 0; d < head_dim; d++) kd[d * block_size] = ks[d];
            } else {
                const float *ks = (const float *)k + src;
                float *kd = (float *)k_cache + head + offset;
                for (int64_t d = 0; d < head_dim; d++) kd[d * block_size] = ks[d];
            }
        }
    }
}
