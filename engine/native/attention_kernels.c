/* Prefill attention with bf16 dot products (AVX512-BF16): one call per layer and chunk.
 *
 * torch's CPU flash attention computes in fp32 whatever the input dtype unless the CPU has AMX
 * tiles; on a CPU with AVX512-BF16 only (Zen 4) a 512-token chunk over 6k keys took the same
 * time in bf16 as in fp32. Here the two products run on vdpbf16ps (pairs of bf16 multiplied and
 * summed into fp32 accumulators), about 4x the fp32 FMA rate on that CPU:
 *
 *   scores S = (scaling * log2 e * Q) K^T   Q and K rounded to bf16, accumulated in fp32
 *   online softmax per query over key blocks, in fp32 (exp2 by a degree-6 polynomial)
 *   O += P V                                 P and V rounded to bf16, accumulated in fp32
 *
 * Layout: lanes are 16 queries of one query head (queries x keys is computed transposed, so
 * the softmax needs no horizontal reductions and K needs no transpose: a key's pair of bf16
 * channels is broadcast from its plain row). K and V (fp32 or bf16, in up to 3 pieces that
 * hold positions 0..N-1 in order: the exact store, the residual window) are converted once per
 * call into bf16 scratch rows (K) and key-pair-interleaved rows (V).
 *
 * Causal rule: query t of the chunk (position start + t) sees keys first..start + t, and with a
 * sliding window W (> 0) only those past start + t - W; the pieces hold positions first..start+T-1
 * (first > 0: a sliding layer's ring from its oldest needed slot), N = start + T - first.
 * Queries are grouped (GQA): row g*T + t of a KV head's Q is query head g's token t.
 * Not bit-exact against fp32 (bf16 rounding of Q, K, P, V): the exact path is torch's fp32 one.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define EXPORT __attribute__((visibility("default")))

typedef struct {
    int64_t H, G, T, D, start, npieces, src_bf16, nthreads;
    int64_t first, window;  /* position of the pieces' first key; sliding window (0: none, else >= BK) */
    float scaling;
    const void *q;      /* fp32 [H][G*T][D] rows contiguous */
    int64_t q_sh;       /* elements between KV heads */
    const void *k[3], *v[3];
    int64_t n[3], sr[3], sh[3];  /* keys per piece, row stride, head stride (elements) */
    float *out;         /* fp32 [H][G*T][D] contiguous */
} PrefillArgs;

EXPORT int specache_prefill_attention_available(void) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define BM 32   /* queries per block: two vectors */
#define BK 64   /* keys per block */
#define KU 8    /* keys per register block of the score product */
#define DU 8    /* channels per register block of the value product */

static inline uint16_t bf16_of(float x) {  /* round to nearest even */
    uint32_t u;
    memcpy(&u, &x, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline __m512 exp2_ps(__m512 x) {  /* 2^x, exactly 0 below -126 (masked keys are -inf) */
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);  /* [-0.5, 0.5] */
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* 16 floats -> 16 bf16 (round to nearest even), as the low halves of 16 u32 lanes */
static inline __m512i bf16_lanes(__m512 x) {
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
}

/* Convert keys [0, N) of one head into bf16 rows kb [Npad][D] and key-pair rows
 * vb [Npad/2][D] (u32: bf16 of key 2j in the low half, key 2j+1 in the high half). */
static void pack_head(const PrefillArgs *a, int64_t h, int64_t npad, uint16_t *kb, uint32_t *vb) {
    const int64_t D = a->D;
    int64_t j = 0;
    float rowk[256], rowv0[256], rowv1[256];
    for (int64_t p = 0; p < a->npieces; p++) {
        for (int64_t r = 0; r < a->n[p]; r++, j++) {
            int64_t off = h * a->sh[p] + r * a->sr[p];
            float *vdst = (j & 1) ? rowv1 : rowv0;  /* V rows are packed by pairs */
            const float *ks;
            if (a->src_bf16) {  /* widen exactly to fp32 (bf16 is fp32's upper half) */
                const uint16_t *k16 = (const uint16_t *)a->k[p] + off, *v16 = (const uint16_t *)a->v[p] + off;
                for (int64_t d = 0; d < D; d++) {
                    uint32_t uk = (uint32_t)k16[d] << 16, uv = (uint32_t)v16[d] << 16;
                    memcpy(&rowk[d], &uk, 4);
                    memcpy(&vdst[d], &uv, 4);
                }
                ks = rowk;
            } else {
                ks = (const float *)a->k[p] + off;
                memcpy(vdst, (const float *)a->v[p] + off, D * sizeof(float));
            }
            for (int64_t d = 0; d < D; d += 16) {
                __m256i k16 = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(ks + d));
                _mm256_storeu_si256((__m256i *)(kb + j * D + d), k16);
            }
            if (j & 1) {
                for (int64_t d = 0; d < D; d += 16) {
                    __m512i lo = bf16_lanes(_mm512_loadu_ps(rowv0 + d)), hi = bf16_lanes(_mm512_loadu_ps(rowv1 + d));
                    _mm512_storeu_si512(vb + (j >> 1) * D + d, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                }
            }
        }
    }
    if (j & 1) {  /* odd N: the last pair's second key is zero */
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_si512(vb + (j >> 1) * D + d, bf16_lanes(_mm512_loadu_ps(rowv0 + d)));
        j++;
    }
    memset(kb + j * D, 0, (size_t)(npad - j) * D * sizeof(uint16_t));
    memset(vb + (j >> 1) * D, 0, (size_t)((npad - j) >> 1) * D * sizeof(uint32_t));
}

/* One block of up to BM queries (tokens t0.. of query head g of KV head h) against all its keys. */
static void query_block(const PrefillArgs *a, int64_t h, int64_t g, int64_t t0, const uint16_t *kb,
                        const uint32_t *vb, float *scratch) {
    const int64_t D = a->D, T = a->T, D2 = D / 2;
    const int64_t rows = T - t0 < BM ? T - t0 : BM;
    uint32_t *qt = (uint32_t *)scratch;              /* [D/2][BM] query pairs, transposed */
    float *st = scratch + D2 * BM;                   /* [BK][BM] scores, then probabilities */
    uint32_t *pp = (uint32_t *)(st + BK * BM);       /* [BK/2][BM] probability pairs */
    float *ot = (float *)(pp + BK / 2 * BM);         /* [D][BM] output, transposed */
    const float scale = a->scaling * 1.4426950408889634f;
    const float *q = (const float *)a->q + h * a->q_sh + (g * T + t0) * D;
    for (int64_t d2 = 0; d2 < D2; d2++)
        for (int64_t i = 0; i < BM; i++)
            qt[d2 * BM + i] = i < rows ? (uint32_t)bf16_of(q[i * D + 2 * d2] * scale)
                                           | ((uint32_t)bf16_of(q[i * D + 2 * d2 + 1] * scale) << 16) : 0;
    memset(ot, 0, (size_t)D * BM * sizeof(float));
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, l0 = _mm512_setzero_ps(), l1 = l0;
    const int64_t p0 = a->start + t0 - a->first;     /* the block's first query, as a key index */
    const int64_t kend = T - t0 < BM ? a->start + T - a->first : p0 + BM;  /* keys [kbeg, kend) matter */
    /* with a window, keys before the first query's oldest visible one are skipped (an even index: keys go
     * in pairs); since W >= BK every query still sees a key of the first block */
    const int64_t kbeg = a->window > 0 && p0 - a->window + 1 > 0 ? (p0 - a->window + 1) & ~1LL : 0;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lane16 = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
    for (int64_t j0 = kbeg; j0 < kend; j0 += BK) {
        const int64_t nk = kend - j0 < BK ? (kend - j0 + 1) & ~1LL : BK;  /* even: keys go in pairs */
        for (int64_t u0 = 0; u0 < nk; u0 += KU) {
            __m512 acc[KU][2];
            for (int u = 0; u < KU; u++) acc[u][0] = acc[u][1] = _mm512_setzero_ps();
            const uint32_t *kr = (const uint32_t *)(kb + (j0 + u0) * D);
            for (int64_t d2 = 0; d2 < D2; d2++) {
                __m512bh qa = (__m512bh)_mm512_loadu_si512(qt + d2 * BM), qb = (__m512bh)_mm512_loadu_si512(qt + d2 * BM + 16);
                for (int u = 0; u < KU; u++) {
                    __m512bh kk = (__m512bh)_mm512_set1_epi32((int)kr[u * D2 + d2]);
                    acc[u][0] = _mm512_dpbf16_ps(acc[u][0], qa, kk);
                    acc[u][1] = _mm512_dpbf16_ps(acc[u][1], qb, kk);
                }
            }
            for (int u = 0; u < KU && u0 + u < nk; u++) {
                int64_t j = j0 + u0 + u;
                __m512 s0 = acc[u][0], s1 = acc[u][1];
                if (j > p0) {  /* causal part: query t0 + i sees key j iff j <= p0 + i */
                    __m512i need = _mm512_set1_epi32((int)(j - p0));
                    s0 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmp_epi32_mask(lane, need, _MM_CMPINT_NLT), s0);
                    s1 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmp_epi32_mask(lane16, need, _MM_CMPINT_NLT), s1);
                }
                if (a->window > 0 && j <= p0 + BM - 1 - a->window) {  /* window: ... and j > p0 + i - W */
                    __m512i below = _mm512_set1_epi32((int)(j - p0 + a->window));
                    s0 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmp_epi32_mask(lane, below, _MM_CMPINT_LT), s0);
                    s1 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), _mm512_cmp_epi32_mask(lane16, below, _MM_CMPINT_LT), s1);
                }
                _mm512_storeu_ps(st + (u0 + u) * BM, s0);
                _mm512_storeu_ps(st + (u0 + u) * BM + 16, s1);
            }
        }
        __m512 b0 = m0, b1 = m1;
        for (int64_t j = 0; j < nk; j++) {
            b0 = _mm512_max_ps(b0, _mm512_loadu_ps(st + j * BM));
            b1 = _mm512_max_ps(b1, _mm512_loadu_ps(st + j * BM + 16));
        }
        /* every query sees a key of the first block, so after it no maximum is -inf */
        __m512 al0 = exp2_ps(_mm512_sub_ps(m0, b0)), al1 = exp2_ps(_mm512_sub_ps(m1, b1));
        if (j0 == kbeg) al0 = al1 = _mm512_setzero_ps();
        m0 = b0, m1 = b1;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0;
        for (int64_t j = 0; j < nk; j += 2) {
            __m512 pa0 = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(st + j * BM), m0));
            __m512 pa1 = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(st + j * BM + 16), m1));
            __m512 pb0 = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(st + (j + 1) * BM), m0));
            __m512 pb1 = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(st + (j + 1) * BM + 16), m1));
            s0 = _mm512_add_ps(s0, _mm512_add_ps(pa0, pb0));
            s1 = _mm512_add_ps(s1, _mm512_add_ps(pa1, pb1));
            _mm512_storeu_si512(pp + (j / 2) * BM, _mm512_or_si512(bf16_lanes(pa0), _mm512_slli_epi32(bf16_lanes(pb0), 16)));
            _mm512_storeu_si512(pp + (j / 2) * BM + 16, _mm512_or_si512(bf16_lanes(pa1), _mm512_slli_epi32(bf16_lanes(pb1), 16)));
        }
        l0 = _mm512_fmadd_ps(l0, al0, s0);
        l1 = _mm512_fmadd_ps(l1, al1, s1);
        const uint32_t *vr = vb + (j0 / 2) * D;
        for (int64_t d0 = 0; d0 < D; d0 += DU) {
            __m512 acc[DU][2];
            for (int u = 0; u < DU; u++) {
                acc[u][0] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + u) * BM), al0);
                acc[u][1] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + u) * BM + 16), al1);
            }
            for (int64_t j2 = 0; j2 < nk / 2; j2++) {
                __m512bh pa = (__m512bh)_mm512_loadu_si512(pp + j2 * BM), pb = (__m512bh)_mm512_loadu_si512(pp + j2 * BM + 16);
                for (int u = 0; u < DU; u++) {
                    __m512bh vv = (__m512bh)_mm512_set1_epi32((int)vr[j2 * D + d0 + u]);
                    acc[u][0] = _mm512_dpbf16_ps(acc[u][0], pa, vv);
                    acc[u][1] = _mm512_dpbf16_ps(acc[u][1], pb, vv);
                }
            }
            for (int u = 0; u < DU; u++) {
                _mm512_storeu_ps(ot + (d0 + u) * BM, acc[u][0]);
                _mm512_storeu_ps(ot + (d0 + u) * BM + 16, acc[u][1]);
            }
        }
    }
    float inv[BM];
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l0));
    _mm512_storeu_ps(inv + 16, _mm512_div_ps(_mm512_set1_ps(1.0f), l1));
    float *o = a->out + (h * a->G * T + g * T + t0) * D;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t d = 0; d < D; d++)
            o[i * D + d] = ot[d * BM + i] * inv[i];
}

/* The chunk's keys are part of the pieces: positions 0..start+T-1 in order. */
EXPORT int specache_prefill_attention(const PrefillArgs *a) {
    const int64_t H = a->H, G = a->G, T = a->T, D = a->D;
    if (D % 32 || D > 256 || D < 32 || a->npieces < 1 || a->npieces > 3 || T < 1) return 1;
    if (a->first < 0 || a->first > a->start || (a->window != 0 && a->window < BK)) return 1;
    int64_t N = 0;
    for (int64_t p = 0; p < a->npieces; p++) N += a->n[p];
    if (N != a->start + T - a->first) return 2;
    const int64_t npad = (N + BK - 1) / BK * BK;
    uint16_t *kb = aligned_alloc(64, (size_t)H * npad * D * sizeof(uint16_t));
    uint32_t *vb = aligned_alloc(64, (size_t)H * (npad / 2) * D * sizeof(uint32_t));
    const int64_t per_block = D / 2 * BM + BK * BM + BK / 2 * BM + D * BM;  /* floats of scratch */
    int nt = a->nthreads > 0 ? (int)a->nthreads : 1;
    float *scratch = aligned_alloc(64, (size_t)nt * per_block * sizeof(float));
    if (!kb || !vb || !scratch) {
        free(kb), free(vb), free(scratch);
        return 3;
    }
    const int64_t qblocks = (T + BM - 1) / BM, items = H * G * qblocks;
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static)
        for (int64_t h = 0; h < H; h++)
            pack_head(a, h, npad, kb + h * npad * D, vb + h * (npad / 2) * D);
#ifdef _OPENMP
        float *mine = scratch + (size_t)omp_get_thread_num() * per_block;
#else
        float *mine = scratch;
#endif
        /* latest blocks first: they see the most keys (dynamic scheduling balances the rest) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            int64_t b = qblocks - 1 - it / (H * G), hg = it % (H * G);
            query_block(a, hg / G, hg % G, b * BM, kb + (hg / G) * npad * D, vb + (hg / G) * (npad / 2) * D, mine);
        }
    }
    free(kb), free(vb), free(scratch);
    return 0;
}
#else
EXPORT int specache_prefill_attention(const void *a) {
    (void)a;
    return 1;
}
#endif
