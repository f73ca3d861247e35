/* bf16 attention on AMX tiles (AMX-BF16), for paged_attention.c.
 *
 * On Intel CPUs with AMX, `vdpbf16ps` issues on one port, so the bf16 dot products of
 * attention_bf16.h run no faster than fp32 FMAs there (docs/design.md, "bf16
 * attention: the pair layout and AMX tiles"). `tdpbf16ps` multiplies a 16 x 32 bf16 tile
 * by a 32 x 16 one into 16 x 16 fp32 sums in one instruction. The cache's pair layout
 * (attention_bf16.h) is already what its second operand wants:
 * - scores: a key block [head_dim / 2][16][2] is head_dim / 32 tiles of 16 pair-rows x
 *   64 bytes; 16 query rows x 32 elements are the first operand; the 16 x 16 sums are
 *   stored straight into the rows' scores;
 * - weighted sums: a value block [8][head_dim][2] is, for each 16 channels, a tile of 8
 *   pair-rows x 64 bytes (head_dim * 4 bytes apart); 16 rows of bf16 weights x 16
 *   positions are the first operand; the sums for 16 rows x 64 channels stay in four
 *   tiles across all of a call's blocks.
 * Only whole groups of 16 rows go on tiles (prompt tiles, rows of decoding sequences that
 * share blocks); the rest take attention_bf16.h's vector path. The sums are the same
 * products in another order, so results agree with that path to fp32 rounding, not bit
 * for bit.
 */
#ifndef TOKENMILL_ATTENTION_AMX_H
#define TOKENMILL_ATTENTION_AMX_H

#if defined(HAVE_BF16_DOT) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX_ATTENTION 1
#include <immintrin.h>

#include "amx.h"

/* Query rows a tile holds. */
#define AMX_TILE_ROWS 16

/* Scores of rows [0, 16 * row_tiles) of q ([rows, head_dim] bf16) against the key blocks
 * [b0, b1) of table, unscaled (the softmax scales them), into scores (rows `stride` floats
 * apart, block b at column b * 16). Tiles: 0 sums, 2-5 the query rows (head_dim / 32 of
 * them), 6-7 keys. Query rows of 256 values take eight tiles, more than are free: they are
 * loaded again for each block (from L1), through tiles 2-3. */
static void score_blocks_amx(const tm_attention_args *a, const uint16_t *q, float *scores,
                             int64_t stride, int64_t kv_head, const int64_t *table, int64_t b0,
                             int64_t b1, int64_t row_tiles) {
    const int64_t head_dim = a->head_dim, block_elems = head_dim * 16, q_bytes = head_dim * 2;
    const uint16_t *keys = (const uint16_t *)a->k_cache;
    const int resident = head_dim <= 128; /* the query rows stay in tiles 2-5 */
    tm_configure_full_tiles();
    for (int64_t rt = 0; rt < row_tiles; rt++) {
        const uint16_t *qt = q + rt * AMX_TILE_ROWS * head_dim;
        float *st = scores + rt * AMX_TILE_ROWS * stride;
        if (resident) {
            _tile_loadd(2, qt, q_bytes);
            _tile_loadd(3, qt + 32, q_bytes);
            if (head_dim == 128) {
                _tile_loadd(4, qt + 64, q_bytes);
                _tile_loadd(5, qt + 96, q_bytes);
            }
        }
        for (int64_t b = b0; b < b1; b++) {
            if (rt == 0) /* the later row tiles find the blocks in L2 */
                prefetch_blocks_ahead(keys, table, b, b0, b1, a->num_kv_heads, kv_head, block_elems * 2);
            const uint16_t *pairs = keys + (table[b] * a->num_kv_heads + kv_head) * block_elems;
            _tile_zero(0);
            if (resident) {
                _tile_loadd(6, pairs, 64); /* pair-rows 0-15: elements 0-31 */
                _tile_dpbf16ps(0, 2, 6);
                _tile_loadd(7, pairs + 512, 64);
                _tile_dpbf16ps(0, 3, 7);
                if (head_dim == 128) {
                    _tile_loadd(6, pairs + 1024, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(7, pairs + 1536, 64);
                    _tile_dpbf16ps(0, 5, 7);
                }
            } else {
                for (int64_t c = 0; c < head_dim / 32; c += 2) { /* pair-rows 16c.. */
                    _tile_loadd(2, qt + c * 32, q_bytes);
                    _tile_loadd(6, pairs + c * 512, 64);
                    _tile_dpbf16ps(0, 2, 6);
                    _tile_loadd(3, qt + (c + 1) * 32, q_bytes);
                    _tile_loadd(7, pairs + (c + 1) * 512, 64);
                    _tile_dpbf16ps(0, 3, 7);
                }
            }
            _tile_stored(0, st + b * 16, stride * 4);
        }
    }
    _tile_release();
}

/* Tiles 0-3 (64 channels of sums) += the weights tile (tile 4: 16 rows, `weight_bytes`
 * apart) x the four 16-channel value tiles from `channels` (position pairs interleaved,
 * rows `pair_row_bytes` apart), through tiles 5-7: one step of a value product, shared
 * by the block tiles below and the windowed prompt tiles (attention_flash.h); the tile
 * configuration says how many positions a step takes. */
static inline void weigh_values_step(const uint16_t *weights, int64_t weight_bytes,
                                     const uint16_t *channels, int64_t pair_row_bytes) {
    _tile_loadd(4, weights, weight_bytes);
    _tile_loadd(5, channels, pair_row_bytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, channels + 32, pair_row_bytes);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, channels + 64, pair_row_bytes);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, channels + 96, pair_row_bytes);
    _tile_dpbf16ps(3, 4, 5);
}

/* acc[rows] += weights x values for rows [0, 16 * row_tiles) over the value blocks
 * [b0, b1) of table; positions at and past `visible` are not read (a partial last block
 * is copied with its tail cleared into `spare`, as the vector path does). Weights are
 * bf16, rows `stride` apart, block b at column b * 16. Tiles: 0-3 the sums of 64
 * channels, 4 the weights, 5-7 values. */
static void weigh_blocks_amx(const tm_attention_args *a, const uint16_t *weights, int64_t stride,
                             float *acc, int64_t kv_head, const int64_t *table, int64_t b0,
                             int64_t b1, int64_t visible, int64_t row_tiles, uint16_t *spare) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 8, 8, 8};
    const uint16_t bytes[8] = {64, 64, 64, 64, 32, 64, 64, 64};
    const int64_t head_dim = a->head_dim, block_elems = head_dim * 16;
    const int64_t acc_bytes = head_dim * 4, pair_row_bytes = head_dim * 4;
    const uint16_t *values = (const uint16_t *)a->v_cache;
#define VALUE_BLOCK(b) (values + (table[b] * a->num_kv_heads + kv_head) * block_elems)
    /* A partial last block, copied once with its tail cleared, for every row tile. */
    const int64_t last = b1 - 1, last_valid = visible - last * 16;
    const int partial_last = b1 > b0 && last_valid < 16;
    if (partial_last) value_pairs_head(VALUE_BLOCK(last), last_valid, head_dim, spare);
    tm_configure_tiles(rows, bytes);
    for (int64_t rt = 0; rt < row_tiles; rt++) {
        const uint16_t *wt = weights + rt * AMX_TILE_ROWS * stride;
        float *at = acc + rt * AMX_TILE_ROWS * head_dim;
        for (int64_t half = 0; half < head_dim; half += 64) { /* 64 channels at a time */
            _tile_loadd(0, at + half, acc_bytes);
            _tile_loadd(1, at + half + 16, acc_bytes);
            _tile_loadd(2, at + half + 32, acc_bytes);
            _tile_loadd(3, at + half + 48, acc_bytes);
            for (int64_t b = b0; b < b1; b++) {
                if (rt == 0 && half == 0)
                    prefetch_blocks_ahead(values, table, b, b0, b1, a->num_kv_heads, kv_head, block_elems * 2);
                const uint16_t *pairs = partial_last && b == last ? spare : VALUE_BLOCK(b);
                weigh_values_step(wt + b * 16, stride * 2, pairs + half * 2, pair_row_bytes);
            }
            _tile_stored(0, at + half, acc_bytes);
            _tile_stored(1, at + half + 16, acc_bytes);
            _tile_stored(2, at + half + 32, acc_bytes);
            _tile_stored(3, at + half + 48, acc_bytes);
        }
    }
    _tile_release();
#undef VALUE_BLOCK
}
#endif

#endif
