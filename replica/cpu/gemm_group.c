/* GEMM over group-quantized weights (GGUF's blocks, GPTQ and AWQ, repacked once at load by
 * replica/cpu/group_quant.py): y = x W^T (+ b), x and y fp32, where each output row j of W
 * holds k small integers q in groups of `group`, and w[j, i] = scale[j, g] * q[j, i] +
 * min[j, g] for the group g of i (min 0 where `mins` is NULL). Scales and mins are fp16.
 *
 * Why: a decode step reads every weight once, and at a few rows it waits on memory. Four
 * bits a weight (plus a scale and a min per 32) is a third of bf16's bytes. The weights
 * stay in their integers: per group the kernel sums q * x in fp32 (the integers convert
 * exactly), multiplies the sum by the scale, and adds min * (the group's sum of x), so the
 * result is the dequantized weights' product up to fp32 summation order.
 *
 * Layouts (bits): 4: [n][k / 32][16] bytes, each 32-block as GGUF's Q4_0 and Q4_1 hold it:
 * byte i has q[i] in its low nibble and q[i + 16] in its high one (group a multiple of 32).
 * 8: [n][k] int8 (group a multiple of 8).
 *
 * Columns go to threads in panels of Q_PANEL, each thread a contiguous share of them: two
 * threads taking small panels in turn read memory at a third of the speed. A thread that
 * finishes its share takes the panels still left at the back of another's, so a thread
 * whose core the serving processes take for a moment holds up only part of its share
 * (Share). Rows go in tiles of Q_TILE_ROWS, whose weights are unpacked once per tile. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kvserve_abi.h"
#include "scalar.h"

#define Q_PANEL 16
#define Q_TILE_ROWS 4
/* How far ahead of its reads a thread prefetches the weights: one column's blocks are too
 * few for the hardware prefetcher to keep enough cache lines in flight on its own. */
#define Q_PREFETCH_BYTES 4096

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8_WIDE 1
#endif

int group_q8_is_wide(void) {
#ifdef Q8_WIDE
    return 1;
#else
    return 0;
#endif
}

int group_gemm_available(void) { return 1; }

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Calls tile(y, <x args>, qs, scales, mins, bias, r0, rows, j, n, k, group, bits) with
 * rows and bits as constants, so that each combination compiles to its own loop with the
 * row accumulators in registers. */
#define DISPATCH(tile, ...)                                                                        \
    do {                                                                                           \
        if (bits == 4) {                                                                           \
            switch (rows) {                                                                        \
                case 1: tile(y, __VA_ARGS__, qs, scales, mins, bias, r0, 1, j, n, k, group, 4); break; \
                case 2: tile(y, __VA_ARGS__, qs, scales, mins, bias, r0, 2, j, n, k, group, 4); break; \
                case 3: tile(y, __VA_ARGS__, qs, scales, mins, bias, r0, 3, j, n, k, group, 4); break; \
                default: tile(y, __VA_ARGS__, qs, scales, mins, bias, r0, 4, j, n, k, group, 4); break; \
            }                                                                                      \
        } else {                                                                                   \
            switch (rows) {                                                                        \
                case 1: tile(y, __VA_ARGS__, qs, scales, mins, bias, r0, 1, j, n, k, group, 8); break; \
                case 2: tile(y, __VA_ARGS__, qs, scales, mins, bias, r0, 2, j, n, k, group, 8); break; \
                case 3: tile(y, __VA_ARGS__, qs, scales, mins, bias, r0, 3, j, n, k, group, 8); break; \
                default: tile(y, __VA_ARGS__, qs, scales, mins, bias, r0, 4, j, n, k, group, 8); break; \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* Units of work (panels of columns) dealt out as contiguous shares, one per thread, in
 * one cache line each: the owner takes its units from the front, and a thread whose own
 * share is done takes units from the back of the others'. Each thread still streams
 * its columns in order, and only the ends of the shares change hands. */
typedef struct {
    uint64_t span; /* the units [front, back) left: front in the low 32 bits, back in the high */
    char pad[56];
} Share;

static Share* deal_shares(int64_t units, int shares) {
    Share* s = (Share*)aligned_alloc(64, sizeof(Share) * (size_t)shares);
    for (int t = 0; t < shares; t++)
        s[t].span = (uint64_t)(units * t / shares) | ((uint64_t)(units * (t + 1) / shares) << 32);
    return s;
}

static inline int64_t take_unit(Share* share, int from_back) {
    uint64_t span = __atomic_load_n(&share->span, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t front = span & 0xFFFFFFFFu, back = span >> 32;
        if (front >= back) return -1;
        const uint64_t next = from_back ? front | ((back - 1) << 32) : (front + 1) | (back << 32);
        if (__atomic_compare_exchange_n(&share->span, &span, next, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return (int64_t)(from_back ? back - 1 : front);
    }
}

/* The calling thread's next unit: its own share's front, then the backs of the others' in
 * turn; -1 when every share is done. *victim starts at the thread's own share. */
static inline int64_t next_unit(Share* shares, int num_shares, int own, int* victim) {
    for (;;) {
        const int64_t unit = take_unit(&shares[*victim], *victim != own);
        if (unit >= 0) return unit;
        *victim = (*victim + 1) % num_shares;
        if (*victim == own) return -1;
    }
}

/* The statement given after `units, p,` for each unit p of `units`, on num_threads
 * threads, each taking its share and then the others' backs as above. */
#define FOR_EACH_UNIT(units, p, ...)                                                        \
    do {                                                                                    \
        Share* shares = deal_shares((units), num_threads);                                  \
        _Pragma("omp parallel num_threads(num_threads)") {                                  \
            const int own = omp_get_thread_num();                                           \
            int victim = own;                                                               \
            for (int64_t p; (p = next_unit(shares, num_threads, own, &victim)) >= 0;) {     \
                __VA_ARGS__                                                                 \
            }                                                                               \
        }                                                                                   \
        free(shares);                                                                       \
    } while (0)

/* Every column of y in panels of Q_PANEL, shared out as above, each column's rows in
 * tiles of up to Q_TILE_ROWS: DISPATCH(tile, ...) for each. */
#define FOR_EACH_TILE(tile, ...)                                                            \
    FOR_EACH_UNIT((n + Q_PANEL - 1) / Q_PANEL, p, {                                         \
        const int64_t end = (p + 1) * Q_PANEL < n ? (p + 1) * Q_PANEL : n;                  \
        for (int64_t r0 = 0; r0 < m; r0 += Q_TILE_ROWS) {                                   \
            const int rows = m - r0 < Q_TILE_ROWS ? (int)(m - r0) : Q_TILE_ROWS;            \
            for (int64_t j = p * Q_PANEL; j < end; j++) DISPATCH(tile, __VA_ARGS__);        \
        }                                                                                   \
    })

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* The 32 weights of a 4-bit block as 4 vectors of 8 floats, in order. */
static inline void unpack4(const uint8_t* block, __m256 q[4]) {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)block);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static inline __m256 unpack8(const int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q)));
}

/* Output column j for rows [r0, r0 + rows) (rows <= Q_TILE_ROWS). xsum: [m][k / group]. */
static inline __attribute__((always_inline)) void column_tile(
    float* y, const float* x, const float* xsum, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
    const float* bias, int64_t r0, int rows, int64_t j, int64_t n, int64_t k, int group, int bits) {
    const int64_t groups = k / group;
    const uint16_t* js = scales + j * groups;
    const uint16_t* jm = mins ? mins + j * groups : NULL;
    __m256 acc[Q_TILE_ROWS];
    float offset[Q_TILE_ROWS];
    for (int r = 0; r < Q_TILE_ROWS; r++) {
        acc[r] = _mm256_setzero_ps();
        offset[r] = 0.0f;
    }
    const float* xr[Q_TILE_ROWS];
    for (int r = 0; r < rows; r++) xr[r] = x + (r0 + r) * k;
    for (int64_t g = 0; g < groups; g++) {
        __m256 part[Q_TILE_ROWS];
        for (int r = 0; r < Q_TILE_ROWS; r++) part[r] = _mm256_setzero_ps();
        const int64_t start = g * group;
        if (bits == 4) {
            const uint8_t* blocks = qs + (j * k + start) / 2;
            for (int b = 0; b < group / 32; b++) {
                __m256 q[4];
                _mm_prefetch((const char*)blocks + 16 * b + Q_PREFETCH_BYTES, _MM_HINT_T0);
                unpack4(blocks + 16 * b, q);
                for (int r = 0; r < rows; r++) {
                    const float* xv = xr[r] + start + 32 * b;
                    part[r] = _mm256_fmadd_ps(q[0], _mm256_loadu_ps(xv), part[r]);
                    part[r] = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xv + 8), part[r]);
                    part[r] = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xv + 16), part[r]);
                    part[r] = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xv + 24), part[r]);
                }
            }
        } else {
            const int8_t* w = (const int8_t*)qs + j * k + start;
            for (int c = 0; c < group; c += 8) {
                if (c % 32 == 0) _mm_prefetch((const char*)w + c + Q_PREFETCH_BYTES, _MM_HINT_T0);
                const __m256 q = unpack8(w + c);
                for (int r = 0; r < rows; r++)
                    part[r] = _mm256_fmadd_ps(q, _mm256_loadu_ps(xr[r] + start + c), part[r]);
            }
        }
        const __m256 s = _mm256_set1_ps(half_to_float(js[g]));
        for (int r = 0; r < rows; r++) acc[r] = _mm256_fmadd_ps(part[r], s, acc[r]);
        if (jm) {
            const float m = half_to_float(jm[g]);
            for (int r = 0; r < rows; r++) offset[r] += m * xsum[(r0 + r) * groups + g];
        }
    }
    const float b = bias ? bias[j] : 0.0f;
    for (int r = 0; r < rows; r++) y[(r0 + r) * n + j] = hsum256(acc[r]) + offset[r] + b;
}

/* xsum [m, k / group]: each group's sum of x, which the mins multiply. */
static void group_sums(float* xsum, const float* x, int64_t m, int64_t k, int group) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < k / group; g++) {
            const float* v = x + r * k + g * group;
            int i = 0;
            __m256 s8 = _mm256_setzero_ps();
            for (; i + 8 <= group; i += 8) s8 = _mm256_add_ps(s8, _mm256_loadu_ps(v + i));
            float s = hsum256(s8);
            for (; i < group; i++) s += v[i];
            xsum[r * (k / group) + g] = s;
        }
}

void gemm_group(float* y, const float* x, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                const float* bias, int64_t m, int64_t n, int64_t k, int32_t group, int32_t bits,
                int32_t num_threads) {
    float* xsum = mins ? (float*)malloc(sizeof(float) * (size_t)(m * (k / group))) : NULL;
    if (mins) group_sums(xsum, x, m, k, group);
    FOR_EACH_TILE(column_tile, x, xsum);
    free(xsum);
}

/* The int8-activation kernel (gemm_group_q8): x quantized per 32-block of each row
 * (symmetric, the block's largest |x| at 127, as GGUF's Q8_0), so that a block's 32
 * products are one integer dot product: vpdpbusd where the CPU has AVX512-VNNI, else
 * vpmaddubsw and vpmaddwd (AVX2), as llama.cpp computes its quantized dot products. The
 * sum converts to fp32 once per block and takes the weight's scale times x's (one scale
 * per block, or per half in groups of 16: group_quant.q8_kernel_runs); the min term uses
 * x's exact fp32 sums. 8-bit weights are signed, and these instructions take
 * one unsigned operand: |w| times x with w's sign. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#else
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

static inline __m256i nibbles32(const uint8_t* block) {
    const __m128i bytes = _mm_loadu_si128((const __m128i*)block);
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask), _mm_and_si128(bytes, mask));
}

/* A 32-block of x quantized into q, and its scale (the block's largest |x| at 127). */
static inline float quantize_block(int8_t* q, const float* v) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 v8[4], peak8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v8[i] = _mm256_loadu_ps(v + 8 * i);
        peak8 = _mm256_max_ps(peak8, _mm256_and_ps(v8[i], magnitude));
    }
    __m128 p4 = _mm_max_ps(_mm256_castps256_ps128(peak8), _mm256_extractf128_ps(peak8, 1));
    p4 = _mm_max_ps(p4, _mm_movehl_ps(p4, p4));
    const float peak = _mm_cvtss_f32(_mm_max_ss(p4, _mm_movehdup_ps(p4)));
    const __m256 inv = _mm256_set1_ps(peak > 0.0f ? 127.0f / peak : 0.0f);
    __m256i r[4]; /* rounded to nearest even, as lrintf in the default rounding mode */
    for (int i = 0; i < 4; i++) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v8[i], inv));
    /* The packs work per 128-bit lane: 4-element runs come out as r0 r1 r2 r3 (low halves),
     * then the high halves; the permutation puts each r's 8 back together. */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return peak / 127.0f;
}

/* x [m, k] -> xq [m, k] int8 and xd [m, k / 32] with x ~ xd * xq per block. */
static void quantize_blocks(int8_t* xq, float* xd, const float* x, int64_t m, int64_t k) {
    for (int64_t b = 0; b < m * (k / 32); b++) xd[b] = quantize_block(xq + b * 32, x + b * 32);
}

/* The pair kernels take a column's blocks two at a time. A 4-bit pair is one load whose
 * nibbles unpack as [block 0 low, block 1 low, block 0 high, block 1 high] halves of 16,
 * so x's pair is quantized in that order (an 8-bit pair keeps x's); each 32-bit lane of a
 * dot product then sums 4 weights of one block, and takes its block's scales from a
 * pattern of `lanes` floats. pair_order: where x's element i of a pair goes. */
static inline int pair_order(int bits, int i) {
    if (bits != 4) return i;
    const int block = i / 32, half = (i % 32) / 16;
    return half * 32 + block * 16 + i % 16;
}

/* x [m, k] -> xq [m, k] int8 in pair_order and xd [m][k / 64][lanes]: each lane's block
 * scale (the lane sums 4 weights, in pair_order). */
static void quantize_pairs(int8_t* xq, float* xd, const float* x, int64_t m, int64_t k, int bits, int lanes) {
    const int64_t pairs = k / 64;
    for (int64_t r = 0; r < m; r++)
        for (int64_t p = 0; p < pairs; p++) {
            int8_t pair[64];
            const float d[2] = {quantize_block(pair, x + r * k + 64 * p),
                                quantize_block(pair + 32, x + r * k + 64 * p + 32)};
            for (int i = 0; i < 64; i += 16) memcpy(xq + r * k + 64 * p + pair_order(bits, i), pair + i, 16);
            for (int lane = 0; lane < lanes; lane++)
                xd[(r * pairs + p) * lanes + lane] = d[bits == 4 ? (lane / 4) % 2 : lane / (lanes / 2)];
        }
}

/* A pair's two block scales, in a vector's first two lanes (a group that is an odd
 * multiple of 32 may end between the two blocks). */
static inline __m128 pair_scales(const uint16_t* js, int64_t p, int group) {
    return group == 32 ? _mm_cvtph_ps(_mm_cvtsi32_si128(*(const int32_t*)(js + 2 * p)))
                       : _mm_setr_ps(_cvtsh_ss(js[(64 * p) / group]), _cvtsh_ss(js[(64 * p + 32) / group]), 0.0f, 0.0f);
}

static inline __attribute__((always_inline)) void column_tile_q8(
    float* y, const int8_t* xq, const float* xd, const float* xsum, const uint8_t* qs, const uint16_t* scales,
    const uint16_t* mins, const float* bias, int64_t r0, int rows, int64_t j, int64_t n, int64_t k, int group,
    int bits) {
    const int64_t groups = k / group, blocks = k / 32;
    const uint16_t* js = scales + j * groups;
    __m256 acc[Q_TILE_ROWS];
    float offset[Q_TILE_ROWS] = {0.0f};
    for (int r = 0; r < Q_TILE_ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        /* A group of 16 (8-bit weights only) gives each half of the block its scale: the
         * dot product's lanes 0-3 sum its first 16 weights. */
        const __m256 ws = group == 16 ? _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(js[2 * b + 1])), _mm_set1_ps(_cvtsh_ss(js[2 * b])))
                                      : _mm256_set1_ps(_cvtsh_ss(js[(b * 32) / group]));
        __m256i w, wsign = _mm256_setzero_si256();
        if (bits == 4) {
            const uint8_t* block = qs + (j * k) / 2 + 16 * b;
            _mm_prefetch((const char*)block + Q_PREFETCH_BYTES, _MM_HINT_T0);
            w = nibbles32(block);
        } else {
            _mm_prefetch((const char*)qs + j * k + 32 * b + Q_PREFETCH_BYTES, _MM_HINT_T0);
            wsign = _mm256_loadu_si256((const __m256i*)((const int8_t*)qs + j * k + 32 * b));
            w = _mm256_abs_epi8(wsign);
        }
        for (int r = 0; r < rows; r++) {
            __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + (r0 + r) * k + 32 * b));
            if (bits != 4) xv = _mm256_sign_epi8(xv, wsign);
            const __m256 sum = _mm256_cvtepi32_ps(dot_u8s8(w, xv));
            const __m256 scale = _mm256_mul_ps(ws, _mm256_broadcast_ss(xd + (r0 + r) * blocks + b));
            acc[r] = _mm256_fmadd_ps(sum, scale, acc[r]);
        }
    }
    if (mins) {
        const uint16_t* jm = mins + j * groups;
        for (int64_t g = 0; g < groups; g++) {
            const float m = _cvtsh_ss(jm[g]);
            for (int r = 0; r < rows; r++) offset[r] += m * xsum[(r0 + r) * groups + g];
        }
    }
    const float b = bias ? bias[j] : 0.0f;
    for (int r = 0; r < rows; r++) y[(r0 + r) * n + j] = hsum256(acc[r]) + offset[r] + b;
}

/* One row's min terms of a column, each group's min times x's sum over the group (xs):
 * eight groups an FMA into *acc; the sum of the groups left over is returned. */
static inline float add_min_terms(__m256* acc, const uint16_t* jm, const float* xs, int64_t groups) {
    float tail = 0.0f;
    int64_t g = 0;
    for (; g + 8 <= groups; g += 8)
        *acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(jm + g))), _mm256_loadu_ps(xs + g), *acc);
    for (; g < groups; g++) tail += _cvtsh_ss(jm[g]) * xs[g];
    return tail;
}

/* One row (a single stream's decode), Q_COLUMNS columns at a time: a column alone is one
 * chain of dependent FMAs a block, and its mins' sum another, which leave the core waiting
 * on their latency; four columns' chains interleave, share each block of x, and end in one
 * horizontal sum. The mins' terms go eight groups an FMA. */
#define Q_COLUMNS 4
static inline __attribute__((always_inline)) void columns_q8_one_row(
    float* y, const int8_t* xq, const float* xd, const float* xsum, const uint8_t* qs, const uint16_t* scales,
    const uint16_t* mins, const float* bias, int64_t j, int64_t k, int group, int bits) {
    const int64_t groups = k / group, blocks = k / 32;
    __m256 acc[Q_COLUMNS];
    for (int c = 0; c < Q_COLUMNS; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + 32 * b));
        const __m256 xs = _mm256_broadcast_ss(xd + b);
        for (int c = 0; c < Q_COLUMNS; c++) {
            const uint16_t* js = scales + (j + c) * groups;
            const __m256 ws = group == 16 ? _mm256_set_m128(_mm_set1_ps(_cvtsh_ss(js[2 * b + 1])), _mm_set1_ps(_cvtsh_ss(js[2 * b])))
                                          : _mm256_set1_ps(_cvtsh_ss(js[(b * 32) / group]));
            __m256i sum;
            if (bits == 4) {
                const uint8_t* block = qs + ((j + c) * k) / 2 + 16 * b;
                _mm_prefetch((const char*)block + Q_PREFETCH_BYTES, _MM_HINT_T0);
                sum = dot_u8s8(nibbles32(block), xv);
            } else {
                const int8_t* w = (const int8_t*)qs + (j + c) * k + 32 * b;
                _mm_prefetch((const char*)w + Q_PREFETCH_BYTES, _MM_HINT_T0);
                const __m256i wsign = _mm256_loadu_si256((const __m256i*)w);
                sum = dot_u8s8(_mm256_abs_epi8(wsign), _mm256_sign_epi8(xv, wsign));
            }
            acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(ws, xs), acc[c]);
        }
    }
    float tail[Q_COLUMNS] = {0.0f};
    if (mins)
        for (int c = 0; c < Q_COLUMNS; c++) tail[c] = add_min_terms(&acc[c], mins + (j + c) * groups, xsum, groups);
    /* the four sums side by side: lanes (c, half) pairwise, then the halves */
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    float out[4];
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
    for (int c = 0; c < Q_COLUMNS; c++) y[j + c] = out[c] + tail[c] + (bias ? bias[j + c] : 0.0f);
}

/* y [1, n]: the columns Q_COLUMNS at a time, in panels of Q_PANEL shared out as above,
 * the last few by column_tile_q8. */
static void one_row_q8(float* y, const int8_t* xq, const float* xd, const float* xsum, const uint8_t* qs,
                       const uint16_t* scales, const uint16_t* mins, const float* bias, int64_t n, int64_t k,
                       int group, int bits, int num_threads) {
    const int64_t quads = n / Q_COLUMNS, quads_per_panel = Q_PANEL / Q_COLUMNS;
    FOR_EACH_UNIT((quads + quads_per_panel - 1) / quads_per_panel, p, {
        const int64_t end = (p + 1) * quads_per_panel < quads ? (p + 1) * quads_per_panel : quads;
        for (int64_t q = p * quads_per_panel; q < end; q++) {
            if (bits == 4)
                columns_q8_one_row(y, xq, xd, xsum, qs, scales, mins, bias, q * Q_COLUMNS, k, group, 4);
            else
                columns_q8_one_row(y, xq, xd, xsum, qs, scales, mins, bias, q * Q_COLUMNS, k, group, 8);
        }
    });
    for (int64_t j = quads * Q_COLUMNS; j < n; j++)
        column_tile_q8(y, xq, xd, xsum, qs, scales, mins, bias, 0, 1, j, n, k, group, bits);
}

/* 4-bit weights in pairs of blocks with 256-bit vectors: half the instructions a weight of
 * the block-at-a-time loops above. Where the AVX-512 kernel below is built too, both run
 * (gemm_group_q8 and gemm_group_q8_256) and the chooser times them: some CPUs execute a
 * 512-bit instruction as two 256-bit halves. */
static inline __m256i pair_dot(__m256i lo, __m256i hi, __m256i xa, __m256i xb) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xa), hi, xb);
#else
    /* each 16-bit sum of vpmaddubsw is at most 2 * 15 * 127, so two add exactly */
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb)),
                             _mm256_set1_epi16(1));
#endif
}

/* xq: [m][k] in pair_order; xd8: [m][k / 64][8] (lanes 0-3 the first block's scale). */
static inline __attribute__((always_inline)) void column_tile_pair(
    float* y, const int8_t* xq, const float* xd8, const float* xsum, const uint8_t* qs, const uint16_t* scales,
    const uint16_t* mins, const float* bias, int64_t r0, int rows, int64_t j, int64_t n, int64_t k, int group,
    int bits) {
    (void)bits; /* 4 */
    const int64_t groups = k / group, pairs = k / 64;
    const uint16_t* js = scales + j * groups;
    const __m256i mask = _mm256_set1_epi8(0x0F), lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 acc[Q_TILE_ROWS];
    float offset[Q_TILE_ROWS] = {0.0f};
    for (int r = 0; r < Q_TILE_ROWS; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const uint8_t* at = qs + (j * k) / 2 + 32 * p;
        _mm_prefetch((const char*)at + Q_PREFETCH_BYTES, _MM_HINT_T0);
        const __m256i bytes = _mm256_loadu_si256((const __m256i*)at);
        const __m256i lo = _mm256_and_si256(bytes, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
        const __m256 ws = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair_scales(js, p, group)), lanes);
        for (int r = 0; r < rows; r++) {
            const int8_t* xr = xq + (r0 + r) * k + 64 * p;
            const __m256i sum = pair_dot(lo, hi, _mm256_loadu_si256((const __m256i*)xr),
                                         _mm256_loadu_si256((const __m256i*)(xr + 32)));
            const __m256 scale = _mm256_mul_ps(ws, _mm256_loadu_ps(xd8 + ((r0 + r) * pairs + p) * 8));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), scale, acc[r]);
        }
    }
    if (mins)
        for (int r = 0; r < rows; r++)
            offset[r] = add_min_terms(&acc[r], mins + j * groups, xsum + (r0 + r) * groups, groups);
    const float b = bias ? bias[j] : 0.0f;
    for (int r = 0; r < rows; r++) y[(r0 + r) * n + j] = hsum256(acc[r]) + offset[r] + b;
}

/* One row (a single stream's decode) of groups of 32, column j: its pairs four at a time,
 * whose dot products two rounds of horizontal adds sum per block, so that the conversion
 * to fp32, the scales' product and the FMA come once per eight blocks rather than once per
 * two; the pairs left over go one at a time. xq, xd8: quantize_pairs'; xd_quads: x's block
 * scales in the adds' order (quad_scales). */
static inline __attribute__((always_inline)) void column_one_row_quads(
    float* y, const int8_t* xq, const float* xd8, const float* xd_quads, const float* xsum, const uint8_t* qs,
    const uint16_t* scales, const uint16_t* mins, const float* bias, int64_t j, int64_t k) {
    const int64_t groups = k / 32, pairs = k / 64, quads = pairs / 4;
    const uint16_t* js = scales + j * groups;
    const uint8_t* column = qs + (j * k) / 2;
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i added = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7); /* the blocks of a quad's sums */
    __m256 acc = _mm256_setzero_ps();
    for (int64_t q = 0; q < quads; q++) {
        __m256i sums[4]; /* pair i's: block 2i's partial sums in lanes 0-3, block 2i + 1's in 4-7 */
        for (int i = 0; i < 4; i++) {
            const int64_t p = 4 * q + i;
            const uint8_t* at = column + 32 * p;
            if (i % 2 == 0) _mm_prefetch((const char*)at + Q_PREFETCH_BYTES, _MM_HINT_T0);
            const __m256i bytes = _mm256_loadu_si256((const __m256i*)at);
            const __m256i lo = _mm256_and_si256(bytes, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
            sums[i] = pair_dot(lo, hi, _mm256_loadu_si256((const __m256i*)(xq + 64 * p)),
                               _mm256_loadu_si256((const __m256i*)(xq + 64 * p + 32)));
        }
        const __m256i blocks = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]), _mm256_hadd_epi32(sums[2], sums[3]));
        const __m256 ws = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(js + 8 * q))), added);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(blocks), _mm256_mul_ps(ws, _mm256_loadu_ps(xd_quads + 8 * q)), acc);
    }
    const __m256i lanes = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (int64_t p = 4 * quads; p < pairs; p++) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i*)(column + 32 * p));
        const __m256i lo = _mm256_and_si256(bytes, mask), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask);
        const __m256 ws = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair_scales(js, p, 32)), lanes);
        const __m256i sum = pair_dot(lo, hi, _mm256_loadu_si256((const __m256i*)(xq + 64 * p)),
                                     _mm256_loadu_si256((const __m256i*)(xq + 64 * p + 32)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(ws, _mm256_loadu_ps(xd8 + 8 * p)), acc);
    }
    const float offset = mins ? add_min_terms(&acc, mins + j * groups, xsum, groups) : 0.0f;
    y[j] = hsum256(acc) + offset + (bias ? bias[j] : 0.0f);
}

/* xd_quads [k / 256][8]: each quad's eight block scales of x (xd8's lane 0 and lane 4 of
 * each pair) in the order its horizontal adds leave the blocks. */
static void quad_scales(float* xd_quads, const float* xd8, int64_t k) {
    static const int added[8] = {0, 2, 4, 6, 1, 3, 5, 7};
    for (int64_t q = 0; q < k / 256; q++)
        for (int lane = 0; lane < 8; lane++) {
            const int64_t block = 8 * q + added[lane];
            xd_quads[8 * q + lane] = xd8[(block / 2) * 8 + (block % 2) * 4];
        }
}

void gemm_group_q8_256(float* y, const float* x, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                       const float* bias, int64_t m, int64_t n, int64_t k, int32_t group, int32_t bits,
                       int32_t num_threads) {
    int8_t* xq = (int8_t*)malloc((size_t)(m * k));
    float* xd8 = (float*)malloc(sizeof(float) * (size_t)(m * (k / 64) * 8));
    float* xsum = mins ? (float*)malloc(sizeof(float) * (size_t)(m * (k / group))) : NULL;
    quantize_pairs(xq, xd8, x, m, k, 4, 8);
    if (mins) group_sums(xsum, x, m, k, group);
    if (m == 1 && group == 32) {
        float* xd_quads = (float*)malloc(sizeof(float) * (size_t)((k / 256) * 8 + 1));
        quad_scales(xd_quads, xd8, k);
        FOR_EACH_UNIT((n + Q_PANEL - 1) / Q_PANEL, p, {
            const int64_t end = (p + 1) * Q_PANEL < n ? (p + 1) * Q_PANEL : n;
            for (int64_t j = p * Q_PANEL; j < end; j++)
                column_one_row_quads(y, xq, xd8, xd_quads, xsum, qs, scales, mins, bias, j, k);
        });
        free(xd_quads);
    } else {
        FOR_EACH_TILE(column_tile_pair, xq, xd8, xsum);
    }
    free(xq);
    free(xd8);
    free(xsum);
}

#ifdef Q8_WIDE
/* With AVX-512, a column's pair of blocks (quantize_pairs) goes in one 64-byte vector,
 * which halves the instructions per weight; the lanes take their block's scales from a
 * 16-float pattern. */

/* The weight scales of pair p of column js's blocks, spread over the lanes. */
static inline __m512 wide_scales(const uint16_t* js, int64_t p, int bits, int group) {
    if (group % 64 == 0) return _mm512_set1_ps(_cvtsh_ss(js[(64 * p) / group]));
    if (group == 16) { /* 8-bit weights only: four scales, one per 16 weights = 4 lanes */
        const __m512 four = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(js + 4 * p))));
        return _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), four);
    }
    const __m128 two = pair_scales(js, p, group);
    const __m512i idx = bits == 4 ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                  : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two));
}

/* xq: [m][k] in pair_order; xd16: [m][k / 64][16] x's block scales spread as the lanes
 * take them; xsum: [m][groups rounded up to 16], zero-padded. */
static inline __attribute__((always_inline)) void column_tile_wide(
    float* y, const int8_t* xq, const float* xd16, const float* xsum, const uint8_t* qs, const uint16_t* scales,
    const uint16_t* mins, const float* bias, int64_t r0, int rows, int64_t j, int64_t n, int64_t k, int group,
    int bits) {
    const int64_t groups = k / group, pairs = k / 64, padded = (groups + 15) / 16 * 16;
    const uint16_t* js = scales + j * groups;
    __m512 acc[Q_TILE_ROWS];
    for (int r = 0; r < Q_TILE_ROWS; r++) acc[r] = _mm512_setzero_ps();
    const __m256i mask4 = _mm256_set1_epi8(0x0F);
    for (int64_t p = 0; p < pairs; p++) {
        __m512i w;
        __mmask64 negative = 0;
        if (bits == 4) {
            const uint8_t* at = qs + (j * k) / 2 + 32 * p;
            _mm_prefetch((const char*)at + Q_PREFETCH_BYTES, _MM_HINT_T0);
            const __m256i bytes = _mm256_loadu_si256((const __m256i*)at);
            const __m256i lo = _mm256_and_si256(bytes, mask4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), mask4);
            w = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        } else {
            const int8_t* at = (const int8_t*)qs + j * k + 64 * p;
            _mm_prefetch((const char*)at + Q_PREFETCH_BYTES, _MM_HINT_T0);
            const __m512i signed_w = _mm512_loadu_si512(at);
            negative = _mm512_movepi8_mask(signed_w);
            w = _mm512_abs_epi8(signed_w);
        }
        const __m512 ws = wide_scales(js, p, bits, group);
        for (int r = 0; r < rows; r++) {
            __m512i xv = _mm512_loadu_si512(xq + (r0 + r) * k + 64 * p);
            if (bits != 4) xv = _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv);
            const __m512 sum = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, xv));
            const __m512 scale = _mm512_mul_ps(ws, _mm512_loadu_ps(xd16 + ((r0 + r) * pairs + p) * 16));
            acc[r] = _mm512_fmadd_ps(sum, scale, acc[r]);
        }
    }
    if (mins) {
        const uint16_t* jm = mins + j * groups;
        for (int64_t g = 0; g < groups; g += 16) {
            const __mmask16 valid = groups - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
            const __m512 m16 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, jm + g));
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_fmadd_ps(m16, _mm512_loadu_ps(xsum + (r0 + r) * padded + g), acc[r]);
        }
    }
    const float b = bias ? bias[j] : 0.0f;
    for (int r = 0; r < rows; r++) y[(r0 + r) * n + j] = _mm512_reduce_add_ps(acc[r]) + b;
}

static void gemm_group_wide(float* y, const float* x, const uint8_t* qs, const uint16_t* scales,
                            const uint16_t* mins, const float* bias, int64_t m, int64_t n, int64_t k, int32_t group,
                            int32_t bits, int32_t num_threads) {
    const int64_t groups = k / group, pairs = k / 64, padded = (groups + 15) / 16 * 16;
    int8_t* xq = (int8_t*)malloc((size_t)(m * k));
    float* xd16 = (float*)malloc(sizeof(float) * (size_t)(m * pairs * 16));
    float* xsum = (float*)calloc((size_t)(m * padded), sizeof(float));
    quantize_pairs(xq, xd16, x, m, k, bits, 16);
    if (mins)
        for (int64_t r = 0; r < m; r++) group_sums(xsum + r * padded, x + r * k, 1, k, group);
    FOR_EACH_TILE(column_tile_wide, xq, xd16, xsum);
    free(xq);
    free(xd16);
    free(xsum);
}
#endif

void gemm_group_q8(float* y, const float* x, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                   const float* bias, int64_t m, int64_t n, int64_t k, int32_t group, int32_t bits,
                   int32_t num_threads) {
#ifdef Q8_WIDE
    if (k % 64 == 0) {
        gemm_group_wide(y, x, qs, scales, mins, bias, m, n, k, group, bits, num_threads);
        return;
    }
#else
    if (bits == 4 && k % 64 == 0) {
        gemm_group_q8_256(y, x, qs, scales, mins, bias, m, n, k, group, bits, num_threads);
        return;
    }
#endif
    const int64_t groups = k / group;
    int8_t* xq = (int8_t*)malloc((size_t)(m * k));
    float* xd = (float*)malloc(sizeof(float) * (size_t)(m * (k / 32)));
    float* xsum = mins ? (float*)malloc(sizeof(float) * (size_t)(m * groups)) : NULL;
    quantize_blocks(xq, xd, x, m, k);
    if (mins) group_sums(xsum, x, m, k, group);
    if (m == 1)
        one_row_q8(y, xq, xd, xsum, qs, scales, mins, bias, n, k, group, bits, num_threads);
    else
        FOR_EACH_TILE(column_tile_q8, xq, xd, xsum);
    free(xq);
    free(xd);
    free(xsum);
}

/* 8 floats -> 8 bf16, rounded to nearest even as a bf16 tensor op rounds. */
static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

void dequantize_group(void* out, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                      const int64_t* rows, int64_t n, int64_t k, int32_t group, int32_t bits, int32_t is_bf16,
                      int32_t num_threads) {
    const int64_t groups = k / group;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; r++) {
        const int64_t j = rows ? rows[r] : r;
        for (int64_t at = 0; at < k; at += 32) {
            /* (a 16-group's halves take their own scales) */
            __m256 q[4], s[4], m[4];
            if (bits == 4) {
                unpack4(qs + (j * k + at) / 2, q);
            } else {
                for (int c = 0; c < 4; c++) q[c] = unpack8((const int8_t*)qs + j * k + at + 8 * c);
            }
            for (int c = 0; c < 4; c++) {
                const int64_t g = j * groups + (at + 8 * c) / group;
                s[c] = _mm256_set1_ps(half_to_float(scales[g]));
                m[c] = _mm256_set1_ps(mins ? half_to_float(mins[g]) : 0.0f);
                const __m256 w = _mm256_fmadd_ps(q[c], s[c], m[c]); /* q * s is exact: one rounding */
                if (is_bf16)
                    _mm_storeu_si128((__m128i*)((bf16*)out + r * k + at + 8 * c), bf16x8(w));
                else
                    _mm256_storeu_ps((float*)out + r * k + at + 8 * c, w);
            }
        }
    }
}

#else

int group_gemm_available(void) { return 0; }
int group_q8_is_wide(void) { return 0; }

void gemm_group(float* y, const float* x, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                const float* bias, int64_t m, int64_t n, int64_t k, int32_t group, int32_t bits,
                int32_t num_threads) {
    (void)y, (void)x, (void)qs, (void)scales, (void)mins, (void)bias, (void)m, (void)n, (void)k, (void)group,
        (void)bits, (void)num_threads;
    abort(); /* group_gemm_available() is 0: Python never calls it */
}

void gemm_group_q8(float* y, const float* x, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                   const float* bias, int64_t m, int64_t n, int64_t k, int32_t group, int32_t bits,
                   int32_t num_threads) {
    gemm_group(y, x, qs, scales, mins, bias, m, n, k, group, bits, num_threads);
}

void gemm_group_q8_256(float* y, const float* x, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                       const float* bias, int64_t m, int64_t n, int64_t k, int32_t group, int32_t bits,
                       int32_t num_threads) {
    gemm_group(y, x, qs, scales, mins, bias, m, n, k, group, bits, num_threads);
}

void dequantize_group(void* out, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                      const int64_t* rows, int64_t n, int64_t k, int32_t group, int32_t bits, int32_t is_bf16,
                      int32_t num_threads) {
    (void)out, (void)qs, (void)scales, (void)mins, (void)rows, (void)n, (void)k, (void)group, (void)bits,
        (void)is_bf16, (void)num_threads;
    abort();
}

#endif

void group_linear(void* y, const void* x, const GroupWeight* w, const void* bias, int64_t m, int64_t n, int64_t k,
                  int gated, int is_bf16, int kernel, int num_threads) {
    const int64_t width = gated ? 2 * n : n;
    float* xf = is_bf16 ? (float*)malloc(sizeof(float) * (size_t)(m * k)) : (float*)x;
    float* yf = is_bf16 || gated ? (float*)malloc(sizeof(float) * (size_t)(m * width)) : (float*)y;
    float* bf = bias && is_bf16 ? (float*)malloc(sizeof(float) * (size_t)width) : (float*)bias;
    if (is_bf16) {
        for (int64_t r = 0; r < m; r++) load_row(xf + r * k, x, r * k, (int)k, 1);
        if (bias) load_row(bf, bias, 0, (int)width, 1);
    }
    (kernel == 2 ? gemm_group_q8_256 : kernel == 1 ? gemm_group_q8 : gemm_group)(
        yf, xf, w->qs, w->scales, w->mins, bf, m, width, k, w->group, w->bits, num_threads);
    if (gated) {
        /* As the Python loop: the projections rounded to the model's dtype, then silu * up. */
        if (is_bf16)  /* in place: each bf16 lands behind the floats still to be read */
            for (int64_t i = 0; i < m * width; i++) ((bf16*)yf)[i] = float_to_bf16(yf[i]);
        silu_mul(y, yf, m, (int)n, is_bf16, num_threads);
    } else if (is_bf16) {
        for (int64_t r = 0; r < m; r++) store_row(y, r * n, yf + r * n, (int)n, 1);
    }
    if (is_bf16) free(xf);
    if (yf != (float*)y) free(yf);
    if (bf != (const float*)bias) free(bf);
}

/* What kernel_choice.py times: a projection as decoder.c's step calls it, once a layer with
 * that layer's weight and no call from Python in between. A one-row call from Python
 * carries tens of microseconds of argument handling and tensor conversion, the same for
 * every kernel, which would shrink the kernels' ratio under the chooser's margin. */
void group_linear_each(void* y, const void* x, const GroupWeight* weights, int64_t count, const void* bias, int64_t m,
                       int64_t n, int64_t k, int gated, int is_bf16, int kernel, int num_threads) {
    for (int64_t i = 0; i < count; i++)
        group_linear(y, x, &weights[i], bias, m, n, k, gated, is_bf16, kernel, num_threads);
}
