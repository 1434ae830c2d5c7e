/* Paged attention of one layer over a packed step (paged_attention, called by decoder.c
 * and through ctypes): the KV write, then the step's attention split into work items that
 * the threads claim. Pages are laid out for the kernel that reads them:
 * - generic (fp32, fp8, or CPUs without AVX512-BF16), here: a K page is [D, BS] (keys
 *   transposed), so a block's scores are broadcast-multiply-adds over its keys; a V page
 *   is [BS, D]. bf16 and fp8 pages are widened to fp32 (fp8 ones scaled) once per block;
 *   bf16 pages may sit beside fp32 activations (kv_format KV_BF16).
 *   An fp8 cache is written as torch writes one (fp8_bits), whatever the activations'
 *   dtype, and read in fp32 (not rounded to bf16 for bf16 activations).
 * - paired (bf16 on AVX512-BF16 CPUs, D % 32 == 0, BS % 16 == 0): attention_paired.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"

/* The generic paths' queries: rotated, widened to fp32 and scaled. */
static inline void load_queries(const Layer* L, const WorkItem* it, const Scratch* w, int group) {
    const int D = L->head_dim;
    for (int r = 0; r < it->nrows; r++) {
        for (int g = 0; g < group; g++) {
            const int i = r * group + g, head = it->kv_head * group + g;
            float* q = w->q + (int64_t)i * D;
            const int64_t offset = (it->row0 + r) * L->q_stride_t + head * L->q_stride_h;
            if (L->cos != NULL) load_rotated(q, L->q, offset, L->cos, L->sin, it->row0 + r, D, L->is_bf16);
            else load_row(q, L->q, offset, D, L->is_bf16);
            for (int d = 0; d < D; d++) q[d] *= L->scale;
        }
    }
    start_item(w, it->nrows * group, D);
}

/* Online softmax for query vector i after a block's first n scores: fills p with
 * exp(score - new max) (0 past n) and returns the factor its accumulator must shrink by
 * (0 on its first block). */
static inline float softmax_update(const Scratch* w, int i, const float* scores, int n, int BS) {
    float block_max = -INFINITY;
    for (int j = 0; j < n; j++) block_max = scores[j] > block_max ? scores[j] : block_max;
    const float m_new = block_max > w->m[i] ? block_max : w->m[i];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < BS; j++) {
        w->p[j] = j < n ? exp_clamped(scores[j] - m_new) : 0.0f;
        sum += w->p[j];
    }
    const float correction = w->m[i] == m_new ? 1.0f : exp_clamped(w->m[i] - m_new);
    w->l[i] = w->l[i] * correction + sum;
    w->m[i] = m_new;
    return correction;
}

/* One register of floats: 16 with AVX-512, 8 with AVX2, 4 otherwise (SSE, NEON). Arrays of
 * them stay in registers when their length is a compile-time constant. A vector wider
 * than the CPU's registers does not: GCC then moves it through the stack on every
 * operation, which made the AVX2 build's decode attention several times slower. */
#if defined(__AVX512F__)
#define VEC 16
#elif defined(__AVX__)
#define VEC 8
#else
#define VEC 4
#endif
typedef float vecf __attribute__((vector_size(VEC * sizeof(float)), aligned(4)));

static inline vecf vload(const float* p) { return *(const vecf*)p; }
static inline void vstore(float* p, vecf x) { *(vecf*)p = x; }

/* Generic pages. D and BS are compile-time constants in the specialisations below
 * (multiples of 16, so of VEC), so a block's scores and a query's accumulator stay in registers. */
static inline __attribute__((always_inline)) void attend_impl(const Layer* L, const WorkItem* it,
                                                              const Scratch* w, const int D, const int BS) {
    const int group = L->num_heads / L->num_kv_heads;
    const int last_pos = it->first_pos + it->nrows - 1;
    load_queries(L, it, w, group);
    for (int b = 0; b <= last_pos / BS; b++) {
        const int64_t page = ((int64_t)it->block_table[b] * L->num_kv_heads + it->kv_head) * BS * D;
        const int key0 = b * BS;
        const int nk = last_pos + 1 - key0 < BS ? last_pos + 1 - key0 : BS;
        /* fp32 pages are read where they lie; bf16 and fp8 ones are widened once per block */
        const float* restrict k = (const float*)L->k_cache + page;
        const float* restrict v = (const float*)L->v_cache + page;
        if (L->is_bf16 || L->kv_format != KV_ACTIVATIONS) {
            load_cache_row(L, w->k, L->k_cache, page, D * BS, L->k_scale);
            load_cache_row(L, w->v, L->v_cache, page, nk * D, L->v_scale);
            k = w->k, v = w->v;
        }
        const int nq = it->nrows * group;
        /* Query vectors in pairs: two sets of score sums hide the FMA latency that one
         * set waits on (an odd last vector is paired with itself). */
        for (int i = 0; i < nq; i += 2) {
            const int second = i + 1 < nq ? i + 1 : i;
            if (key0 > it->first_pos + second / group) continue; /* in both rows' future */
            const float* restrict q0 = w->q + (int64_t)i * D;
            const float* restrict q1 = w->q + (int64_t)second * D;
            vecf s0[BS / VEC], s1[BS / VEC];
            for (int c = 0; c < BS / VEC; c++) s0[c] = s1[c] = (vecf){0};
            for (int d = 0; d < D; d++)
                for (int c = 0; c < BS / VEC; c++) {
                    const vecf kd = vload(k + d * BS + c * VEC);
                    s0[c] += q0[d] * kd;
                    s1[c] += q1[d] * kd;
                }
            float scores[2][BS];
            for (int c = 0; c < BS / VEC; c++) vstore(scores[0] + c * VEC, s0[c]), vstore(scores[1] + c * VEC, s1[c]);
            for (int h = 0; h < 2 && i + h < nq; h++) {
                const int pos = it->first_pos + (i + h) / group;
                if (key0 > pos) continue; /* the whole block lies in this row's future */
                const int n = pos + 1 - key0 < nk ? pos + 1 - key0 : nk;
                const float correction = softmax_update(w, i + h, scores[h], n, BS);
                float* restrict acc = w->acc + (int64_t)(i + h) * D;
                vecf a[D / VEC];
                for (int c = 0; c < D / VEC; c++) a[c] = vload(acc + c * VEC) * correction;
                for (int j = 0; j < n; j++)
                    for (int c = 0; c < D / VEC; c++) a[c] += w->p[j] * vload(v + j * D + c * VEC);
                for (int c = 0; c < D / VEC; c++) vstore(acc + c * VEC, a[c]);
            }
        }
    }
    store_outputs(L, it, w, group);
}

/* Generic pages, any D or block size: the same algorithm with plain loops. */
static void attend_any(const Layer* L, const WorkItem* it, const Scratch* w) {
    const int group = L->num_heads / L->num_kv_heads, D = L->head_dim, BS = L->block_size;
    const int last_pos = it->first_pos + it->nrows - 1;
    float* scores = w->p + BS;
    load_queries(L, it, w, group);
    for (int b = 0; b <= last_pos / BS; b++) {
        const int64_t page = ((int64_t)it->block_table[b] * L->num_kv_heads + it->kv_head) * BS * D;
        const int key0 = b * BS;
        const int nk = last_pos + 1 - key0 < BS ? last_pos + 1 - key0 : BS;
        load_cache_row(L, w->k, L->k_cache, page, D * BS, L->k_scale);
        load_cache_row(L, w->v, L->v_cache, page, nk * D, L->v_scale);
        for (int i = 0; i < it->nrows * group; i++) {
            const int pos = it->first_pos + i / group;
            if (key0 > pos) continue;
            const int n = pos + 1 - key0 < nk ? pos + 1 - key0 : nk;
            for (int j = 0; j < n; j++) {
                scores[j] = 0.0f;
                for (int d = 0; d < D; d++) scores[j] += w->q[(int64_t)i * D + d] * w->k[d * BS + j];
            }
            const float correction = softmax_update(w, i, scores, n, BS);
            float* acc = w->acc + (int64_t)i * D;
            for (int d = 0; d < D; d++) acc[d] *= correction;
            for (int j = 0; j < n; j++)
                for (int d = 0; d < D; d++) acc[d] += w->p[j] * w->v[j * D + d];
        }
    }
    store_outputs(L, it, w, group);
}

static void attend(const Layer* L, const WorkItem* it, const WorkItem* next, int warm, const Scratch* w) {
    const int D = L->head_dim, BS = L->block_size;
#if defined(__AVX512BF16__)
    if (paired_pages(L)) {
        attend_paired(L, it, next, warm, w);
        return;
    }
#else
    (void)next, (void)warm;
#endif
    if (D == 64 && BS == 16) attend_impl(L, it, w, 64, 16);
    else if (D == 64 && BS == 32) attend_impl(L, it, w, 64, 32);
    else if (D == 128 && BS == 16) attend_impl(L, it, w, 128, 16);
    else if (D == 128 && BS == 32) attend_impl(L, it, w, 128, 32);
    else attend_any(L, it, w);
}

/* Copy this step's K/V rows into their pages, rotating K first when cos/sin are given
 * (fp8: each divided by its scale, a true division as torch's, then encoded). A negative
 * slot means "skip" (padded rows). */
static void write_kv(const Layer* L, const void* k, int64_t k_stride_t, int64_t k_stride_h, const void* v,
                     int64_t v_stride_t, int64_t v_stride_h, const int64_t* slots, int64_t num_tokens,
                     int num_threads) {
    const int D = L->head_dim, BS = L->block_size, Hkv = L->num_kv_heads;
    const int fp8 = L->kv_format == KV_FP8_E4M3 || L->kv_format == KV_FP8_E5M2;
    const int bf16_pages = L->is_bf16 || L->kv_format == KV_BF16;
#pragma omp parallel num_threads(num_threads) if (num_tokens >= 16)
    {
        float* buf = (float*)malloc(sizeof(float) * (size_t)D);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; t++) {
            const int64_t slot = slots[t];
            if (slot < 0) continue;
            const int64_t block = slot / BS;
            const int j = (int)(slot % BS);
#if defined(__AVX512BF16__)
            if (paired_pages(L)) {
                write_paired_kv(L, (const bf16*)k + t * k_stride_t, k_stride_h, (const bf16*)v + t * v_stride_t,
                                v_stride_h, t, block, j);
                continue;
            }
#endif
            for (int h = 0; h < Hkv; h++) {
                const int64_t page = (block * Hkv + h) * BS * D;
                if (L->cos != NULL) load_rotated(buf, k, t * k_stride_t + h * k_stride_h, L->cos, L->sin, t, D, L->is_bf16);
                else load_row(buf, k, t * k_stride_t + h * k_stride_h, D, L->is_bf16);
                for (int d = 0; d < D; d++) {
                    const int64_t at = page + k_offset(L, j, d);
                    if (fp8) ((uint8_t*)L->k_cache)[at] = fp8_bits(buf[d] / L->k_scale, L->kv_format);
                    else if (bf16_pages) ((bf16*)L->k_cache)[at] = float_to_bf16(buf[d]);
                    else ((float*)L->k_cache)[at] = buf[d];
                }
                load_row(buf, v, t * v_stride_t + h * v_stride_h, D, L->is_bf16);
                if (fp8) {
                    uint8_t* row = (uint8_t*)L->v_cache + page + (int64_t)j * D;
                    for (int d = 0; d < D; d++) row[d] = fp8_bits(buf[d] / L->v_scale, L->kv_format);
                } else {
                    store_row(L->v_cache, page + (int64_t)j * D, buf, D, bf16_pages);
                }
            }
        }
        free(buf);
    }
}

/* Declared, with its arguments, in kvserve_abi.h. */
void paged_attention(void* out, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k,
                     int64_t k_stride_t, int64_t k_stride_h, const void* v, int64_t v_stride_t, int64_t v_stride_h,
                     const void* cos, const void* sin, void* k_cache, void* v_cache, const StepLayout* step,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int is_bf16,
                     int kv_format, float k_scale, float v_scale, int num_threads) {
    const Layer L = {out,       q,          q_stride_t, q_stride_h, cos,       sin,     k_cache,
                     v_cache,   num_heads,  num_kv_heads, head_dim, block_size, scale, is_bf16,
                     kv_format, k_scale,    v_scale};
    /* Locals, so that the stores into items below cannot make the compiler reload them. */
    const int num_decodes = step->num_decodes, decode_width = step->decode_width;
    const int num_prefills = step->num_prefills, prefill_width = step->prefill_width;
    const int32_t *decode_tables = step->decode_tables, *decode_lens = step->decode_lens;
    const int32_t *prefill_starts = step->prefill_starts, *prefill_ends = step->prefill_ends;
    const int32_t *prefill_lens = step->prefill_lens, *prefill_tables = step->prefill_tables;
    write_kv(&L, k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h, step->slots, step->num_tokens, num_threads);

    int64_t num_items = (int64_t)num_decodes * num_kv_heads;
    for (int p = 0; p < num_prefills; p++)
        num_items += (int64_t)((prefill_ends[p] - prefill_starts[p] + MAX_ROWS - 1) / MAX_ROWS) * num_kv_heads;
    WorkItem* items = (WorkItem*)malloc(sizeof(WorkItem) * (size_t)(num_items > 0 ? num_items : 1));
    int64_t n = 0;
    /* Prefill tiles first, latest (most keys) first: dynamic scheduling then evens out. */
    for (int p = 0; p < num_prefills; p++) {
        const int start = prefill_starts[p], len = prefill_ends[p] - start;
        for (int r = (len - 1) / MAX_ROWS * MAX_ROWS; r >= 0; r -= MAX_ROWS)
            for (int h = 0; h < num_kv_heads; h++)
                items[n++] = (WorkItem){start + r, len - r < MAX_ROWS ? len - r : MAX_ROWS,
                                        prefill_lens[p] - len + r, h, prefill_tables + (int64_t)p * prefill_width};
    }
    for (int i = 0; i < num_decodes; i++)
        for (int h = 0; h < num_kv_heads; h++)
            items[n++] = (WorkItem){i, 1, decode_lens[i] - 1, h, decode_tables + (int64_t)i * decode_width};

    const int nq = MAX_ROWS * (num_heads / num_kv_heads), D = head_dim;
    int64_t claimed = 0;
#pragma omp parallel num_threads(num_threads) if (n > 1)
    {
        const size_t k_size = (size_t)D * (block_size > nq ? block_size : nq); /* a page, or bf16 queries */
        const size_t chunk_keys = block_size > PREFILL_KEYS ? block_size : PREFILL_KEYS; /* attend_prefill_paired's */
        const size_t p_size = 2 * (size_t)(block_size > nq ? block_size : nq);
        float* buf = (float*)malloc(sizeof(float) * ((size_t)2 * nq * D + 2 * nq + k_size + (size_t)block_size * D +
                                                     p_size + 2 * (size_t)nq * chunk_keys));
        Scratch w;
        w.q = buf;
        w.acc = w.q + (size_t)nq * D;
        w.m = w.acc + (size_t)nq * D;
        w.l = w.m + nq;
        w.k = w.l + nq;
        w.v = w.k + k_size;
        w.p = w.v + (size_t)block_size * D;
        w.scores = w.p + p_size;
        w.probs = (bf16*)(w.scores + (size_t)nq * chunk_keys);
        /* Dynamic scheduling, each item claimed one item ahead, so that its first pages
         * can load while this thread attends the one before it. */
        int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        int warm = 0;
        while (next < n) {
            const int64_t i = next;
            next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            attend(&L, &items[i], next < n ? &items[next] : NULL, warm, &w);
            /* a decode item loads the next item's first pages while it attends its last blocks */
            const int loads_ahead = items[i].nrows == 1 && item_blocks(&items[i], block_size) > PAGES_AHEAD;
            warm = next < n && loads_ahead ? PAGES_AHEAD + 1 : 0;
        }
        free(buf);
    }
    free(items);
}

size_t kvserve_step_layout_size(void) { return sizeof(StepLayout); }
