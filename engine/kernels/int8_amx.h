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
 * the same epilogue as the VNNI path (zero-point correction, scales, bias, rounding).
 * Rows past the last full 16 are read from a zero-padded copy, so no tile load reads
 * past the activations. Tiles need k % 64 == 0 (AMX_K); other shapes stay on VNNI.
 *
 * Measured on a 2-core Intel Xeon (Emerald Rapids) VM at SmolLM2's shapes
 * (benchmarks/quant_matmul.py, benchmarks/README.md, separate runs): tiles ran 1.3-2.2x
 * VNNI at 64 rows and even or behind at 1 row, where a mostly empty tile and the round
 * trip of the sums through memory cost more than they save. Two builds A/B'd in one
 * process (9 rounds, the qkv, gate_up and down shapes): tiles ran 1.03-1.59x VNNI from 8
 * rows (12 rows: 1.17-1.59x), mixed at 6-7 (0.93-1.31x) and behind at 2-4 (0.82-0.97x);
 * so calls of fewer than AMX_MIN_ROWS rows stay on VNNI.
 */
#ifndef TOKENMILL_INT8_AMX_H
#define TOKENMILL_INT8_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && TM_HAVE_VNNI
#define TM_HAVE_AMX 1
#include <immintrin.h>

#include "amx.h"

#define AMX_K 64          /* k-values per tile step */
#define AMX_MIN_ROWS 8    /* below this, VNNI */
#define AMX_ROW_BLOCK 256 /* activation rows kept in L2 while a thread's panels pass */

/* The epilogue of 16 channels for `rows` rows whose int32 sums are in `results` (16 a
 * row): the VNNI path's finish_row16, with the channels' terms loaded once rather than
 * per row. On tiles the epilogue, not the product, is most of a call at the model's
 * shapes (left out, a 2,048-row call ran 2-3x faster); loading the terms once gained
 * ~1.1x. */
static inline __attribute__((always_inline)) void finish_rows(
    const problem *p, const int32_t *results, int64_t row, int rows, int64_t col) {
    const channels16 c = load_channels16(p, col);
    for (int r = 0; r < rows; r++)
        finish_row16(p, &c, row + r, col, _mm512_load_si512(results + r * 16));
}

/* Accumulator tile `c` (16 rows x 16 channels) to the epilogue, for its first `rows`
 * rows. */
#define FINISH_TILE(c, row, rows, col)                                                  \
    do {                                                                                \
        _tile_stored(c, results, 64);                                                   \
        finish_rows(p, results, (row), (rows), (col));                                  \
    } while (0)

/* One register block: rows [row, row + mr) (mr <= 32) x panels [panel, panel + np)
 * (np <= 2). a0 and a1 are the two activation tiles' first rows (a1 unused when
 * mr <= 16), k bytes apart. */
static void amx_block(const problem *p, const uint8_t *a0, const uint8_t *a1, int64_t row,
                      int mr, int64_t panel, int np) {
    int32_t results[16 * 16] __attribute__((aligned(64)));
    const int64_t k = p->k, panel_bytes = k / 4 * 64;
    const int8_t *w0 = p->w + panel * panel_bytes, *w1 = w0 + panel_bytes;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < k; kb += AMX_K) {
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
    FINISH_TILE(0, row, top, col);
    if (np > 1) FINISH_TILE(1, row, top, col + 16);
    if (bottom > 0) {
        FINISH_TILE(2, row + 16, bottom, col);
        if (np > 1) FINISH_TILE(3, row + 16, bottom, col + 16);
    }
}

/* Rows [0, rows) x panels [first, last) on tiles; `tail` holds the rows from
 * rows - rows % 16 on, zero-padded to 16. */
static void amx_panels_all_rows(const problem *p, int64_t rows, int64_t first, int64_t last,
                                const uint8_t *tail) {
    const int64_t k = p->k, full = rows - rows % 16;
    tm_configure_full_tiles();
    for (int64_t block = 0; block < rows; block += AMX_ROW_BLOCK) {
        const int64_t block_end = block + AMX_ROW_BLOCK < rows ? block + AMX_ROW_BLOCK : rows;
        for (int64_t panel = first; panel < last; panel += 2) {
            const int np = last - panel < 2 ? 1 : 2;
            for (int64_t row = block; row < block_end; row += 32) {
                const int mr = (int)(block_end - row < 32 ? block_end - row : 32);
                const uint8_t *a0 = row < full ? p->x + row * k : tail;
                const uint8_t *a1 = row + 16 < full ? p->x + (row + 16) * k : tail;
                amx_block(p, a0, a1, row, mr, panel, np);
            }
        }
    }
    _tile_release();
}
#else
#define TM_HAVE_AMX 0
#endif

#endif
