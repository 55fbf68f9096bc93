/* Decoding a quantized store entry (store/codecs.py's int8, int4, k8v4, k6v6, k7v5 and k5v5) into bf16
 * KV, for x86 CPUs with AVX512-BF16: each row's codes unpacked once, then x = q * scale + zero in fp32
 * (a product and a sum, each rounded, as the torch path's two ops) and one rounding to bf16, where the
 * torch path makes an fp32 copy, two more fp32 passes, a cast and, for 5-7-bit codes, a dozen integer
 * passes to unpack them.
 *
 * Layout: codes [outer, tokens, width] uint8, `bits`-bit codes along each row as codecs._pack lays them
 * out (8: a byte each; 4: two a byte, the low nibble first; 5-7: eight codes to `bits` bytes, little-
 * endian); out [outer, tokens, dim] bf16. scale and zero fp32, per channel ([outer, dim], the keys) or
 * per token ([outer, tokens], the values).
 *
 * Out of scope: fp32 and fp16 output, codes wider than 8 bits.
 */
#include <string.h>

#include "simd.h"

#define MAX_DIM 1024

/* the group of eight codes at `p` (`bits` bytes) in a word's low bits: x86 is little-endian, as the layout */
static inline uint64_t group_word(const uint8_t *p, const int bits) {
    uint64_t word = 0;
    memcpy(&word, p, (size_t)bits); /* exactly the group's bytes: for the last row, where nothing follows */
    return word;
}

/* the same, reading eight bytes (one load, where gcc calls memcpy for 5-7): not for the buffer's last row */
static inline uint64_t group_word8(const uint8_t *p) {
    uint64_t word;
    memcpy(&word, p, 8);
    return word;
}

static inline void unpack_row(const uint8_t *row, int64_t dim, int bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, row, (size_t)dim);
    } else if (bits == 4) { /* two a byte: an odd head_dim's last group has fewer than four bytes */
        for (int64_t d = 0; d < dim; d++) out[d] = (row[d >> 1] >> ((d & 1) * 4)) & 15;
    } else {
        for (int64_t d = 0; d < dim; d++) {
            const uint64_t word = group_word(row + (d / 8) * bits, bits);
            out[d] = (uint8_t)((word >> (bits * (d % 8))) & ((1u << bits) - 1));
        }
    }
}

/* codes d .. d + 15 of a row (two groups of eight) as fp32, for bits 4-7 (4: the nibble layout is the
 * same little-endian one, a group of eight codes in four bytes); reads up to 8 - bits bytes past them */
static inline __m512 codes16(const uint8_t *row, int64_t d, const int bits) {
    const __m512i shifts = _mm512_set_epi64(7 * bits, 6 * bits, 5 * bits, 4 * bits, 3 * bits, 2 * bits, bits, 0);
    const __m512i mask = _mm512_set1_epi64((1 << bits) - 1);
    const uint8_t *g = row + (d / 8) * bits;
    const __m512i lo = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64((long long)group_word8(g)), shifts), mask);
    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64((long long)group_word8(g + bits)), shifts), mask);
    const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(lo)), _mm512_cvtepi64_epi32(hi), 1);
    return _mm512_cvtepi32_ps(q);
}

static inline __m512 codes_at(const uint8_t *row, int64_t d, int bits) {
    switch (bits) {
    case 8: return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + d))));
    case 4: return codes16(row, d, 4);
    case 5: return codes16(row, d, 5);
    case 6: return codes16(row, d, 6);
    default: return codes16(row, d, 7);
    }
}

/* Returns 0, or -1 for arguments out of scope (nothing written). */
int dequantize_bf16(const uint8_t *codes, int64_t outer, int64_t tokens, int64_t dim, int64_t width, int bits,
                    const float *scale, const float *zero, int per_token, bf16 *out, int threads) {
    if (outer < 0 || tokens < 0 || dim <= 0 || dim > MAX_DIM || bits < 4 || bits > 8) return -1;
    if (width != (bits == 8 ? dim : bits == 4 ? (dim + 1) / 2 : (dim + 7) / 8 * bits)) return -1;
#pragma omp parallel for schedule(static) num_threads(threads < 1 ? 1 : threads)
    for (int64_t o = 0; o < outer; o++) {
        uint8_t tail[MAX_DIM];
        for (int64_t s = 0; s < tokens; s++) {
            const int64_t r = o * tokens + s;
            const uint8_t *row = codes + r * width;
            bf16 *y = out + r * dim;
            __m512 sv = _mm512_set1_ps(per_token ? scale[r] : 0.0f), zv = _mm512_set1_ps(per_token ? zero[r] : 0.0f);
            int64_t d = 0;
            /* the buffer's last row one code at a time: codes16 reads past a row's last group */
            for (; d + 16 <= dim && r + 1 < outer * tokens; d += 16) {
                if (!per_token) {
                    sv = _mm512_loadu_ps(scale + o * dim + d);
                    zv = _mm512_loadu_ps(zero + o * dim + d);
                }
                store16(y + d, _mm512_add_ps(_mm512_mul_ps(codes_at(row, d, bits), sv), zv), 0xFFFF);
            }
            if (d < dim) /* a head_dim that is not a multiple of 16, or the last row: the rest one code at a time */
                unpack_row(row, dim, bits, tail);
            for (; d < dim; d += 16) {
                const __mmask16 m = mask16(dim - d);
                if (!per_token) {
                    sv = _mm512_maskz_loadu_ps(m, scale + o * dim + d);
                    zv = _mm512_maskz_loadu_ps(m, zero + o * dim + d);
                }
                const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, tail + d)));
                store16(y + d, _mm512_add_ps(_mm512_mul_ps(x, sv), zv), m);
            }
        }
    }
    return 0;
}
