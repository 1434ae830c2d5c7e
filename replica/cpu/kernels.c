/* kvserve's CPU kernels, built once per machine by replica/cpu/build.py
 * (cc -O3 -march=native -fopenmp) and called through ctypes.
 *
 * Everything works on fp32 or bf16 tensors (is_bf16) and computes in fp32. Where a kernel
 * stands in for a chain of transformers ops, it rounds to the tensor dtype at the same
 * points those ops do, so bf16 results match transformers' eager code and fp32 results
 * differ from it only by summation order.
 *
 * Threads: OpenMP, sharing the runtime that torch already loaded (same soname), with the
 * thread count passed in by the caller (torch.get_num_threads()). */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_to_float(bf16 x) {
    const uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even; NaN stays NaN. Branch-free (memcpy punning, a select for NaN),
 * so loops over it vectorize. */
static inline uint32_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
}

static inline bf16 float_to_bf16(float f) { return (bf16)bf16_bits(f); }

/* What a bf16 tensor op would store: the value rounded to bf16 (identity for fp32). */
static inline float round_to(float x, int is_bf16) {
    const uint32_t u = bf16_bits(x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return is_bf16 ? f : x;
}

/* Rows are converted whole, so inner loops are plain float loops the compiler vectorizes. */
static inline void load_row(float* dst, const void* src, int64_t offset, int n, int is_bf16) {
    if (is_bf16) {
        const bf16* s = (const bf16*)src + offset;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        memcpy(dst, (const float*)src + offset, (size_t)n * sizeof(float));
    }
}

static inline void store_row(void* dst, int64_t offset, const float* src, int n, int is_bf16) {
    if (is_bf16) {
        bf16* d = (bf16*)dst + offset;
        for (int i = 0; i < n; i++) d[i] = float_to_bf16(src[i]);
    } else {
        memcpy((float*)dst + offset, src, (size_t)n * sizeof(float));
    }
}

static inline float dot(const float* a, const float* b, int n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* exp(x) within 2 ulp for x in [-87, 88] (clamped outside: softmax and SiLU never need
 * more); plain arithmetic, so loops over it vectorize, which libm's expf does not without
 * -ffast-math. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = rintf(x * 1.44269504f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* Cody-Waite: r in [-ln2/2, ln2/2] */
    float p = 1.98412698e-4f;
    p = p * r + 1.38888889e-3f;
    p = p * r + 8.33333333e-3f;
    p = p * r + 4.16666667e-2f;
    p = p * r + 1.66666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* ------------------------------------------------------------------------------------ */
#if defined(__AVX512BF16__)
#include "avx512_bf16.h"

/* rms_norm for bf16 rows of a multiple of 16 elements, 16 lanes at a time: the same
 * rounding points, the sum of squares in 16 lanes (a different order of fp32 adds). */
static void rms_norm_bf16(bf16* out, const bf16* x, bf16* residual, const bf16* weight, int64_t rows, int n,
                          float eps, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const bf16* xr = x + r * n;
        bf16* rr = residual ? residual + r * n : NULL;
        __m512 squares = _mm512_setzero_ps();
        for (int i = 0; i < n; i += 16) {
            __m512 v = bf16_load(xr + i, 0xffff);
            if (rr) {
                v = bf16_round(_mm512_add_ps(bf16_load(rr + i, 0xffff), v));
                bf16_store(rr + i, 0xffff, v);
            }
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)n + eps));
        const bf16* src = rr ? rr : xr;
        for (int i = 0; i < n; i += 16) {
            const __m512 v = bf16_round(_mm512_mul_ps(bf16_load(src + i, 0xffff), inv));
            bf16_store(out + r * n + i, 0xffff, _mm512_mul_ps(bf16_load(weight + i, 0xffff), v));
        }
    }
}
#endif

/* RMSNorm as transformers' Llama family computes it: normalise in fp32, round to the
 * input dtype, then multiply by the weight in that dtype. With `residual` given, the
 * decoder layer's skip connection comes first, fused in: residual = residual + x (rounded
 * to the dtype, in place), then out = norm(residual). All [rows, n], contiguous. */
void rms_norm(void* out, const void* x, void* residual, const void* weight, int64_t rows, int n, float eps,
              int is_bf16, int num_threads) {
#if defined(__AVX512BF16__)
    if (is_bf16 && n % 16 == 0) {
        rms_norm_bf16((bf16*)out, (const bf16*)x, (bf16*)residual, (const bf16*)weight, rows, n, eps, num_threads);
        return;
    }
#endif
#pragma omp parallel num_threads(num_threads) if (rows >= 16)
    {
        float* buf = (float*)malloc(sizeof(float) * 3 * (size_t)n);
        float* w = buf + n;
        float* skip = buf + 2 * n;
        load_row(w, weight, 0, n, is_bf16);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row(buf, x, r * n, n, is_bf16);
            if (residual != NULL) {
                load_row(skip, residual, r * n, n, is_bf16);
                for (int i = 0; i < n; i++) buf[i] = round_to(skip[i] + buf[i], is_bf16);
                store_row(residual, r * n, buf, n, is_bf16);
            }
            const float inv = 1.0f / sqrtf(dot(buf, buf, n) / (float)n + eps);
            for (int i = 0; i < n; i++) buf[i] = w[i] * round_to(buf[i] * inv, is_bf16);
            store_row(out, r * n, buf, n, is_bf16);
        }
        free(buf);
    }
}

/* out[r] = silu(gate_up[r, :n]) * gate_up[r, n:], as act_fn(gate) * up in the dtype.
 * gate_up: [rows, 2n] contiguous; out: [rows, n]. */
void silu_mul(void* out, const void* gate_up, int64_t rows, int n, int is_bf16, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows >= 16)
    {
        float* buf = (float*)malloc(sizeof(float) * 2 * (size_t)n);
        float* up = buf + n;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row(buf, gate_up, r * 2 * n, n, is_bf16);
            load_row(up, gate_up, r * 2 * n + n, n, is_bf16);
            for (int i = 0; i < n; i++) buf[i] = round_to(buf[i] / (1.0f + exp_clamped(-buf[i])), is_bf16) * up[i];
            store_row(out, r * n, buf, n, is_bf16);
        }
        free(buf);
    }
}

/* Greedy sampling: the index of each row's largest value (the first one on ties, as
 * torch.argmax). x: [rows, n] contiguous; NaN rows give an arbitrary index. */
void argmax_rows(int64_t* out, const void* x, int64_t rows, int64_t n, int is_bf16, int num_threads) {
    const int64_t chunk = 4096;
#pragma omp parallel num_threads(num_threads)
    {
        float* buf = (float*)malloc(sizeof(float) * chunk);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float best = -INFINITY;
            int64_t best_index = 0;
            for (int64_t start = 0; start < n; start += chunk) {
                const int len = (int)(n - start < chunk ? n - start : chunk);
                load_row(buf, x, r * n + start, len, is_bf16);
                float chunk_max = -INFINITY;
#pragma omp simd reduction(max : chunk_max)
                for (int i = 0; i < len; i++) chunk_max = buf[i] > chunk_max ? buf[i] : chunk_max;
                if (chunk_max > best) {
                    best = chunk_max;
                    for (int i = 0; i < len; i++)
                        if (buf[i] == chunk_max) {
                            best_index = start + i;
                            break;
                        }
                }
            }
            out[r] = best_index;
        }
        free(buf);
    }
}

/* Temperature sampling by inverse CDF, fused: per row, the max, then the weights
 * exp((x - max) / T) with their sum, then the first token whose running sum exceeds
 * draw x sum. Weights are never normalised (the draw scales instead), and the walk
 * skips whole chunks by their sums. Rows with T = 0 (inv_temperature 0) take the
 * argmax. Weights below e^-87 of the top are 0, as softmax underflows them too.
 * x: [rows, n] contiguous; draws in [0, 1). */
#define SAMPLE_CHUNK 64
void sample_rows(int64_t* out, const void* x, const float* inv_temperature, const float* draws, int64_t rows,
                 int64_t n, int is_bf16, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows >= 16)
    {
        const int64_t num_chunks = (n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
        float* w = (float*)malloc(sizeof(float) * (size_t)(n + num_chunks));
        float* chunk_sums = w + n;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row(w, x, r * n, (int)n, is_bf16);
            float top = -INFINITY;
#pragma omp simd reduction(max : top)
            for (int64_t i = 0; i < n; i++) top = w[i] > top ? w[i] : top;
            const float inv_t = inv_temperature[r];
            if (inv_t == 0.0f) { /* greedy: the first index of the max, as torch.argmax */
                int64_t i = 0;
                while (i < n - 1 && w[i] != top) i++;
                out[r] = i;
                continue;
            }
            float total = 0.0f;
            for (int64_t c = 0; c < num_chunks; c++) {
                const int64_t start = c * SAMPLE_CHUNK, end = start + SAMPLE_CHUNK < n ? start + SAMPLE_CHUNK : n;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = start; i < end; i++) {
                    const float d = (w[i] - top) * inv_t;
                    w[i] = d < -87.0f ? 0.0f : exp_clamped(d);
                    sum += w[i];
                }
                chunk_sums[c] = sum;
                total += sum;
            }
            const float target = draws[r] * total;
            float running = 0.0f;
            int64_t c = 0;
            while (c < num_chunks - 1 && running + chunk_sums[c] <= target) running += chunk_sums[c++];
            /* Within the chunk; rounding may leave the target unreached: take its last token
             * with weight, which a zero-weight token never is. */
            const int64_t start = c * SAMPLE_CHUNK, end = start + SAMPLE_CHUNK < n ? start + SAMPLE_CHUNK : n;
            int64_t pick = -1;
            for (int64_t i = start; i < end; i++) {
                if (w[i] == 0.0f) continue;
                pick = i;
                running += w[i];
                if (running > target) break;
            }
            while (pick < 0 && c > 0) { /* an all-zero last chunk: step back to one with weight */
                c--;
                for (int64_t i = c * SAMPLE_CHUNK; i < (c + 1) * SAMPLE_CHUNK; i++)
                    if (w[i] != 0.0f) pick = i;
            }
            out[r] = pick < 0 ? 0 : pick;
        }
        free(w);
    }
}

/* ------------------------------------------------------------------------------------ */
static inline float element(const void* src, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_float(((const bf16*)src)[i]) : ((const float*)src)[i];
}

/* One pair of a rotate-half (GPT-NeoX) rotary embedding in bf16, as transformers'
 * apply_rotary_pos_emb computes it: x * cos + rotate_half(x) * sin, each product rounded.
 * (x0, x1) are elements i and i + D/2 of a row. */
static inline void rotate_pair_bf16(float* y0, float* y1, float x0, float x1, float c0, float c1, float s0,
                                    float s1) {
    *y0 = round_to(round_to(x0 * c0, 1) - round_to(x1 * s0, 1), 1);
    *y1 = round_to(round_to(x1 * c1, 1) + round_to(x0 * s1, 1), 1);
}

/* dst = row `offset` of src rotated by the rotary embedding (cos and sin: row `angle` of
 * [T, D] tables), as rotate_pair_bf16 (and in fp32 without rounding). Read where they
 * lie, not widened into scratch rows first and read back from there (with store_outputs'
 * one pass, 16-25% off the attention of sixteen 128-token prompts). */
static inline void load_rotated(float* restrict dst, const void* src, int64_t offset, const void* cos,
                                const void* sin, int64_t angle, int D, int is_bf16) {
    const int half = D / 2;
    const int64_t a = angle * D;
    if (is_bf16) {
        for (int i = 0; i < half; i++)
            rotate_pair_bf16(dst + i, dst + i + half, element(src, offset + i, 1), element(src, offset + i + half, 1),
                             element(cos, a + i, 1), element(cos, a + i + half, 1), element(sin, a + i, 1),
                             element(sin, a + i + half, 1));
    } else {
        for (int i = 0; i < half; i++) {
            const float x0 = element(src, offset + i, 0), x1 = element(src, offset + i + half, 0);
            const float c0 = element(cos, a + i, 0), c1 = element(cos, a + i + half, 0);
            const float s0 = element(sin, a + i, 0), s1 = element(sin, a + i + half, 0);
            dst[i] = x0 * c0 - x1 * s0;
            dst[i + half] = x1 * c1 + x0 * s1;
        }
    }
}

/* out = x rotated by the rotary embedding (as `load_rotated` rounds it), for rows of any
 * strides; out: contiguous [rows, heads, D]; cos/sin: contiguous [rows, D]. */
void rotary_embed(void* out, const void* x, int64_t stride_t, int64_t stride_h, const void* cos, const void* sin,
                  int64_t rows, int heads, int D, int is_bf16, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows >= 16)
    {
        float* buf = (float*)malloc(sizeof(float) * (size_t)D);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows; t++) {
            for (int h = 0; h < heads; h++) {
                load_rotated(buf, x, t * stride_t + h * stride_h, cos, sin, t, D, is_bf16);
                store_row(out, (t * heads + h) * D, buf, D, is_bf16);
            }
        }
        free(buf);
    }
}

/* ------------------------------------------------------------------------------------ */
/* Paged attention. A layer's cache is a pair of [num_blocks, Hkv, ...] tensors: one page
 * per (block, KV head), laid out for the kernel that reads it.
 * - Generic (fp32, or CPUs without AVX512-BF16): a K page is [D, BS] (keys transposed),
 *   so a block's scores are broadcast-multiply-adds over its keys; a V page is [BS, D].
 *   Pages are widened to fp32 once per block.
 * - bf16 with AVX512-BF16, D % 32 == 0 and BS % 16 == 0: pages interleave pairs along
 *   each product's sum, K as [D/2, BS, 2] and V as [BS/2, D, 2], so vdpbf16ps reads them
 *   as they are (no widening pass) and accumulates in fp32. */

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
 * each multiply-add's accumulator went back to the stack on every iteration (about 6% of
 * a 64-sequence decode's attention, 3% of a prefill's). */
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

/* Each output is scaled and rounded in one pass. Scaled in place and then read back, the
 * accumulators' loads waited on the stores just before them (perf's hottest lines in the
 * attention of a prefill; one pass took 7% off it). */
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

/* 16 floats: GCC lowers these to whatever the CPU has (one AVX-512 register, two AVX2
 * registers, four NEON registers), and keeps arrays of them in registers when their
 * length is a compile-time constant. */
typedef float vec16 __attribute__((vector_size(64), aligned(4)));
#define VEC 16

static inline vec16 vload(const float* p) { return *(const vec16*)p; }
static inline void vstore(float* p, vec16 x) { *(vec16*)p = x; }

/* Generic pages. D and BS are compile-time constants in the specialisations below
 * (multiples of 16), so a block's scores and a query's accumulator stay in registers. */
static inline __attribute__((always_inline)) void attend_impl(const Layer* L, const WorkItem* it,
                                                              const Scratch* w, const int D, const int BS) {
    const int group = L->num_heads / L->num_kv_heads;
    const int last_pos = it->first_pos + it->nrows - 1;
    const float* restrict k = w->k;
    const float* restrict v = w->v;
    load_queries(L, it, w, group);
    for (int b = 0; b <= last_pos / BS; b++) {
        const int64_t page = ((int64_t)it->block_table[b] * L->num_kv_heads + it->kv_head) * BS * D;
        const int key0 = b * BS;
        const int nk = last_pos + 1 - key0 < BS ? last_pos + 1 - key0 : BS;
        load_row(w->k, L->k_cache, page, D * BS, L->is_bf16);
        load_row(w->v, L->v_cache, page, nk * D, L->is_bf16);
        for (int i = 0; i < it->nrows * group; i++) {
            const int pos = it->first_pos + i / group;
            if (key0 > pos) continue; /* the whole block lies in this row's future */
            const int n = pos + 1 - key0 < nk ? pos + 1 - key0 : nk;
            const float* restrict q = w->q + (int64_t)i * D;
            vec16 s[BS / VEC];
            for (int c = 0; c < BS / VEC; c++) s[c] = (vec16){0};
            for (int d = 0; d < D; d++)
                for (int c = 0; c < BS / VEC; c++) s[c] += q[d] * vload(k + d * BS + c * VEC);
            float scores[BS];
            for (int c = 0; c < BS / VEC; c++) vstore(scores + c * VEC, s[c]);
            const float correction = softmax_update(w, i, scores, n, BS);
            float* restrict acc = w->acc + (int64_t)i * D;
            vec16 a[D / VEC];
            for (int c = 0; c < D / VEC; c++) a[c] = vload(acc + c * VEC) * correction;
            for (int j = 0; j < n; j++)
                for (int c = 0; c < D / VEC; c++) a[c] += w->p[j] * vload(v + j * D + c * VEC);
            for (int c = 0; c < D / VEC; c++) vstore(acc + c * VEC, a[c]);
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
        load_row(w->k, L->k_cache, page, D * BS, L->is_bf16);
        load_row(w->v, L->v_cache, page, nk * D, L->is_bf16);
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

/* The blocks an item attends: its sequence's up to its last row's. */
static inline int item_blocks(const WorkItem* it, int block_size) {
    return (it->first_pos + it->nrows - 1) / block_size + 1;
}

/* Start loading blocks first..last of an item (its K and V pages) into L2: they sit
 * anywhere in the cache, so the hardware prefetchers cannot guess them, and a decode
 * step reads far more KV than fits in L3. A few blocks ahead of the attention rather
 * than the whole item at once: 5-10% faster decode attention (64 sequences of 200
 * tokens, 32 of 400), since a burst of a whole item's pages overflows what L2 can have
 * in flight. */
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
    const int D = L->head_dim, elem = L->is_bf16 ? 2 : 4;
    for (int r = 0; r < it->nrows; r++) {
        const int64_t row = it->row0 + r;
        for (int g = 0; g < group; g++) {
            const int head = it->kv_head * group + g;
            const char* q = (const char*)L->q + (row * L->q_stride_t + head * L->q_stride_h) * elem;
            const char* o = (const char*)L->out + (row * L->num_heads + head) * (int64_t)D * elem;
            for (int x = 0; x < D * elem; x += 64) {
                __builtin_prefetch(q + x, 0, 3);
                __builtin_prefetch(o + x, 1, 3);
            }
        }
        if (L->cos != NULL)
            for (int x = 0; x < D * elem; x += 64) {
                __builtin_prefetch((const char*)L->cos + row * D * elem + x, 0, 3);
                __builtin_prefetch((const char*)L->sin + row * D * elem + x, 0, 3);
            }
    }
}

#if defined(__AVX512BF16__)

/* dst = the bf16 row x (D % 32 == 0) rotated as rotate_pair_bf16 rotates it, 16 pairs at
 * a time (cos and sin: the row's angles), or copied when cos is NULL. Scalar, it was the
 * costliest part of writing K and of loading a prefill's queries. */
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
static void write_paired_kv(const Layer* L, const bf16* k, int64_t k_stride_h, const bf16* v, int64_t v_stride_h,
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
 * load_rotated rounds them, in one pass. Widened to fp32 scratch rows first, scaled by 1
 * and converted back, they were a quarter of a prefill's attention in `perf`; one pass
 * took about 4% off that attention. */
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
 * latency bounded the arithmetic (a 16-sequence decode step's 30 layers with the KV in
 * cache: 5.4 -> 4.3 ms; from memory, with prefetch_pages too: 10 -> 8.5 ms). */
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
 * left its multiply-adds at a quarter of the vdpbf16ps peak on sixteen 128-token prompts.
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
            const int pos = it->first_pos + i / group;
            const int n = pos + 1 - key0 < nkeys ? pos + 1 - key0 : nkeys;
            const int64_t row = (int64_t)i * chunk_keys;
            correction[i] = softmax_chunk(w, i, scores + row, n, nkeys, probs + row);
        }
        for (int i0 = 0; i0 < nq; i0 += vectors_per_tile) {
            const int T = nq - i0 < vectors_per_tile ? nq - i0 : vectors_per_tile;
            int n = 0; /* the most keys of this tile's vectors */
            for (int t = 0; t < T; t++) {
                const int pos = it->first_pos + (i0 + t) / group;
                const int nt = pos + 1 - key0 < nkeys ? pos + 1 - key0 : nkeys;
                n = nt > n ? nt : n;
            }
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
             * The later page's loads, issued in one burst, filled the miss queue and
             * stalled that arithmetic; spread through it, they overlap it. With the next
             * item's pages loaded ahead too, a 64-sequence decode step of the bundled
             * model went from 48.8 to 42.8 ms (150-token contexts) and from 68.3 to
             * 57.1 ms (400), measured in turns in one process. */
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
static inline __attribute__((always_inline)) void attend_paired(const Layer* L, const WorkItem* it,
                                                                const WorkItem* next, int warm, const Scratch* w,
                                                                const int D, const int BS) {
    if (it->nrows == 1) attend_decode_paired(L, it, next, warm, w, D, BS);
    else attend_prefill_paired(L, it, next, w, D, BS);
}
#endif

static void attend(const Layer* L, const WorkItem* it, const WorkItem* next, int warm, const Scratch* w) {
    const int D = L->head_dim, BS = L->block_size;
#if defined(__AVX512BF16__)
    if (paired_pages(L)) {
        if (D == 64 && BS == 16) attend_paired(L, it, next, warm, w, 64, 16);
        else if (D == 64 && BS == 32) attend_paired(L, it, next, warm, w, 64, 32);
        else if (D == 128 && BS == 16) attend_paired(L, it, next, warm, w, 128, 16);
        else if (D == 128 && BS == 32) attend_paired(L, it, next, warm, w, 128, 32);
        else attend_paired(L, it, next, warm, w, D, BS);
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

/* Copy this step's K/V rows into their pages, rotating K first when cos/sin are given.
 * A negative slot means "skip" (padded rows). */
static void write_kv(const Layer* L, const void* k, int64_t k_stride_t, int64_t k_stride_h, const void* v,
                     int64_t v_stride_t, int64_t v_stride_h, const int64_t* slots, int64_t num_tokens,
                     int num_threads) {
    const int D = L->head_dim, BS = L->block_size, Hkv = L->num_kv_heads;
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
                    if (L->is_bf16) ((bf16*)L->k_cache)[page + k_offset(L, j, d)] = float_to_bf16(buf[d]);
                    else ((float*)L->k_cache)[page + k_offset(L, j, d)] = buf[d];
                }
                load_row(buf, v, t * v_stride_t + h * v_stride_h, D, L->is_bf16);
                store_row(L->v_cache, page + (int64_t)j * D, buf, D, L->is_bf16);
            }
        }
        free(buf);
    }
}

/* One attention layer over a packed step: (rotary), KV write, then causal attention of
 * every query row over its sequence's paged KV.
 *   q: [T, H, D], k/v: [T, Hkv, D], each with the given strides (last dim contiguous)
 *   cos/sin: [T, D] or NULL; out: contiguous [T, H, D]
 *   decode rows 0..num_decodes-1: one query token each, at the end of a context of
 *     decode_lens[i] tokens, block table row i of decode_tables [num_decodes, decode_width]
 *   prefill chunk p: rows prefill_starts[p]..prefill_ends[p]-1, the last rows of a
 *     context of prefill_lens[p] tokens, block table row p of prefill_tables
 * Rows of no decode and no chunk get their KV written but are not attended (ops.py
 * attends fresh prefills, which need no cache, with torch's SDPA). */
void paged_attention(void* out, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k,
                     int64_t k_stride_t, int64_t k_stride_h, const void* v, int64_t v_stride_t, int64_t v_stride_h,
                     const void* cos, const void* sin, void* k_cache, void* v_cache, const int64_t* slots,
                     int64_t num_tokens, int num_decodes, const int32_t* decode_tables, int decode_width,
                     const int32_t* decode_lens, int num_prefills, const int32_t* prefill_starts,
                     const int32_t* prefill_ends, const int32_t* prefill_lens, const int32_t* prefill_tables, int prefill_width, int num_heads,
                     int num_kv_heads, int head_dim, int block_size, float scale, int is_bf16, int num_threads) {
    const Layer L = {out,     q,       q_stride_t, q_stride_h, cos,       sin,        k_cache, v_cache,
                     num_heads, num_kv_heads, head_dim, block_size, scale, is_bf16};
    write_kv(&L, k, k_stride_t, k_stride_h, v, v_stride_t, v_stride_h, slots, num_tokens, num_threads);

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
