/* A few new tokens through a whole Llama-family decoder in bf16, for x86 CPUs with AVX512-BF16.
 *
 * A one-token decode step of a small model is many small matrix-vector products and a long tail of
 * elementwise work. Run as torch ops, each of the ~50 ops per layer costs microseconds of dispatch, and
 * the products reach about 18 GB/s of weights where the memory gives ~28 (SmolLM2-135M: 22.6 ms per
 * step at a 16-token context, 15 of them in the products). Here the whole step is one call and one
 * OpenMP region: every thread keeps its own copy of the residual stream and of what is computed from
 * it alone (the norms, RoPE inputs, the MLP's activation), and the threads split only the products
 * (by output row) and the attention (by KV head and key range), with a barrier after each.
 *
 * What it computes is the lean torch forward's (engine/forward.py) with transformers' roundings:
 *   RMSNorm: fp32 x * rsqrt(mean(x^2) + eps) rounded to bf16, times the weight, rounded
 *   linear:  fp32 sums of bf16 products (vdpbf16ps), rounded to bf16
 *   RoPE:    bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)) with the caller's bf16 cos, sin
 *   attention: fp32 scores, fp32 softmax, probabilities rounded to bf16 for P.V (SDPA's CPU kernel),
 *            the output rounded to bf16; token t sees the cached keys and the new ones up to itself
 *   MLP:     bf16(bf16(silu(gate)) * up); residual adds rounded to bf16
 * Sums run in another order than torch's, so results agree to rounding, not bit for bit.
 *
 * Layout: weights row-major [out, in] with contiguous rows; per layer, the cache's keys and values
 * [kv_heads, capacity, dim] (`kv_head_stride` elements apart), the first `num_cached` rows filled: the
 * new tokens' keys and values are written after them. x [n, hidden] bf16 in (embeddings), the logits
 * of the last `keep` tokens [keep, vocab] fp32 out (the bf16 head's values, as torch's .float()).
 *
 * Out of scope: biases, other norms or activations, sliding windows, masks other than causal over the
 * cache, more than MAX_NEW tokens, odd sizes (the caller runs the torch forward instead).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_NEW 16  /* new tokens per call */
#define MAX_DIM 256 /* head_dim */
#define KEY_BLOCK 64

typedef uint16_t bf16;

enum { IN_NORM, Q, K, V, O, POST_NORM, GATE, UP, DOWN, PER_LAYER };

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, inter, vocab;
    float eps, scale;
} Shape;

static inline float f32(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 to_bf16(float f) { /* round to nearest even, as torch */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline float round_bf16(float f) { return f32(to_bf16(f)); }

static inline __mmask32 mask32(int64_t left) { return left >= 32 ? 0xFFFFFFFFu : (__mmask32)((1ull << left) - 1); }
static inline __mmask16 mask16(int64_t left) { return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1); }

static inline __m512 load16(const bf16 *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

static inline void store16(bf16 *p, __m512 x, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x)); }

static inline __m512 round16(__m512 x) { /* each lane rounded to bf16, kept as fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* e^x in fp32 (~2 ulp); 0 below -87, clamped above 88 */
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

/* 16 vectors → one whose lane i is the sum of a[i]'s lanes (a transposing tree of adds, not 16 reductions) */
static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) d[i] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * i], c[2 * i + 1]), _mm512_unpackhi_ps(c[2 * i], c[2 * i + 1]));
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
    /* the tree leaves row i's sum in lane order 0 4 8 12 1 5 9 13 2 6 10 14 3 7 11 15 */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi)));
}

#define PREFETCH_ROWS 32 /* rows ahead: measured 21-25 GB/s without, 24-31 with, on SmolLM2's shapes */

/* y[0..16) = bf16(W[r] . x) for 16 rows of W [*, in] from w, in a multiple of 32; `ahead`: prefetch */
static inline void rows16(const bf16 *w, int64_t in, const bf16 *x, bf16 *y, int ahead) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < in; c += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + c);
        if (ahead)
            for (int i = 0; i < 16; i++) _mm_prefetch((const char *)(w + (PREFETCH_ROWS + i) * in + c), _MM_HINT_T0);
        for (int i = 0; i < 16; i++) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(w + i * in + c), xv);
    }
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(sum16(a)));
}

/* y[t * y_stride + r] = bf16(W[r] . x[t]) for rows r in [r0, r1) of W [*, in], tokens t < n, x rows `in` apart.
 * Sixteen rows at a time where `in` allows, each block read from memory once for all n tokens. */
static void matvec(const bf16 *w, int64_t in, int64_t r0, int64_t r1, const bf16 *x, int64_t n, bf16 *y,
                   int64_t y_stride) {
    int64_t r = r0;
    if (in % 32 == 0)
        for (; r + 16 <= r1; r += 16)
            for (int64_t t = 0; t < n; t++) rows16(w + r * in, in, x + t * in, y + t * y_stride + r, t == 0 && r + PREFETCH_ROWS + 16 <= r1);
    for (; r < r1; r++) { /* the rest, one row at a time */
        for (int64_t t = 0; t < n; t++) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t c = 0; c < in; c += 32) {
                const __mmask32 m = mask32(in - c);
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(m, w + r * in + c),
                                     (__m512bh)_mm512_maskz_loadu_epi16(m, x + t * in + c));
            }
            y[t * y_stride + r] = to_bf16(_mm512_reduce_add_ps(a));
        }
    }
}

/* The rows [lo, hi) of `total` that thread `id` of `count` takes: contiguous, in blocks of 16. */
static void share(int64_t total, int id, int count, int64_t *lo, int64_t *hi) {
    const int64_t blocks = (total + 15) / 16, per = blocks / count, extra = blocks % count;
    const int64_t b0 = id * per + (id < extra ? id : extra), b1 = b0 + per + (id < extra);
    *lo = b0 * 16 < total ? b0 * 16 : total;
    *hi = b1 * 16 < total ? b1 * 16 : total;
}

/* y[t] = bf16(weight * bf16(x[t] * rsqrt(mean(x[t]^2) + eps))), for each of n tokens */
static void rms_norm(const bf16 *x, const bf16 *weight, int64_t n, int64_t dim, float eps, bf16 *y) {
    for (int64_t t = 0; t < n; t++) {
        const bf16 *xt = x + t * dim;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t c = 0; c < dim; c += 16) {
            const __m512 v = load16(xt + c, mask16(dim - c));
            sq = _mm512_fmadd_ps(v, v, sq);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)dim + eps));
        for (int64_t c = 0; c < dim; c += 16) {
            const __mmask16 m = mask16(dim - c);
            const __m512 h = round16(_mm512_mul_ps(load16(xt + c, m), inv));
            store16(y + t * dim + c, _mm512_mul_ps(h, load16(weight + c, m)), m);
        }
    }
}

/* x[i] = bf16(x[i] + d[i]) */
static void add_into(bf16 *x, const bf16 *d, int64_t count) {
    for (int64_t c = 0; c < count; c += 16) {
        const __mmask16 m = mask16(count - c);
        store16(x + c, _mm512_add_ps(load16(x + c, m), load16(d + c, m)), m);
    }
}

/* one head's vector rotated in place: bf16(bf16(v * cos) + bf16(rotate_half(v) * sin)) */
static void rope(bf16 *v, const bf16 *cos, const bf16 *sin, int64_t dim) {
    const int64_t half = dim / 2;
    float out[MAX_DIM];
    for (int64_t i = 0; i < dim; i++) {
        const float rot = i < half ? -f32(v[i + half]) : f32(v[i - half]);
        out[i] = round_bf16(round_bf16(f32(v[i]) * f32(cos[i])) + round_bf16(round_bf16(rot) * f32(sin[i])));
    }
    for (int64_t i = 0; i < dim; i++) v[i] = to_bf16(out[i]);
}

/* Attention of query rows `q` [group, dim] (one new token, the heads sharing one KV head) over keys
 * [lo, hi): the unnormalised fp32 output o [group, dim], and per row the running max m and sum l. */
static void attend(const bf16 *q, int64_t group, const bf16 *k, const bf16 *v, int64_t dim, int64_t lo, int64_t hi,
                   float scale, float *o, float *m, float *l) {
    const int64_t chunks = (dim + 31) / 32;
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(o, 0, (size_t)(group * dim) * sizeof(float));
    float s[KEY_BLOCK];
    for (int64_t j0 = lo; j0 < hi; j0 += KEY_BLOCK) { /* a block of keys, then every row on it (from L1) */
        const int64_t nk = hi - j0 < KEY_BLOCK ? hi - j0 : KEY_BLOCK;
        for (int64_t g = 0; g < group; g++) {
            const bf16 *qg = q + g * dim;
            float *og = o + g * dim;
            __m512bh qv[MAX_DIM / 32];
            for (int64_t c = 0; c < chunks; c++) qv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask32(dim - 32 * c), qg + 32 * c);
            int64_t j = 0;
            for (; j + 16 <= nk; j += 16) { /* sixteen keys' scores at once */
                __m512 a[16];
                const bf16 *kj = k + (j0 + j) * dim;
                for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; c++) {
                    const __mmask32 mk = mask32(dim - 32 * c);
                    for (int i = 0; i < 16; i++)
                        a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_maskz_loadu_epi16(mk, kj + i * dim + 32 * c), qv[c]);
                }
                _mm512_storeu_ps(s + j, _mm512_mul_ps(sum16(a), _mm512_set1_ps(scale)));
            }
            for (; j < nk; j++) {
                const bf16 *kj = k + (j0 + j) * dim;
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; c++)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(mask32(dim - 32 * c), kj + 32 * c), qv[c]);
                s[j] = _mm512_reduce_add_ps(a) * scale;
            }
            float block_max = -INFINITY;
            for (j = 0; j < nk; j++) block_max = s[j] > block_max ? s[j] : block_max;
            if (block_max > m[g]) {
                const float shrink = m[g] == -INFINITY ? 0.0f : expf(m[g] - block_max);
                l[g] *= shrink;
                for (int64_t c = 0; c < dim; c++) og[c] *= shrink;
                m[g] = block_max;
            }
            const __m512 mg = _mm512_set1_ps(m[g]);
            __m512 sum = _mm512_setzero_ps();
            for (j = 0; j < nk; j += 16) {
                const __mmask16 mk = mask16(nk - j);
                const __m512 p = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), mg)));
                sum = _mm512_add_ps(sum, p);
                _mm512_mask_storeu_ps(s + j, mk, round16(p)); /* P.V with P in bf16 */
            }
            l[g] += _mm512_reduce_add_ps(sum);
            for (int64_t c = 0; c < dim; c += 64) { /* 64 output dims in registers, two chains of keys each */
                __mmask16 mc[4];
                __m512 even[4], odd[4];
                for (int u = 0; u < 4; u++) {
                    mc[u] = c + 16 * u < dim ? mask16(dim - c - 16 * u) : 0;
                    even[u] = _mm512_maskz_loadu_ps(mc[u], og + c + 16 * u);
                    odd[u] = _mm512_setzero_ps();
                }
                for (j = 0; j + 2 <= nk; j += 2) {
                    const __m512 pe = _mm512_set1_ps(s[j]), po = _mm512_set1_ps(s[j + 1]);
                    const bf16 *ve = v + (j0 + j) * dim + c, *vo = ve + dim;
                    for (int u = 0; u < 4; u++) {
                        even[u] = _mm512_fmadd_ps(pe, load16(ve + 16 * u, mc[u]), even[u]);
                        odd[u] = _mm512_fmadd_ps(po, load16(vo + 16 * u, mc[u]), odd[u]);
                    }
                }
                if (j < nk) {
                    const __m512 pe = _mm512_set1_ps(s[j]);
                    for (int u = 0; u < 4; u++)
                        even[u] = _mm512_fmadd_ps(pe, load16(v + (j0 + j) * dim + c + 16 * u, mc[u]), even[u]);
                }
                for (int u = 0; u < 4; u++) _mm512_mask_storeu_ps(og + c + 16 * u, mc[u], _mm512_add_ps(even[u], odd[u]));
            }
        }
    }
}

/* Returns 0, or -1 for arguments out of scope (nothing written). */
int llama_decode_bf16(const int64_t *weights, const bf16 *final_norm, const bf16 *head, const int64_t *k_cache,
                      const int64_t *v_cache, int64_t kv_head_stride, int64_t num_cached, int64_t layers,
                      int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, int64_t vocab,
                      float eps, const bf16 *x_in, int64_t n, const bf16 *cos, const bf16 *sin, int64_t keep,
                      float *logits, int threads) {
    if (n < 1 || n > MAX_NEW || keep < 1 || keep > n || head_dim > MAX_DIM || head_dim % 2 || hidden % 2 ||
        inter % 2 || kv_heads < 1 || heads % kv_heads || num_cached < 0)
        return -1;
    const int64_t group = heads / kv_heads, qd = heads * head_dim, kvd = kv_heads * head_dim;
    const int64_t qkv_rows = qd + 2 * kvd, num_keys = num_cached + n;
    /* the attention's work items: (KV head, token, key split); splits keep every thread busy */
    int64_t splits = (2 * threads + kv_heads * n - 1) / (kv_heads * n);
    if (splits > num_keys / 256) splits = num_keys / 256;
    if (splits < 1) splits = 1;
    const int64_t items = kv_heads * n * splits, part = group * (head_dim + 2);
    /* shared between threads: the products' outputs, the attention's partial results */
    bf16 *qkv = malloc((size_t)(n * qkv_rows) * sizeof(bf16));
    bf16 *attn = malloc((size_t)(n * qd) * sizeof(bf16));
    bf16 *proj = malloc((size_t)(n * (hidden > 2 * inter ? hidden : 2 * inter)) * sizeof(bf16));
    float *partial = malloc((size_t)(items * part) * sizeof(float));
    bf16 *head_in = malloc((size_t)(keep * hidden) * sizeof(bf16));
    bf16 *head_out = malloc((size_t)(keep * vocab) * sizeof(bf16));
    if (!qkv || !attn || !proj || !partial || !head_in || !head_out) {
        free(qkv), free(attn), free(proj), free(partial), free(head_in), free(head_out);
        return -2;
    }
    const float scale = 1.0f / sqrtf((float)head_dim);
    int failed = 0;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        bf16 *x = malloc((size_t)(n * hidden) * sizeof(bf16)); /* each thread's own residual stream */
        bf16 *h = malloc((size_t)(n * (hidden > inter ? hidden : inter)) * sizeof(bf16));
        if (!x || !h) {
#pragma omp atomic write
            failed = 1;
        } else {
            memcpy(x, x_in, (size_t)(n * hidden) * sizeof(bf16));
        }
#pragma omp barrier
        for (int64_t layer = 0; layer < layers && !failed; layer++) {
            const int64_t *lw = weights + layer * PER_LAYER;
            bf16 *kc = (bf16 *)(intptr_t)k_cache[layer], *vc = (bf16 *)(intptr_t)v_cache[layer];
            int64_t lo, hi;
            /* q, k, v: each thread its share of the fused rows */
            rms_norm(x, (const bf16 *)(intptr_t)lw[IN_NORM], n, hidden, eps, h);
            share(qkv_rows, id, count, &lo, &hi);
            for (int64_t part_i = 0; part_i < 3; part_i++) {
                const int64_t base = part_i == 0 ? 0 : part_i == 1 ? qd : qd + kvd, size = part_i == 0 ? qd : kvd;
                const int64_t a = lo > base ? lo : base, b = hi < base + size ? hi : base + size;
                if (a < b)
                    matvec((const bf16 *)(intptr_t)lw[Q + part_i], hidden, a - base, b - base, h, n, qkv + base,
                           qkv_rows);
            }
#pragma omp barrier
            /* RoPE on q and k; k and v into the cache after the cached rows */
#pragma omp for schedule(static)
            for (int64_t w = 0; w < n * (heads + 2 * kv_heads); w++) {
                const int64_t t = w / (heads + 2 * kv_heads), hd = w % (heads + 2 * kv_heads);
                bf16 *vec = qkv + t * qkv_rows + hd * head_dim;
                if (hd < heads + kv_heads) rope(vec, cos + t * head_dim, sin + t * head_dim, head_dim);
                if (hd >= heads) {
                    const int64_t kvh = (hd - heads) % kv_heads;
                    bf16 *dst = (hd < heads + kv_heads ? kc : vc) + kvh * kv_head_stride + (num_cached + t) * head_dim;
                    memcpy(dst, vec, (size_t)head_dim * sizeof(bf16));
                }
            }
            /* attention: partial results per (KV head, token, key split) */
#pragma omp for schedule(static)
            for (int64_t w = 0; w < items; w++) {
                const int64_t kvh = w / (n * splits), t = (w / splits) % n, sp = w % splits;
                const int64_t seen = num_cached + t + 1, lo_k = seen * sp / splits, hi_k = seen * (sp + 1) / splits;
                float *out = partial + w * part;
                attend(qkv + t * qkv_rows + kvh * group * head_dim, group, kc + kvh * kv_head_stride,
                       vc + kvh * kv_head_stride, head_dim, lo_k, hi_k, scale, out, out + group * head_dim,
                       out + group * head_dim + group);
            }
            /* combine the splits → attn [n, heads * dim] (implicit barrier above) */
#pragma omp for schedule(static)
            for (int64_t w = 0; w < kv_heads * n * group; w++) {
                const int64_t kvh = w / (n * group), t = (w / group) % n, g = w % group;
                float mx = -INFINITY, sum = 0.0f, o[MAX_DIM];
                for (int64_t sp = 0; sp < splits; sp++) {
                    const float *p = partial + ((kvh * n + t) * splits + sp) * part;
                    const float pm = p[group * head_dim + g];
                    mx = pm > mx ? pm : mx;
                }
                for (int64_t c = 0; c < head_dim; c++) o[c] = 0.0f;
                for (int64_t sp = 0; sp < splits; sp++) {
                    const float *p = partial + ((kvh * n + t) * splits + sp) * part;
                    const float pm = p[group * head_dim + g], pl = p[group * head_dim + group + g];
                    if (pm == -INFINITY) continue;
                    const float f = expf(pm - mx);
                    sum += pl * f;
                    for (int64_t c = 0; c < head_dim; c++) o[c] += p[g * head_dim + c] * f;
                }
                bf16 *dst = attn + t * qd + (kvh * group + g) * head_dim;
                for (int64_t c = 0; c < head_dim; c++) dst[c] = to_bf16(o[c] / sum);
            }
            /* o_proj, then every thread adds it to its residual stream */
            share(hidden, id, count, &lo, &hi);
            matvec((const bf16 *)(intptr_t)lw[O], qd, lo, hi, attn, n, proj, hidden);
#pragma omp barrier
            add_into(x, proj, n * hidden);
            /* gate and up */
            rms_norm(x, (const bf16 *)(intptr_t)lw[POST_NORM], n, hidden, eps, h);
#pragma omp barrier /* every thread has read proj */
            share(2 * inter, id, count, &lo, &hi);
            if (lo < inter)
                matvec((const bf16 *)(intptr_t)lw[GATE], hidden, lo, hi < inter ? hi : inter, h, n, proj, 2 * inter);
            if (hi > inter)
                matvec((const bf16 *)(intptr_t)lw[UP], hidden, (lo > inter ? lo : inter) - inter, hi - inter, h, n,
                       proj + inter, 2 * inter);
#pragma omp barrier
            /* the activation (every thread, all of it), then down */
            for (int64_t t = 0; t < n; t++) {
                const bf16 *gate = proj + t * 2 * inter, *up = gate + inter;
                for (int64_t c = 0; c < inter; c += 16) {
                    const __mmask16 m = mask16(inter - c);
                    const __m512 g = load16(gate + c, m);
                    const __m512 act = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                             exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
                    store16(h + t * inter + c, _mm512_mul_ps(act, load16(up + c, m)), m);
                }
            }
#pragma omp barrier /* every thread has read proj */
            share(hidden, id, count, &lo, &hi);
            matvec((const bf16 *)(intptr_t)lw[DOWN], inter, lo, hi, h, n, proj, hidden);
#pragma omp barrier
            add_into(x, proj, n * hidden);
#pragma omp barrier /* every thread has read proj before the next layer writes it */
        }
        if (!failed) {
            /* the head over the last `keep` tokens */
            rms_norm(x + (n - keep) * hidden, final_norm, keep, hidden, eps, h);
            if (id == 0) memcpy(head_in, h, (size_t)(keep * hidden) * sizeof(bf16));
        }
#pragma omp barrier
        if (!failed) {
            int64_t lo, hi;
            share(vocab, id, count, &lo, &hi);
            matvec(head, hidden, lo, hi, head_in, keep, head_out, vocab);
            for (int64_t t = 0; t < keep; t++)
                for (int64_t r = lo; r < hi; r++) logits[t * vocab + r] = f32(head_out[t * vocab + r]);
        }
        free(x);
        free(h);
    }
    free(qkv), free(attn), free(proj), free(partial), free(head_in), free(head_out);
    return failed ? -2 : 0;
}
