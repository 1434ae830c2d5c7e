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
