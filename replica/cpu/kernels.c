/* kvserve's CPU kernels, built once per machine by replica/cpu/build.py
 * (cc -O3 -march=native -fopenmp) and called through ctypes.
 *
 * Everything works on fp32 or bf16 tensors (is_bf16) and computes in fp32. Where a kernel
 * stands in for a chain of transformers ops, it rounds to the tensor dtype at the same
 * points those ops do, so bf16 results match transformers' eager code and fp32 results
 * differ from it only by summation order.
 *
 * Paged attention is in attention.c (and attention_paired.c); the scalar helpers both
 * use are in scalar.h.
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

#include "kvserve_abi.h"
#include "scalar.h"

static inline float dot(const float* a, const float* b, int n) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
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
