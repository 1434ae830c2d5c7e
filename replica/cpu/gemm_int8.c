/* int8 GEMM for AVX2 CPUs: y = x W^T (+ b) with W quantized once per output row (int8,
 * symmetric, one fp32 scale per row) and x quantized per row at each call (symmetric,
 * dynamic), fp32 in and out.
 *
 * Why: a decode step reads every weight once, and at a few rows the fp32 kernel waits on
 * memory. int8 weights are a quarter of the bytes. CPUs without AVX512-VNNI have no int8
 * dot product, so the products go through vpmaddwd: a panel's int8 weights are widened
 * to int16 as they are loaded, and each instruction multiplies 16 int16 pairs and adds
 * neighbours into 8 int32 sums, twice the multiply-adds of an fp32 FMA.
 *
 * Since vpmaddwd takes int16 activations anyway, a row of x is quantized to the widest
 * range whose sums int32 still holds: |x_q| <= activation_limit(k), with k * 128 * limit
 * < 2^31, and at most 8191 (13 bits): quantized to 8 bits, the activations cost the
 * bundled model several times the perplexity 13 bits do (the figures are in commit
 * 5652b36's message). Up to k = 132,000 the limit is at least 127.
 *
 * Weights are packed (pack_i8_weight) into panels of 16 output rows, [panel][k / 2][16][2]:
 * a k-pair of a panel is two 16-byte halves, each 8 rows' two weights side by side, which
 * vpmovsxbw widens into the pairs vpmaddwd takes. Rows of x go in tiles of up to 6 (12
 * accumulators, 2 weight vectors and a broadcast fill the 16 registers), as gemm.c's fp32
 * kernel does, each tile's quantized rows interleaved [k / 2][rows] as int16 pairs. A
 * gated MLP projection's panels hold 8 gate rows and their 8 up rows (interleave_gate_up
 * with group 8, scales and bias alike). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "kvserve_abi.h"
#include "pair_panels.h"

#define I8_PANEL 16
#define I8_TILE_ROWS 6
#define I8_BLOCK_BYTES (192 << 10) /* of quantized x per row block: stays in L2 while the panels pass */

int64_t packed_i8_weight_bytes(int64_t n, int64_t k) { return pair_panels_elements(n, k, I8_PANEL); }

/* w [n, k] row-major -> [panel][k / 2][I8_PANEL][2] (pair_panels.h). */
void pack_i8_weight(int8_t* dst, const int8_t* w, int64_t n, int64_t k) {
    pack_pair_panels(dst, w, n, k, I8_PANEL, sizeof(int8_t));
}

/* The largest |x_q| of a row of k activations: k products of up to 128 * limit (k + 1,
 * for an odd k's zero pad; 128 for a checkpoint's weights, which may hold -128) fit an
 * int32 sum. */
int32_t activation_limit(int64_t k) {
    int64_t limit = (INT32_MAX / 128) / (k + 1);
    if (limit > 8191) limit = 8191;
    return (int32_t)(limit < 127 ? 127 : limit);
}

/* x [rows, k] -> xt [k / 2][rows] int16 pairs (a zero past an odd k) and scale [rows]:
 * x[r] ~ scale[r] * quantized, symmetric, with the row's largest |x| at the limit. */
static void quantize_rows(int32_t* xt, float* scale, const float* x, int64_t k, int rows) {
    const int64_t pairs = (k + 1) / 2;
    for (int r = 0; r < rows; r++) {
        const float* row = x + r * k;
        float peak = 0.0f;
        for (int64_t c = 0; c < k; c++) peak = fmaxf(peak, fabsf(row[c]));
        const float top = (float)activation_limit(k);
        const float inv = peak > 0.0f ? top / peak : 0.0f;
        scale[r] = peak > 0.0f ? peak / top : 0.0f;
        for (int64_t p = 0; p < pairs; p++) {
            const int32_t lo = (int32_t)lrintf(row[2 * p] * inv);
            const int32_t hi = 2 * p + 1 < k ? (int32_t)lrintf(row[2 * p + 1] * inv) : 0;
            xt[p * rows + r] = (int32_t)(((uint32_t)(uint16_t)(int16_t)hi << 16) | (uint16_t)(int16_t)lo);
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
#include "avx2_exp.h"

int i8_gemm_available(void) { return 1; }

/* silu(g) * u, 8 lanes, by the expression of gemm.c's gated epilogue. */
static inline __m256 silu_mul256(__m256 g, __m256 u) {
    const __m256 sig = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g)));
    return _mm256_mul_ps(_mm256_div_ps(g, sig), u);
}

/* One panel times a tile of `rows` rows, read from xt [k / 2][rows]; xs: the rows'
 * scales. Named sums, not an array, as in gemm.c's fp32 tile. */
static inline __attribute__((always_inline)) void i8_tile(float* y, const int32_t* xt, const float* xs,
                                                          const int8_t* panel, const float* ws, const float* bias,
                                                          int64_t p, int64_t n, int64_t pairs, int rows,
                                                          int gated) {
    const __m256i zero = _mm256_setzero_si256();
    __m256i a00 = zero, a01 = zero, a10 = zero, a11 = zero, a20 = zero, a21 = zero;
    __m256i a30 = zero, a31 = zero, a40 = zero, a41 = zero, a50 = zero, a51 = zero;
#define I8_ROW(r)                                                          \
    if (rows > r) {                                                        \
        const __m256i xb = _mm256_set1_epi32(x[r]);                        \
        a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(w0, xb));    \
        a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(w1, xb));    \
    }
#pragma GCC unroll 4
    for (int64_t c = 0; c < pairs; c++) {
        const int8_t* w = panel + c * 2 * I8_PANEL;
        const int32_t* x = xt + c * rows;
        _mm_prefetch((const char*)(w + 1024), _MM_HINT_T0); /* 1 KiB ahead in the stream */
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 16)));
        I8_ROW(0) I8_ROW(1) I8_ROW(2) I8_ROW(3) I8_ROW(4) I8_ROW(5)
    }
#undef I8_ROW
    const __m256i sums[I8_TILE_ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
    const int64_t col = p * I8_PANEL;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 s0 = _mm256_loadu_ps(ws + col), s1 = _mm256_loadu_ps(ws + col + 8); /* padded to panels */
    if (gated) { /* lanes 0-7 are gates and 8-15 ups of outputs 8 p to 8 p + 7, scales and bias alike */
        const int64_t out_col = col / 2;
        const __m256 gate_bias = bias ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
        const __m256 up_bias = bias ? _mm256_loadu_ps(bias + col + 8) : _mm256_setzero_ps();
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - out_col)), lanes);
        for (int r = 0; r < rows; r++) {
            const __m256 xr = _mm256_set1_ps(xs[r]);
            const __m256 gate = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][0]), _mm256_mul_ps(s0, xr), gate_bias);
            const __m256 up = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][1]), _mm256_mul_ps(s1, xr), up_bias);
            _mm256_maskstore_ps(y + r * n + out_col, mask, silu_mul256(gate, up));
        }
        return;
    }
    const __m256i mask0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - col)), lanes);
    const __m256i mask1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - col - 8)), lanes);
    const __m256 b0 = bias ? _mm256_maskload_ps(bias + col, mask0) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_maskload_ps(bias + col + 8, mask1) : _mm256_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const __m256 xr = _mm256_set1_ps(xs[r]);
        _mm256_maskstore_ps(y + r * n + col, mask0,
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][0]), _mm256_mul_ps(s0, xr), b0));
        _mm256_maskstore_ps(y + r * n + col + 8, mask1,
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][1]), _mm256_mul_ps(s1, xr), b1));
    }
}

#define I8_TILE_CASE(h) \
    case h: i8_tile(y, xt, xs, panel, ws, bias, p, n, pairs, h, gated); break;

/* One instance per tile height and epilogue, so every loop over rows unrolls into registers. */
static inline __attribute__((always_inline)) void i8_tile_as(float* y, const int32_t* xt, const float* xs,
                                                             const int8_t* panel, const float* ws,
                                                             const float* bias, int64_t p, int64_t n,
                                                             int64_t pairs, int rows, int gated) {
    switch (rows) {
        I8_TILE_CASE(1) I8_TILE_CASE(2) I8_TILE_CASE(3) I8_TILE_CASE(4) I8_TILE_CASE(5)
        default: i8_tile(y, xt, xs, panel, ws, bias, p, n, pairs, I8_TILE_ROWS, gated);
    }
}

static void i8_tile_rows(float* y, const int32_t* xt, const float* xs, const int8_t* panel, const float* ws,
                         const float* bias, int64_t p, int64_t n, int64_t pairs, int rows, int gated) {
    if (gated)
        i8_tile_as(y, xt, xs, panel, ws, bias, p, n, pairs, rows, 1);
    else
        i8_tile_as(y, xt, xs, panel, ws, bias, p, n, pairs, rows, 0);
}

/* y [m, n] = dequantized (quantized x [m, k]) W^T + bias, all fp32 but W: packed by
 * pack_i8_weight, with w_scale [n] padded with zeros to whole panels (gated: gate and up
 * rows, scales and bias interleaved by 8, and y = silu(gate) * up). The rows go in tiles
 * as gemm_f32's do; each tile is quantized once, the tiles shared out between threads,
 * then the threads stream the panels past a block of tiles, taking them as they come
 * free (as gemm_f32 does). */
void gemm_i8(float* y, const float* x, const int8_t* packed, const float* w_scale, const float* bias, int64_t m,
             int64_t n, int64_t k, int gated, int num_threads) {
    if (m <= 0) return;
    const int64_t panel_outputs = gated ? I8_PANEL / 2 : I8_PANEL, pairs = (k + 1) / 2;
    const int64_t panels = (n + panel_outputs - 1) / panel_outputs, tiles = (m + I8_TILE_ROWS - 1) / I8_TILE_ROWS;
    const int64_t q = m / tiles, rem = m % tiles;
    int64_t block_tiles = I8_BLOCK_BYTES / ((int64_t)sizeof(int32_t) * I8_TILE_ROWS * pairs);
    if (block_tiles < 1) block_tiles = 1;
    int32_t* xt = (int32_t*)malloc(sizeof(int32_t) * (size_t)(m * pairs) + sizeof(float) * (size_t)m);
    if (!xt) return;
    float* xs = (float*)(xt + m * pairs);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r = t * q + (t < rem ? t : rem);
            quantize_rows(xt + r * pairs, xs + r, x + r * k, k, (int)(q + (t < rem)));
        }
        for (int64_t first = 0; first < tiles; first += block_tiles) {
            const int64_t last = first + block_tiles < tiles ? first + block_tiles : tiles;
#pragma omp for schedule(dynamic) nowait
            for (int64_t p = 0; p < panels; p++) {
                const int8_t* panel = packed + p * pairs * 2 * I8_PANEL;
                for (int64_t t = first; t < last; t++) {
                    const int64_t r = t * q + (t < rem ? t : rem);
                    i8_tile_rows(y + r * n, xt + r * pairs, xs + r, panel, w_scale, bias, p, n, pairs,
                                 (int)(q + (t < rem)), gated);
                }
            }
        }
    }
    free(xt);
}
#else
int i8_gemm_available(void) { return 0; }

void gemm_i8(float* y, const float* x, const int8_t* packed, const float* w_scale, const float* bias, int64_t m,
             int64_t n, int64_t k, int gated, int num_threads) {
    (void)y, (void)x, (void)packed, (void)w_scale, (void)bias, (void)m, (void)n, (void)k, (void)gated,
        (void)num_threads;
    (void)quantize_rows;
}
#endif
