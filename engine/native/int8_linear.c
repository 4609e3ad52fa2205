/* Decode-step linears on GGUF block weights with int8 activations: the "int8" decode kernel, a declared
 * choice beside linear_kernels.c's exact one (engine/model/decode_kernels.py picks per machine and says so).
 *
 * The exact kernel rebuilds every weight in fp32 and multiplies it by the fp32 activation (its result is the
 * de-quantized fp32 model's bit for bit); that costs a float conversion and a fused multiply-add per weight,
 * and on a 2-core Zen 4 it ran Gemma 3 270M's linears at ~10 G weights/s, well below the memory bound. This
 * kernel, like llama.cpp's, quantizes each activation row once per call to int8 per 32 values (dx = amax / 127,
 * xq = nearbyint(x / dx)) and takes integer dot products of the weights' own codes with xq (AVX-512 VNNI
 * vpdpbusd, AVX2 vpmaddubsw, NEON sdot or smull; plain C elsewhere), one float scale per 32 (16 for Q6_K):
 *   w = d q + m (per block of 32; m = 0 for Q8_0 and Q6_K)  ->  sum w x = d dx sum(q xq) + m sum(x)
 * with sum(x) the exact float sum of the block's activations. Its error against the exact product is at most
 * sum over blocks of (dx / 2) sum |d q| (the rounding of xq) plus float rounding: engine/model/decode_kernels.py
 * holds the torch reference (the same quantization, in float64) and the tests hold the kernel to both.
 * Each activation row is quantized and summed alone, in the same order whatever the rows of the call, so
 * each row of an R-row call equals the 1-row call bit for bit (exact mode's verification needs it).
 *
 * Formats (linear_kernels.c, block_codes.h): Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 (fmt 2, 3, 9, 10, 11), Q4_K, Q5_K,
 * Q6_K (fmt 7, 5, 6). Others (affine4, scaled8, bf16, fp16) return -2: the caller takes the exact kernel.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include "simd.h"
#include "block_codes.h"
#include "columns.h"

#define EXPORT __attribute__((visibility("default")))
#define MAX_ROWS 8
#define AHEAD 2048 /* bytes prefetched ahead of the weight row being read */
#define INT8_FMT(f) (GGUF_BLOCK_FMT(f) || SUPERBLOCK_FMT(f))

/* One activation row quantized per 32 values: q[K] (int8 or int16), d[K / 32] (dx), s[K / 32] (the exact float
 * sums of x). */
typedef struct { const void *q; const float *d; const float *s; } QRow;
/* its quantized values from column k on, for an activation width of bits (8, 16) */
#define XQ(xr, k, bits) ((bits) == 8 ? (const void *)((const int8_t *)(xr).q + (k)) : (const void *)((const int16_t *)(xr).q + (k)))

/* ---- integer dot products of 32 codes with 32 int8 activations ----------------------------------------
 * dot32(w, x, sgn) -> lanes holding the products of weights 0..15 (lo) and 16..31 (hi) summed in int32;
 * sgn: w are signed int8 (-128..127: Q8_0, Q6_K's q - 32), else unsigned codes 0..63 (4- and 5-bit).
 * acc_add1 / acc_add2 multiply the lanes by one scale, or by s0 (lo) and s1 (hi), into a float accumulator. */
#if defined(__AVX2__)
typedef __m256 qacc;
typedef __m256i qlanes;
typedef __m256i qcodes; /* 32 codes in a register */
INLINE qcodes codes_at(const int8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE qacc acc_zero(void) { return _mm256_setzero_ps(); }
INLINE qlanes dot32(qcodes wv, const int8_t *x, const int sgn) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    if (sgn) { /* |w| times x with w's sign: an unsigned by signed product (|-128| = 128 as a byte) */
        xv = _mm256_sign_epi8(xv, wv);
        wv = _mm256_abs_epi8(wv);
    }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), wv, xv);
#else /* pairs of products fit int16: 2 * 128 * 127 < 32768 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), _mm256_set1_epi16(1));
#endif
}
INLINE qacc acc_add1(qacc acc, qlanes l, float s) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), _mm256_set1_ps(s), acc); }
INLINE qacc acc_add2(qacc acc, qlanes l, float s0, float s1) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(l), _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0)), acc);
}
INLINE qacc acc_plus(qacc a, qacc b) { return _mm256_add_ps(a, b); }
INLINE float acc_sum(qacc v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* 16 codes times 16 int16 activations: 8 int32 lanes */
INLINE __m256i dot16_i16(__m128i w, const int16_t *x) {
    const __m256i wv = _mm256_cvtepi8_epi16(w), xv = _mm256_loadu_si256((const __m256i *)x);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(_mm256_setzero_si256(), wv, xv);
#else
    return _mm256_madd_epi16(wv, xv);
#endif
}
/* acc + the 32 products of codes w with activations x (bits 8 or 16) scaled by s0 (weights 0..15) and s1
 * (16..31; two == 0: s0 for all 32) */
INLINE qacc dot_add(qacc acc, qcodes w, const void *x, const int sgn, const int bits, float s0, float s1,
                    const int two) {
    if (bits == 8) return two ? acc_add2(acc, dot32(w, (const int8_t *)x, sgn), s0, s1) : acc_add1(acc, dot32(w, (const int8_t *)x, sgn), s0);
    const __m256i lo = dot16_i16(_mm256_castsi256_si128(w), (const int16_t *)x);
    const __m256i hi = dot16_i16(_mm256_extracti128_si256(w, 1), (const int16_t *)x + 16);
    if (!two) return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_set1_ps(s0), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(s1), _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(s0), acc));
}
/* The 32 codes of a Q4_0 / Q4_1 block (16 bytes: weight j in the low nibble of byte j, j + 16 in the high one),
 * of a Q5_0 / Q5_1 block (those, then qh: bit j the fifth bit of weight j). */
INLINE qcodes q4_reg(const uint8_t *q) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
}
INLINE qcodes q5_reg(const uint8_t *q) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    uint32_t qh;
    memcpy(&qh, q + QB / 2, 4);
    return _mm256_or_si256(q4_reg(q), _mm256_maskz_mov_epi8((__mmask32)qh, _mm256_set1_epi8(16)));
#else
    int8_t codes[QB];
    q5_codes(q, codes);
    return codes_at(codes);
#endif
}
#elif defined(__aarch64__) && defined(__ARM_NEON)
typedef struct { float32x4_t lo, hi; } qacc;
typedef struct { int32x4_t lo, hi; } qlanes;
typedef const int8_t *qcodes; /* 32 codes in memory */
INLINE qcodes codes_at(const int8_t *p) { return p; }
INLINE qacc acc_zero(void) { return (qacc){vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)}; }
INLINE int32x4_t dot16(int8x16_t w, int8x16_t x) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), w, x);
#else /* two products per int16 lane: |sum| <= 2 * 128 * 127 < 32768 */
    return vpaddlq_s16(vmlal_high_s8(vmull_s8(vget_low_s8(w), vget_low_s8(x)), w, x));
#endif
}
INLINE qlanes dot32(const int8_t *w, const int8_t *x, const int sgn) {
    (void)sgn; /* signed products either way: unsigned codes are below 64 */
    return (qlanes){dot16(vld1q_s8(w), vld1q_s8(x)), dot16(vld1q_s8(w + 16), vld1q_s8(x + 16))};
}
INLINE qacc acc_add2(qacc acc, qlanes l, float s0, float s1) {
    return (qacc){vfmaq_n_f32(acc.lo, vcvtq_f32_s32(l.lo), s0), vfmaq_n_f32(acc.hi, vcvtq_f32_s32(l.hi), s1)};
}
INLINE qacc acc_add1(qacc acc, qlanes l, float s) { return acc_add2(acc, l, s, s); }
INLINE qacc acc_plus(qacc a, qacc b) { return (qacc){vaddq_f32(a.lo, b.lo), vaddq_f32(a.hi, b.hi)}; }
INLINE int32x4_t dot16_i16(const int8_t *w, const int16_t *x) { /* 16 codes times 16 int16 activations */
    const int8x16_t wv = vld1q_s8(w);
    const int16x8_t a = vmovl_s8(vget_low_s8(wv)), b = vmovl_high_s8(wv), xa = vld1q_s16(x), xb = vld1q_s16(x + 8);
    int32x4_t s = vmull_s16(vget_low_s16(a), vget_low_s16(xa));
    s = vmlal_high_s16(s, a, xa);
    s = vmlal_s16(s, vget_low_s16(b), vget_low_s16(xb));
    return vmlal_high_s16(s, b, xb);
}
INLINE qacc dot_add(qacc acc, const int8_t *w, const void *x, const int sgn, const int bits, float s0, float s1,
                    const int two) {
    const qlanes l = bits == 8 ? dot32(w, (const int8_t *)x, sgn)
                               : (qlanes){dot16_i16(w, (const int16_t *)x), dot16_i16(w + 16, (const int16_t *)x + 16)};
    return acc_add2(acc, l, s0, two ? s1 : s0);
}
INLINE float acc_sum(qacc v) { return vaddvq_f32(vaddq_f32(v.lo, v.hi)); }
#else
typedef float qacc;
typedef struct { int32_t lo, hi; } qlanes;
typedef const int8_t *qcodes; /* 32 codes in memory */
INLINE qcodes codes_at(const int8_t *p) { return p; }
INLINE qacc acc_zero(void) { return 0.0f; }
INLINE qlanes dot32(const int8_t *w, const int8_t *x, const int sgn) {
    (void)sgn;
    qlanes l = {0, 0};
    for (int j = 0; j < 16; j++) l.lo += (int32_t)w[j] * x[j];
    for (int j = 16; j < 32; j++) l.hi += (int32_t)w[j] * x[j];
    return l;
}
INLINE qacc acc_add2(qacc acc, qlanes l, float s0, float s1) { return acc + (float)l.lo * s0 + (float)l.hi * s1; }
INLINE qacc acc_add1(qacc acc, qlanes l, float s) { return acc + (float)(l.lo + l.hi) * s; }
INLINE qacc acc_plus(qacc a, qacc b) { return a + b; }
INLINE qacc dot_add(qacc acc, const int8_t *w, const void *x, const int sgn, const int bits, float s0, float s1,
                    const int two) {
    qlanes l = {0, 0};
    if (bits == 8) {
        l = dot32(w, (const int8_t *)x, sgn);
    } else {
        const int16_t *x16 = (const int16_t *)x;
        for (int j = 0; j < 16; j++) l.lo += (int32_t)w[j] * x16[j];
        for (int j = 16; j < 32; j++) l.hi += (int32_t)w[j] * x16[j];
    }
    return two ? acc_add2(acc, l, s0, s1) : acc_add1(acc, l, s0);
}
INLINE float acc_sum(qacc v) { return v; }
#endif

/* The 32 4-bit codes of a Q4_0 / Q4_1 block (16 bytes: weight j in the low nibble of byte j, j + 16 in the
 * high one) as bytes 0..15. */
INLINE void q4_codes(const uint8_t *q, int8_t codes[QB]) {
#if defined(__aarch64__) && defined(__ARM_NEON)
    const uint8x16_t b = vld1q_u8(q);
    vst1q_u8((uint8_t *)codes, vandq_u8(b, vdupq_n_u8(15)));
    vst1q_u8((uint8_t *)codes + 16, vshrq_n_u8(b, 4));
#else
    for (int j = 0; j < QB / 2; j++) {
        codes[j] = (int8_t)(q[j] & 15);
        codes[j + QB / 2] = (int8_t)(q[j] >> 4);
    }
#endif
}

/* Quantize row x[K] into q (int8 for bits 8, else int16), d, s (QRow): per 32 values, with top = 127 or 32767,
 * dx = amax / top, q = nearbyint(x * (top / amax)), s = their float sum in order. */
static void quantize_row(const float *x, int64_t K, const int bits, void *q, float *d, float *s) {
    const float top = bits == 8 ? 127.0f : 32767.0f;
    for (int64_t b = 0; b < K / QB; b++) {
        const float *v = x + b * QB;
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < QB; j++) {
            const float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
            sum += v[j];
        }
        const float inv = amax > 0.0f ? top / amax : 0.0f;
        for (int j = 0; j < QB; j++) {
            const float r = nearbyintf(v[j] * inv);
            if (bits == 8)
                ((int8_t *)q)[b * QB + j] = (int8_t)r;
            else
                ((int16_t *)q)[b * QB + j] = (int16_t)r;
        }
        d[b] = amax / top;
        s[b] = sum;
    }
}

/* The 32 codes of block b of a GGUF 32-weight block row (Q8_0: in place; Q4_0 / Q4_1, Q5_0 / Q5_1: decoded, in a
 * register where the target has them, else into codes). */
INLINE qcodes block_codes(const uint8_t *row, const int fmt, int64_t b, int8_t codes[QB]) {
    const uint8_t *p = row + b * CODE_BYTES(fmt);
    simd_prefetch(p + AHEAD);
    if (fmt == Q80_FMT) return codes_at((const int8_t *)p);
#if defined(__AVX2__)
    (void)codes;
    return Q5_FMT(fmt) ? q5_reg(p) : q4_reg(p);
#else
    if (Q5_FMT(fmt))
        q5_codes(p, codes);
    else
        q4_codes(p, codes);
    return codes_at(codes);
#endif
}

/* One weight row of a GGUF 32-weight block format (fmt 2, 3, 9, 10, 11) against R quantized rows: acc[r] and
 * acc[MAX_ROWS + r] (even and odd blocks: two chains, so one row is not bound by the add latency) get the
 * d dx sum(q xq) terms, msum[r] the m sum(x) ones. */
INLINE void block_row(const uint8_t *row, const int fmt, int64_t nb, const QRow *xr, const int R, const int bits,
                      qacc *acc, float *msum) {
    float dc[SCALE_CHUNK], mc[SCALE_CHUNK], sc[MAX_ROWS][SCALE_CHUNK];
    int8_t codes[2][QB];
    for (int64_t b0 = 0; b0 < nb; b0 += SCALE_CHUNK) {
        const int cnt = (int)(nb - b0 < SCALE_CHUNK ? nb - b0 : SCALE_CHUNK);
        gguf_block_scales(row, fmt, nb, b0, cnt, dc, mc);
        for (int r = 0; r < R; r++) { /* the blocks' scales d dx, and the m sum(x) terms, VW at a time */
            const float *xd = xr[r].d + b0, *xs = xr[r].s + b0;
            vf mv = vf_zero();
            int j = 0;
            for (; j + VW <= cnt; j += VW) {
                vf_store(sc[r] + j, vf_mul(vf_load(dc + j), vf_load(xd + j)));
                if (fmt != Q80_FMT) mv = vf_fma(vf_load(mc + j), vf_load(xs + j), mv);
            }
            float mt = fmt != Q80_FMT ? vf_hsum(mv) : 0.0f;
            for (; j < cnt; j++) {
                sc[r][j] = dc[j] * xd[j];
                if (fmt != Q80_FMT) mt += mc[j] * xs[j];
            }
            msum[r] += mt;
        }
        int j = 0;
        for (; j + 2 <= cnt; j += 2) {
            const qcodes w0 = block_codes(row, fmt, b0 + j, codes[0]), w1 = block_codes(row, fmt, b0 + j + 1, codes[1]);
            for (int r = 0; r < R; r++) {
                acc[r] = dot_add(acc[r], w0, XQ(xr[r], (b0 + j) * QB, bits), fmt == Q80_FMT, bits, sc[r][j], 0.0f, 0);
                acc[MAX_ROWS + r] = dot_add(acc[MAX_ROWS + r], w1, XQ(xr[r], (b0 + j + 1) * QB, bits), fmt == Q80_FMT, bits,
                                            sc[r][j + 1], 0.0f, 0);
            }
        }
        if (j < cnt) {
            const qcodes w0 = block_codes(row, fmt, b0 + j, codes[0]);
            for (int r = 0; r < R; r++)
                acc[r] = dot_add(acc[r], w0, XQ(xr[r], (b0 + j) * QB, bits), fmt == Q80_FMT, bits, sc[r][j], 0.0f, 0);
        }
    }
}

/* One weight row of Q4_K / Q5_K / Q6_K superblocks (fmt 7, 5, 6) against R quantized rows, as block_row. */
INLINE void superblock_row(const uint8_t *row, const int fmt, int64_t nsb, const QRow *xr, const int R,
                           const int bits, qacc *acc, float *msum) {
    int8_t codes[Q6K_WEIGHTS];
    float scale[16], minus[8];
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *p = row + sb * SUPERBLOCK_BYTES(fmt);
        for (int o = 0; o < SUPERBLOCK_BYTES(fmt); o += 64) simd_prefetch(p + AHEAD + o);
        if (fmt == 6)
            q6k_superblock(p, codes, scale); /* codes q - 32, scale per 16 */
        else
            kq_superblock(p, fmt, codes, scale, minus); /* codes q, scale and minus per 32 */
        for (int r = 0; r < R; r++) {
            const int64_t b = sb * Q6K_CHUNKS;
            const float *dx = xr[r].d + b;
            if (fmt != 6) {
                const float *xs = xr[r].s + b;
                msum[r] += ((minus[0] * xs[0] + minus[1] * xs[1]) + (minus[2] * xs[2] + minus[3] * xs[3]))
                         + ((minus[4] * xs[4] + minus[5] * xs[5]) + (minus[6] * xs[6] + minus[7] * xs[7]));
            }
            for (int j = 0; j < Q6K_CHUNKS; j++) {
                qacc *a = acc + (j & 1) * MAX_ROWS + r;
                const void *xq = XQ(xr[r], (b + j) * QB, bits);
                const qcodes w = codes_at(codes + j * QB);
                *a = fmt == 6 ? dot_add(*a, w, xq, 1, bits, scale[2 * j] * dx[j], scale[2 * j + 1] * dx[j], 1)
                              : dot_add(*a, w, xq, 0, bits, scale[j] * dx[j], 0.0f, 0);
            }
        }
    }
}

/* Output columns [n0, n1) of y for R quantized rows (R and fmt compile-time constants after inlining). */
INLINE void int8_rows(const QRow *xr, const uint8_t *W, const int fmt, int64_t K, const float *bias, float *y,
                      int64_t y_s, int64_t n0, int64_t n1, const int R, const int bits) {
    const int64_t row_bytes = SUPERBLOCK_FMT(fmt) ? K / Q6K_WEIGHTS * SUPERBLOCK_BYTES(fmt) : K / QB * BLOCK_BYTES(fmt);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = W + n * row_bytes;
        qacc acc[2 * MAX_ROWS];
        float msum[MAX_ROWS];
        for (int r = 0; r < R; r++) acc[r] = acc[MAX_ROWS + r] = acc_zero(), msum[r] = 0.0f;
        if (SUPERBLOCK_FMT(fmt))
            superblock_row(row, fmt, K / Q6K_WEIGHTS, xr, R, bits, acc, msum);
        else
            block_row(row, fmt, K / QB, xr, R, bits, acc, msum);
        for (int r = 0; r < R; r++) {
            const float s = acc_sum(acc_plus(acc[r], acc[MAX_ROWS + r])) + msum[r];
            y[r * y_s + n] = bias ? s + bias[n] : s;
        }
    }
}

#define INT8_CASE(r, f) \
    case r * 16 + f: \
        if (bits == 8) int8_rows(xr, W, f, K, bias, y, y_s, n0, n1, r, 8); \
        else int8_rows(xr, W, f, K, bias, y, y_s, n0, n1, r, 16); \
        break;
#define INT8_CASES(r) INT8_CASE(r, 2) INT8_CASE(r, 3) INT8_CASE(r, 5) INT8_CASE(r, 6) INT8_CASE(r, 7) INT8_CASE(r, 9) \
    INT8_CASE(r, 10) INT8_CASE(r, 11)

/* Rows, format and activation width as compile-time constants. */
static void int8_columns(const QRow *xr, int64_t R, const uint8_t *W, int fmt, int64_t K, const float *bias,
                         float *y, int64_t y_s, int64_t n0, int64_t n1, int bits) {
    switch (R * 16 + fmt) {
        INT8_CASES(1) INT8_CASES(2) INT8_CASES(3) INT8_CASES(4) INT8_CASES(5) INT8_CASES(6) INT8_CASES(7) INT8_CASES(8)
    default: break;
    }
}

typedef struct {  /* int8_columns' arguments but the columns (split_columns' ctx) */
    const QRow *xr;
    int64_t R;
    const uint8_t *W;
    int fmt;
    int64_t K;
    const float *bias;
    float *y;
    int64_t y_s;
    int bits;
} Int8Call;

static void int8_call_columns(const void *ctx, int64_t n0, int64_t n1) {
    const Int8Call *c = ctx;
    int8_columns(c->xr, c->R, c->W, c->fmt, c->K, c->bias, c->y, c->y_s, n0, n1, c->bits);
}

/* y[r, n] = sum_k x[r, k] W[n, k] (+ bias[n]) for r < R <= 8, W a GGUF block weight (fmt, layout as
 * specache_packed_linear's), x quantized per row to int8 (bits 8) or int16 (bits 16) per 32 (above). Returns 0;
 * -1 for bad arguments; -2 where fmt is not one this kernel takes (nothing written: take
 * specache_packed_linear); -3 out of memory. */
EXPORT int specache_int8_linear(const float *x, int64_t x_s, int64_t R, const uint8_t *P, int64_t fmt, int64_t N,
                                int64_t K, const float *bias, float *y, int64_t y_s, int64_t nthreads, int64_t bits) {
    if (R < 1 || R > MAX_ROWS || N < 0 || K < QB || (bits != 8 && bits != 16)) return -1;
    if (!INT8_FMT(fmt)) return -2;
    if (K % (SUPERBLOCK_FMT(fmt) ? Q6K_WEIGHTS : QB)) return -1;
    const int64_t nb = K / QB, qbytes = R * K * (bits / 8);
    uint8_t *buf = malloc((size_t)(qbytes + 2 * R * nb * (int64_t)sizeof(float)));
    if (!buf) return -3;
    QRow xr[MAX_ROWS];
    float *f = (float *)(buf + qbytes); /* a multiple of 32 bytes: aligned */
    for (int64_t r = 0; r < R; r++) {
        void *q = buf + r * K * (bits / 8);
        quantize_row(x + r * x_s, K, (int)bits, q, f + 2 * r * nb, f + (2 * r + 1) * nb);
        xr[r] = (QRow){q, f + 2 * r * nb, f + (2 * r + 1) * nb};
    }
    const Int8Call call = {xr, R, P, (int)fmt, K, bias, y, y_s, (int)bits};
    split_columns(N, nthreads, int8_call_columns, &call);
    free(buf);
    return 0;
}

/* The quantization of one row as the kernel makes it (tests: the torch reference takes the same values):
 * x[K] -> q[K] (int8 or int16 for bits 8 or 16), d[K / 32], s[K / 32]. Returns 0, or -1 for bad arguments. */
EXPORT int specache_int8_quantize_row(const float *x, int64_t K, int64_t bits, void *q, float *d, float *s) {
    if (K < QB || K % QB || (bits != 8 && bits != 16)) return -1;
    quantize_row(x, K, (int)bits, q, d, s);
    return 0;
}
