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
 * A batch (`llama_decode_batch_bf16`) is n sequences of one new token each, each with its own cache and
 * length: the products treat them as n tokens (each block of weight rows read from memory once for all),
 * the attention reads each token's own cache.
 *
 * Out of scope: biases, other norms or activations, sliding windows, masks other than causal over the
 * cache, more than MAX_NEW tokens, odd sizes (the caller runs the torch forward instead).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MAX_NEW 16  /* new tokens per call */
#define MAX_DIM 256 /* head_dim */
#define KEY_BLOCK 64
#define MAX_GROUP 16 /* query heads per KV head */
#define BLOCKED_FROM 4 /* new tokens from which the attention runs in prefill_attention.c's row blocks */

enum { IN_NORM, Q, K, V, O, POST_NORM, GATE, UP, DOWN, PER_LAYER };

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

/* one head's vector rotated into dst: bf16(bf16(v * cos) + bf16(rotate_half(v) * sin)) */
static void rope(const bf16 *v, bf16 *dst, const bf16 *cos, const bf16 *sin, int64_t dim) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < dim; i++) {
        const float rot = i < half ? -f32(v[i + half]) : f32(v[i - half]);
        dst[i] = to_bf16(round_bf16(f32(v[i]) * f32(cos[i])) + round_bf16(rot * f32(sin[i])));
    }
}

/* prefill_attention.c: one (head, 16 rows) block of many query rows against the cache */
void prefill_attention_block(const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out, int64_t heads, int64_t rows,
                             int64_t dim, int64_t num_keys, int64_t num_new, int64_t k_stride, int64_t v_stride,
                             float scale, int64_t head, int64_t row0);

/* q . k for 16 consecutive keys of `dim` = 32 * chunks, q in registers (a constant chunks unrolls the loops) */
static inline __m512 scores16(const bf16 *k, int64_t dim, const __m512bh *qv, int chunks) {
    __m512 a[16];
    for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++)
        for (int i = 0; i < 16; i++) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_loadu_si512(k + i * dim + 32 * c), qv[c]);
    return sum16(a);
}

/* o[r][0..64) += sum_j p[r][j] v[j][0..64) for `rows` rows (a constant where inlined), `left` dims
 * from here to the row's end; p rows KEY_BLOCK apart, o rows and v rows `dim` apart. */
static inline void pv_rows(float *o, const float *p, const bf16 *v, int64_t dim, int64_t left, int64_t nk, const int rows) {
    __mmask16 mc[4];
    __m512 acc[4][4];
    for (int u = 0; u < 4; u++) mc[u] = 16 * u < left ? mask16(left - 16 * u) : 0;
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < 4; u++) acc[r][u] = _mm512_maskz_loadu_ps(mc[u], o + r * dim + 16 * u);
    for (int64_t j = 0; j < nk; j++) {
        __m512 vv[4];
        for (int u = 0; u < 4; u++) vv[u] = load16(v + j * dim + 16 * u, mc[u]);
        for (int r = 0; r < rows; r++) {
            const __m512 pr = _mm512_set1_ps(p[r * KEY_BLOCK + j]);
            for (int u = 0; u < 4; u++) acc[r][u] = _mm512_fmadd_ps(pr, vv[u], acc[r][u]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int u = 0; u < 4; u++) _mm512_mask_storeu_ps(o + r * dim + 16 * u, mc[u], acc[r][u]);
}

/* Attention of query rows `q` [group, dim] (one new token, the heads sharing one KV head) over keys
 * [lo, hi): the unnormalised fp32 output o [group, dim], and per row the running max m and sum l. A
 * block of keys at a time: its scores for every row, then its values read once for all the rows. */
static void attend(const bf16 *q, int64_t q_stride, int64_t group, const bf16 *k, const bf16 *v, int64_t dim, int64_t lo, int64_t hi,
                   float scale, float *o, float *m, float *l) {
    const int64_t chunks = (dim + 31) / 32;
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(o, 0, (size_t)(group * dim) * sizeof(float));
    float s[MAX_GROUP][KEY_BLOCK]; /* scores, then the probabilities rounded to bf16 */
    for (int64_t j0 = lo; j0 < hi; j0 += KEY_BLOCK) {
        const int64_t nk = hi - j0 < KEY_BLOCK ? hi - j0 : KEY_BLOCK;
        for (int64_t g = 0; g < group; g++) {
            const bf16 *qg = q + g * q_stride;
            float *og = o + g * dim, *sg = s[g];
            __m512bh qv[MAX_DIM / 32];
            for (int64_t c = 0; c < chunks; c++) qv[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask32(dim - 32 * c), qg + 32 * c);
            __m512 top = _mm512_set1_ps(-INFINITY);
            int64_t j = 0;
            for (; dim % 32 == 0 && j + 16 <= nk; j += 16) { /* sixteen keys' scores at once */
                const bf16 *kj = k + (j0 + j) * dim;
                const __m512 raw = dim == 64 ? scores16(kj, 64, qv, 2) : dim == 128 ? scores16(kj, 128, qv, 4)
                                                                                    : scores16(kj, dim, qv, (int)chunks);
                const __m512 sc = _mm512_mul_ps(raw, _mm512_set1_ps(scale));
                top = _mm512_max_ps(top, sc);
                _mm512_storeu_ps(sg + j, sc);
            }
            float block_max = _mm512_reduce_max_ps(top);
            for (; j < nk; j++) { /* the block's last keys; every key where dim is not a multiple of 32 */
                const bf16 *kj = k + (j0 + j) * dim;
                __m512 a = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; c++)
                    a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(mask32(dim - 32 * c), kj + 32 * c), qv[c]);
                sg[j] = _mm512_reduce_add_ps(a) * scale;
                block_max = sg[j] > block_max ? sg[j] : block_max;
            }
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
                const __m512 p = _mm512_maskz_mov_ps(mk, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + j), mg)));
                sum = _mm512_add_ps(sum, p);
                _mm512_mask_storeu_ps(sg + j, mk, round16(p)); /* P.V with P in bf16 */
            }
            l[g] += _mm512_reduce_add_ps(sum);
        }
        /* P.V: 64 output dims of up to 4 rows in registers; each value row converted once for them */
        for (int64_t c = 0; c < dim; c += 64) {
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                float *og = o + g0 * dim + c;
                const bf16 *vc = v + j0 * dim + c;
                switch (group - g0 < 4 ? group - g0 : 4) { /* constant row counts: the accumulators stay in registers */
                case 1: pv_rows(og, s[g0], vc, dim, dim - c, nk, 1); break;
                case 2: pv_rows(og, s[g0], vc, dim, dim - c, nk, 2); break;
                case 3: pv_rows(og, s[g0], vc, dim, dim - c, nk, 3); break;
                default: pv_rows(og, s[g0], vc, dim, dim - c, nk, 4); break;
                }
            }
        }
    }
}

/* The step of n tokens of `seqs` sequences: one sequence (seqs 1) whose tokens follow its cached[0] rows,
 * or n sequences (seqs n) of one token each, token t after the cached[t] rows of its own cache. Caches
 * per layer and sequence: k_cache[layer * seqs + s]. Returns 0, -1 for arguments out of scope, -2 out of
 * memory (nothing written but the caches' new rows). */
static int decode(const int64_t *weights, const bf16 *final_norm, const bf16 *head, const int64_t *k_cache,
                  const int64_t *v_cache, int64_t kv_head_stride, const int64_t *cached, int64_t seqs, int64_t layers,
                  int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, int64_t vocab,
                  float eps, const bf16 *x_in, int64_t n, const bf16 *cos, const bf16 *sin, int64_t keep,
                  float *logits, int threads) {
    if (n < 1 || n > MAX_NEW || keep < 1 || keep > n || head_dim > MAX_DIM || head_dim % 2 || hidden % 2 ||
        inter % 2 || kv_heads < 1 || heads % kv_heads || heads / kv_heads > MAX_GROUP || (seqs != 1 && seqs != n))
        return -1;
    int64_t most = 0; /* the longest sequence's keys after this step */
    for (int64_t s = 0; s < seqs; s++) {
        if (cached[s] < 0) return -1;
        const int64_t keys_s = cached[s] + (seqs == 1 ? n : 1);
        most = keys_s > most ? keys_s : most;
    }
    const int64_t group = heads / kv_heads, qd = heads * head_dim, kvd = kv_heads * head_dim;
    const int64_t qkv_rows = qd + 2 * kvd, num_keys = most, rows = group * n;
    /* A few tokens: the attention's work items are (KV head, token, key split), the splits keeping every
     * thread busy, each with its own partial softmax. More tokens of one sequence (a long prompt lookup
     * draft): prefill_attention.c's blocks of 16 query rows, which read each key once for all of them. */
    const int blocked = seqs == 1 && n >= BLOCKED_FROM;
    int64_t splits = (2 * threads + kv_heads * n - 1) / (kv_heads * n);
    if (splits > num_keys / 256) splits = num_keys / 256;
    if (splits < 1 || blocked) splits = 1;
    const int64_t row_blocks = (rows + 15) / 16;
    const int64_t items = blocked ? kv_heads * row_blocks : kv_heads * n * splits, part = group * (head_dim + 2);
    /* shared between threads: the products' outputs, the rotated queries, the attention's results.
     * Each product writes its own buffer, so a thread may start the next one while another still
     * reads the last one's output. */
    bf16 *qkv = malloc((size_t)(n * qkv_rows) * sizeof(bf16));
    bf16 *qrows = malloc((size_t)(n * qd) * sizeof(bf16));  /* [kv_heads, group * n, dim]: row g * n + t */
    bf16 *arows = malloc((size_t)(n * qd) * sizeof(bf16));  /* the same layout, attention's output */
    bf16 *o_out = malloc((size_t)(n * hidden) * sizeof(bf16));
    bf16 *gate_up = malloc((size_t)(n * 2 * inter) * sizeof(bf16));
    bf16 *down = malloc((size_t)(n * hidden) * sizeof(bf16));
    float *partial = malloc((size_t)(kv_heads * n * splits * part) * sizeof(float));
    bf16 *head_out = malloc((size_t)(keep * vocab) * sizeof(bf16));
    int failed = !qkv || !qrows || !arows || !o_out || !gate_up || !down || !partial || !head_out;
    const float scale = 1.0f / sqrtf((float)head_dim);
#pragma omp parallel num_threads(threads < 1 ? 1 : threads) if (!failed)
    {
        const int id = omp_get_thread_num(), count = omp_get_num_threads();
        /* each thread's own: the residual stream, a normed input or activation, the attention output */
        bf16 *x = malloc((size_t)(n * hidden) * sizeof(bf16));
        bf16 *h = malloc((size_t)(n * (hidden > inter ? hidden : inter)) * sizeof(bf16));
        bf16 *attn = malloc((size_t)(n * qd) * sizeof(bf16));
        if (!x || !h || !attn) {
#pragma omp atomic write
            failed = 1;
        } else {
            memcpy(x, x_in, (size_t)(n * hidden) * sizeof(bf16));
        }
#pragma omp barrier
        for (int64_t layer = 0; layer < layers && !failed; layer++) {
            const int64_t *lw = weights + layer * PER_LAYER;
            /* sequence 0's cache; token t's is (k|v)_cache[layer * seqs + t] when each token is its own sequence */
            bf16 *kc = (bf16 *)(intptr_t)k_cache[layer * seqs], *vc = (bf16 *)(intptr_t)v_cache[layer * seqs];
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
            /* RoPE: queries into qrows, keys into the cache after the cached rows; values copied there */
#pragma omp for schedule(static)
            for (int64_t w = 0; w < n * (heads + 2 * kv_heads); w++) {
                const int64_t t = w / (heads + 2 * kv_heads), hd = w % (heads + 2 * kv_heads);
                const bf16 *vec = qkv + t * qkv_rows + hd * head_dim;
                const bf16 *c = cos + t * head_dim, *sn = sin + t * head_dim;
                const int64_t seq = seqs == 1 ? 0 : t, slot = seqs == 1 ? cached[0] + t : cached[t];
                bf16 *kt = (bf16 *)(intptr_t)k_cache[layer * seqs + seq], *vt = (bf16 *)(intptr_t)v_cache[layer * seqs + seq];
                if (hd < heads) {
                    rope(vec, qrows + ((hd / group) * rows + (hd % group) * n + t) * head_dim, c, sn, head_dim);
                } else if (hd < heads + kv_heads) {
                    rope(vec, kt + (hd - heads) * kv_head_stride + slot * head_dim, c, sn, head_dim);
                } else {
                    memcpy(vt + (hd - heads - kv_heads) * kv_head_stride + slot * head_dim, vec,
                           (size_t)head_dim * sizeof(bf16));
                }
            }
#pragma omp for schedule(static)
            for (int64_t w = 0; w < items; w++) {
                if (blocked) {
                    prefill_attention_block(qrows, kc, vc, arows, kv_heads, rows, head_dim, num_keys, n, kv_head_stride,
                                            kv_head_stride, scale, w / row_blocks, (w % row_blocks) * 16);
                } else {
                    const int64_t kvh = w / (n * splits), t = (w / splits) % n, sp = w % splits;
                    /* its sequence's cache and new tokens up to this one */
                    const int64_t seq = seqs == 1 ? 0 : t, seen = seqs == 1 ? cached[0] + t + 1 : cached[t] + 1;
                    const bf16 *kt = (const bf16 *)(intptr_t)k_cache[layer * seqs + seq];
                    const bf16 *vt = (const bf16 *)(intptr_t)v_cache[layer * seqs + seq];
                    float *out = partial + w * part;
                    attend(qrows + (kvh * rows + t) * head_dim, n * head_dim, group, kt + kvh * kv_head_stride,
                           vt + kvh * kv_head_stride, head_dim, seen * sp / splits, seen * (sp + 1) / splits, scale, out,
                           out + group * head_dim, out + group * head_dim + group);
                }
            }
            /* every thread gathers the whole attention output into its own [n, heads * dim] */
            for (int64_t hd = 0; hd < heads; hd++) {
                const int64_t kvh = hd / group, g = hd % group;
                for (int64_t t = 0; t < n; t++) {
                    bf16 *dst = attn + t * qd + hd * head_dim;
                    if (blocked) {
                        memcpy(dst, arows + (kvh * rows + g * n + t) * head_dim, (size_t)head_dim * sizeof(bf16));
                        continue;
                    }
                    float mx = -INFINITY, sum = 0.0f, o[MAX_DIM];
                    for (int64_t sp = 0; sp < splits; sp++) {
                        const float pm = partial[((kvh * n + t) * splits + sp) * part + group * head_dim + g];
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
                    for (int64_t c = 0; c < head_dim; c++) dst[c] = to_bf16(o[c] / sum);
                }
            }
            /* o_proj, then every thread adds it to its residual stream */
            share(hidden, id, count, &lo, &hi);
            matvec((const bf16 *)(intptr_t)lw[O], qd, lo, hi, attn, n, o_out, hidden);
#pragma omp barrier
            add_into(x, o_out, n * hidden);
            /* gate and up */
            rms_norm(x, (const bf16 *)(intptr_t)lw[POST_NORM], n, hidden, eps, h);
            share(2 * inter, id, count, &lo, &hi);
            if (lo < inter)
                matvec((const bf16 *)(intptr_t)lw[GATE], hidden, lo, hi < inter ? hi : inter, h, n, gate_up, 2 * inter);
            if (hi > inter)
                matvec((const bf16 *)(intptr_t)lw[UP], hidden, (lo > inter ? lo : inter) - inter, hi - inter, h, n,
                       gate_up + inter, 2 * inter);
#pragma omp barrier
            /* the activation (every thread, all of it), then down */
            for (int64_t t = 0; t < n; t++) {
                const bf16 *gate = gate_up + t * 2 * inter, *up = gate + inter;
                for (int64_t c = 0; c < inter; c += 16) {
                    const __mmask16 m = mask16(inter - c);
                    const __m512 g = load16(gate + c, m);
                    const __m512 act = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                             exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
                    store16(h + t * inter + c, _mm512_mul_ps(act, load16(up + c, m)), m);
                }
            }
            share(hidden, id, count, &lo, &hi);
            matvec((const bf16 *)(intptr_t)lw[DOWN], inter, lo, hi, h, n, down, hidden);
#pragma omp barrier
            add_into(x, down, n * hidden);
        }
        if (!failed) { /* the head over the last `keep` tokens */
            int64_t lo, hi;
            rms_norm(x + (n - keep) * hidden, final_norm, keep, hidden, eps, h);
            share(vocab, id, count, &lo, &hi);
            matvec(head, hidden, lo, hi, h, keep, head_out, vocab);
            for (int64_t t = 0; t < keep; t++)
                for (int64_t r = lo; r < hi; r++) logits[t * vocab + r] = f32(head_out[t * vocab + r]);
        }
        free(x), free(h), free(attn);
    }
    free(qkv), free(qrows), free(arows), free(o_out), free(gate_up), free(down), free(partial), free(head_out);
    return failed ? -2 : 0;
}

/* One sequence: n new tokens after its num_cached rows (a decode step, a prompt lookup check). */
int llama_decode_bf16(const int64_t *weights, const bf16 *final_norm, const bf16 *head, const int64_t *k_cache,
                      const int64_t *v_cache, int64_t kv_head_stride, int64_t num_cached, int64_t layers,
                      int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, int64_t vocab,
                      float eps, const bf16 *x_in, int64_t n, const bf16 *cos, const bf16 *sin, int64_t keep,
                      float *logits, int threads) {
    return decode(weights, final_norm, head, k_cache, v_cache, kv_head_stride, &num_cached, 1, layers, hidden, heads,
                  kv_heads, head_dim, inter, vocab, eps, x_in, n, cos, sin, keep, logits, threads);
}

/* A batch: one new token for each of n sequences, token t after the lengths[t] rows of its own cache
 * (k_cache, v_cache: [layers, n] pointers); the weights are read once for all of them. */
int llama_decode_batch_bf16(const int64_t *weights, const bf16 *final_norm, const bf16 *head, const int64_t *k_cache,
                            const int64_t *v_cache, int64_t kv_head_stride, const int64_t *lengths, int64_t layers,
                            int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                            int64_t vocab, float eps, const bf16 *x_in, int64_t n, const bf16 *cos, const bf16 *sin,
                            float *logits, int threads) {
    return decode(weights, final_norm, head, k_cache, v_cache, kv_head_stride, lengths, n, layers, hidden, heads,
                  kv_heads, head_dim, inter, vocab, eps, x_in, n, cos, sin, n, logits, threads);
}
