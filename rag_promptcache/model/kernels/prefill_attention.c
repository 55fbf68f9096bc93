/* Attention of many new query rows against a long bf16 KV cache, for x86 CPUs with AVX512-BF16.
 *
 * What it computes is SDPA's for the engine's prefill against a cache: new token i sees the first
 * `visible[i]` cached keys (all of them where `visible` is NULL) and the new keys up to its own, the
 * `num_new` new keys being the last ones. Every mask assembly builds has this form, since the cache
 * holds its tokens in sequence order: a new token sees the cached ones before it in the sequence.
 * Scores are accumulated in fp32 (vdpbf16ps) and never rounded to bf16, the softmax runs online in
 * fp32, the probabilities are rounded to bf16 for the P.V product, as SDPA's CPU flash kernel does.
 *
 * Layout (one KV head per `head`, the query heads that share it folded into its rows):
 *   q    [heads, rows, dim]  bf16, contiguous; row r is new token r % num_new
 *   k, v [heads, *, dim]     bf16, rows contiguous, `k_stride` / `v_stride` elements between heads
 *   out  [heads, rows, dim]  bf16, contiguous
 *   visible [num_new]        int32 in [0, num_keys - num_new], or NULL
 *
 * The work is one (head, block of 16 rows) at a time, one row per vector lane, so the key broadcast
 * from its natural layout needs no transpose and the softmax no horizontal sums. Threads: OpenMP over
 * those blocks, built against libgomp.so.1, the runtime torch has already loaded, so that its warm
 * worker threads run them (a second pool of threads would fight torch's spinning ones for the cores).
 *
 * Out of scope: other masks (a cached key hidden from a token that sees a later one), fp32 and fp16
 * inputs, dim > 256 or odd.
 */
#include <string.h>

#include "simd.h"

#define LANES 16
#define TILE 16 /* keys per tile: 16 score vectors live in registers */
#define MAX_DIM 256

typedef struct {
    const bf16 *q, *k, *v;
    bf16 *out;
    const int32_t *visible;
    int64_t heads, rows, dim, num_keys, num_new, k_stride, v_stride;
    float scale;
} Job;

/* Two fp32 vectors → one vector of bf16 pairs per lane: (a[i] low half, b[i] high half). */
static inline __m512i pair_bf16(__m512 a, __m512 b) {
    __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
    __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
    return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

static inline int32_t load32(const bf16 *p) {
    int32_t x;
    memcpy(&x, p, sizeof x);
    return x;
}

static void block(const Job *job, int64_t head, int64_t row0) {
    const int64_t dim = job->dim, pairs = dim / 2;
    const int64_t first_new = job->num_keys - job->num_new, n_rows = job->rows - row0 < LANES ? job->rows - row0 : LANES;
    const bf16 *q = job->q + (head * job->rows + row0) * dim;
    const bf16 *k = job->k + head * job->k_stride, *v = job->v + head * job->v_stride;

    /* queries as bf16 pairs per lane: qp[p] lane i = (q[i][2p], q[i][2p+1]); padding lanes are 0 */
    __m512i qp[MAX_DIM / 2];
    int32_t lane_q[LANES];
    for (int64_t p = 0; p < pairs; p++) {
        for (int i = 0; i < LANES; i++) lane_q[i] = i < n_rows ? load32(q + i * dim + 2 * p) : 0;
        qp[p] = _mm512_loadu_si512(lane_q);
    }
    int32_t lane_pos[LANES]; /* the new token each lane's row is: it sees new keys up to this one */
    int32_t lane_lim[LANES]; /* the cached keys each lane's row sees: [0, lim) */
    int32_t last_pos = 0, min_lim = (int32_t)first_new, max_lim = 0;
    for (int i = 0; i < LANES; i++) {
        lane_pos[i] = (int32_t)((row0 + (i < n_rows ? i : 0)) % job->num_new);
        lane_lim[i] = job->visible ? job->visible[lane_pos[i]] : (int32_t)first_new;
        last_pos = lane_pos[i] > last_pos ? lane_pos[i] : last_pos;
        min_lim = lane_lim[i] < min_lim ? lane_lim[i] : min_lim;
        max_lim = lane_lim[i] > max_lim ? lane_lim[i] : max_lim;
    }
    const __m512i pos = _mm512_loadu_si512(lane_pos), lim = _mm512_loadu_si512(lane_lim);
    const int64_t key_end = first_new + last_pos + 1; /* no row of this block sees a key past it */

    __m512 o[MAX_DIM]; /* o[c] lane i = unnormalised output of row i, dim c; spilled to the stack */
    for (int64_t c = 0; c < dim; c++) o[c] = _mm512_setzero_ps();
    __m512 m = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps();
    const __m512 scale = _mm512_set1_ps(job->scale), neg_inf = _mm512_set1_ps(-__builtin_inff());
    int32_t vp[TILE / 2][MAX_DIM]; /* the tile's values as pairs of keys: vp[t][c] = (v[2t][c], v[2t+1][c]) */

    for (int64_t j0 = 0; j0 < key_end; j0 += TILE) {
        if (j0 >= max_lim && j0 < first_new) j0 = first_new; /* cached keys no row of the block sees */
        const int64_t n_keys = key_end - j0 < TILE ? key_end - j0 : TILE;
        __m512 s[TILE];
        for (int t = 0; t < TILE; t++) s[t] = _mm512_setzero_ps();
        if (n_keys == TILE) {
            for (int64_t p = 0; p < pairs; p++) {
                const __m512bh qv = (__m512bh)qp[p];
                const bf16 *kp = k + j0 * dim + 2 * p;
                for (int t = 0; t < TILE; t++)
                    s[t] = _mm512_dpbf16_ps(s[t], (__m512bh)_mm512_set1_epi32(load32(kp + t * dim)), qv);
            }
        } else {
            for (int64_t p = 0; p < pairs; p++) {
                const __m512bh qv = (__m512bh)qp[p];
                const bf16 *kp = k + j0 * dim + 2 * p;
                for (int t = 0; t < n_keys; t++)
                    s[t] = _mm512_dpbf16_ps(s[t], (__m512bh)_mm512_set1_epi32(load32(kp + t * dim)), qv);
            }
        }
        __m512 tile_max = neg_inf;
        for (int t = 0; t < TILE; t++) {
            const int64_t j = j0 + t;
            if (t >= n_keys) {
                s[t] = neg_inf;
                continue;
            }
            s[t] = _mm512_mul_ps(s[t], scale);
            if (j >= first_new) { /* causal among the new tokens */
                __mmask16 hidden = _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32((int32_t)(j - first_new)));
                s[t] = _mm512_mask_mov_ps(s[t], hidden, neg_inf);
            } else if (j >= min_lim) { /* a cached key past some rows' prefix */
                __mmask16 hidden = _mm512_cmple_epi32_mask(lim, _mm512_set1_epi32((int32_t)j));
                s[t] = _mm512_mask_mov_ps(s[t], hidden, neg_inf);
            }
            tile_max = _mm512_max_ps(tile_max, s[t]);
        }
        const __m512 m_new = _mm512_max_ps(m, tile_max);
        if (_mm512_cmp_ps_mask(m_new, m, _CMP_GT_OQ)) {
            const __m512 shrink = exp16(_mm512_sub_ps(m, m_new));
            l = _mm512_mul_ps(l, shrink);
            for (int64_t c = 0; c < dim; c++) o[c] = _mm512_mul_ps(o[c], shrink);
            m = m_new;
        }
        __m512i pp[TILE / 2];
        for (int t = 0; t < TILE; t += 2) {
            const __m512 a = exp16(_mm512_sub_ps(s[t], m)), b = exp16(_mm512_sub_ps(s[t + 1], m));
            l = _mm512_add_ps(l, _mm512_add_ps(a, b));
            pp[t / 2] = pair_bf16(a, b);
        }
        for (int t = 0; t < TILE / 2; t++) {
            const bf16 *va = v + (j0 + 2 * t) * dim;
            const int has_a = 2 * t < n_keys, has_b = 2 * t + 1 < n_keys;
            for (int64_t c = 0; c < dim; c += LANES) {
                const __mmask16 lanes = dim - c < LANES ? (__mmask16)((1u << (dim - c)) - 1) : 0xFFFF;
                __m512i a = has_a ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, va + c)) : _mm512_setzero_si512();
                __m512i b = has_b ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, va + dim + c)) : _mm512_setzero_si512();
                _mm512_mask_storeu_epi32(&vp[t][c], lanes, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
        }
        int64_t c = 0;
        for (; c + 8 <= dim; c += 8) { /* 8 independent chains: the instruction's latency stays hidden */
            __m512 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = o[c + u];
            for (int t = 0; t < TILE / 2; t++)
                for (int u = 0; u < 8; u++)
                    acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)pp[t], (__m512bh)_mm512_set1_epi32(vp[t][c + u]));
            for (int u = 0; u < 8; u++) o[c + u] = acc[u];
        }
        for (; c < dim; c++)
            for (int t = 0; t < TILE / 2; t++)
                o[c] = _mm512_dpbf16_ps(o[c], (__m512bh)pp[t], (__m512bh)_mm512_set1_epi32(vp[t][c]));
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l);
    bf16 lanes[LANES];
    bf16 *out = job->out + (head * job->rows + row0) * dim;
    for (int64_t c = 0; c < dim; c++) {
        _mm256_storeu_si256((__m256i *)lanes, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[c], inv)));
        for (int64_t i = 0; i < n_rows; i++) out[i * dim + c] = lanes[i];
    }
}

/* One (head, block of 16 rows) of a call without `visible`, for a caller with its own threads
 * (decode_step.c's check of a prompt lookup draft); its arguments already checked. */
void prefill_attention_block(const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out, int64_t heads, int64_t rows,
                             int64_t dim, int64_t num_keys, int64_t num_new, int64_t k_stride, int64_t v_stride,
                             float scale, int64_t head, int64_t row0) {
    const Job job = {q, k, v, out, NULL, heads, rows, dim, num_keys, num_new, k_stride, v_stride, scale};
    block(&job, head, row0);
}

/* Returns 0, or -1 for arguments out of scope (nothing written). */
int prefill_attention(const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out, const int32_t *visible,
                      int64_t heads, int64_t rows, int64_t dim, int64_t num_keys, int64_t num_new, int64_t k_stride,
                      int64_t v_stride, float scale, int threads) {
    if (dim <= 0 || dim > MAX_DIM || dim % 2 || num_new <= 0 || num_new > num_keys || heads <= 0 || rows <= 0)
        return -1;
    for (int64_t i = 0; visible && i < num_new; i++)
        if (visible[i] < 0 || visible[i] > num_keys - num_new) return -1;
    const Job job = {q, k, v, out, visible, heads, rows, dim, num_keys, num_new, k_stride, v_stride, scale};
    const int64_t blocks = (rows + LANES - 1) / LANES;
#pragma omp parallel for schedule(static) num_threads(threads < 1 ? 1 : threads)
    for (int64_t w = 0; w < heads * blocks; w++) block(&job, w / blocks, (w % blocks) * LANES);
    return 0;
}
