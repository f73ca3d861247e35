/* What the kernels that use AMX tiles share (int8_amx.h, attention_amx.h): Linux's
 * permission for the tile state, and loading a tile configuration. */
#ifndef TOKENMILL_AMX_H
#define TOKENMILL_AMX_H

#include <stdint.h>

/* Linux hands a process the tile registers' state only when asked (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); the grant is process-wide and asking again
 * is harmless. 1 where granted; 0 where refused (an old kernel, a hypervisor hiding AMX,
 * not Linux on x86-64), and callers stay on their vector paths. Asked once (amx.c). */
int tm_internal_amx_permitted(void);

#if defined(__AMX_TILE__)
#include <immintrin.h>

/* The configuration ldtilecfg takes (palette 1). */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tm_tile_config;

/* Configures tiles 0-7 as rows[t] rows of bytes_per_row[t] bytes (all tiles are zeroed). */
static inline void tm_configure_tiles(const uint8_t rows[8], const uint16_t bytes_per_row[8]) {
    tm_tile_config config = {0};
    config.palette_id = 1;
    for (int t = 0; t < 8; t++) config.rows[t] = rows[t], config.bytes_per_row[t] = bytes_per_row[t];
    /* GCC 12 does not count ldtilecfg as reading all 64 bytes: where rows[] is not a
     * constant it dropped the stores above and loaded stack garbage (a #GP). The empty asm
     * that may read the whole struct keeps them. */
    __asm__ volatile("" : : "m"(config) : "memory");
    _tile_loadconfig(&config);
}

/* Tiles 0-7 all 16 rows x 64 bytes: the shape of every tile of an int8 product and of
 * attention's scores. */
static inline void tm_configure_full_tiles(void) {
    const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    const uint16_t bytes[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    tm_configure_tiles(rows, bytes);
}
#endif

#endif
