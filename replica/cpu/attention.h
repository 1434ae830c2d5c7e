/* Paged attention's shared parts: the layer and work-item types, the page layouts, and
 * the helpers both attention.c (generic pages, the step's entry point) and
 * attention_paired.c (AVX512-BF16 pages) use. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvserve_abi.h"
#include "scalar.h"

/* A layer's cache is a pair of [num_blocks, Hkv, ...] tensors: one page per (block, KV
 * head), laid out for the kernel that reads it (attention.c, attention_paired.c). */

#define PAGES_AHEAD 2 /* blocks whose pages are loaded ahead of the one being attended */
#define MAX_ROWS 8 /* query rows of one chunk handled together, sharing each page load */
#define PREFILL_KEYS 256 /* keys per superchunk of attend_prefill_paired */

/* One unit of attention work: up to MAX_ROWS consecutive query rows of one sequence, for
 * the query heads of one KV head. Row r sits at position first_pos + (r - row0) and
 * attends to keys 0..position (causal). */
typedef struct {
    int64_t row0;
    int nrows;
    int first_pos;
    int kv_head;
    const int32_t* block_table;
} WorkItem;

typedef struct {
    void* out; /* [T, H, D] contiguous */
    const void* q;
    int64_t q_stride_t, q_stride_h;
    const void* cos; /* [T, D] contiguous, or NULL when q and k arrive rotated */
    const void* sin;
    void* k_cache;
    void* v_cache;
    int num_heads, num_kv_heads, head_dim, block_size;
    float scale;
    int is_bf16;
} Layer;

typedef struct {
    float* q;   /* [MAX_ROWS * group, D], rotated (generic pages) */
    float* acc; /* [MAX_ROWS * group, D] */
    float* m;   /* running max per query vector */
    float* l;   /* running sum per query vector */
    float* k;   /* [D, BS] widened K page (generic); bf16 query pairs (paired pages) */
    float* v;   /* [BS, D] widened V page (generic); bf16 probabilities (paired pages) */
    float* p;   /* [2 * BS]: probabilities, and scores for attend_any; corrections (prefill) */
    float* scores; /* [MAX_ROWS * group, PREFILL_KEYS or BS] (paired prefill) */
    bf16* probs;   /* [MAX_ROWS * group, PREFILL_KEYS or BS] (paired prefill) */
} Scratch;

/* Bounds of attend_rows' register arrays. Sized by these constants rather than by its
 * arguments: arrays sized by arguments are variable-length, which GCC keeps in memory, so
 * each multiply-add's accumulator would go back to the stack on every iteration. */
#define MAX_PAIRED_VECTORS 4
#define MAX_PAIRED_BLOCK 256
#define MAX_PAIRED_HEAD_DIM 512

static inline int paired_pages(const Layer* L) {
#if defined(__AVX512BF16__)
    return L->is_bf16 && L->head_dim % 32 == 0 && L->block_size % 16 == 0 && L->head_dim <= MAX_PAIRED_HEAD_DIM &&
           L->block_size <= MAX_PAIRED_BLOCK;
#else
    (void)L;
    return 0;
#endif
}

/* Offsets within a page, in elements, of key j's dimension d. */
static inline int64_t k_offset(const Layer* L, int j, int d) {
    const int BS = L->block_size;
    return paired_pages(L) ? ((int64_t)(d / 2) * BS + j) * 2 + d % 2 : (int64_t)d * BS + j;
}

static inline int64_t v_offset(const Layer* L, int j, int d) {
    const int D = L->head_dim;
    return paired_pages(L) ? ((int64_t)(j / 2) * D + d) * 2 + j % 2 : (int64_t)j * D + d;
}

/* An item's online softmax starts empty: no maximum, no sum, zero accumulators. */
static inline void start_item(const Scratch* w, int num_vectors, int D) {
    for (int i = 0; i < num_vectors; i++) {
        w->m[i] = -INFINITY;
        w->l[i] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)num_vectors * D);
}

/* Each output is scaled and rounded in one pass: scaled in place and then read back, the
 * accumulators' loads would wait on the stores just before them. */
static inline void store_outputs(const Layer* L, const WorkItem* it, const Scratch* w, int group) {
    const int D = L->head_dim;
    for (int i = 0; i < it->nrows * group; i++) {
        const int head = it->kv_head * group + i % group;
        const float* acc = w->acc + (int64_t)i * D;
        const float inv = 1.0f / w->l[i];
        const int64_t offset = (it->row0 + i / group) * (int64_t)L->num_heads * D + (int64_t)head * D;
        if (L->is_bf16) {
            bf16* out = (bf16*)L->out + offset;
            for (int d = 0; d < D; d++) out[d] = float_to_bf16(acc[d] * inv);
        } else {
            float* out = (float*)L->out + offset;
            for (int d = 0; d < D; d++) out[d] = acc[d] * inv;
        }
    }
}

/* The blocks an item attends: its sequence's up to its last row's. */
static inline int item_blocks(const WorkItem* it, int block_size) {
    return (it->first_pos + it->nrows - 1) / block_size + 1;
}

#if defined(__AVX512BF16__)
/* attention_paired.c: one item on paired pages (`next`: the item this thread attends
 * after it, or NULL; `warm`: how many of its first blocks' pages are already loading),
 * and token t's K and V rows written into key j of `block`'s pages. */
void attend_paired(const Layer* L, const WorkItem* it, const WorkItem* next, int warm, const Scratch* w);
void write_paired_kv(const Layer* L, const bf16* k, int64_t k_stride_h, const bf16* v, int64_t v_stride_h,
                     int64_t t, int64_t block, int j);
#endif
