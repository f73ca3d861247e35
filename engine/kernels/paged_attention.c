/* Attention straight over the paged KV cache: decode tokens and prompt chunks alike
 * (the interface, its struct and limits: kernels.h, tm_paged_attention).
 *
 * Every query token is part of an entry - a sequence's chunk of `queries` tokens whose
 * keys and values are already in the cache, after whatever context came before (earlier
 * chunks, a cached shared prefix, generated tokens). Token i of an entry with `context`
 * positions sits at position context - queries + i and sees positions 0 .. that, or only
 * the last `sliding_window` of them, so a decode step is an entry of one token and a
 * prompt chunk is causal attention.
 *
 * Work is split into items of one kv head each. An item's rows are query tokens times
 * the kv head's G query heads, and every key and value row read from the cache serves
 * all the rows that see it:
 * - a prompt chunk is cut into tiles of up to TM_TILE_ROWS (48) rows, each an item: a key
 *   block is then used 48 times per load, so the tile runs at the speed of its FMAs, not
 *   of memory; a tile's scores with a 2,048-token context are 48 * 2048 * 4 = 384 KiB,
 *   resident in L2 (over int8 caches on AMX tiles are twice that: INT8_TILE_FACTOR);
 *   on AMX over a bf16 cache a tile is FLASH_TILE_ROWS (192) rows instead, and walks its
 *   blocks in windows with an online softmax (attention_flash.h): its scores never
 *   outgrow a window, so long contexts stay in L2 and each block is read once per 192
 *   rows;
 * - decoding sequences that share leading blocks (a prompt prefix served from the prefix
 *   cache, or siblings of one prompt) form one item, and the shared blocks are read once
 *   for all of them rather than once per sequence. Decode is bound by reading the cache,
 *   so this is where it saves.
 * Each item runs the same named steps (attend_item): gather its query rows, score them
 * against the key blocks they see, an exact softmax per row, accumulate the weighted sum
 * of the value blocks, store the rows. Rows see different ranges (causality, windows,
 * different sequences); weights outside a row's range are zero, and blocks no row of a
 * part sees are never read. Storage is fp32 or bf16. Math is fp32, except that bf16
 * caches with 16-token blocks use bf16 dot products where the CPU has them
 * (attention_bf16.h). int8 caches (kv_int8.h) are read directly in int16 dot products
 * where the CPU has them (attention_int8.h; rows not on AMX tiles), else widened into
 * scratch, where the float path reads them: a prompt chunk's blocks once per call, for
 * all of its tiles (WideCopy), a decode group's a window of blocks at a time.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_bf16.h"
#include "attention_fp32.h"
#include "attention_int8.h"
#include "kernel_common.h"
#include "kernels.h"
#include "kv_int8.h"
/* after kernels.h: its functions take tm_attention_args */
#include "attention_amx.h"
#include "attention_flash.h"

/* One entry's tokens [first, first + tokens) within an item; their rows are
 * [row, row + tokens * group), token-major. Its first token sits at position seen0 (and
 * sees seen0 + 1 positions, or its window of them), its last sees `visible`; first_block
 * is the first key block any of its rows sees. */
typedef struct {
    int64_t entry, first, tokens, row, seen0, visible, first_block;
} Part;

struct WideCopy;

/* Everything about one call that every item shares. */
typedef struct {
    const tm_attention_args *a;
    int64_t group;       /* query heads per kv head */
    int64_t tile_tokens; /* query tokens per tile of a prompt chunk */
    int64_t rows_max;    /* rows of the largest item */
    int64_t parts_max;   /* entries of the largest group */
    int64_t stride;      /* a row's scores: the longest context, in whole blocks */
    int use_dot;         /* bf16 dot products (attention_bf16.h) */
    int use_amx;         /* and AMX tiles for whole groups of 16 rows (attention_amx.h) */
    int use_flash;       /* prompt tiles in windows with an online softmax (attention_flash.h) */
    int64_t stage_blocks; /* int8 caches: blocks widened per window */
    int int8_pairs;       /* int8 caches: in the pair layout (kv_int8_pairs) */
    int int8_dot;         /* int8 caches: rows off the tiles read them directly */
    int64_t *item_start; /* [num_groups + 1]: group k's items are [item_start[k], [k + 1]) */
    int64_t num_items;
    const struct WideCopy *wide; /* int8 caches: the prompt chunks' blocks widened, or NULL */
} Plan;

/* An int8 call's prompt chunks' blocks, widened once for the call (widen_prompt_blocks):
 * a float cache with the int8 cache's kv heads, whose block tables (one per entry, as
 * block_tables) point at the widened copies. A chunk's tiles read it on their staged rows
 * instead of each tile widening the chunk's context again a window at a time. */
typedef struct WideCopy {
    tm_attention_args args; /* the call over the widened cache */
    Plan plan;
    int64_t *tables;      /* [num_entries * max_blocks] */
    unsigned char *entry_widened; /* [num_entries] 1 where tables holds the entry's blocks */
    void *k, *v;
} WideCopy;

/* One item: a kv head's rows of some parts, and the blocks all of its rows score together
 * ([shared_lo, shared_hi) of the group's first table, empty for a tile). */
typedef struct {
    int64_t kv_head;
    int64_t group_index;
    Part *parts;
    int64_t num_parts, total_rows;
    int64_t shared_lo, shared_hi;
} Item;

/* A thread's buffers, sized for the largest item. fp32 math: q rows in fp32 and bf16
 * blocks widened to fp32. bf16 dot products: q rows and weights in bf16, a block's pairs,
 * a zero row. */
typedef struct {
    float *acc, *scores, *qf, *widened;
    float *row_max, *row_sum; /* a flash tile's running softmax, */
    uint16_t *window_values;  /* and its window's value blocks */
    uint16_t *qb, *weights_bf16, *pairs;
    Part *parts;
    /* int8 caches: a window of widened blocks, the table that maps a block index to its
     * place there, and the call as the float path sees it over them */
    void *stage;
    int64_t *stage_table;
    int16_t *q16, *wq; /* direct reads: int16 query rows and block weights, */
    float *q_scales, *w_scales; /* and their scales */
    tm_attention_args stage_args;
    Plan stage_plan;
} Scratch;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* The first position a token at `position` sees. */
static inline int64_t first_seen(const tm_attention_args *a, int64_t position) {
    return a->sliding_window > 0 ? max64(0, position - a->sliding_window + 1) : 0;
}

/* Over an int8 cache on AMX, prompt tiles are this many times TM_TILE_ROWS, so that more
 * rows share each widening where a tile widens windows of its own (no WideCopy: a call
 * past WIDE_COPY_MAX_BYTES). Why 2: docs/design.md, "The int8 KV cache, scaled per
 * 32 values". */
#define INT8_TILE_FACTOR 2

/* Bytes of one kv head's block widened from an int8 cache: bf16 pairs for bf16 dot
 * products, else fp32 (the float path would widen bf16 to fp32 anyway). */
static inline int64_t widened_block_bytes(const tm_attention_args *a, int use_dot) {
    return a->head_dim * a->block_size * (use_dot ? 2 : 4);
}

/* Sizes every item and every thread's scratch. Returns TM_OK or TM_OUT_OF_MEMORY. */
static int plan_items(const tm_attention_args *a, Plan *plan) {
    plan->a = a;
    plan->wide = NULL;
    plan->group = a->num_heads / a->num_kv_heads;
    plan->use_dot = uses_bf16_pairs(a->is_bf16, a->block_size, a->head_dim);
#ifdef HAVE_AMX_ATTENTION
    plan->use_amx = plan->use_dot && tm_internal_amx_permitted();
#else
    plan->use_amx = 0;
#endif
#ifdef HAVE_AMX_ATTENTION
    plan->use_flash = plan->use_amx && !a->kv_int8;
    const int64_t flash_rows = FLASH_TILE_ROWS;
#else
    plan->use_flash = 0;
    const int64_t flash_rows = TM_TILE_ROWS;
#endif
    const int64_t tile_rows = plan->use_flash                 ? flash_rows
                              : a->kv_int8 && plan->use_amx ? INT8_TILE_FACTOR * TM_TILE_ROWS
                                                            : TM_TILE_ROWS;
    plan->tile_tokens = tile_rows / plan->group;
    plan->item_start = malloc(sizeof(int64_t) * (size_t)(a->num_groups + 1));
    if (!plan->item_start) return TM_OUT_OF_MEMORY;
    int64_t max_context = 1;
    plan->rows_max = plan->tile_tokens * plan->group;
    plan->parts_max = 1;
    plan->item_start[0] = 0;
    for (int64_t k = 0; k < a->num_groups; k++) {
        const int64_t first = a->group_starts[k], count = a->group_starts[k + 1] - first;
        int64_t items = 1, tokens = 0;
        for (int64_t e = first; e < first + count; e++) {
            tokens += a->queries[e];
            max_context = max64(max_context, a->contexts[e]);
        }
        if (count == 1) items = ceil_div(tokens, plan->tile_tokens);
        else plan->rows_max = max64(plan->rows_max, tokens * plan->group);
        plan->parts_max = max64(plan->parts_max, count);
        plan->item_start[k + 1] = plan->item_start[k] + items * a->num_kv_heads;
    }
    plan->num_items = plan->item_start[a->num_groups];
    plan->stride = ceil_div(max_context, a->block_size) * a->block_size;
#ifdef HAVE_AMX_ATTENTION
    if (plan->use_flash) { /* a tile's rows padded to whole AMX tiles, its scores a window */
        plan->rows_max = ceil_div(plan->rows_max, AMX_TILE_ROWS) * AMX_TILE_ROWS;
        plan->stride = max64(plan->stride, FLASH_WINDOW_BLOCKS * 16);
    }
#endif
    /* Windows of ~32 KiB, so that widened blocks are read back from L1. */
    plan->stage_blocks = max64(1, 32768 / widened_block_bytes(a, plan->use_dot));
    plan->int8_pairs = kv_int8_pairs(a->is_bf16, a->block_size, a->head_dim);
#ifdef HAVE_INT8_DOT
    plan->int8_dot = a->kv_int8 && plan->int8_pairs;
#else
    plan->int8_dot = 0;
#endif
    return TM_OK;
}

/* An int8 call's window: the blocks staged by stage_window, as a call over a float cache
 * of one kv head whose block b sits at stage_table[b]. Keys and values share the buffer
 * (a step scores every block before it weighs any). With bf16 dot products the blocks
 * are bf16 pairs, else fp32 - the float path would widen bf16 to fp32 anyway. */
static int alloc_stage(const Plan *plan, Scratch *s) {
    const tm_attention_args *a = plan->a;
    s->stage = malloc((size_t)(plan->stage_blocks * widened_block_bytes(a, plan->use_dot)));
    s->stage_table = malloc(sizeof(int64_t) * (size_t)a->max_blocks);
    s->stage_args = *a;
    s->stage_args.k_cache = s->stage_args.v_cache = s->stage;
    s->stage_args.num_kv_heads = 1;
    s->stage_args.is_bf16 = plan->use_dot;
    s->stage_args.kv_int8 = 0;
    s->stage_plan = *plan;
    s->stage_plan.a = &s->stage_args;
    if (plan->int8_dot) {
        const size_t rows = (size_t)plan->rows_max, dim = (size_t)a->head_dim;
        s->q16 = malloc(sizeof(int16_t) * rows * dim);
        s->wq = malloc(sizeof(int16_t) * rows * dim / 2);
        s->q_scales = malloc(sizeof(float) * rows * dim / TM_KV_INT8_GROUP);
        s->w_scales = malloc(sizeof(float) * rows * dim / TM_KV_INT8_GROUP);
        if (!s->q16 || !s->wq || !s->q_scales || !s->w_scales) return 0;
    }
    return s->stage && s->stage_table;
}

/* Returns 1 when every buffer was allocated; free_scratch frees them either way. */
static int alloc_scratch(const Plan *plan, Scratch *s) {
    const size_t rows = (size_t)plan->rows_max, dim = (size_t)plan->a->head_dim;
    const size_t block = dim * (size_t)plan->a->block_size, stride = (size_t)plan->stride;
    memset(s, 0, sizeof *s);
    s->acc = malloc(sizeof(float) * rows * dim);
    s->scores = malloc(sizeof(float) * rows * stride);
    s->parts = malloc(sizeof(Part) * (size_t)plan->parts_max);
    int ok = s->acc && s->scores && s->parts && (!plan->a->kv_int8 || alloc_stage(plan, s));
#ifdef HAVE_AMX_ATTENTION
    if (plan->use_flash) {
        s->row_max = malloc(sizeof(float) * rows);
        s->row_sum = malloc(sizeof(float) * rows);
        /* FLASH_WINDOW_BLOCKS, and a zero block after an odd count (attention_flash.h) */
        s->window_values = malloc(sizeof(uint16_t) * (size_t)(FLASH_WINDOW_BLOCKS + 1) * block);
        ok = ok && s->row_max && s->row_sum && s->window_values;
    }
#endif
    if (plan->use_dot) {
        s->qb = malloc(sizeof(uint16_t) * rows * dim);
        s->weights_bf16 = malloc(sizeof(uint16_t) * rows * stride);
        s->pairs = malloc(sizeof(uint16_t) * block);
        return ok && s->qb && s->weights_bf16 && s->pairs;
    }
    s->qf = malloc(sizeof(float) * rows * dim);
    s->widened = plan->a->is_bf16 ? malloc(sizeof(float) * block) : NULL;
    return ok && s->qf && (!plan->a->is_bf16 || s->widened);
}

static void free_scratch(Scratch *s) {
    free(s->acc), free(s->scores), free(s->parts), free(s->qf), free(s->widened);
    free(s->qb), free(s->weights_bf16), free(s->pairs), free(s->stage), free(s->stage_table);
    free(s->q16), free(s->wq), free(s->q_scales), free(s->w_scales);
    free(s->row_max), free(s->row_sum), free(s->window_values);
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

/* Item `index`'s parts (into parts) and the blocks its rows score together. */
static Item describe_item(const Plan *plan, int64_t index, Part *parts) {
    const tm_attention_args *a = plan->a;
    const int64_t k = group_of(plan->item_start, a->num_groups, index);
    const int64_t local = index - plan->item_start[k];
    const int64_t e0 = a->group_starts[k], count = a->group_starts[k + 1] - e0;
    Item it = {local % a->num_kv_heads, k, parts, 0, 0, 0, 0};
    if (count == 1) { /* one tile of a chunk */
        const int64_t first = local / a->num_kv_heads * plan->tile_tokens;
        const int64_t tokens = min64(a->queries[e0] - first, plan->tile_tokens);
        const int64_t seen0 = a->contexts[e0] - a->queries[e0] + first;
        parts[it.num_parts++] = (Part){e0, first, tokens, 0, seen0, seen0 + tokens,
                                       first_seen(a, seen0) / a->block_size};
        it.total_rows = tokens * plan->group;
        return it;
    }
    int64_t first_block = INT64_MAX;
    for (int64_t e = e0; e < e0 + count; e++) {
        const int64_t seen0 = a->contexts[e] - a->queries[e];
        const Part part = {e, 0, a->queries[e], it.total_rows, seen0, a->contexts[e],
                           first_seen(a, seen0) / a->block_size};
        parts[it.num_parts++] = part;
        it.total_rows += part.tokens * plan->group;
        first_block = min64(first_block, part.first_block);
    }
    /* Windows may leave the first shared blocks unseen by every member. */
    it.shared_hi = a->group_shared_blocks[k];
    it.shared_lo = min64(first_block, it.shared_hi);
    return it;
}

/* The block table an item's shared blocks are read from, and a part's own. */
static const int64_t *table_of(const Plan *plan, int64_t entry) {
    return plan->a->block_tables + entry * plan->a->max_blocks;
}

/* Step 1: the item's query rows into scratch - token t's G heads are adjacent in q - in
 * bf16 for bf16 dot products, else in fp32 pre-multiplied by the scale. */
static void gather_queries(const Plan *plan, const Item *it, Scratch *s) {
    const tm_attention_args *a = plan->a;
    const int64_t width = plan->group * a->head_dim;
    for (int64_t p = 0; p < it->num_parts; p++) {
        const Part *pt = &it->parts[p];
        for (int64_t t = 0; t < pt->tokens; t++) {
            const int64_t token = a->rows[pt->entry] + pt->first + t;
            const int64_t offset = (token * a->num_heads + it->kv_head * plan->group) * a->head_dim;
            const int64_t row = (pt->row + t * plan->group) * a->head_dim;
            if (plan->use_dot) memcpy(s->qb + row, (const uint16_t *)a->q + offset, sizeof(uint16_t) * (size_t)width);
            else load_row(a->q, offset, a->is_bf16, width, s->qf + row);
        }
    }
    if (!plan->use_dot)
        for (int64_t i = 0; i < it->total_rows * a->head_dim; i++) s->qf[i] *= a->scale;
#ifdef HAVE_INT8_DOT /* bf16 rows as they are, fp32 rows pre-scaled */
    if (plan->int8_dot)
        quantize_queries_int16(plan->use_dot ? (const void *)s->qb : (const void *)s->qf, plan->use_dot,
                               it->total_rows, a->head_dim, s->q16, s->q_scales);
#endif
}

/* kv_head's int8 block b of table in cache (keys or values). */
static inline const int8_t *int8_block(const tm_attention_args *a, const void *cache,
                                       const int64_t *table, int64_t b, int64_t kv_head) {
    const int64_t head_bytes = kv_int8_head_bytes(a->head_dim, a->block_size);
    return (const int8_t *)cache + (table[b] * a->num_kv_heads + kv_head) * head_bytes;
}

/* The int8 key (or value) blocks [b0, b1) of table widened into s->stage, and
 * s->stage_table pointed at them; blocks up to `end` are prefetched ahead. */
static void stage_window(const Plan *plan, Scratch *s, int keys, int64_t kv_head,
                         const int64_t *table, int64_t b0, int64_t b1, int64_t end) {
    const tm_attention_args *a = plan->a;
    const int64_t stage_bytes = widened_block_bytes(a, plan->use_dot);
    const void *cache = keys ? a->k_cache : a->v_cache;
    for (int64_t b = b0; b < b1; b++) {
        const int8_t *block = int8_block(a, cache, table, b, kv_head);
        prefetch_blocks_ahead(cache, table, b, b0, end, a->num_kv_heads, kv_head,
                              kv_int8_head_bytes(a->head_dim, a->block_size));
        void *out = (char *)s->stage + (b - b0) * stage_bytes;
        if (keys) widen_key_block(block, plan->int8_pairs, plan->use_dot, a->head_dim, a->block_size, out);
        else widen_value_block(block, plan->int8_pairs, plan->use_dot, a->head_dim, a->block_size, out);
        s->stage_table[b] = b - b0;
    }
}

/* Of an int8 call's `rows` rows, how many take the widened blocks (the rest are read
 * directly): all of them without int16 dot products, else those on AMX tiles. */
static int64_t int8_staged_rows(const Plan *plan, int64_t rows) {
    if (!plan->int8_dot) return rows;
#ifdef HAVE_AMX_ATTENTION
    if (plan->use_amx && rows >= AMX_TILE_ROWS) return rows / AMX_TILE_ROWS * AMX_TILE_ROWS;
#endif
    return 0;
}

/* Widened copies past this many bytes (keys and values) are not made; tiles then widen
 * windows of their own, as decode groups always do. */
#define WIDE_COPY_MAX_BYTES ((int64_t)256 << 20)

/* The blocks [*first, return value) that group k's entry has widened for the call: every
 * block any of its rows sees when the group is a prompt chunk (one entry) whose first
 * tile has staged rows; else none (0). */
static int64_t wide_blocks_of_group(const Plan *plan, int64_t k, int64_t *first) {
    const tm_attention_args *a = plan->a;
    const int64_t e = a->group_starts[k];
    const int64_t first_tile = min64(a->queries[e], plan->tile_tokens) * plan->group;
    *first = 0;
    if (a->group_starts[k + 1] - e != 1 || int8_staged_rows(plan, first_tile) == 0) return 0;
    *first = first_seen(a, a->contexts[e] - a->queries[e]) / a->block_size;
    return ceil_div(a->contexts[e], a->block_size);
}

/* The blocks wide_blocks_of_group names, widened into wide (see WideCopy). Returns TM_OK
 * with wide->tables NULL when no chunk needs it or the copy would pass
 * WIDE_COPY_MAX_BYTES, TM_OUT_OF_MEMORY when an allocation fails. */
static int widen_prompt_blocks(const Plan *plan, WideCopy *wide) {
    const tm_attention_args *a = plan->a;
    const int64_t entries = a->group_starts[a->num_groups];
    const int64_t stage_bytes = widened_block_bytes(a, plan->use_dot);
    memset(wide, 0, sizeof *wide);
    int64_t slots = 0, first;
    for (int64_t k = 0; k < a->num_groups; k++) slots += wide_blocks_of_group(plan, k, &first) - first;
    const int64_t bytes = 2 * slots * a->num_kv_heads * stage_bytes;
    if (slots == 0 || bytes > WIDE_COPY_MAX_BYTES) return TM_OK;
    wide->tables = malloc(sizeof(int64_t) * (size_t)(entries * a->max_blocks));
    wide->entry_widened = calloc((size_t)entries, 1);
    wide->k = malloc((size_t)(bytes / 2));
    wide->v = malloc((size_t)(bytes / 2));
    int64_t *source = malloc(sizeof(int64_t) * (size_t)slots); /* a slot's cache block */
    if (!wide->tables || !wide->entry_widened || !wide->k || !wide->v || !source) {
        free(source);
        return TM_OUT_OF_MEMORY;
    }
    int64_t slot = 0;
    for (int64_t k = 0; k < a->num_groups; k++) {
        const int64_t e = a->group_starts[k], end = wide_blocks_of_group(plan, k, &first);
        const int64_t row = e * a->max_blocks;
        wide->entry_widened[e] = end > first;
        for (int64_t b = first; b < end; b++, slot++) {
            wide->tables[row + b] = slot;
            source[slot] = a->block_tables[row + b];
        }
    }
    const int64_t head_bytes = kv_int8_head_bytes(a->head_dim, a->block_size);
#pragma omp parallel for num_threads(a->num_threads) schedule(static)
    for (int64_t i = 0; i < slots * a->num_kv_heads; i++) {
        const int64_t from = (source[i / a->num_kv_heads] * a->num_kv_heads + i % a->num_kv_heads) * head_bytes;
        widen_key_block((const int8_t *)a->k_cache + from, plan->int8_pairs, plan->use_dot,
                        a->head_dim, a->block_size, (char *)wide->k + i * stage_bytes);
        widen_value_block((const int8_t *)a->v_cache + from, plan->int8_pairs, plan->use_dot,
                          a->head_dim, a->block_size, (char *)wide->v + i * stage_bytes);
    }
    free(source);
    wide->args = *a;
    wide->args.k_cache = wide->k;
    wide->args.v_cache = wide->v;
    wide->args.block_tables = wide->tables;
    wide->args.is_bf16 = plan->use_dot;
    wide->args.kv_int8 = 0;
    wide->plan = *plan;
    wide->plan.a = &wide->args;
    return TM_OK;
}

static void free_wide_copy(WideCopy *wide) {
    free(wide->tables), free(wide->entry_widened), free(wide->k), free(wide->v);
}

/* The widened copy's table for `table`, an entry's row of block_tables, or NULL where that
 * entry was not widened (or `table` is no entry's: a window's stage_table). */
static const int64_t *wide_table_of(const Plan *plan, const int64_t *table) {
    const WideCopy *wide = plan->wide;
    if (!wide) return NULL;
    const tm_attention_args *a = plan->a;
    const int64_t entries = a->group_starts[a->num_groups];
    if (table < a->block_tables || table >= a->block_tables + entries * a->max_blocks) return NULL;
    const int64_t at = table - a->block_tables;
    if (at % a->max_blocks || !wide->entry_widened[at / a->max_blocks]) return NULL;
    return wide->tables + at;
}

static void score_blocks(const Plan *plan, Scratch *s, int64_t kv_head, const int64_t *table,
                         int64_t b0, int64_t b1, int64_t row0, int64_t rows);
static void weigh_blocks(const Plan *plan, Scratch *s, int64_t kv_head, const int64_t *table,
                         int64_t b0, int64_t b1, int64_t visible, int64_t row0, int64_t rows);

/* The int8 block b of a direct walk over [b0, b1) of table, the blocks ahead asked for. */
static inline const int8_t *next_int8_block(const tm_attention_args *a, const void *cache,
                                            const int64_t *table, int64_t b, int64_t b0,
                                            int64_t b1, int64_t kv_head) {
    prefetch_blocks_ahead(cache, table, b, b0, b1, a->num_kv_heads, kv_head,
                          kv_int8_head_bytes(a->head_dim, a->block_size));
    return int8_block(a, cache, table, b, kv_head);
}

/* score_blocks over an int8 cache: the rows int8_staged_rows names through widened
 * windows and the float path, the rest straight from the blocks. */
static void score_blocks_int8(const Plan *plan, Scratch *s, int64_t kv_head, const int64_t *table,
                              int64_t b0, int64_t b1, int64_t row0, int64_t rows) {
    const int64_t staged = int8_staged_rows(plan, rows);
    const int64_t *wide_table = staged > 0 ? wide_table_of(plan, table) : NULL;
    if (wide_table) score_blocks(&plan->wide->plan, s, kv_head, wide_table, b0, b1, row0, staged);
    for (int64_t w = b0; w < b1 && staged > 0 && !wide_table; w += plan->stage_blocks) {
        const int64_t w1 = min64(b1, w + plan->stage_blocks);
        stage_window(plan, s, 1, kv_head, table, w, w1, b1);
        score_blocks(&s->stage_plan, s, 0, s->stage_table, w, w1, row0, staged);
    }
#ifdef HAVE_INT8_DOT
    const tm_attention_args *a = plan->a;
    const int64_t head_dim = a->head_dim, stride = plan->stride;
    for (int64_t b = b0; b < b1 && staged < rows; b++) {
        const int8_t *block = next_int8_block(a, a->k_cache, table, b, b0, b1, kv_head);
        for (int64_t r = row0 + staged; r < row0 + rows; r += SCORE_ROWS)
            score_rows_int8_any(s->q16 + r * head_dim, s->q_scales + r * (head_dim / TM_KV_INT8_GROUP),
                                min64(row0 + rows - r, SCORE_ROWS), block, s->scores + r * stride + b * 16,
                                stride, head_dim);
    }
#endif
}

/* weigh_blocks over an int8 cache, its rows split as score_blocks_int8 splits them. */
static void weigh_blocks_int8(const Plan *plan, Scratch *s, int64_t kv_head, const int64_t *table,
                              int64_t b0, int64_t b1, int64_t visible, int64_t row0, int64_t rows) {
    const int64_t staged = int8_staged_rows(plan, rows);
    const int64_t *wide_table = staged > 0 ? wide_table_of(plan, table) : NULL;
    if (wide_table)
        weigh_blocks(&plan->wide->plan, s, kv_head, wide_table, b0, b1, visible, row0, staged);
    for (int64_t w = b0; w < b1 && staged > 0 && !wide_table; w += plan->stage_blocks) {
        const int64_t w1 = min64(b1, w + plan->stage_blocks);
        stage_window(plan, s, 0, kv_head, table, w, w1, b1);
        weigh_blocks(&s->stage_plan, s, 0, s->stage_table, w, w1, visible, row0, staged);
    }
#ifdef HAVE_INT8_DOT
    const tm_attention_args *a = plan->a;
    const int64_t head_dim = a->head_dim, stride = plan->stride, r = row0 + staged;
    /* the softmax's weights: bf16 for bf16 dot products, else the fp32 probabilities */
    const void *w = plan->use_dot ? (const void *)(s->weights_bf16 + r * stride + b0 * 16)
                                  : (const void *)(s->scores + r * stride + b0 * 16);
    const int64_t w_elem = plan->use_dot ? 2 : 4;
    for (int64_t b = b0; b < b1 && staged < rows; b++)
        weigh_block_int8((const char *)w + (b - b0) * 16 * w_elem, plan->use_dot, stride,
                         next_int8_block(a, a->v_cache, table, b, b0, b1, kv_head),
                         min64(visible - b * a->block_size, a->block_size), s->acc + r * head_dim,
                         rows - staged, head_dim, s->wq, s->w_scales);
#endif
}

/* Scores of rows [row0, row0 + rows) against the key blocks [b0, b1) of table, into
 * s->scores at each block's positions. With bf16 dot products the bf16 rows are scored
 * against each block's pairs (the scale applied there), else the fp32 rows against fp32
 * (or widened) keys. */
static void score_blocks(const Plan *plan, Scratch *s, int64_t kv_head, const int64_t *table,
                         int64_t b0, int64_t b1, int64_t row0, int64_t rows) {
    const tm_attention_args *a = plan->a;
    const int64_t head_dim = a->head_dim, block_size = a->block_size, stride = plan->stride;
    const int64_t block_elems = head_dim * block_size, elem = a->is_bf16 ? 2 : 4;
    if (a->kv_int8) {
        score_blocks_int8(plan, s, kv_head, table, b0, b1, row0, rows);
        return;
    }
#ifdef HAVE_AMX_ATTENTION
    if (plan->use_amx && rows >= AMX_TILE_ROWS) { /* whole groups of 16 rows on tiles */
        const int64_t tiles = rows / AMX_TILE_ROWS;
        score_blocks_amx(a, s->qb + row0 * head_dim, s->scores + row0 * stride, stride, kv_head,
                         table, b0, b1, tiles);
        row0 += tiles * AMX_TILE_ROWS, rows -= tiles * AMX_TILE_ROWS;
        if (rows == 0) return;
    }
#endif
#ifdef HAVE_BF16_DOT
    if (plan->use_dot) { /* the cache holds the blocks as pairs already */
        const int64_t step = rows <= SCORE_TWO_ROWS ? 2 : 1; /* a decoding sequence: two */
        for (int64_t b = b0; b < b1; b += step) {
            const uint16_t *pairs = (const uint16_t *)a->k_cache +
                                    (table[b] * a->num_kv_heads + kv_head) * block_elems;
            float *scores = s->scores + row0 * stride + b * 16;
            prefetch_blocks_ahead(a->k_cache, table, b, b0, b1, a->num_kv_heads, kv_head, block_elems * elem);
            if (step == 2 && b + 1 < b1) {
                prefetch_blocks_ahead(a->k_cache, table, b + 1, b0, b1, a->num_kv_heads, kv_head,
                                      block_elems * elem);
                const uint16_t *next = (const uint16_t *)a->k_cache +
                                       (table[b + 1] * a->num_kv_heads + kv_head) * block_elems;
                score_two_blocks_bf16_any(s->qb + row0 * head_dim, rows, pairs, next, scores, stride,
                                          head_dim);
                continue;
            }
            for (int64_t r = 0; r < rows; r += SCORE_ROWS)
                score_rows_bf16_any(s->qb + (row0 + r) * head_dim, min64(rows - r, SCORE_ROWS), pairs,
                                    scores + r * stride, stride, head_dim);
        }
        return;
    }
#endif
    for (int64_t b = b0; b < b1; b++) {
        const int64_t base = (table[b] * a->num_kv_heads + kv_head) * block_elems;
        prefetch_blocks_ahead(a->k_cache, table, b, b0, b1, a->num_kv_heads, kv_head, block_elems * elem);
        const float *kb = (const float *)a->k_cache + base;
        if (a->is_bf16) { /* widen the block once; every row reuses it */
            load_row(a->k_cache, base, 1, block_elems, s->widened);
            kb = s->widened;
        }
        for (int64_t r = row0; r < row0 + rows; r += SCORE_ROWS)
            score_rows(s->qf + r * head_dim, min64(row0 + rows - r, SCORE_ROWS), kb,
                       s->scores + r * stride + b * block_size, stride, head_dim, block_size);
    }
}

/* Step 2: every row's scores against the blocks it may see: the shared blocks once for
 * all rows, then each part's own, from the first block one of its rows sees. */
static void score_item(const Plan *plan, const Item *it, Scratch *s) {
    const int64_t bs = plan->a->block_size;
    const int64_t *shared_table = table_of(plan, it->parts[0].entry);
    score_blocks(plan, s, it->kv_head, shared_table, it->shared_lo, it->shared_hi, 0, it->total_rows);
    for (int64_t p = 0; p < it->num_parts; p++) {
        const Part *pt = &it->parts[p];
        score_blocks(plan, s, it->kv_head, table_of(plan, pt->entry),
                     max64(it->shared_hi, pt->first_block), ceil_div(pt->visible, bs), pt->row,
                     pt->tokens * plan->group);
    }
}

/* Step 3: an exact softmax per row over the positions it sees, and zero weight at the
 * other positions step 4 reads for it (from the item's first scored block to its part's
 * last), so that step can treat a part's rows alike. */
static void softmax_item(const Plan *plan, const Item *it, Scratch *s) {
    const tm_attention_args *a = plan->a;
    const int64_t bs = a->block_size;
    for (int64_t p = 0; p < it->num_parts; p++) {
        const Part *pt = &it->parts[p];
        const int64_t padded = ceil_div(pt->visible, bs) * bs;
        const int64_t read_from = (it->shared_lo < it->shared_hi ? it->shared_lo : pt->first_block) * bs;
        for (int64_t r = pt->row; r < pt->row + pt->tokens * plan->group; r++) {
            float *sr = s->scores + r * plan->stride;
            const int64_t position = pt->seen0 + (r - pt->row) / plan->group;
            const int64_t lo = first_seen(a, position), seen = position + 1;
            /* A sink is one more logit in the denominator: exp(-INFINITY) adds nothing. */
            const float sink =
                a->sinks ? a->sinks[it->kv_head * plan->group + (r - pt->row) % plan->group] : -INFINITY;
#ifdef HAVE_BF16_DOT
            if (plan->use_dot) {
                softmax_row_bf16(sr, s->weights_bf16 + r * plan->stride, read_from, lo, seen, padded,
                                 a->scale, sink);
                continue;
            }
#endif
            float max = sink;
            for (int64_t t = lo; t < seen; t++) max = sr[t] > max ? sr[t] : max;
            float sum = expf(sink - max);
            for (int64_t t = lo; t < seen; t++) {
                sr[t] = expf(sr[t] - max);
                sum += sr[t];
            }
            const float inv = 1.f / sum;
            for (int64_t t = lo; t < seen; t++) sr[t] *= inv;
            for (int64_t t = read_from; t < lo; t++) sr[t] = 0.f;
            for (int64_t t = seen; t < padded; t++) sr[t] = 0.f;
        }
    }
}

/* acc[rows] += weights x values over the value blocks [b0, b1) of table; positions at
 * and past `visible` are not read. With bf16 dot products the weights are their bf16
 * copy. */
static void weigh_blocks(const Plan *plan, Scratch *s, int64_t kv_head, const int64_t *table,
                         int64_t b0, int64_t b1, int64_t visible, int64_t row0, int64_t rows) {
    const tm_attention_args *a = plan->a;
    const int64_t head_dim = a->head_dim, block_size = a->block_size, stride = plan->stride;
    const int64_t block_elems = head_dim * block_size, elem = a->is_bf16 ? 2 : 4;
    if (a->kv_int8) {
        weigh_blocks_int8(plan, s, kv_head, table, b0, b1, visible, row0, rows);
        return;
    }
#ifdef HAVE_AMX_ATTENTION
    if (plan->use_amx && rows >= AMX_TILE_ROWS) { /* whole groups of 16 rows on tiles */
        const int64_t tiles = rows / AMX_TILE_ROWS;
        weigh_blocks_amx(a, s->weights_bf16 + row0 * stride, stride, s->acc + row0 * head_dim,
                         kv_head, table, b0, b1, visible, tiles, s->pairs);
        row0 += tiles * AMX_TILE_ROWS, rows -= tiles * AMX_TILE_ROWS;
        if (rows == 0) return;
    }
#endif
    for (int64_t b = b0; b < b1; b++) {
        const int64_t base = (table[b] * a->num_kv_heads + kv_head) * block_elems;
        const int64_t m = min64(visible - b * block_size, block_size);
        prefetch_blocks_ahead(a->v_cache, table, b, b0, b1, a->num_kv_heads, kv_head, block_elems * elem);
#ifdef HAVE_BF16_DOT
        if (plan->use_dot) { /* pairs in the cache; a sequence's last block copied, its tail cleared */
            const uint16_t *pairs = (const uint16_t *)a->v_cache + base;
            if (m < 16) {
                value_pairs_head(pairs, m, head_dim, s->pairs);
                pairs = s->pairs;
            }
            weigh_block_bf16(s->weights_bf16 + row0 * stride + b * 16, stride, pairs,
                             s->acc + row0 * head_dim, rows, head_dim);
            continue;
        }
#endif
        const float *vb = (const float *)a->v_cache + base;
        if (a->is_bf16) {
            load_row(a->v_cache, base, 1, m * head_dim, s->widened);
            vb = s->widened;
        }
        weigh_block(s->scores + row0 * stride + b * block_size, stride, vb, m,
                    s->acc + row0 * head_dim, rows, head_dim);
    }
}

/* Step 4: the weighted sum of values, over the same blocks as step 2 in the same way. */
static void accumulate_item(const Plan *plan, const Item *it, Scratch *s) {
    const int64_t bs = plan->a->block_size;
    memset(s->acc, 0, sizeof(float) * (size_t)(it->total_rows * plan->a->head_dim));
    weigh_blocks(plan, s, it->kv_head, table_of(plan, it->parts[0].entry), it->shared_lo,
                 it->shared_hi, it->shared_hi * bs, 0, it->total_rows);
    for (int64_t p = 0; p < it->num_parts; p++) {
        const Part *pt = &it->parts[p];
        weigh_blocks(plan, s, it->kv_head, table_of(plan, pt->entry),
                     max64(it->shared_hi, pt->first_block), ceil_div(pt->visible, bs),
                     pt->visible, pt->row, pt->tokens * plan->group);
    }
}

/* Step 5: the rows into out, in its storage type. */
static void store_item(const Plan *plan, const Item *it, const Scratch *s) {
    const tm_attention_args *a = plan->a;
    for (int64_t p = 0; p < it->num_parts; p++) {
        const Part *pt = &it->parts[p];
        for (int64_t t = 0; t < pt->tokens; t++) {
            const int64_t token = a->rows[pt->entry] + pt->first + t;
            const int64_t offset = (token * a->num_heads + it->kv_head * plan->group) * a->head_dim;
            store_row(a->out, offset, a->is_bf16, plan->group * a->head_dim,
                      s->acc + (pt->row + t * plan->group) * a->head_dim);
        }
    }
}

#ifdef HAVE_AMX_ATTENTION
/* Steps 2-4 for a prompt tile, in windows (attention_flash.h). */
static void attend_tile_in_windows(const Plan *plan, const Item *it, Scratch *s) {
    const tm_attention_args *a = plan->a;
    const Part *pt = &it->parts[0];
    const int64_t row_tiles = ceil_div(it->total_rows, AMX_TILE_ROWS);
    const int64_t padding = row_tiles * AMX_TILE_ROWS - it->total_rows;
    memset(s->qb + it->total_rows * a->head_dim, 0, sizeof(uint16_t) * (size_t)(padding * a->head_dim));
    const FlashTile tile = {
        s->qb, row_tiles, plan->group, pt->tokens, pt->seen0, it->kv_head, table_of(plan, pt->entry),
        a->sinks ? a->sinks + it->kv_head * plan->group : NULL, s->scores, s->weights_bf16,
        s->acc, s->row_max, s->row_sum, s->window_values,
    };
    attend_tile_flash(a, &tile);
}
#endif

static void attend_item(const Plan *plan, int64_t index, Scratch *s) {
    const Item it = describe_item(plan, index, s->parts);
    gather_queries(plan, &it, s);
#ifdef HAVE_AMX_ATTENTION
    /* A prompt tile (one part) of at least one AMX tile's rows; a decoding sequence's few
     * rows stay on the vector path. */
    if (plan->use_flash && it.num_parts == 1 && it.total_rows >= AMX_TILE_ROWS) {
        attend_tile_in_windows(plan, &it, s);
        store_item(plan, &it, s);
        return;
    }
#endif
    score_item(plan, &it, s);
    softmax_item(plan, &it, s);
    accumulate_item(plan, &it, s);
    store_item(plan, &it, s);
}

int tm_paged_attention(const tm_attention_args *a) {
    if (a->head_dim > TM_MAX_HEAD_DIM || a->block_size > TM_MAX_BLOCK_SIZE ||
        a->num_heads / a->num_kv_heads > TM_MAX_HEADS_PER_KV_HEAD || a->sliding_window < 0 ||
        (a->kv_int8 && a->head_dim % TM_KV_INT8_GROUP != 0))
        return TM_UNSUPPORTED_SHAPE;
    Plan plan;
    if (plan_items(a, &plan) != TM_OK) return TM_OUT_OF_MEMORY;
    WideCopy wide = {0};
    if (a->kv_int8) {
        if (widen_prompt_blocks(&plan, &wide) != TM_OK) {
            free_wide_copy(&wide), free(plan.item_start);
            return TM_OUT_OF_MEMORY;
        }
        if (wide.tables) plan.wide = &wide;
    }
    int failed = 0;
#pragma omp parallel num_threads(a->num_threads)
    {
        Scratch scratch;
        const int ok = alloc_scratch(&plan, &scratch);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* A sequence's (or a tile's) kv heads are adjacent items, and their blocks adjacent
         * in the cache: one thread takes them all, so that two threads never read
         * neighbouring parts of one block at once (docs/design.md, "Decode
         * attention"). */
#pragma omp for schedule(dynamic, a->num_kv_heads)
        for (int64_t item = 0; item < plan.num_items; item++)
            if (ok) attend_item(&plan, item, &scratch);
        free_scratch(&scratch);
    }
    free_wide_copy(&wide), free(plan.item_start);
    return failed ? TM_OUT_OF_MEMORY : TM_OK;
}

int tm_stores_bf16_pairs(int64_t block_size, int64_t head_dim) {
    return uses_bf16_pairs(1, block_size, head_dim);
}

/* Internal (tm_limits reports it): whether this build reads int8 caches in int16 dot
 * products (attention_int8.h). */
int tm_internal_kv_int8_direct(void) {
#ifdef HAVE_INT8_DOT
    return 1;
#else
    return 0;
#endif
}

/* Internal (tm_limits reports it): whether this build attends to pair-layout caches on
 * AMX tiles here. */
int tm_internal_bf16_attention_amx(void) {
#ifdef HAVE_AMX_ATTENTION
    return tm_internal_amx_permitted();
#else
    return 0;
#endif
}

/* Keys go in transposed within the block ([head_dim, block_size]), as score_blocks reads
 * them, values token-major - or, for the caches uses_bf16_pairs names, both in the pair
 * layout of bf16 dot products (attention_bf16.h). */
int tm_write_kv_cache(const tm_kv_write_args *a) {
    const int64_t elem = a->is_bf16 ? 2 : 4;
    const int64_t row = a->num_kv_heads * a->head_dim, block_size = a->block_size;
    const int pairs = a->kv_int8 ? kv_int8_pairs(a->is_bf16, block_size, a->head_dim)
                                 : uses_bf16_pairs(a->is_bf16, block_size, a->head_dim);
    if (a->kv_int8 && (a->head_dim > TM_MAX_HEAD_DIM || a->head_dim % TM_KV_INT8_GROUP != 0))
        return TM_UNSUPPORTED_SHAPE;
    /* A decode step's few rows are not worth waking the other threads for. */
#pragma omp parallel for num_threads(a->num_threads) schedule(static) if (a->num_tokens >= 256)
    for (int64_t t = 0; t < a->num_tokens; t++) {
        const int64_t block = a->slot_blocks[t], offset = a->slot_offsets[t];
        for (int64_t h = 0; h < a->num_kv_heads; h++) {
            const int64_t head = (block * a->num_kv_heads + h) * a->head_dim * block_size;
            const int64_t src = t * row + h * a->head_dim;
            if (a->kv_int8) {
                const int64_t head_bytes = kv_int8_head_bytes(a->head_dim, block_size);
                const int64_t at = (block * a->num_kv_heads + h) * head_bytes;
                write_kv_int8((const char *)a->k + src * elem, (const char *)a->v + src * elem,
                              a->is_bf16, pairs, offset, a->head_dim, block_size,
                              (int8_t *)a->k_cache + at, (int8_t *)a->v_cache + at);
                continue;
            }
            if (pairs) { /* the layout attention's bf16 dot products read (attention_bf16.h) */
                const uint16_t *ks = (const uint16_t *)a->k + src, *vs = (const uint16_t *)a->v + src;
                uint16_t *kd = (uint16_t *)a->k_cache + head, *vd = (uint16_t *)a->v_cache + head;
                for (int64_t d = 0; d < a->head_dim; d++) kd[(d >> 1) * 32 + offset * 2 + (d & 1)] = ks[d];
                uint16_t *vrow = vd + (offset >> 1) * 2 * a->head_dim + (offset & 1);
                for (int64_t c = 0; c < a->head_dim; c++) vrow[2 * c] = vs[c];
                continue;
            }
            memcpy((char *)a->v_cache + (head + offset * a->head_dim) * elem,
                   (const char *)a->v + src * elem, (size_t)(a->head_dim * elem));
            if (a->is_bf16) {
                const uint16_t *ks = (const uint16_t *)a->k + src;
                uint16_t *kd = (uint16_t *)a->k_cache + head + offset;
                for (int64_t d = 0; d < a->head_dim; d++) kd[d * block_size] = ks[d];
            } else {
                const float *ks = (const float *)a->k + src;
                float *kd = (float *)a->k_cache + head + offset;
                for (int64_t d = 0; d < a->head_dim; d++) kd[d * block_size] = ks[d];
            }
        }
    }
    return TM_OK;
}
