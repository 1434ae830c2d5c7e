/* Paged attention on AVX512-BF16 CPUs, over bf16 pages that interleave pairs along each
 * product's sum (K as [D/2, BS, 2], V as [BS/2, D, 2]), so that vdpbf16ps reads them as
 * they are and accumulates in fp32. Decode items (one query row) attend block by block,
 * with their pages loaded ahead from memory; prefill items attend in superchunks of keys.
 * attention.c picks these paths (paired_pages) and schedules the items. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvserve_abi.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "attention.h"
#include "avx512_bf16.h"

/* Start loading blocks first..last of an item (its K and V pages) into L2: they sit
 * anywhere in the cache, so the hardware prefetchers cannot guess them, and a decode
 * step reads far more KV than fits in L3. A few blocks ahead of the attention rather
 * than the whole item at once, since a burst of a whole item's pages overflows what L2
 * can have in flight. */
static inline void prefetch_pages(const Layer* L, const WorkItem* it, int first, int last) {
    const int64_t page_bytes = (int64_t)L->block_size * L->head_dim * (L->is_bf16 ? 2 : 4);
    if (last >= item_blocks(it, L->block_size)) last = item_blocks(it, L->block_size) - 1;
    for (int b = first; b <= last; b++) {
        const int64_t page = ((int64_t)it->block_table[b] * L->num_kv_heads + it->kv_head) * page_bytes;
        for (int64_t x = 0; x < page_bytes; x += 64) {
            __builtin_prefetch((const char*)L->k_cache + page + x, 0, 2);
            __builtin_prefetch((const char*)L->v_cache + page + x, 0, 2);
        }
    }
}

/* Start loading an item's query rows, rotary rows and output rows (for the next item
 * while this one is attended): the step's GEMM just wrote its queries, much of them from
 * the other core, and its outputs are lines no core holds. */
static inline void prefetch_item_rows(const Layer* L, const WorkItem* it, int group) {
    if (it == NULL) return;
    const int D = L->head_dim, row_bytes = D * (int)sizeof(bf16);
    for (int r = 0; r < it->nrows; r++) {
        const int64_t row = it->row0 + r;
        for (int g = 0; g < group; g++) {
            const int head = it->kv_head * group + g;
            const char* q = (const char*)((const bf16*)L->q + row * L->q_stride_t + head * L->q_stride_h);
            const char* o = (const char*)((const bf16*)L->out + (row * L->num_heads + head) * (int64_t)D);
            for (int x = 0; x < row_bytes; x += 64) {
                __builtin_prefetch(q + x, 0, 3);
                __builtin_prefetch(o + x, 1, 3);
            }
        }
        if (L->cos != NULL)
            for (int x = 0; x < row_bytes; x += 64) {
                __builtin_prefetch((const char*)((const bf16*)L->cos + row * D) + x, 0, 3);
                __builtin_prefetch((const char*)((const bf16*)L->sin + row * D) + x, 0, 3);
            }
    }
}

/* dst = the bf16 row x (D % 32 == 0) rotated as rotate_pair_bf16 rotates it, 16 pairs at
 * a time (cos and sin: the row's angles), or copied when cos is NULL. Vectorized because
 * the rotation dominates writing K and loading a prefill's queries. */
static inline void rotate_row_bf16(bf16* dst, const bf16* x, const bf16* cos, const bf16* sin, int D) {
    const int half = D / 2;
    if (cos == NULL) {
        memcpy(dst, x, sizeof(bf16) * (size_t)D);
        return;
    }
    for (int d = 0; d < half; d += 16) {
        const __m512 x0 = bf16_load(x + d, 0xffff), x1 = bf16_load(x + d + half, 0xffff);
        const __m512 c0 = bf16_load(cos + d, 0xffff), c1 = bf16_load(cos + d + half, 0xffff);
        const __m512 s0 = bf16_load(sin + d, 0xffff), s1 = bf16_load(sin + d + half, 0xffff);
        bf16_store(dst + d, 0xffff,
                   _mm512_sub_ps(bf16_round(_mm512_mul_ps(x0, c0)), bf16_round(_mm512_mul_ps(x1, s0))));
        bf16_store(dst + d + half, 0xffff,
                   _mm512_add_ps(bf16_round(_mm512_mul_ps(x1, c1)), bf16_round(_mm512_mul_ps(x0, s1))));
    }
}

/* Paired pages' K/V write for token t: key j of each KV head's page. K's dimension pairs
 * are 32-bit words BS apart (scattered 16 at a time); V's elements go to every other
 * bf16 of a pair row, the other half of each word left as it is. */
void write_paired_kv(const Layer* L, const bf16* k, int64_t k_stride_h, const bf16* v, int64_t v_stride_h,
                     int64_t t, int64_t block, int j) {
    const int D = L->head_dim, BS = L->block_size;
    bf16 rotated[MAX_PAIRED_HEAD_DIM];
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i words_apart = _mm512_mullo_epi32(lane, _mm512_set1_epi32(BS));
    const __mmask32 halves = j % 2 ? 0xaaaaaaaau : 0x55555555u;
    for (int h = 0; h < L->num_kv_heads; h++) {
        const int64_t page = (block * L->num_kv_heads + h) * BS * D;
        rotate_row_bf16(rotated, k + h * k_stride_h, L->cos ? (const bf16*)L->cos + t * D : NULL,
                        L->sin ? (const bf16*)L->sin + t * D : NULL, D);
        int32_t* kpairs = (int32_t*)((bf16*)L->k_cache + page) + j;
        for (int d2 = 0; d2 < D / 2; d2 += 16)
            _mm512_i32scatter_epi32(kpairs + (int64_t)d2 * BS, words_apart,
                                    _mm512_loadu_si512((const int32_t*)rotated + d2), 4);
        const bf16* vsrc = v + h * v_stride_h;
        bf16* vrow = (bf16*)L->v_cache + page + v_offset(L, j - j % 2, 0);
        for (int d = 0; d < D; d += 16) {
            __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(vsrc + d)));
            if (j % 2) words = _mm512_slli_epi32(words, 16);
            _mm512_mask_storeu_epi16(vrow + 2 * d, halves, words);
        }
    }
}

/* The item's queries as the bf16 rows attend_rows broadcasts, rotated and rounded as
 * load_rotated rounds them, in one pass rather than widened to fp32 scratch rows and
 * converted back. */
static inline void load_paired_queries(const Layer* L, const WorkItem* it, const Scratch* w, int group) {
    const int D = L->head_dim;
    const bf16 *src = (const bf16*)L->q, *cos = (const bf16*)L->cos, *sin = (const bf16*)L->sin;
    for (int r = 0; r < it->nrows; r++) {
        const int64_t a = (it->row0 + r) * D;
        for (int g = 0; g < group; g++) {
            const int i = r * group + g, head = it->kv_head * group + g;
            bf16* q16 = (bf16*)w->k + (int64_t)i * D;
            const bf16* x = src + (it->row0 + r) * L->q_stride_t + head * L->q_stride_h;
            rotate_row_bf16(q16, x, cos ? cos + a : NULL, sin ? sin + a : NULL, D);
        }
    }
    start_item(w, it->nrows * group, D);
}

/* Paired bf16 pages. Queries are the rotated bf16 values transformers would use (scores
 * are scaled after the products); probabilities are rounded to bf16 for the weighted
 * sum, as a bf16 matmul of them would be.
 *
 * R query vectors (rows i0..i0+R-1 of the item) go through a block together: each page
 * load serves all of them, and each score is two interleaved sums, so the fused
 * multiply-adds form 2R independent chains instead of one long chain per row, whose
 * latency would bound the arithmetic. */
static inline __attribute__((always_inline)) void attend_rows(const Layer* L, const WorkItem* it,
                                                              const Scratch* w, const int D, const int BS,
                                                              const int R, const int i0, const int32_t* kpage,
                                                              const int32_t* vpage, const int key0, const int nk,
                                                              const char* ahead_k, const char* ahead_v) {
    const int group = L->num_heads / L->num_kv_heads;
    const bf16* q16 = (const bf16*)w->k;
    bf16* p16 = (bf16*)w->v; /* [R, BS] */
    int n[MAX_PAIRED_VECTORS], n_max = 0;
    for (int t = 0; t < R; t++) {
        const int pos = it->first_pos + (i0 + t) / group;
        n[t] = pos + 1 - key0 < nk ? pos + 1 - key0 : nk; /* <= 0: the block is in this row's future */
        n_max = n[t] > n_max ? n[t] : n_max;
    }
    if (n_max <= 0) return;
    __m512 s[MAX_PAIRED_VECTORS][2][MAX_PAIRED_BLOCK / 16];
    for (int t = 0; t < R; t++)
        for (int c = 0; c < BS / 16; c++) s[t][0][c] = s[t][1][c] = _mm512_setzero_ps();
    /* A later block's pages load a slice per iteration, spread over the arithmetic,
     * rather than in one burst that fills the miss queue and stalls the core. */
    const int64_t page_bytes = (int64_t)BS * D * 2;
    const int64_t k_slice = page_bytes / (D / 4);
    for (int d2 = 0; d2 < D / 2; d2 += 2) {
        if (ahead_k != NULL)
            for (int64_t x = 0; x < k_slice; x += 64) _mm_prefetch(ahead_k + (d2 / 2) * k_slice + x, _MM_HINT_T1);
        for (int c = 0; c < BS / 16; c++) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kpage + d2 * BS + c * 16);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kpage + (d2 + 1) * BS + c * 16);
            for (int t = 0; t < R; t++) {
                const int32_t* q2 = (const int32_t*)(q16 + (int64_t)(i0 + t) * D);
                s[t][0][c] = _mm512_dpbf16_ps(s[t][0][c], (__m512bh)_mm512_set1_epi32(q2[d2]), k0);
                s[t][1][c] = _mm512_dpbf16_ps(s[t][1][c], (__m512bh)_mm512_set1_epi32(q2[d2 + 1]), k1);
            }
        }
    }
    /* The online softmax in registers (what softmax_update does, a block at a time). */
    float correction[MAX_PAIRED_VECTORS];
    for (int t = 0; t < R; t++) {
        correction[t] = 1.0f;
        __m512 p[MAX_PAIRED_BLOCK / 16];
        __mmask16 valid[MAX_PAIRED_BLOCK / 16];
        float block_max = -INFINITY;
        for (int c = 0; c < BS / 16; c++) {
            const int left = n[t] - c * 16;
            valid[c] = left >= 16 ? (__mmask16)0xffff : (left <= 0 ? 0 : (__mmask16)((1u << left) - 1));
            p[c] = _mm512_mul_ps(_mm512_add_ps(s[t][0][c], s[t][1][c]), _mm512_set1_ps(L->scale));
            if (valid[c]) {
                const float m = _mm512_mask_reduce_max_ps(valid[c], p[c]);
                block_max = m > block_max ? m : block_max;
            }
        }
        if (n[t] > 0) {
            const int i = i0 + t;
            const float m_new = block_max > w->m[i] ? block_max : w->m[i];
            __m512 sum = _mm512_setzero_ps();
            for (int c = 0; c < BS / 16; c++) {
                p[c] = _mm512_maskz_mov_ps(valid[c], exp512(_mm512_sub_ps(p[c], _mm512_set1_ps(m_new))));
                sum = _mm512_add_ps(sum, p[c]);
            }
            correction[t] = w->m[i] == m_new ? 1.0f : exp_clamped(w->m[i] - m_new);
            w->l[i] = w->l[i] * correction[t] + _mm512_reduce_add_ps(sum);
            w->m[i] = m_new;
        }
        for (int c = 0; c < BS / 16; c++)
            _mm256_storeu_si256((__m256i*)(p16 + t * BS + c * 16),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(valid[c], p[c])));
    }
    /* Keys n[t]..n_max-1 of a shorter row have probability 0 and are written memory. */
    __m512 a[MAX_PAIRED_VECTORS][MAX_PAIRED_HEAD_DIM / 16];
    for (int t = 0; t < R; t++)
        for (int c = 0; c < D / 16; c++)
            a[t][c] = _mm512_mul_ps(_mm512_loadu_ps(w->acc + (int64_t)(i0 + t) * D + c * 16),
                                    _mm512_set1_ps(correction[t]));
    const int64_t v_slice = page_bytes / (BS / 2);
    if (ahead_v != NULL)
        for (int64_t x = (int64_t)(n_max / 2) * v_slice; x < page_bytes; x += 64) _mm_prefetch(ahead_v + x, _MM_HINT_T1);
    for (int j2 = 0; j2 < n_max / 2; j2++) {
        if (ahead_v != NULL)
            for (int64_t x = 0; x < v_slice; x += 64) _mm_prefetch(ahead_v + j2 * v_slice + x, _MM_HINT_T1);
        for (int c = 0; c < D / 16; c++) {
            const __m512bh vj = (__m512bh)_mm512_loadu_si512(vpage + j2 * D + c * 16);
            for (int t = 0; t < R; t++)
                a[t][c] = _mm512_dpbf16_ps(a[t][c], (__m512bh)_mm512_set1_epi32(((const int32_t*)(p16 + t * BS))[j2]), vj);
        }
    }
    if (n_max % 2) { /* an odd last key: its partner (probability 0) may be unwritten memory, so
                      * it is masked out rather than multiplied by 0, which NaN would survive */
        const __m512i keep_first = _mm512_set1_epi32(0xffff);
        for (int c = 0; c < D / 16; c++) {
            const __m512bh vj = (__m512bh)_mm512_and_si512(_mm512_loadu_si512(vpage + (n_max / 2) * D + c * 16), keep_first);
            for (int t = 0; t < R; t++)
                a[t][c] = _mm512_dpbf16_ps(a[t][c], (__m512bh)_mm512_set1_epi32(((const int32_t*)(p16 + t * BS))[n_max / 2]), vj);
        }
    }
    for (int t = 0; t < R; t++)
        for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(w->acc + (int64_t)(i0 + t) * D + c * 16, a[t][c]);
}

/* Prefill items (several query rows) in superchunks of up to PREFILL_KEYS keys: all the
 * item's scores for a superchunk first, then their softmax, then the weighted sum of the
 * values, each pass a loop of independent multiply-adds. attend_rows' block-at-a-time
 * online softmax is a chain of dependent reductions per block and query vector, which
 * leaves the multiply-adds of many query rows far below the vdpbf16ps peak.
 * Scores are scaled after the products; probabilities are rounded to bf16 for the
 * weighted sum, as attend_rows does. */
#define SCORE_TILE 12 /* query vectors per score tile: 12 x 2 accumulators of 16 keys */
#define VALUE_TILE_REGS 24 /* accumulator registers of a weighted-sum tile */

/* Scaled scores of query vectors i0..i0+T-1 (rows of `scores`) for the 16 * C keys of a
 * block's K page from key `within`. */
static inline __attribute__((always_inline)) void score_tile(const Layer* L, const Scratch* w, const int D,
                                                             const int BS, const int T, const int C,
                                                             const int i0, const int32_t* kpage, int within,
                                                             float* scores, int ld) {
    const bf16* q16 = (const bf16*)w->k;
    __m512 s[SCORE_TILE][2];
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) s[t][c] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < D / 2; d2++) {
        __m512bh k[2];
        for (int c = 0; c < C; c++) k[c] = (__m512bh)_mm512_loadu_si512(kpage + d2 * BS + within + c * 16);
        for (int t = 0; t < T; t++) {
            const __m512bh q = (__m512bh)_mm512_set1_epi32(((const int32_t*)(q16 + (int64_t)(i0 + t) * D))[d2]);
            for (int c = 0; c < C; c++) s[t][c] = _mm512_dpbf16_ps(s[t][c], q, k[c]);
        }
    }
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++)
            _mm512_storeu_ps(scores + (int64_t)(i0 + t) * ld + c * 16,
                             _mm512_mul_ps(s[t][c], _mm512_set1_ps(L->scale)));
}

#define SCORE_CASE(t, c) \
    case t: score_tile(L, w, D, BS, t, c, i0, kpage, within, scores, ld); break;

static inline __attribute__((always_inline)) void score_tiles(const Layer* L, const Scratch* w, const int D,
                                                              const int BS, int nq, const int32_t* kpage,
                                                              int within, int C, float* scores, int ld) {
    for (int i0 = 0; i0 < nq; i0 += SCORE_TILE) {
        const int T = nq - i0 < SCORE_TILE ? nq - i0 : SCORE_TILE;
        if (C == 2) {
            switch (T) {
                SCORE_CASE(1, 2) SCORE_CASE(2, 2) SCORE_CASE(3, 2) SCORE_CASE(4, 2) SCORE_CASE(5, 2) SCORE_CASE(6, 2)
                SCORE_CASE(7, 2) SCORE_CASE(8, 2) SCORE_CASE(9, 2) SCORE_CASE(10, 2) SCORE_CASE(11, 2)
                default: score_tile(L, w, D, BS, SCORE_TILE, 2, i0, kpage, within, scores, ld);
            }
        } else {
            switch (T) {
                SCORE_CASE(1, 1) SCORE_CASE(2, 1) SCORE_CASE(3, 1) SCORE_CASE(4, 1) SCORE_CASE(5, 1) SCORE_CASE(6, 1)
                SCORE_CASE(7, 1) SCORE_CASE(8, 1) SCORE_CASE(9, 1) SCORE_CASE(10, 1) SCORE_CASE(11, 1)
                default: score_tile(L, w, D, BS, SCORE_TILE, 1, i0, kpage, within, scores, ld);
            }
        }
    }
}
#undef SCORE_CASE

/* acc[i0..i0+T-1] = acc * correction + probabilities . values over keys key0..key0+n-1
 * (n: the most keys any of them sees; probabilities past a vector's own keys are 0). */
static inline __attribute__((always_inline)) void value_tile(const Layer* L, const WorkItem* it, const Scratch* w,
                                                             const int D, const int BS, const int T, const int i0,
                                                             const bf16* probs, int ld, const float* correction,
                                                             int key0, int n) {
    const int C = D / 16;
    if (T * C > MAX_PAIRED_HEAD_DIM / 16) return; /* never called so: see value_tiles */
    __m512 a[MAX_PAIRED_HEAD_DIM / 16];
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++)
            a[t * C + c] = _mm512_mul_ps(_mm512_loadu_ps(w->acc + (int64_t)(i0 + t) * D + c * 16),
                                         _mm512_set1_ps(correction[i0 + t]));
    for (int j = 0; j < n; j += 2) {
        const int key = key0 + j;
        const int64_t page = ((int64_t)it->block_table[key / BS] * L->num_kv_heads + it->kv_head) * BS * D;
        const int32_t* vrow = (const int32_t*)((const bf16*)L->v_cache + page) + (key % BS) / 2 * D;
        /* an odd last key's partner may be unwritten memory: masked out rather than
         * multiplied by probability 0, which NaN would survive */
        const __m512i keep = _mm512_set1_epi32(j + 1 < n ? -1 : 0xffff);
        for (int c = 0; c < C; c++) {
            const __m512bh v = (__m512bh)_mm512_and_si512(_mm512_loadu_si512(vrow + c * 16), keep);
            for (int t = 0; t < T; t++) {
                const int32_t pair = ((const int32_t*)(probs + (int64_t)(i0 + t) * ld))[j / 2];
                a[t * C + c] = _mm512_dpbf16_ps(a[t * C + c], (__m512bh)_mm512_set1_epi32(pair), v);
            }
        }
    }
    for (int t = 0; t < T; t++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(w->acc + (int64_t)(i0 + t) * D + c * 16, a[t * C + c]);
}

/* The first `count` of 16 lanes (none for count <= 0). */
static inline __mmask16 lanes(int count) {
    return count >= 16 ? (__mmask16)0xffff : (count <= 0 ? (__mmask16)0 : (__mmask16)((1u << count) - 1));
}

/* Online softmax of query vector i over a superchunk's nkeys scores, of which it sees
 * the first n (<= 0: all in its future): probs[0..nkeys rounded up to 16) = bf16
 * exp(score - new max), 0 past n; returns the factor its accumulator must shrink by. */
static inline float softmax_chunk(const Scratch* w, int i, const float* scores, int n, int nkeys, bf16* probs) {
    if (n <= 0) {
        memset(probs, 0, sizeof(bf16) * (size_t)((nkeys + 15) / 16 * 16));
        return 1.0f;
    }
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += 16) top = _mm512_max_ps(top, _mm512_maskz_loadu_ps(lanes(n - j), scores + j));
    const float chunk_max = _mm512_reduce_max_ps(top);
    const float m_new = chunk_max > w->m[i] ? chunk_max : w->m[i];
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < nkeys; j += 16) {
        const __mmask16 valid = lanes(n - j);
        const __m512 p = _mm512_maskz_mov_ps(
            valid, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, scores + j), _mm512_set1_ps(m_new))));
        sum = _mm512_add_ps(sum, p);
        _mm256_storeu_si256((__m256i*)(probs + j), (__m256i)_mm512_cvtneps_pbh(p));
    }
    const float correction = w->m[i] == m_new ? 1.0f : exp_clamped(w->m[i] - m_new);
    w->l[i] = w->l[i] * correction + _mm512_reduce_add_ps(sum);
    w->m[i] = m_new;
    return correction;
}

/* How many of a superchunk's nkeys keys, from key0, query vector i of a prefill item
 * sees (<= 0: all in its future). Vectors go in row order, so this never decreases in i. */
static inline int keys_seen(const WorkItem* it, int group, int i, int key0, int nkeys) {
    const int pos = it->first_pos + i / group;
    return pos + 1 - key0 < nkeys ? pos + 1 - key0 : nkeys;
}

static inline __attribute__((always_inline)) void attend_prefill_paired(const Layer* L, const WorkItem* it,
                                                                      const WorkItem* next, const Scratch* w,
                                                                      const int D, const int BS) {
    const int group = L->num_heads / L->num_kv_heads, nq = it->nrows * group;
    const int last_pos = it->first_pos + it->nrows - 1;
    prefetch_item_rows(L, next, group);
    load_paired_queries(L, it, w, group);
    const int chunk_keys = BS >= PREFILL_KEYS ? BS : PREFILL_KEYS / BS * BS;
    float* scores = w->scores;  /* [nq, chunk_keys] */
    bf16* probs = w->probs;     /* [nq, chunk_keys] */
    float* correction = w->p;   /* [nq] */
    /* up to 6 query vectors per weighted-sum tile, within VALUE_TILE_REGS accumulators
     * (one vector past D = 384, within MAX_PAIRED_HEAD_DIM) */
    const int by_regs = VALUE_TILE_REGS / (D / 16), vectors_per_tile = by_regs < 1 ? 1 : (by_regs > 6 ? 6 : by_regs);
    for (int key0 = 0; key0 <= last_pos; key0 += chunk_keys) {
        const int nkeys = last_pos + 1 - key0 < chunk_keys ? last_pos + 1 - key0 : chunk_keys;
        for (int b = key0 / BS; b * BS < key0 + nkeys; b++) {
            const int64_t page = ((int64_t)it->block_table[b] * L->num_kv_heads + it->kv_head) * BS * D;
            const int32_t* kpage = (const int32_t*)((const bf16*)L->k_cache + page);
            const int end = (b + 1) * BS < key0 + nkeys ? BS : key0 + nkeys - b * BS;
            for (int within = 0; within < end; within += 32)
                score_tiles(L, w, D, BS, nq, kpage, within, end - within > 16 ? 2 : 1,
                            scores + b * BS + within - key0, chunk_keys);
        }
        for (int i = 0; i < nq; i++) {
            const int64_t row = (int64_t)i * chunk_keys;
            correction[i] = softmax_chunk(w, i, scores + row, keys_seen(it, group, i, key0, nkeys), nkeys, probs + row);
        }
        for (int i0 = 0; i0 < nq; i0 += vectors_per_tile) {
            const int T = nq - i0 < vectors_per_tile ? nq - i0 : vectors_per_tile;
            const int n = keys_seen(it, group, i0 + T - 1, key0, nkeys); /* the most of the tile's vectors */
            if (n <= 0) continue;
            switch (T) {
                case 1: value_tile(L, it, w, D, BS, 1, i0, probs, chunk_keys, correction, key0, n); break;
                case 2: value_tile(L, it, w, D, BS, 2, i0, probs, chunk_keys, correction, key0, n); break;
                case 3: value_tile(L, it, w, D, BS, 3, i0, probs, chunk_keys, correction, key0, n); break;
                case 4: value_tile(L, it, w, D, BS, 4, i0, probs, chunk_keys, correction, key0, n); break;
                case 5: value_tile(L, it, w, D, BS, 5, i0, probs, chunk_keys, correction, key0, n); break;
                default: value_tile(L, it, w, D, BS, 6, i0, probs, chunk_keys, correction, key0, n); break;
            }
        }
    }
    store_outputs(L, it, w, group);
}

/* One block for query vectors first..first+count-1 (count <= 4), in one attend_rows call. */
#define ATTEND_ROWS(count, first, ahead_k, ahead_v)                                                              \
    do {                                                                                                     \
        if ((count) == 4) attend_rows(L, it, w, D, BS, 4, first, kpage, vpage, key0, nk, ahead_k, ahead_v);  \
        else if ((count) == 3) attend_rows(L, it, w, D, BS, 3, first, kpage, vpage, key0, nk, ahead_k, ahead_v); \
        else if ((count) == 2) attend_rows(L, it, w, D, BS, 2, first, kpage, vpage, key0, nk, ahead_k, ahead_v); \
        else if ((count) == 1) attend_rows(L, it, w, D, BS, 1, first, kpage, vpage, key0, nk, ahead_k, ahead_v); \
    } while (0)

/* `next` is the item this thread attends after this one (or NULL), whose first pages
 * load while this item's last blocks are attended; `warm` of this item's first pages
 * were loaded that way already. */
static inline __attribute__((always_inline)) void attend_decode_paired(const Layer* L, const WorkItem* it,
                                                                       const WorkItem* next, int warm,
                                                                       const Scratch* w, const int D, const int BS) {
    const int group = L->num_heads / L->num_kv_heads, nq = group;
    load_paired_queries(L, it, w, group);
    /* Four rows' accumulators fill half the 32 vector registers at D = 64; two at D = 128. */
    const int rows = D <= 64 ? 4 : 2;
    const int blocks = item_blocks(it, BS);
    prefetch_pages(L, it, warm, PAGES_AHEAD);
    for (int b = 0; b < blocks; b++) {
        /* The block PAGES_AHEAD + 1 on, in this item or else in the next. */
        const WorkItem* owner = b + PAGES_AHEAD + 1 < blocks ? it : next;
        const int ahead = b + PAGES_AHEAD + 1 < blocks ? b + PAGES_AHEAD + 1 : b + PAGES_AHEAD + 1 - blocks;
        const int64_t page = ((int64_t)it->block_table[b] * L->num_kv_heads + it->kv_head) * BS * D;
        const int32_t* kpage = (const int32_t*)((const bf16*)L->k_cache + page);
        const int32_t* vpage = (const int32_t*)((const bf16*)L->v_cache + page);
        const int key0 = b * BS;
        const int nk = it->first_pos + 1 - key0 < BS ? it->first_pos + 1 - key0 : BS;
        int i = 0;
        if (owner != NULL && ahead < item_blocks(owner, BS)) {
            /* One pass of a few hundred cycles per block, whose pages come from memory.
             * The later page's loads, issued in one burst, would fill the miss queue and
             * stall that arithmetic; spread through it, they overlap it, the next item's
             * first pages included. */
            const int64_t later = ((int64_t)owner->block_table[ahead] * L->num_kv_heads + owner->kv_head) * BS * D;
            const char* ahead_k = (const char*)((const bf16*)L->k_cache + later);
            const char* ahead_v = (const char*)((const bf16*)L->v_cache + later);
            const int count = nq < rows ? nq : rows;
            ATTEND_ROWS(count, 0, ahead_k, ahead_v);
            i = count;
        }
        for (; i + rows <= nq; i += rows) ATTEND_ROWS(rows, i, NULL, NULL);
        ATTEND_ROWS(nq - i, i, NULL, NULL);
    }
    store_outputs(L, it, w, group);
}
#undef ATTEND_ROWS

/* Decode items (one query row) and prefill items have their own kernels. */
static inline __attribute__((always_inline)) void attend_paired_as(const Layer* L, const WorkItem* it,
                                                                   const WorkItem* next, int warm,
                                                                   const Scratch* w, const int D, const int BS) {
    if (it->nrows == 1) attend_decode_paired(L, it, next, warm, w, D, BS);
    else attend_prefill_paired(L, it, next, w, D, BS);
}

void attend_paired(const Layer* L, const WorkItem* it, const WorkItem* next, int warm, const Scratch* w) {
    const int D = L->head_dim, BS = L->block_size;
    if (D == 64 && BS == 16) attend_paired_as(L, it, next, warm, w, 64, 16);
    else if (D == 64 && BS == 32) attend_paired_as(L, it, next, warm, w, 64, 32);
    else if (D == 128 && BS == 16) attend_paired_as(L, it, next, warm, w, 128, 16);
    else if (D == 128 && BS == 32) attend_paired_as(L, it, next, warm, w, 128, 32);
    else attend_paired_as(L, it, next, warm, w, D, BS);
}
#endif

