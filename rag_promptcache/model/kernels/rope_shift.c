/* Relocation of one prompt module's bf16 keys: every key turned by the same RoPE angle (its shift),
 * written straight into the engine's reserved cache, for x86 CPUs with AVX512-BF16.
 *
 * The same arithmetic as model/positions.py's RopeRelocator.rotate in the rotate_half layout, in fp32
 * with one rounding to bf16 at the end: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin for the pairs
 * (i, i + half), dims from 2 * half on copied (partial rotary). One read and one write of each key,
 * where the torch path makes an fp32 copy, four fp32 passes and two more copies.
 *
 * Layout: src, dst [layers, heads, rows, dim] with contiguous rows and the given layer and head
 * strides (elements); cos, sin [layers, half] fp32, each layer's row of its rotary base.
 *
 * Out of scope: the interleaved (GPT-J) layout, fp32 and fp16 keys, per-token shifts.
 */
#include <string.h>

#include "simd.h"

/* Returns 0, or -1 for arguments out of scope (nothing written). */
int rope_shift_bf16(const bf16 *src, bf16 *dst, int64_t layers, int64_t heads, int64_t rows, int64_t dim,
                    int64_t half, int64_t src_layer, int64_t src_head, int64_t dst_layer, int64_t dst_head,
                    const float *cos, const float *sin, int threads) {
    if (layers <= 0 || heads <= 0 || rows < 0 || half <= 0 || 2 * half > dim) return -1;
#pragma omp parallel for schedule(static) num_threads(threads < 1 ? 1 : threads)
    for (int64_t lh = 0; lh < layers * heads; lh++) {
        const int64_t l = lh / heads, h = lh % heads;
        const float *c = cos + l * half, *s = sin + l * half;
        for (int64_t r = 0; r < rows; r++) {
            const bf16 *x = src + l * src_layer + h * src_head + r * dim;
            bf16 *y = dst + l * dst_layer + h * dst_head + r * dim;
            for (int64_t i = 0; i < half; i += 16) {
                const __mmask16 m = half - i < 16 ? (__mmask16)((1u << (half - i)) - 1) : 0xFFFF;
                const __m512 x1 = load16(x + i, m), x2 = load16(x + half + i, m);
                const __m512 cv = _mm512_maskz_loadu_ps(m, c + i), sv = _mm512_maskz_loadu_ps(m, s + i);
                store16(y + i, _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv)), m);
                store16(y + half + i, _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv)), m);
            }
            if (2 * half < dim) memcpy(y + 2 * half, x + 2 * half, (size_t)(dim - 2 * half) * sizeof(bf16));
        }
    }
    return 0;
}
