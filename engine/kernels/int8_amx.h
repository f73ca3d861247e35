/* The int8 product on AMX tiles (Intel Sapphire Rapids and later), for int8_linear.c.
 *
 * `tdpbusd` multiplies a tile of 16 rows x 64 uint8 activations by a tile of 16 x 64 int8
 * weights and adds the 16 x 16 int32 results to a third tile: 16,384 multiply-adds an
 * instruction, where AVX512-VNNI's vpdpbusd does 64. Its weight operand holds, in each of
 * its 16 rows, four consecutive k-values of 16 output channels - exactly one k-step range
 * of a panel int8_linear.c already packs ([k / 4][16][4]), so both paths read the same
 * packed weights and a layer keeps one copy.
 *
 * A register block is 32 rows x 32 channels: two activation tiles, two weight tiles and
 * four accumulator tiles (all eight tiles). Its accumulators go through a small buffer to
 * the same epilogue arithmetic as the VNNI path (zero-point correction, scales, bias,
 * rounding), a row's 32 channels at a time.
 * Rows past the last full 16 are read from a zero-padded copy, so no tile load reads
 * past the activations. Tiles need k % 64 == 0 (AMX_K); other shapes stay on VNNI.
 *
 * Loop order: a thread's panels go in blocks whose weights fit its L2 (AMX_PANEL_BYTES);
 * within a block, 32-row strips of activations (in L1) go once over every panel pair, so
 * each output row is written as one contiguous run of the block's channels. Storing 64
 * bytes into each of many rows in turn instead scatters a prompt chunk's outputs (12 MB
 * for gate_up at 2,048 rows, past L2), and those stores, not the product, become most of
 * the call (docs/design.md, "int8 on AMX tiles").
 *
 * With few rows a mostly empty tile and the round trip of the sums through memory cost
 * more than the tiles save, so calls of fewer than AMX_MIN_ROWS rows stay on VNNI (where
 * the two cross: docs/design.md, "int8 on AMX tiles").
 */
#ifndef TOKENMILL_INT8_AMX_H
#define TOKENMILL_INT8_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && TM_HAVE_VNNI
#define TM_HAVE_AMX 1
#include <immintrin.h>

#include "amx.h"

#define AMX_K 64          /* k-values per tile step */
#define AMX_MIN_ROWS 8    /* below this, VNNI */
#define AMX_PANEL_BYTES (1 << 20) /* weights of a panel block, kept in L2 */
/* The first row strip of a block asks for each weight tile's 16 lines this many bytes
 * (four k-steps) before its tile loads reach them. In a model, the KV cache's reads
 * evict the layers' weights between steps, so a decode step's first strip reads them
 * from memory; later strips find them in L2. Why 4 KiB: docs/design.md, "int8 on
 * AMX tiles". */
#define AMX_PREFETCH_AHEAD 4096

/* One row's 32 channels from two accumulator tiles' sums (lo: channels col.., hi: col +
 * 16..): finish_row16's arithmetic on each half, stored as one 64-byte run in bf16. */
static inline __attribute__((always_inline)) void finish_row32(const problem *p,
                                                               const channels16 *lo_c,
                                                               const channels16 *hi_c,
                                                               int64_t row, int64_t col,
                                                               __m512i lo, __m512i hi) {
    const __m512 x_scale = _mm512_set1_ps(p->x_scales[row]);
    const __m512 lo_v = finish_value16(lo_c, x_scale, lo);
    const __m512 hi_v = finish_value16(hi_c, x_scale, hi);
#if defined(__AVX512BF16__)
    if (p->is_bf16) {
        _mm512_storeu_si512((uint16_t *)p->out + row * p->out_n + col,
                            (__m512i)_mm512_cvtne2ps_pbh(hi_v, lo_v));
        return;
    }
#endif
    store16(p, row, col, lo_v);
    store16(p, row, col + 16, hi_v);
}

/* Tiles `lo` and `hi` (16 rows x 16 channels each, channels col.. and col + 16..) to the
 * output, for their first `rows` rows. */
#define FINISH_TILE_PAIR(lo, hi, row, rows, col)                                        \
    do {                                                                                \
        _tile_stored(lo, results, 64);                                                  \
        _tile_stored(hi, results + 256, 64);                                            \
        const channels16 lo_c = load_channels16(p, (col));                              \
        const channels16 hi_c = load_channels16(p, (col) + 16);                         \
        if (p->activation) /* lo: gate panel, hi: its up panel */                        \
            for (int r = 0; r < (rows); r++)                                            \
                finish_gated16(p, &lo_c, &hi_c, (row) + r, (col),                       \
                               _mm512_load_si512(results + r * 16),                     \
                               _mm512_load_si512(results + 256 + r * 16));              \
        else                                                                            \
            for (int r = 0; r < (rows); r++)                                            \
                finish_row32(p, &lo_c, &hi_c, (row) + r, (col),                         \
                             _mm512_load_si512(results + r * 16),                       \
                             _mm512_load_si512(results + 256 + r * 16));                \
    } while (0)

/* Tile `c` alone (a thread's odd last panel). */
#define FINISH_TILE(c, row, rows, col)                                                  \
    do {                                                                                \
        _tile_stored(c, results, 64);                                                   \
        const channels16 one = load_channels16(p, (col));                               \
        for (int r = 0; r < (rows); r++)                                                \
            finish_row16(p, &one, (row) + r, (col), _mm512_load_si512(results + r * 16)); \
    } while (0)

/* One register block: rows [row, row + mr) (mr <= 32) x panels [panel, panel + np)
 * (np <= 2). a0 and a1 are the two activation tiles' first rows (a1 unused when
 * mr <= 16), k bytes apart. */
static void amx_block(const problem *p, const uint8_t *a0, const uint8_t *a1, int64_t row,
                      int mr, int64_t panel, int np) {
    int32_t results[2 * 16 * 16] __attribute__((aligned(64)));
    const int64_t k = p->k, panel_bytes = k / 4 * 64;
    const int8_t *w0 = p->w + panel * panel_bytes, *w1 = w0 + panel_bytes;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < k; kb += AMX_K) {
        if (row == 0) { /* the block's first strip: its weights may still be in memory */
            const int8_t *ahead0 = w0 + kb / 4 * 64 + AMX_PREFETCH_AHEAD;
            const int8_t *ahead1 = w1 + kb / 4 * 64 + AMX_PREFETCH_AHEAD;
            for (int line = 0; line < 1024; line += 64) {
                _mm_prefetch((const char *)ahead0 + line, _MM_HINT_T0);
                if (np > 1) _mm_prefetch((const char *)ahead1 + line, _MM_HINT_T0);
            }
        }
        _tile_loadd(4, a0 + kb, k);
        _tile_loadd(6, w0 + kb / 4 * 64, 64);
        _tile_dpbusd(0, 4, 6);
        if (np > 1) {
            _tile_loadd(7, w1 + kb / 4 * 64, 64);
            _tile_dpbusd(1, 4, 7);
        }
        if (mr > 16) {
            _tile_loadd(5, a1 + kb, k);
            _tile_dpbusd(2, 5, 6);
            if (np > 1) _tile_dpbusd(3, 5, 7);
        }
    }
    const int64_t col = panel * 16;
    const int top = mr < 16 ? mr : 16, bottom = mr - top;
    if (np > 1) {
        FINISH_TILE_PAIR(0, 1, row, top, col);
        if (bottom > 0) FINISH_TILE_PAIR(2, 3, row + 16, bottom, col);
    } else {
        FINISH_TILE(0, row, top, col);
        if (bottom > 0) FINISH_TILE(2, row + 16, bottom, col);
    }
}

/* Rows [0, rows) x panels [first, last) on tiles; `tail` holds the rows from
 * rows - rows % 16 on, zero-padded to 16. */
static void amx_panels_all_rows(const problem *p, int64_t rows, int64_t first, int64_t last,
                                const uint8_t *tail) {
    const int64_t k = p->k, full = rows - rows % 16;
    int64_t block_panels = AMX_PANEL_BYTES / (k * 16) / 2 * 2; /* even: whole pairs */
    if (block_panels < 2) block_panels = 2;
    tm_configure_full_tiles();
    for (int64_t block = first; block < last; block += block_panels) {
        const int64_t block_end = block + block_panels < last ? block + block_panels : last;
        for (int64_t row = 0; row < rows; row += 32) {
            const int mr = (int)(rows - row < 32 ? rows - row : 32);
            const uint8_t *a0 = row < full ? p->x + row * k : tail;
            const uint8_t *a1 = row + 16 < full ? p->x + (row + 16) * k : tail;
            for (int64_t panel = block; panel < block_end; panel += 2)
                amx_block(p, a0, a1, row, mr, panel, block_end - panel < 2 ? 1 : 2);
        }
    }
    _tile_release();
}
#else
#define TM_HAVE_AMX 0
#endif

#endif
