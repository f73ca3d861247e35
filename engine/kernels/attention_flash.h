/* A prompt tile's attention in windows of key blocks with an online softmax, on AMX tiles
 * (for paged_attention.c; the tiles themselves: attention_amx.h).
 *
 * The exact path scores a tile's rows against every block they see before any softmax,
 * so its scores are rows x context floats: at 8k tokens 48 rows hold 1.5 MiB of scores
 * and 0.75 MiB of weights, more than L2 beside the blocks being read, and the tile must
 * stay small (48 rows), so each key and value block is read again from L3 for every 48
 * rows. Here a tile walks its blocks FLASH_WINDOW_BLOCKS at a time: score the window,
 * fold it into each row's running maximum and sum (the sums so far, and the weighted
 * values in acc, are rescaled by exp(old max - new max)), weigh the window's values,
 * and divide by the sum at the end. The scores never outgrow one window, so a tile can
 * hold FLASH_TILE_ROWS rows and read each block once per that many rows; scores, weights,
 * sums and a window of keys and values stay in L2 whatever the context.
 *
 * The result is the same softmax: only the order of the sums and the rounding of the
 * weights to bf16 differ (they are rounded before the division, not after), so it agrees
 * with the exact path to bf16 rounding, as the AMX path agrees with the vector one. Rows
 * that see nothing in a window (causality, a sliding window) take zero weights there and
 * keep their maximum and sum. A tile's rows are padded to whole tiles of 16 with zero
 * queries that see what its last token sees; they are never stored.
 */
#ifndef TOKENMILL_ATTENTION_FLASH_H
#define TOKENMILL_ATTENTION_FLASH_H

#ifdef HAVE_AMX_ATTENTION
#include <math.h>

/* Rows of a prompt tile on this path: 12 AMX row tiles. */
#define FLASH_TILE_ROWS 192
/* Key blocks per window: 512 positions, so a tile's scores (192 x 512 floats, 384 KiB),
 * bf16 weights (192 KiB) and the window's keys and values (256 KiB at head_dim 128)
 * stay in L2 together. */
#define FLASH_WINDOW_BLOCKS 32

/* 2^x for x <= 0: 2^n * p(f) with x = n + f, |f| <= 1/2 and p Taylor's degree 5 for
 * e^(f ln 2), within 3e-6 relative - far under the bf16 rounding the weights then take.
 * The caller folds log2(e) into its fused multiply-add (scaled score minus maximum), so
 * an exponential costs eight vector operations. Large negative x gives 0 (scalef). */
static inline __m512 exp2_nonpositive(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.33335581e-3f); /* (ln 2)^k / k!, k = 5 .. 0 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* One row's window: raw scores s[0, cols), of which [lo, hi) are positions the row sees.
 * Folds them into the row's running maximum *m (of scaled scores) and sum *l, writes
 * their exponentials as bf16 weights w[0, cols) (zero outside [lo, hi)), and returns the
 * factor the row's weighted values so far must be multiplied by. */
static inline float flash_row(const float *restrict s, uint16_t *restrict w, int64_t cols,
                              int64_t lo, int64_t hi, float scale, float *m, float *l) {
    if (lo >= hi) {
        memset(w, 0, sizeof(uint16_t) * (size_t)cols);
        return 1.f;
    }
    /* A row with nothing summed yet (*l == 0: no sink, no position seen) has no maximum;
     * tested so, not with infinities, which -ffast-math may assume away. */
    const int fresh = *l == 0.f;
    const float window_max = max_of(s, lo, hi) * scale;
    const float m_new = fresh || window_max > *m ? window_max : *m;
    const float factor = fresh ? 0.f : expf(*m - m_new);
    const float log2e = 1.44269504f;
    const __m512 vscale = _mm512_set1_ps(scale * log2e), shift = _mm512_set1_ps(-m_new * log2e);
    __m512 sum = _mm512_setzero_ps();
    memset(w, 0, sizeof(uint16_t) * (size_t)lo);
    for (int64_t t = lo; t < hi; t += 16) {
        const __mmask16 k = hi - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hi - t)) - 1);
        const __m512 e = exp2_nonpositive(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, s + t), vscale, shift));
        sum = _mm512_mask_add_ps(sum, k, sum, e);
        _mm256_mask_storeu_epi16(w + t, k, (__m256i)_mm512_cvtneps_pbh(e));
    }
    memset(w + hi, 0, sizeof(uint16_t) * (size_t)(cols - hi));
    *l = *l * factor + _mm512_reduce_add_ps(sum);
    *m = m_new;
    return factor;
}

/* acc[rows] += weights x values over a window's `blocks` value blocks of table, with the
 * positions at and past `visible` read as zeros. attention_amx.h's weigh_blocks_amx takes
 * 16 positions (one block) per tile product, half of what a product can take: a tile's
 * 16 pair-rows must sit one stride apart, and two blocks of the cache need not. So the
 * window's blocks are copied next to each other first (once, for all of its row tiles:
 * up to 256 KiB, from L2), a partial last block with its tail cleared and an odd count
 * padded with a zero block, and each product then takes 32 positions. Tiles: 0-3 the
 * sums of 64 channels, 4 the weights (16 rows x 32 positions), 5-7 values. */
static void weigh_window_amx(const tm_attention_args *a, const uint16_t *weights, int64_t stride,
                             float *acc, int64_t kv_head, const int64_t *table, int64_t blocks,
                             int64_t visible, int64_t row_tiles, uint16_t *window) {
    const int64_t head_dim = a->head_dim, block_elems = head_dim * 16;
    const int64_t acc_bytes = head_dim * 4, pair_row_bytes = head_dim * 4;
    const uint16_t *values = (const uint16_t *)a->v_cache;
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *block = values + (table[b] * a->num_kv_heads + kv_head) * block_elems;
        const int64_t valid = visible - b * 16;
        if (valid >= 16) memcpy(window + b * block_elems, block, sizeof(uint16_t) * (size_t)block_elems);
        else value_pairs_head(block, valid, head_dim, window + b * block_elems);
    }
    const int64_t pairs_of_blocks = (blocks + 1) / 2;
    if (blocks % 2) memset(window + blocks * block_elems, 0, sizeof(uint16_t) * (size_t)block_elems);
    tm_configure_full_tiles();
    for (int64_t rt = 0; rt < row_tiles; rt++) {
        const uint16_t *wt = weights + rt * AMX_TILE_ROWS * stride;
        float *at = acc + rt * AMX_TILE_ROWS * head_dim;
        for (int64_t half = 0; half < head_dim; half += 64) { /* 64 channels at a time */
            _tile_loadd(0, at + half, acc_bytes);
            _tile_loadd(1, at + half + 16, acc_bytes);
            _tile_loadd(2, at + half + 32, acc_bytes);
            _tile_loadd(3, at + half + 48, acc_bytes);
            for (int64_t bp = 0; bp < pairs_of_blocks; bp++) {
                weigh_values_step(wt + bp * 32, stride * 2, window + bp * 2 * block_elems + half * 2,
                                  pair_row_bytes);
            }
            _tile_stored(0, at + half, acc_bytes);
            _tile_stored(1, at + half + 16, acc_bytes);
            _tile_stored(2, at + half + 32, acc_bytes);
            _tile_stored(3, at + half + 48, acc_bytes);
        }
    }
    _tile_release();
}

/* What a flash tile needs beyond the call: its rows, their positions and buffers. */
typedef struct {
    const uint16_t *q;  /* [16 * row_tiles, head_dim] bf16, padding rows zero */
    int64_t row_tiles;
    int64_t group;      /* rows per token (query heads of the kv head) */
    int64_t tokens;     /* the tile's real tokens; rows past tokens * group are padding */
    int64_t seen0;      /* position of the tile's first token */
    int64_t kv_head;
    const int64_t *table;
    const float *sinks; /* the kv head's query heads' sink logits, or NULL */
    float *scores;      /* [rows, FLASH_WINDOW_BLOCKS * 16] */
    uint16_t *weights;  /* likewise, bf16 */
    float *acc;         /* [rows, head_dim]: the output rows, normalised at the end */
    float *row_max, *row_sum; /* [rows] */
    uint16_t *window_values; /* FLASH_WINDOW_BLOCKS value blocks, side by side */
} FlashTile;

static void attend_tile_flash(const tm_attention_args *a, const FlashTile *t) {
    const int64_t rows = t->row_tiles * AMX_TILE_ROWS, head_dim = a->head_dim;
    const int64_t cols = FLASH_WINDOW_BLOCKS * 16, end = t->seen0 + t->tokens;
    const int64_t window = a->sliding_window;
    const int64_t first = window > 0 && t->seen0 - window + 1 > 0 ? t->seen0 - window + 1 : 0;
    for (int64_t r = 0; r < rows; r++) { /* a sink: a logit in the denominator, no value */
        t->row_max[r] = t->sinks ? t->sinks[r % t->group] : 0.f;
        t->row_sum[r] = t->sinks ? 1.f : 0.f;
    }
    memset(t->acc, 0, sizeof(float) * (size_t)(rows * head_dim));
    for (int64_t w0 = first / 16; w0 * 16 < end; w0 += FLASH_WINDOW_BLOCKS) {
        const int64_t blocks = (end - w0 * 16 + 15) / 16 < FLASH_WINDOW_BLOCKS
                                   ? (end - w0 * 16 + 15) / 16
                                   : FLASH_WINDOW_BLOCKS;
        const int64_t *table = t->table + w0;
        score_blocks_amx(a, t->q, t->scores, cols, t->kv_head, table, 0, blocks, t->row_tiles);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t token = r / t->group < t->tokens ? r / t->group : t->tokens - 1;
            const int64_t position = t->seen0 + token;
            const int64_t lo = window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
            const int64_t from = lo - w0 * 16 > 0 ? lo - w0 * 16 : 0;
            const int64_t to = position + 1 - w0 * 16 < blocks * 16 ? position + 1 - w0 * 16 : blocks * 16;
            const float factor = flash_row(t->scores + r * cols, t->weights + r * cols, cols, from,
                                           to, a->scale, &t->row_max[r], &t->row_sum[r]);
            if (factor != 1.f) {
                float *acc = t->acc + r * head_dim;
                const __m512 f = _mm512_set1_ps(factor);
                for (int64_t c = 0; c < head_dim; c += 16)
                    _mm512_storeu_ps(acc + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), f));
            }
        }
        weigh_window_amx(a, t->weights, cols, t->acc, t->kv_head, table, blocks, end - w0 * 16,
                         t->row_tiles, t->window_values);
    }
    for (int64_t r = 0; r < t->tokens * t->group; r++) {
        const __m512 inv = _mm512_set1_ps(1.f / t->row_sum[r]);
        float *acc = t->acc + r * head_dim;
        for (int64_t c = 0; c < head_dim; c += 16)
            _mm512_storeu_ps(acc + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), inv));
    }
}
#endif

#endif
