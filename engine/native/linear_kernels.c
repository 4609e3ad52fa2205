/* Native CPU kernel for decode-step linears: y = x @ W^T (+ bias) for a few rows of x.
 *
 * A decode step multiplies 1-8 activation rows by every weight matrix of the model, so it
 * is bound by reading the weights once. The CPU BLAS behind torch reads them at about half
 * the memory bandwidth for such skinny shapes (measured on a 2-core AVX-512 machine: 11-14
 * GB/s vs 25 GB/s for a plain sequential sum); this kernel streams the weight rows in memory
 * order through VW-wide fused multiply-adds against all activation rows (simd.h: 16 lanes with
 * AVX-512, 8 with AVX2 + FMA, 4 with NEON or plain C), so each weight byte is read once per
 * call. Summation order differs from the BLAS: results agree to float rounding.
 *
 * Packed weights (below): a weight matrix whose values are exactly those of a block format
 * (the embedded model's GGUF stores its linears as Q4_1 and its embedding as Q8_0, and the
 * fp32 copy transformers makes is their exact dequantization) is kept a second time in that
 * format, 5 or 9 bits per weight instead of 32. The kernels rebuild each weight bit-exactly
 * and feed it through the same loop as the fp32 kernel (one function, the weight source a
 * compile-time argument), so their results equal the fp32 kernel's bit for bit on every
 * target; they only read 6.4x (4-bit) or 3.6x (8-bit) fewer bytes. GGUF Q6_K weights are read
 * in their own 210-byte superblocks of 256 weights the same way (4.9x fewer bytes than fp32), and Q4_K / Q5_K
 * in their 144- / 176-byte ones (7.1x / 5.8x fewer).
 *
 * Built into the same library as guide_kernels.c (engine/native/__init__.py); the packers of fp32 weights
 * into affine4 / scaled8 blocks are pack_kernels.c's.
 */
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "simd.h"
#include "block_codes.h"
#include "columns.h"

#define EXPORT __attribute__((visibility("default")))
#define INLINE static inline __attribute__((always_inline))
#define MAX_ROWS 8
#define PREFETCH 4096 /* bytes ahead: with it, 2 rows ran 57 -> 37 ms and 8 rows 97 -> 78 ms per 708 MB
                         of fp32 weights on the 2-core AVX-512 machine */

/* The vector instruction set the kernels were built for (simd.h). */
EXPORT const char *specache_native_isa(void) { return SIMD_ISA; }


/* 32 bf16 or fp16 weights at h as floats (exact conversions: a bf16's bits are a float's upper half). */
INLINE void half_weights(const uint8_t *h, const int fmt, float out[QB]) {
    if (fmt == F16_FMT) {
        halves_to_floats(h, QB, out);
        return;
    }
    int j = 0;
#if defined(__AVX512F__)
    for (; j < QB; j += 16)
        _mm512_storeu_si512(out + j, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(h + 2 * j))), 16));
#elif defined(__AVX2__)
    for (; j < QB; j += 8)
        _mm256_storeu_si256((__m256i *)(out + j),
                            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + 2 * j))), 16));
#elif defined(__aarch64__) && defined(__ARM_NEON)
    for (; j < QB; j += 4) vst1q_u32((uint32_t *)(out + j), vshll_n_u16(vld1_u16((const uint16_t *)(h + 2 * j)), 16));
#endif
    for (; j < QB; j++) {
        uint16_t b;
        memcpy(&b, h + 2 * j, 2);
        const uint32_t u = (uint32_t)b << 16;
        memcpy(out + j, &u, 4);
    }
}

/* The 32 weights of the block record at p as NV vectors (fmt a compile-time constant after
 * inlining; fmt 0 reads 32 fp32 weights). Every target rebuilds the same floats: fma(d, q, m)
 * rounded once (an AVX-512 table of the 16 values fma(d, i, m) is the same numbers) and d * q. */
INLINE void block_weights(const void *src, const int fmt, vf w[NV], const float *dc, const float *mc) {
    if (fmt == 0) {
        for (int v = 0; v < NV; v++) w[v] = vf_load((const float *)src + v * VW);
        return;
    }
    if (HALF_FMT(fmt)) { /* 16-bit weights, converted exactly: then as fp32's */
        float f[QB];
        half_weights((const uint8_t *)src, fmt, f);
        for (int v = 0; v < NV; v++) w[v] = vf_load(f + v * VW);
        return;
    }
    float d, m;
    const uint8_t *q;
    if (GGUF_BLOCK_FMT(fmt)) { /* src: the block's codes; the scales converted beforehand (gguf_block_scales) */
        d = *dc, m = *mc;
        q = (const uint8_t *)src;
    } else {
        block_header(src, fmt, &d, &m, &q);
    }
    if (CODES8(fmt)) {
        const vf dv = vf_set1(d);
        for (int v = 0; v < NV; v++) w[v] = vf_mul(dv, vf_from_i8(q + v * VW));
        return;
    }
#if VW == 16
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 tbl = _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(m));
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    w[0] = _mm512_permutexvar_ps(idx, tbl); /* uses the low 4 bits of each lane */
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), tbl);
#elif VW == 8 /* AVX2 */
    const __m128i b = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), mv);
    w[1] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo))), mv);
    w[2] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), mv);
    w[3] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi))), mv);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    const uint8x16_t b = vld1q_u8(q);
    const uint8x16_t half[2] = {vandq_u8(b, vdupq_n_u8(15)), vshrq_n_u8(b, 4)};
    const float32x4_t dv = vdupq_n_f32(d), mv = vdupq_n_f32(m);
    for (int h = 0; h < 2; h++) {
        const uint16x8_t a = vmovl_u8(vget_low_u8(half[h])), c = vmovl_u8(vget_high_u8(half[h]));
        w[4 * h + 0] = vfmaq_f32(mv, dv, vcvtq_f32_u32(vmovl_u16(vget_low_u16(a))));
        w[4 * h + 1] = vfmaq_f32(mv, dv, vcvtq_f32_u32(vmovl_u16(vget_high_u16(a))));
        w[4 * h + 2] = vfmaq_f32(mv, dv, vcvtq_f32_u32(vmovl_u16(vget_low_u16(c))));
        w[4 * h + 3] = vfmaq_f32(mv, dv, vcvtq_f32_u32(vmovl_u16(vget_high_u16(c))));
    }
#else
    const vf dv = vf_set1(d), mv = vf_set1(m);
    for (int v = 0; v < NV; v++) {
        float c[VW];
        for (int i = 0; i < VW; i++) {
            const int j = v * VW + i;
            c[i] = (float)(j < QB / 2 ? q[j] & 15 : q[j - QB / 2] >> 4);
        }
        w[v] = vf_fmaf(dv, vf_load(c), mv);
    }
#endif
}

/* The 32 weights of one chunk (codes and its two scales from q6k_superblock) as NV vectors:
 * vector v holds weights v VW .. v VW + VW - 1, all under scale[v VW / 16]; one rounding each. */
INLINE void q6k_chunk_weights(const int8_t *codes, const float *scale, vf w[NV]) {
    for (int v = 0; v < NV; v++) w[v] = vf_mul(vf_set1(scale[v * VW / 16]), vf_from_i8(codes + v * VW));
}


/* The 32 weights of one chunk as NV vectors: fma(scale, q, minus), one rounding each (AVX-512: looked up
 * in a table of the 16 or 32 values fma(scale, i, minus), the same numbers, as affine4 does). */
INLINE void kq_chunk_weights(const int8_t *codes, const int fmt, float scale, float minus, vf w[NV]) {
    const vf sv = vf_set1(scale), mv = vf_set1(minus);
#if VW == 16
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lo = _mm512_fmadd_ps(sv, iota, mv);
    const __m512 hi = _mm512_fmadd_ps(sv, _mm512_add_ps(iota, _mm512_set1_ps(16.0f)), mv);
    for (int v = 0; v < NV; v++) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + v * VW)));
        w[v] = fmt == 5 ? _mm512_permutex2var_ps(lo, idx, hi) : _mm512_permutexvar_ps(idx, lo);
    }
#else
    (void)fmt;
    for (int v = 0; v < NV; v++) w[v] = vf_fmaf(sv, vf_from_i8(codes + v * VW), mv);
#endif
}

/* acc[r] += the even vectors, acc2[r] += the odd vectors of block weights w times x's row r at column k. */
INLINE void accumulate(const vf w[NV], const float *x, int64_t x_s, int64_t k, const int R, vf *acc, vf *acc2) {
    for (int v = 0; v < NV; v += 2) /* (x + r * x_s + k) + v * VW: one address register per row */
        for (int r = 0; r < R; r++) {
            acc[r] = vf_fma(w[v], vf_load(x + r * x_s + k + v * VW), acc[r]);
            acc2[r] = vf_fma(w[v + 1], vf_load(x + r * x_s + k + (v + 1) * VW), acc2[r]);
        }
}

/* A Q5_0 / Q5_1 block's weights fma(d, q, m) (Q5_0: m = -16 d, so d (q - 16), exact): the gguf package's floats. */
INLINE void q5_block_weights(const uint8_t *q, float d, float m, vf w[NV]) {
    int8_t codes[QB];
    q5_codes(q, codes);
    kq_chunk_weights(codes, 5, d, m, w); /* Q5_K's 32-entry table on AVX-512, fmaf elsewhere */
}

/* Output columns [n0, n1) of y[R, N] for R activation rows (R and fmt compile-time constants
 * after inlining; fmt 0: W is fp32 [N, K], 4 / 8 packed records, 6 / 7 / 5 Q6_K / Q4_K / Q5_K superblocks). One weight row at a time, in
 * memory order: a single sequential stream, which the hardware prefetcher follows at full
 * bandwidth (interleaving several weight rows measured ~40% slower), plus a software prefetch
 * a few KiB ahead, which the hardware prefetcher alone did not match when several activation
 * rows make the loop longer. Every activation row uses two accumulator chains (even and odd
 * vectors), so one row is not bound by the add latency, and a row's sum is the same whatever the
 * number of rows in the call (R): each row of an R-row call equals the 1-row call bit for bit, so
 * exact mode's verification (gamma + 1 rows) reproduces the full cache's one-row steps. The fp32
 * kernel and the packed one run the same multiply-adds in the same order: the same result bit
 * for bit. */
INLINE void linear_rows(const float *x, int64_t x_s, const void *W, const int fmt, int64_t K, const float *bias,
                        float *y, int64_t y_s, int64_t n0, int64_t n1, const int R) {
    const int64_t nb = K / QB, rec = SUPERBLOCK_FMT(fmt) ? 0 : GGUF_BLOCK_FMT(fmt) ? CODE_BYTES(fmt) : BLOCK_BYTES(fmt);
    const int64_t row_bytes = SUPERBLOCK_FMT(fmt) ? K / Q6K_WEIGHTS * SUPERBLOCK_BYTES(fmt) : fmt == 0 ? K * 4
                                                                                         : nb * BLOCK_BYTES(fmt);
    const int64_t kv = fmt == 0 ? K / VW * VW : K; /* fp32: vectors past the last whole block, then scalars */
    int8_t codes[Q6K_WEIGHTS]; /* Q4_K / Q5_K / Q6_K: the current superblock, decoded */
    float scale[16], minus[8];
    float dc[SCALE_CHUNK], mc[SCALE_CHUNK]; /* GGUF 32-weight blocks: d and m of the row's current chunk of blocks */
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = (const uint8_t *)W + n * row_bytes;
        vf acc[MAX_ROWS], acc2[MAX_ROWS]; /* even and odd vectors of each row */
        for (int r = 0; r < R; r++) acc[r] = acc2[r] = vf_zero();
        if (GGUF_BLOCK_FMT(fmt)) { /* chunks of blocks: their scales converted, then the blocks */
            for (int64_t b0 = 0; b0 < nb; b0 += SCALE_CHUNK) {
                const int cnt = (int)(nb - b0 < SCALE_CHUNK ? nb - b0 : SCALE_CHUNK);
                gguf_block_scales(row, fmt, nb, b0, cnt, dc, mc);
                for (int j = 0; j < cnt; j++) {
                    const uint8_t *p = row + (b0 + j) * rec;
                    simd_prefetch(p + PREFETCH / 2);
                    vf w[NV];
                    if (Q5_FMT(fmt))
                        q5_block_weights(p, dc[j], mc[j], w);
                    else
                        block_weights(p, fmt, w, dc + j, mc + j);
                    accumulate(w, x, x_s, (b0 + j) * QB, R, acc, acc2);
                }
            }
        }
        for (int64_t b = 0; b < nb && !GGUF_BLOCK_FMT(fmt); b++) {
            vf w[NV];
            if (SUPERBLOCK_FMT(fmt)) { /* chunk b % 8 of superblock b / 8 */
                const int j = (int)(b % Q6K_CHUNKS);
                if (j == 0) {
                    const uint8_t *p = row + b / Q6K_CHUNKS * SUPERBLOCK_BYTES(fmt);
                    for (int o = 0; o < SUPERBLOCK_BYTES(fmt); o += 64) simd_prefetch(p + PREFETCH / 2 + o);
                    if (fmt == 6)
                        q6k_superblock(p, codes, scale);
                    else
                        kq_superblock(p, fmt, codes, scale, minus);
                }
                if (fmt == 6)
                    q6k_chunk_weights(codes + j * QB, scale + j * (QB / 16), w);
                else
                    kq_chunk_weights(codes + j * QB, fmt, scale[j], minus[j], w);
            } else {
                const uint8_t *p = row + b * rec;
                simd_prefetch(p + (fmt == 0 ? PREFETCH : PREFETCH / 2));
                if (fmt == 0) simd_prefetch(p + PREFETCH + 64); /* an fp32 block is two cache lines */
                block_weights(p, fmt, w, NULL, NULL);
            }
            accumulate(w, x, x_s, b * QB, R, acc, acc2);
        }
        const float *wf = (const float *)row;
        for (int64_t k = nb * QB; k + VW <= kv; k += VW) /* fp32 only: K % 32 != 0 */
            for (int r = 0; r < R; r++) acc[r] = vf_fma(vf_load(wf + k), vf_load(x + r * x_s + k), acc[r]);
        for (int r = 0; r < R; r++) {
            float s = vf_hsum(vf_add(acc[r], acc2[r]));
            for (int64_t j = kv / VW * VW; fmt == 0 && j < K; j++) s += wf[j] * x[r * x_s + j];
            y[r * y_s + n] = bias ? s + bias[n] : s;
        }
    }
}

/* Rebuild the 32 weights of block b of a row into w[32] (fmt 5, 6, 7: the 256 of superblock b into w[256])
 * (the portable path and the tests). */
static void unpack_block(const uint8_t *row, int64_t nb, int64_t b, int fmt, float *w) {
    if (fmt == 6) { /* superblock b: 256 weights */
        int8_t codes[Q6K_WEIGHTS];
        float scale[16];
        q6k_superblock(row + b * Q6K_BYTES, codes, scale);
        for (int i = 0; i < Q6K_WEIGHTS; i++) w[i] = scale[i / 16] * (float)codes[i];
    } else if (KQ_FMT(fmt)) { /* superblock b: 256 weights */
        int8_t codes[Q6K_WEIGHTS];
        float scale[8], minus[8];
        kq_superblock(row + b * SUPERBLOCK_BYTES(fmt), fmt, codes, scale, minus);
        for (int i = 0; i < Q6K_WEIGHTS; i++) w[i] = fmaf(scale[i / QB], (float)codes[i], minus[i / QB]);
    } else if (HALF_FMT(fmt)) {
        half_weights(row + b * BLOCK_BYTES(fmt), fmt, w);
    } else {
        float d, m;
        const uint8_t *q;
        if (GGUF_BLOCK_FMT(fmt)) {
            gguf_block_scales(row, fmt, nb, b, 1, &d, &m);
            q = row + b * CODE_BYTES(fmt);
        } else {
            block_header(row + b * BLOCK_BYTES(fmt), fmt, &d, &m, &q);
        }
        if (Q5_FMT(fmt)) {
            int8_t codes[QB];
            q5_codes(q, codes);
            for (int j = 0; j < QB; j++) w[j] = fmaf(d, (float)codes[j], m);
        } else if (CODES8(fmt)) {
            for (int j = 0; j < QB; j++) w[j] = d * (float)(int8_t)q[j];
        } else {
            for (int j = 0; j < QB / 2; j++) {
                w[j] = fmaf(d, (float)(q[j] & 15), m);
                w[j + QB / 2] = fmaf(d, (float)(q[j] >> 4), m);
            }
        }
    }
}

/* Rows and format as compile-time constants. */
static void linear_columns_of(const float *x, int64_t x_s, int64_t R, const void *W, int fmt, int64_t K,
                              const float *bias, float *y, int64_t y_s, int64_t n0, int64_t n1) {
    switch (R * 16 + fmt) {
#define CASE1(r, f) case r * 16 + f: linear_rows(x, x_s, W, f, K, bias, y, y_s, n0, n1, r); break;
#define CASE(r) CASE1(r, 0) CASE1(r, 4) CASE1(r, 8) CASE1(r, 6) CASE1(r, 5) CASE1(r, 7) CASE1(r, 2) CASE1(r, 3) \
    CASE1(r, 9) CASE1(r, 10) CASE1(r, 11) CASE1(r, 12) CASE1(r, 13)
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
#undef CASE1
    default: break;
    }
}

/* One call's operands: W (fp32, fmt 0) or P (a packed weight, fmt 4 or 8, or Q6_K, Q4_K, Q5_K: fmt 6, 7, 5), as the entry points
 * below take them. */
typedef struct {
    const float *x;
    int64_t x_s, R;
    const float *W;
    const uint8_t *P;
    int fmt;
    int64_t K;
    const float *bias;
    float *y;
    int64_t y_s;
} Linear;

static void linear_columns(const void *ctx, int64_t n0, int64_t n1) {
    const Linear *L = ctx;
    linear_columns_of(L->x, L->x_s, L->R, L->fmt == 0 ? (const void *)L->W : (const void *)L->P, L->fmt, L->K,
                      L->bias, L->y, L->y_s, n0, n1);
}

/* Output columns [0, N), split evenly over the threads when there are enough of them. */
static void run_linear(const Linear *L, int64_t N, int64_t nthreads) { split_columns(N, nthreads, linear_columns, L); }

/* y[r, n] = sum_k x[r, k] * W[n, k] (+ bias[n]) for r < R <= 8.
 * x: fp32, row r at x + r * x_s (contiguous along k); W: fp32 [N, K] contiguous;
 * bias: fp32 [N] or NULL; y: fp32, row r at y + r * y_s. Returns 0, or -1 for bad arguments. */
EXPORT int specache_skinny_linear(const float *x, int64_t x_s, int64_t R, const float *W, int64_t N, int64_t K,
                                  const float *bias, float *y, int64_t y_s, int64_t nthreads) {
    if (R < 1 || R > MAX_ROWS || N < 0 || K < 1) return -1;
    const Linear L = {x, x_s, R, W, NULL, 0, K, bias, y, y_s};
    run_linear(&L, N, nthreads);
    return 0;
}

/* Whether fmt is a block format and K a row length it takes: 2, 3, 4, 8, 9, 10, 11, 12, 13 (K % 32 == 0), 5, 6, 7
 * (K % 256 == 0). */
static int valid_blocks(int64_t fmt, int64_t K) {
    return SUPERBLOCK_FMT(fmt) ? K >= Q6K_WEIGHTS && K % Q6K_WEIGHTS == 0 : BLOCK_FMT(fmt) && K >= QB && K % QB == 0;
}

/* specache_skinny_linear for a packed weight (fmt 4: affine4, 8: scaled8, P as the packers wrote it; 2, 3, 9,
 * 10, 11: the GGUF's Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 blocks, each row's codes then its scales; 12, 13: bf16 / fp16 [N, K];
 * 6, 7, 5: the GGUF's Q6_K, Q4_K, Q5_K superblocks, P [N, K / 256 * 210, 144 or 176] bytes). The result equals specache_skinny_linear's
 * on the weight the blocks rebuild (specache_unpack) bit for bit. */
EXPORT int specache_packed_linear(const float *x, int64_t x_s, int64_t R, const uint8_t *P, int64_t fmt, int64_t N,
                                  int64_t K, const float *bias, float *y, int64_t y_s, int64_t nthreads) {
    if (R < 1 || R > MAX_ROWS || N < 0 || !valid_blocks(fmt, K)) return -1;
    const Linear L = {x, x_s, R, NULL, P, (int)fmt, K, bias, y, y_s};
    run_linear(&L, N, nthreads);
    return 0;
}

/* Rebuild rows [n0, n1) of a packed weight into W [n1 - n0, K]: fp32, or (bf16 != 0) bf16 rounded to nearest even
 * as torch converts (a bf16 prefill's weight tile, rebuilt without an fp32 copy); rows split over nthreads. */
EXPORT int specache_unpack(const uint8_t *P, int64_t fmt, int64_t n0, int64_t n1, int64_t K, void *W, int64_t bf16,
                           int64_t nthreads) {
    if (!valid_blocks(fmt, K) || n1 < n0) return -1;
    const int64_t per = SUPERBLOCK_FMT(fmt) ? Q6K_WEIGHTS : QB, nb = K / per; /* weights per block, blocks per row */
    const int64_t row_bytes = nb * (SUPERBLOCK_FMT(fmt) ? SUPERBLOCK_BYTES(fmt) : BLOCK_BYTES(fmt));
#pragma omp parallel for num_threads((int)nthreads) schedule(static) if (nthreads > 1 && (n1 - n0) * K >= 1 << 18)
    for (int64_t n = n0; n < n1; n++) {
        float w[Q6K_WEIGHTS];
        for (int64_t b = 0; b < nb; b++) {
            float *out = bf16 ? w : (float *)W + (n - n0) * K + b * per;
            unpack_block(P + n * row_bytes, nb, b, (int)fmt, out);
            for (int64_t i = 0; bf16 && i < per; i++) {
                uint32_t u;
                memcpy(&u, &w[i], 4);
                ((uint16_t *)W)[(n - n0) * K + b * per + i] = (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
            }
        }
    }
    return 0;
}
