/* Paged attention's shared parts: the layer and work-item types, the page layouts, and
 * the helpers both attention.c (generic pages, the step's entry point) and
 * attention_paired.c (AVX512-BF16 pages) use. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvserve_abi.h"
#include "scalar.h"
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

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
    int is_bf16; /* q, k, v and out; the cache too unless kv_format is fp8 */
    int kv_format;
    float k_scale, v_scale; /* an fp8 cache's */
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
    return L->is_bf16 && L->kv_format == KV_ACTIVATIONS && L->head_dim % 32 == 0 && L->block_size % 16 == 0 &&
           L->head_dim <= MAX_PAIRED_HEAD_DIM && L->block_size <= MAX_PAIRED_BLOCK;
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

/* x (a key or value over its scale) as an fp8 cache stores it, as torch's clamp to the
 * format's largest finite value and .to(float8_e4m3fn or float8_e5m2) store it: saturated,
 * rounded to nearest even (subnormals included), the sign kept (-0.0 too), NaN as NaN. */
static inline uint8_t fp8_bits(float x, int kv_format) {
    const int e4m3 = kv_format == KV_FP8_E4M3;
    const int mantissa = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const float largest = e4m3 ? 448.0f : 57344.0f, smallest_normal = e4m3 ? 0x1p-6f : 0x1p-14f;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    float a = fabsf(x);
    if (a != a) return sign | 0x7fu;
    if (a > largest) a = largest;
    /* Subnormals are whole multiples of the smallest one; rounding up to the smallest
     * normal gives its code too. */
    if (a < smallest_normal) return sign | (uint8_t)nearbyintf(a * (e4m3 ? 0x1p9f : 0x1p16f));
    /* Normals: fp32's mantissa rounded to the format's (half an ulp less one, plus the
     * kept bit's lsb: ties to even), and the exponent rebiased. */
    memcpy(&u, &a, sizeof u);
    const int drop = 23 - mantissa;
    u = (u + (1u << (drop - 1)) - 1u + ((u >> drop) & 1u)) >> drop;
    return sign | (uint8_t)(u - ((uint32_t)(127 - bias) << mantissa));
}

/* n fp8 elements times scale, widened to fp32 and rounded once, as value * scale. With
 * F16C, each byte becomes the fp16 of the same sign and digits (e5m2 is fp16's top byte;
 * e4m3's exponent and mantissa go 3 bits lower, which divides it by 2^8, its subnormals
 * becoming fp16's), which the hardware widens exactly. Unlike the fallback's bit trick,
 * that puts no subnormal float into the multiply, which costs a microcode assist on some
 * CPUs (AMD Zen among them). (The NaN bytes never occur: writes saturate.) */
static inline __attribute__((always_inline)) void widen_fp8(float* restrict dst, const uint8_t* restrict src, int n,
                                                            const int e4m3, float scale) {
    int i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    const float factor = e4m3 ? scale * 0x1p8f : scale;
    if (factor <= 0x1.fffffep127f) {
        const __m256 f = _mm256_set1_ps(factor);
        const __m256i magnitude = _mm256_set1_epi16(0x7f), sign = _mm256_set1_epi16(0x80);
        for (; i + 16 <= n; i += 16) {
            const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(src + i)));
            const __m256i h = e4m3 ? _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, magnitude), 7),
                                                     _mm256_slli_epi16(_mm256_and_si256(b, sign), 8))
                                   : _mm256_slli_epi16(b, 8);
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), f));
            _mm256_storeu_ps(dst + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), f));
        }
    }
#endif
    /* The rest, and CPUs without F16C: a byte's exponent and mantissa put at the top of a
     * float's give its magnitude times 2^-120 (e4m3) or 2^-112 (e5m2), subnormals
     * included; the sign bit goes back last. */
    for (; i < n; i++) {
        const uint32_t b = src[i], bits = (b & 0x7fu) << (e4m3 ? 20 : 21);
        float f;
        memcpy(&f, &bits, sizeof f);
        f = f * (e4m3 ? 0x1p120f : 0x1p112f) * scale;
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        u |= (b & 0x80u) << 24;
        memcpy(dst + i, &u, sizeof u);
    }
}

/* n elements of a cache from `offset` (in elements), widened to fp32 (and scaled, fp8). */
static inline void load_cache_row(const Layer* L, float* dst, const void* cache, int64_t offset, int n,
                                  float scale) {
    if (L->kv_format == KV_FP8_E4M3) widen_fp8(dst, (const uint8_t*)cache + offset, n, 1, scale);
    else if (L->kv_format == KV_FP8_E5M2) widen_fp8(dst, (const uint8_t*)cache + offset, n, 0, scale);
    else load_row(dst, cache, offset, n, L->is_bf16 || L->kv_format == KV_BF16);
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
