/* bf16 GEMM for the linears of a decoder on CPUs with AVX512-BF16: y = x W^T (+ b).
 *
 * Why not oneDNN: a decode step multiplies a few to a few dozen rows by every weight of
 * the model once, and oneDNN's kernels are tuned for larger batches: at a few rows they
 * read the weights well below the speed memory streams them, and at tens of rows their
 * dot products stay short of the vdpbf16ps peak. This kernel streams each weight panel
 * once, in the order it is stored, and keeps 24 accumulators in registers, so the
 * weights come in at close to memory speed for few rows and the dot products run near
 * peak for many.
 *
 * Weights are packed once (pack_bf16_weight) into panels of 32 output rows:
 * [panel][k / 2][32][2], the pairs vdpbf16ps takes, so a k-pair of a panel is two 64-byte
 * vectors and a panel is one sequential stream. Rows of x are consumed in tiles of up to
 * 12; a tile's k-pair is broadcast and multiplied with both vectors of the panel.
 *
 * Accumulation is fp32 in k order, and the result is rounded to bf16 once (after the
 * bias), as oneDNN does: on the model's shapes the two agree bit for bit on almost every
 * element. K must be even (every model's hidden sizes are); the caller checks. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "kvserve_abi.h"
#include "pair_panels.h"

#define PANEL 32    /* output rows per panel: two 16-lane vectors */
#define TILE_ROWS 12 /* rows of x per tile: 12 x 2 accumulators, 2 weight vectors */
#define ROW_CHUNK 384 /* rows of x per pass over the weights when there are many */

int64_t packed_bf16_weight_elements(int64_t n, int64_t k) { return pair_panels_elements(n, k, PANEL); }

/* w [n, k] row-major -> [panel][k / 2][PANEL][2] (pair_panels.h). */
void pack_bf16_weight(bf16* dst, const bf16* w, int64_t n, int64_t k) {
    pack_pair_panels(dst, w, n, k, PANEL, sizeof(bf16));
}

#if defined(__AVX512BF16__)
#include "avx512_bf16.h"

int bf16_gemm_available(void) { return 1; }

static inline __mmask16 first_lanes(int64_t count) {
    return count >= 16 ? 0xffff : (__mmask16)((1u << count) - 1);
}

/* One panel times `rows` (<= TILE_ROWS) rows of x. Plain: y[r, 32 p + c] for the panel's
 * 32 outputs. Gated: the panel holds 16 gate and 16 up rows (ops.interleave_gate_up's
 * order), and y[r, 16 p + c]
 * = silu(gate) * up, rounded where transformers' bf16 MLP rounds: gate and up, silu(gate),
 * the product. */
static inline __attribute__((always_inline)) void tile(bf16* y, int64_t ldy, const bf16* x, int64_t ldx,
                                                       const bf16* panel, const bf16* bias, int64_t p,
                                                       int64_t n, int64_t pairs, int rows, int gated) {
    __m512 acc[TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 2 /* two k-pairs per iteration: half the loop overhead, which shows at many rows */
    for (int64_t i = 0; i < pairs; i++) {
        const bf16* w = panel + i * PANEL * 2;
        _mm_prefetch((const char*)(w + 1024), _MM_HINT_T0); /* 2 KiB ahead in the stream */
        _mm_prefetch((const char*)(w + 1056), _MM_HINT_T0);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
        for (int r = 0; r < rows; r++) {
            const __m512bh xp = (__m512bh)_mm512_set1_epi32(*(const int32_t*)(x + r * ldx + 2 * i));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xp);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xp);
        }
    }
    if (gated) {
        const int64_t col = p * 16;
        const __mmask16 mask = first_lanes(n - col);
        const __m512 gate_bias = bias ? bf16_load(bias + 2 * col, 0xffff) : _mm512_setzero_ps();
        const __m512 up_bias = bias ? bf16_load(bias + 2 * col + 16, 0xffff) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 gate = bf16_round(_mm512_add_ps(acc[r][0], gate_bias));
            const __m512 up = bf16_round(_mm512_add_ps(acc[r][1], up_bias));
            const __m512 sig = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate)));
            bf16_store(y + r * ldy + col, mask, _mm512_mul_ps(bf16_round(_mm512_div_ps(gate, sig)), up));
        }
        return;
    }
    for (int v = 0; v < 2; v++) {
        const int64_t col = p * PANEL + 16 * v;
        if (col >= n) break;
        const __mmask16 mask = first_lanes(n - col);
        const __m512 b = bias ? bf16_load(bias + col, mask) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) bf16_store(y + r * ldy + col, mask, _mm512_add_ps(acc[r][v], b));
    }
}

/* One instance per tile height and epilogue, so every loop over rows unrolls into registers. */
#define TILE_CASE(h) \
    case h: tile(y, n, x, k, panel, bias, p, n, pairs, h, gated); break;

static inline __attribute__((always_inline)) void tile_rows_as(bf16* y, const bf16* x, const bf16* panel,
                                                               const bf16* bias, int64_t p, int64_t n, int64_t k,
                                                               int64_t pairs, int rows, int gated) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11)
        default: tile(y, n, x, k, panel, bias, p, n, pairs, TILE_ROWS, gated);
    }
}

static void tile_rows(bf16* y, const bf16* x, const bf16* panel, const bf16* bias, int64_t p, int64_t n,
                      int64_t k, int64_t pairs, int rows, int gated) {
    if (gated)
        tile_rows_as(y, x, panel, bias, p, n, k, pairs, rows, 1);
    else
        tile_rows_as(y, x, panel, bias, p, n, k, pairs, rows, 0);
}

/* y [m, n] = x [m, k] W^T + bias, all contiguous; W packed by pack_bf16_weight; bias
 * [n] bf16 or NULL. Gated (gate_up weights packed by SiluMLP, 16 gate rows then the 16
 * matching up rows per panel, bias alike): y [m, n] = silu(x Wg^T + bg) * (x Wu^T + bu).
 * Each thread owns a share of the panels and streams only those; many rows go in chunks
 * of equal size, so a thread's panels stay in its cache between tiles. */
void gemm_bf16(bf16* y, const bf16* x, const bf16* packed, const bf16* bias, int64_t m, int64_t n, int64_t k,
               int gated, int num_threads) {
    if (m <= 0) return;
    const int64_t pairs = k / 2, panels = (n + (gated ? 16 : PANEL) - 1) / (gated ? 16 : PANEL);
    const int64_t chunks = (m + ROW_CHUNK - 1) / ROW_CHUNK;
    const int64_t chunk_rows = ((m + chunks - 1) / chunks + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
#pragma omp parallel num_threads(num_threads)
    for (int64_t chunk = 0; chunk < chunks; chunk++) {
        const int64_t end = (chunk + 1) * chunk_rows < m ? (chunk + 1) * chunk_rows : m;
#pragma omp for schedule(static) nowait
        for (int64_t p = 0; p < panels; p++) {
            const bf16* panel = packed + p * pairs * PANEL * 2;
            for (int64_t r = chunk * chunk_rows; r < end; r += TILE_ROWS) {
                const int rows = end - r < TILE_ROWS ? (int)(end - r) : TILE_ROWS;
                tile_rows(y + r * n, x + r * k, panel, bias, p, n, k, pairs, rows, gated);
            }
        }
    }
}
#else
int bf16_gemm_available(void) { return 0; }

void gemm_bf16(bf16* y, const bf16* x, const bf16* packed, const bf16* bias, int64_t m, int64_t n, int64_t k,
               int gated, int num_threads) {
    (void)y, (void)x, (void)packed, (void)bias, (void)m, (void)n, (void)k, (void)gated, (void)num_threads;
}
#endif

/* fp32 GEMM on CPUs with AVX2 and FMA, for few rows: the same idea as the bf16 kernel
 * (each weight panel streamed once, in the order it is stored, with the rows' sums in
 * registers), for fp32 models on CPUs without AVX512-BF16. oneDNN's fp32 kernels read
 * the weights of a decode step well below memory speed at 1 to 8 rows. Weights are packed
 * (pack_f32_weight) into panels of 16 output rows, [panel][k][16]: a column of a panel is
 * two 8-lane vectors. Rows of x go in tiles of up to 6: 12 accumulators, 2 weight vectors
 * and a broadcast fill the 16 AVX2 registers. Sums run in k order, in fp32. A gated MLP
 * projection's panels hold 8 gate rows and their 8 up rows (ops.interleave_gate_up), so
 * silu(gate) * up is applied to a tile's sums in registers: the gate and up outputs,
 * twice the width of the result, are never written out and read back. */
#define F32_PANEL 16
#define F32_TILE_ROWS 6

int64_t packed_f32_weight_elements(int64_t n, int64_t k) { return (n + F32_PANEL - 1) / F32_PANEL * F32_PANEL * k; }

/* w [n, k] row-major -> [panel][k][F32_PANEL], zero-padded to whole panels. */
void pack_f32_weight(float* dst, const float* w, int64_t n, int64_t k) {
    const int64_t panels = (n + F32_PANEL - 1) / F32_PANEL;
    for (int64_t panel = 0; panel < panels; panel++)
        for (int64_t c = 0; c < k; c++)
            for (int64_t i = 0; i < F32_PANEL; i++) {
                const int64_t row = panel * F32_PANEL + i;
                dst[(panel * k + c) * F32_PANEL + i] = row < n ? w[row * k + c] : 0.0f;
            }
}

#if defined(__AVX2__) && defined(__FMA__)
#include "avx2_exp.h"

int f32_gemm_available(void) { return 1; }

/* One panel times a tile of `rows` rows of x, read from xt [k][rows] (the tile's rows
 * interleaved, so one pointer walks them). The sums are named variables, not an array:
 * GCC kept an array of them in registers and also stored it to the stack on every k,
 * which made the stores the bottleneck. */
static inline __attribute__((always_inline)) void f32_tile(float* y, const float* xt, const float* panel,
                                                           const float* bias, int64_t p, int64_t n, int64_t k,
                                                           int rows, int gated) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 a00 = zero, a01 = zero, a10 = zero, a11 = zero, a20 = zero, a21 = zero;
    __m256 a30 = zero, a31 = zero, a40 = zero, a41 = zero, a50 = zero, a51 = zero;
#define F32_ROW(r)                                                \
    if (rows > r) {                                               \
        const __m256 xb = _mm256_broadcast_ss(x + r);             \
        a##r##0 = _mm256_fmadd_ps(w0, xb, a##r##0);               \
        a##r##1 = _mm256_fmadd_ps(w1, xb, a##r##1);               \
    }
#pragma GCC unroll 4
    for (int64_t c = 0; c < k; c++) {
        const float* w = panel + c * F32_PANEL;
        const float* x = xt + c * rows;
        _mm_prefetch((const char*)(w + 512), _MM_HINT_T0); /* 2 KiB ahead in the stream */
        const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
        F32_ROW(0) F32_ROW(1) F32_ROW(2) F32_ROW(3) F32_ROW(4) F32_ROW(5)
    }
#undef F32_ROW
    const __m256 sums[F32_TILE_ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
    const int64_t col = p * F32_PANEL;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    if (gated) { /* lanes 0-7 are gates and 8-15 ups of outputs 8 p to 8 p + 7, bias alike */
        const int64_t out_col = p * F32_PANEL / 2;
        const __m256 gate_bias = bias ? _mm256_loadu_ps(bias + col) : zero;
        const __m256 up_bias = bias ? _mm256_loadu_ps(bias + col + 8) : zero;
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - out_col)), lanes);
        for (int r = 0; r < rows; r++) {
            const __m256 gate = _mm256_add_ps(sums[r][0], gate_bias), up = _mm256_add_ps(sums[r][1], up_bias);
            const __m256 sig = _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(zero, gate)));
            _mm256_maskstore_ps(y + r * n + out_col, mask, _mm256_mul_ps(_mm256_div_ps(gate, sig), up));
        }
        return;
    }
    /* The last panel's outputs past n are padding: masked out (a masked lane never faults). */
    const __m256i mask0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - col)), lanes);
    const __m256i mask1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - col - 8)), lanes);
    const __m256 b0 = bias ? _mm256_maskload_ps(bias + col, mask0) : zero;
    const __m256 b1 = bias ? _mm256_maskload_ps(bias + col + 8, mask1) : zero;
    for (int r = 0; r < rows; r++) {
        _mm256_maskstore_ps(y + r * n + col, mask0, _mm256_add_ps(sums[r][0], b0));
        _mm256_maskstore_ps(y + r * n + col + 8, mask1, _mm256_add_ps(sums[r][1], b1));
    }
}

/* One instance per tile height and epilogue, so every loop over rows unrolls into registers. */
#define F32_TILE_CASE(h) \
    case h: f32_tile(y, xt, panel, bias, p, n, k, h, gated); break;

static inline __attribute__((always_inline)) void f32_tile_as(float* y, const float* xt, const float* panel,
                                                              const float* bias, int64_t p, int64_t n, int64_t k,
                                                              int rows, int gated) {
    switch (rows) {
        F32_TILE_CASE(1) F32_TILE_CASE(2) F32_TILE_CASE(3) F32_TILE_CASE(4) F32_TILE_CASE(5)
        default: f32_tile(y, xt, panel, bias, p, n, k, F32_TILE_ROWS, gated);
    }
}

static void f32_tile_rows(float* y, const float* xt, const float* panel, const float* bias, int64_t p, int64_t n,
                          int64_t k, int rows, int gated) {
    if (gated)
        f32_tile_as(y, xt, panel, bias, p, n, k, rows, 1);
    else
        f32_tile_as(y, xt, panel, bias, p, n, k, rows, 0);
}

#define F32_BLOCK_BYTES (384 << 10) /* of x per row block: stays in L2, with a panel, while the panels pass */

/* Tile t's first row and height when m rows go in tiles of q rows, the first rem of them
 * one taller (q = m / tiles, rem = m % tiles). */
static inline int64_t f32_tile_start(int64_t t, int64_t q, int64_t rem) { return t * q + (t < rem ? t : rem); }
static inline int64_t f32_tile_height(int64_t t, int64_t q, int64_t rem) { return q + (t < rem); }

/* xt [k][height] = the tile's rows x [height, k] interleaved; height is a constant in
 * each instance, so the loop over a column's rows unrolls, which it does not for a
 * height known only at run time. */
static inline __attribute__((always_inline)) void f32_interleave_as(float* xt, const float* x, int64_t k,
                                                                    int height) {
    for (int64_t c = 0; c < k; c++)
        for (int i = 0; i < height; i++) xt[c * height + i] = x[i * k + c];
}

static void f32_interleave(float* xt, const float* x, int64_t k, int height) {
    switch (height) {
        case 1: memcpy(xt, x, sizeof(float) * (size_t)k); break;
        case 2: f32_interleave_as(xt, x, k, 2); break;
        case 3: f32_interleave_as(xt, x, k, 3); break;
        case 4: f32_interleave_as(xt, x, k, 4); break;
        case 5: f32_interleave_as(xt, x, k, 5); break;
        default: f32_interleave_as(xt, x, k, F32_TILE_ROWS);
    }
}

/* y [m, n] = x [m, k] W^T + bias, all contiguous fp32; W packed by pack_f32_weight; bias
 * [n] or NULL. Gated (gate and up rows interleaved by 8, bias alike): y [m, n] =
 * silu(x Wg^T + bg) * (x Wu^T + bu), by the expression of kernels.c's silu_mul. The rows
 * go in tiles of as equal heights as up to 6 allow (8 rows as 4 + 4, not 6 + 2: a short
 * tile is bound by the FMA latency, not the throughput): tile t has
 * q + 1 rows if t < rem, else q. Each tile is copied once into xt [k][height], the tiles
 * shared out between the threads. Then the tiles go in row blocks of about
 * F32_BLOCK_BYTES of x, and within a block the threads stream the panels past the
 * block's tiles: the block stays in each thread's L2 while a panel passes over all its
 * tiles, where one pass of every panel over all the rows would read x from L3 once per
 * panel. The threads take panels as they come free, not a fixed share each: where the
 * serving processes take a core for a moment (a replica that runs on every core), the
 * thread there does fewer panels and the others more, instead of every thread waiting
 * for it at the end. A panel is one contiguous stream of weights, and dealing them out
 * in turn measured no slower offline. */
void gemm_f32(float* y, const float* x, const float* packed, const float* bias, int64_t m, int64_t n, int64_t k,
              int gated, int num_threads) {
    if (m <= 0) return;
    const int64_t panel_outputs = gated ? F32_PANEL / 2 : F32_PANEL;
    const int64_t panels = (n + panel_outputs - 1) / panel_outputs, tiles = (m + F32_TILE_ROWS - 1) / F32_TILE_ROWS;
    const int64_t q = m / tiles, rem = m % tiles;
    int64_t block_tiles = F32_BLOCK_BYTES / ((int64_t)sizeof(float) * F32_TILE_ROWS * k);
    if (block_tiles < 1) block_tiles = 1;
    float* xt = (float*)malloc(sizeof(float) * (size_t)(m * k));
    if (!xt) return;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t r = f32_tile_start(t, q, rem);
            f32_interleave(xt + r * k, x + r * k, k, (int)f32_tile_height(t, q, rem));
        }
        for (int64_t first = 0; first < tiles; first += block_tiles) {
            const int64_t last = first + block_tiles < tiles ? first + block_tiles : tiles;
            /* nowait: blocks write disjoint rows of y, so a thread goes on to the next one */
#pragma omp for schedule(dynamic) nowait
            for (int64_t p = 0; p < panels; p++) {
                const float* panel = packed + p * k * F32_PANEL;
                for (int64_t t = first; t < last; t++) {
                    const int64_t r = f32_tile_start(t, q, rem);
                    f32_tile_rows(y + r * n, xt + r * k, panel, bias, p, n, k, (int)f32_tile_height(t, q, rem),
                                  gated);
                }
            }
        }
    }
    free(xt);
}
#else
int f32_gemm_available(void) { return 0; }

void gemm_f32(float* y, const float* x, const float* packed, const float* bias, int64_t m, int64_t n, int64_t k,
              int gated, int num_threads) {
    (void)y, (void)x, (void)packed, (void)bias, (void)m, (void)n, (void)k, (void)gated, (void)num_threads;
}
#endif
