/* Scalar helpers shared by kernels.c and attention.c: bf16 conversions with the rounding
 * a bf16 tensor op does, row loads and stores, a vectorizable exp, and the rotary
 * embedding as transformers computes it. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvserve_abi.h" /* bf16 */

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
 * lie: widening them into scratch rows first and reading them back costs a pass over
 * memory per row. */
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
