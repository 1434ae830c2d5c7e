/* exp for 8 fp32 lanes in AVX2 intrinsics, shared by gemm.c's and gemm_int8.c's gated
 * epilogues. Include only where __AVX2__ and __FMA__ are defined. */
#pragma once
#include <immintrin.h>

/* scalar.h's exp_clamped, 8 lanes at a time, in intrinsics: the gated epilogue is then
 * vector code whatever GCC makes of a loop over the scalar one inlined into a tile. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f),
                                      _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x));
    __m256 p = _mm256_set1_ps(1.98412698e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.38888889e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.33333333e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.16666667e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.66666667e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}
