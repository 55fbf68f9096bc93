/* What the kernels share: bf16 loads and stores in fp32 vectors, masks for a row's tail, e^x.
 * Header-only (static inline): each kernel file includes it; `native.py` hashes it with the sources. */
#ifndef RAG_PROMPTCACHE_SIMD_H
#define RAG_PROMPTCACHE_SIMD_H

#include <immintrin.h>
#include <stdint.h>

typedef uint16_t bf16;

static inline __mmask32 mask32(int64_t left) { return left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << left) - 1); }
static inline __mmask16 mask16(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

/* up to 16 bf16 values (lanes in `m`) → fp32, exactly */
static inline __m512 load16(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* fp32 → bf16, rounded to nearest even, into the lanes in `m` */
static inline void store16(bf16 *p, __m512 x, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x)); }

/* each lane rounded to bf16, kept as fp32 */
static inline __m512 round16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* e^x in fp32 (~2 ulp); 0 below -87 (where e^x is subnormal, or a masked score), clamped above 88 */
static inline __m512 exp16(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504089f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

#endif
