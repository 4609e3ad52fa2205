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
 * Built into the same library as guide_kernels.c (engine/native/__init__.py).
 */
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "simd.h"

#define EXPORT __attribute__((visibility("default")))
#define INLINE static inline __attribute__((always_inline))
#define MAX_ROWS 8
#define PREFETCH 4096 /* bytes ahead: with it, 2 rows ran 57 -> 37 ms and 8 rows 97 -> 78 ms per 708 MB
                         of fp32 weights on the 2-core AVX-512 machine */

/* The vector instruction set the kernels were built for (simd.h). */
EXPORT const char *specache_native_isa(void) { return SIMD_ISA; }

/* ---- packed weights -------------------------------------------------------------------
 * Blocks of QB = 32 consecutive weights of one row (along K). Each block is stored as one
 * record, so a row is a single sequential stream:
 *   affine4: float d, float m, 16 bytes of codes; w[j] = fma(d, q[j], m), q in 0..15, byte j
 *            holds q[j] (low nibble) and q[j + 16] (high nibble)           (24 bytes / 32 weights)
 *   scaled8: float d, 32 int8 codes; w[j] = d * q[j]                        (36 bytes / 32 weights)
 * The packers accept a matrix only if every block rebuilds to exactly the given floats.
 * A GGUF's own 32-weight blocks keep their bytes, with fp16 scales, each row's split into its codes and then
 * its scales (the file interleaves them per block; apart, the codes are 16-byte aligned and a row's scales
 * convert 16 at a time, where one convert per block cost 2x):
 *   Q4_0 (fmt 2): row = nb x 16 code bytes as affine4's, nb x fp16 d; w[j] = fma(d, q[j], -8 d) = d (q[j] - 8)
 *   Q4_1 (fmt 3): row = nb x 16 code bytes, nb x fp16 d, nb x fp16 m; w[j] = fma(d, q[j], m)
 *   Q8_0 (fmt 9): row = nb x 32 int8 codes, nb x fp16 d; w[j] = d * q[j]
 *   Q5_0 (fmt 10), Q5_1 (fmt 11): row = nb x (16 bytes of low nibbles as Q4's + 4 bytes qh, the fifth bits),
 *                 nb x fp16 d, (Q5_1) nb x fp16 m; w[j] = fma(d, q[j], m), Q5_0's m = -16 d
 * (18, 20, 34, 22 and 24 bytes a block, as in the file; d * q is exact for an fp16 d and a 4- or 8-bit q, so each
 * weight is the gguf package's float.)
 * 16-bit weights as they are (a GGUF's F16 / BF16 tensors, a folder's 16-bit safetensors), K % 32 == 0:
 *   bf16 (fmt 12), f16 (fmt 13): row = K x 2 bytes; each weight converted to fp32 exactly (bf16: its bits << 16) */
#define QB 32
#define NV (QB / VW) /* vectors per block */
#define A4_BYTES 24
#define S8_BYTES 36
#define Q40_FMT 2
#define Q41_FMT 3
#define Q80_FMT 9
#define Q50_FMT 10
#define Q51_FMT 11
#define Q5_FMT(f) ((f) == Q50_FMT || (f) == Q51_FMT)
#define BF16_FMT 12
#define F16_FMT 13
#define HALF_FMT(f) ((f) == BF16_FMT || (f) == F16_FMT)
/* bytes of one 32-weight block record (fmt 0: 32 fp32 weights) */
#define BLOCK_BYTES(f) ((f) == 0 ? QB * 4 : (f) == 4 ? A4_BYTES : (f) == 8 ? S8_BYTES : (f) == Q40_FMT ? 18 \
                        : (f) == Q41_FMT ? 20 : (f) == Q50_FMT ? 22 : (f) == Q51_FMT ? 24 : HALF_FMT(f) ? QB * 2 : 34)
#define BLOCK_FMT(f) ((f) == 4 || (f) == 8 || (f) == Q40_FMT || (f) == Q41_FMT || (f) == Q80_FMT || Q5_FMT(f) \
                      || HALF_FMT(f))
#define CODES8(f) ((f) == 8 || (f) == Q80_FMT) /* 32 int8 codes, w = d * q; the others: 4-bit, w = fma(d, q, m) */
#define GGUF_BLOCK_FMT(f) ((f) == Q40_FMT || (f) == Q41_FMT || (f) == Q80_FMT || Q5_FMT(f)) /* fp16 scales */
#define SCALE_CHUNK 64 /* GGUF blocks whose scales are converted at a time */
#define CODE_BYTES(f) ((f) == Q80_FMT ? QB : Q5_FMT(f) ? QB / 2 + 4 : QB / 2) /* a GGUF block's codes (Q5: qs, qh) */
#define HAS_MIN(f) ((f) == Q41_FMT || (f) == Q51_FMT) /* a stored fp16 m; Q4_0 / Q5_0: m = -8 d / -16 d */

typedef struct { float d, m; uint8_t q[QB / 2]; } affine4_block;
typedef struct { float d; int8_t q[QB]; } scaled8_block;
_Static_assert(sizeof(affine4_block) == A4_BYTES, "affine4 record");
_Static_assert(sizeof(scaled8_block) == S8_BYTES, "scaled8 record");

/* An affine4 or scaled8 record's scale d, min m (affine4) and codes q, as floats and a pointer. */
INLINE void block_header(const void *src, const int fmt, float *d, float *m, const uint8_t **q) {
    const uint8_t *p = (const uint8_t *)src;
    memcpy(d, p, 4);
    if (fmt == 4) memcpy(m, p + 4, 4);
    *q = p + (fmt == 4 ? 8 : 4);
}

/* n fp16 values at h as floats (exact): 16, 8 or 4 at a time where the target converts vectors. */
INLINE void halves_to_floats(const uint8_t *h, int n, float *out) {
    int i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + 2 * i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 2 * i))));
#elif defined(__aarch64__) && defined(__ARM_NEON)
    for (; i + 4 <= n; i += 4) vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u8(vld1_u8(h + 2 * i))));
#endif
    for (; i < n; i++) {
        uint16_t v;
        memcpy(&v, h + 2 * i, 2);
        out[i] = half_to_float(v);
    }
}

/* d[i], m[i] (Q4_0: -8 d; Q5_0: -16 d; Q8_0: d only) of blocks [b, b + n) of a GGUF block row of nb blocks
 * (split layout). */
INLINE void gguf_block_scales(const uint8_t *row, const int fmt, int64_t nb, int64_t b, int n, float *d, float *m) {
    const uint8_t *dh = row + nb * CODE_BYTES(fmt);
    halves_to_floats(dh + 2 * b, n, d);
    if (HAS_MIN(fmt))
        halves_to_floats(dh + 2 * nb + 2 * b, n, m);
    else if (fmt == Q40_FMT || fmt == Q50_FMT)
        for (int i = 0; i < n; i++) m[i] = (fmt == Q40_FMT ? -8.0f : -16.0f) * d[i]; /* exact */
}

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

/* ---- GGUF Q6_K superblocks -------------------------------------------------------------
 * 256 consecutive weights of one row in 210 bytes, stored as the GGUF has them: ql[128] (low 4 bits
 * of the codes), qh[64] (high 2 bits), int8 sc[16] (one scale per 16 weights), fp16 d. Weight
 * i = 128 h + 32 c + t (half h 0..1, quarter c 0..3, t 0..31) has the 6-bit code
 *   q = (ql[64 h + 32 (c & 1) + t] >> 4 (c >> 1)) & 15  |  ((qh[32 h + t] >> 2 c) & 3) << 4
 * and the value w = (d * sc[i / 16]) * (q - 32): d * sc is exact in float (11 by 8 significant bits),
 * the product with q - 32 is rounded once -- gguf.quants.dequantize's floats and Q6KWeight.rows'.
 * The kernel decodes a superblock's codes and scales once (q6k_superblock), then feeds its eight
 * 32-weight chunks through the loop below like any other block (q6k_chunk_weights). */
#define Q6K_WEIGHTS 256
#define Q6K_BYTES 210
#define Q6K_CHUNKS (Q6K_WEIGHTS / QB)

/* codes[256] = q - 32 (int8, -32..31, in weight order) of a superblock's ql[128] and qh[64]. Per half h, the
 * 32 bytes L0 = ql[64 h ..], L1 = ql[64 h + 32 ..] and H = qh[32 h ..] give its four quarters as
 *   c 0: L0 & 15 | (H << 4) & 0x30    c 1: L1 & 15 | (H << 2) & 0x30
 *   c 2: L0 >> 4 | H & 0x30           c 3: L1 >> 4 | (H >> 2) & 0x30
 * (x86 shifts 16-bit lanes: the masks drop the bits a shift moves across bytes). */
INLINE void q6k_codes(const uint8_t *ql, const uint8_t *qh, int8_t codes[Q6K_WEIGHTS]) {
#if defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30), off = _mm256_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        const __m256i c[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2)),
            _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2))};
        for (int q = 0; q < 4; q++)
            _mm256_storeu_si256((__m256i *)(codes + 128 * h + 32 * q), _mm256_sub_epi8(c[q], off));
    }
#elif defined(__aarch64__) && defined(__ARM_NEON)
    const uint8x16_t m4 = vdupq_n_u8(15), m2 = vdupq_n_u8(0x30), off = vdupq_n_u8(32);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 32; t += 16) { /* bytes t .. t + 15 of each quarter */
            const uint8x16_t l0 = vld1q_u8(ql + 64 * h + t), l1 = vld1q_u8(ql + 64 * h + 32 + t);
            const uint8x16_t hb = vld1q_u8(qh + 32 * h + t);
            const uint8x16_t c[4] = {vorrq_u8(vandq_u8(l0, m4), vandq_u8(vshlq_n_u8(hb, 4), m2)),
                                     vorrq_u8(vandq_u8(l1, m4), vandq_u8(vshlq_n_u8(hb, 2), m2)),
                                     vorrq_u8(vshrq_n_u8(l0, 4), vandq_u8(hb, m2)),
                                     vorrq_u8(vshrq_n_u8(l1, 4), vandq_u8(vshrq_n_u8(hb, 2), m2))};
            for (int q = 0; q < 4; q++) vst1q_s8(codes + 128 * h + 32 * q + t, vreinterpretq_s8_u8(vsubq_u8(c[q], off)));
        }
#else
    for (int h = 0; h < 2; h++)
        for (int c = 0; c < 4; c++) {
            const uint8_t *lo = ql + 64 * h + 32 * (c & 1), *hi = qh + 32 * h;
            int8_t *out = codes + 128 * h + 32 * c;
            for (int t = 0; t < 32; t++)
                out[t] = (int8_t)((((lo[t] >> (4 * (c >> 1))) & 15) | (((hi[t] >> (2 * c)) & 3) << 4)) - 32);
        }
#endif
}

/* The superblock at p: codes[256] = q - 32 (q6k_codes) and scale[16] = d * sc (exact). */
INLINE void q6k_superblock(const uint8_t *p, int8_t codes[Q6K_WEIGHTS], float scale[16]) {
    const int8_t *sc = (const int8_t *)(p + 192);
    uint16_t dh;
    memcpy(&dh, p + 208, 2);
    const float d = half_to_float(dh);
    for (int s = 0; s < 16; s++) scale[s] = d * (float)sc[s];
    q6k_codes(p, p + 128, codes);
}

/* The 32 weights of one chunk (codes and its two scales from q6k_superblock) as NV vectors:
 * vector v holds weights v VW .. v VW + VW - 1, all under scale[v VW / 16]; one rounding each. */
INLINE void q6k_chunk_weights(const int8_t *codes, const float *scale, vf w[NV]) {
    for (int v = 0; v < NV; v++) w[v] = vf_mul(vf_set1(scale[v * VW / 16]), vf_from_i8(codes + v * VW));
}

/* ---- GGUF Q4_K and Q5_K superblocks ---------------------------------------------------
 * 256 consecutive weights of one row in eight chunks of 32, stored as the GGUF has them: fp16 d, fp16 dmin,
 * scales[12] (a 6-bit scale sc and min mn per chunk, gguf.quants.Q4_K.get_scale_min's packing), then, Q5_K only,
 * qh[32] (bit j of qh[t]: the fifth bit of chunk j's weight t), and qs[128]: chunk j = 2 i + h holds its low
 * four bits in nibble h of qs[32 i + t]. 144 bytes (Q4_K, 4.5 bits a weight) or 176 (Q5_K, 5.5 bits).
 * w = (d * sc) * q - dmin * mn: d * sc and dmin * mn are exact in float (11 by 6 significant bits) and so is
 * (d * sc) * q (by 4 or 5 more), so fma(d * sc, q, -(dmin * mn)) rounds once, to gguf.quants.dequantize's
 * float (and, for Q4_K, to the affine4 record's fma(d, q, m) that held these weights before). */
#define KQ_FMT(f) ((f) == 5 || (f) == 7)
#define SUPERBLOCK_FMT(f) ((f) == 6 || KQ_FMT(f))
#define Q4K_BYTES 144
#define Q5K_BYTES 176
#define SUPERBLOCK_BYTES(f) ((f) == 6 ? Q6K_BYTES : (f) == 5 ? Q5K_BYTES : Q4K_BYTES)

/* codes[256] = q (0..15 or 0..31, in weight order) of qs[128] and, for Q5_K, qh[32] (NULL for Q4_K).
 * (x86 shifts 16-bit lanes: the masks drop the bits a shift moves across bytes.) */
INLINE void kq_codes(const uint8_t *qs, const uint8_t *qh, int8_t codes[Q6K_WEIGHTS]) {
#if defined(__AVX2__)
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i hb = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256i b = _mm256_loadu_si256((const __m256i *)(qs + 32 * i));
        __m256i lo = _mm256_and_si256(b, m4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
        if (qh) {
            const __m256i h0 = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * i)), one);
            const __m256i h1 = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * i + 1)), one);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(h0, 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(h1, 4));
        }
        _mm256_storeu_si256((__m256i *)(codes + 64 * i), lo);
        _mm256_storeu_si256((__m256i *)(codes + 64 * i + 32), hi);
    }
#elif defined(__aarch64__) && defined(__ARM_NEON)
    const uint8x16_t m4 = vdupq_n_u8(15), one = vdupq_n_u8(1);
    for (int i = 0; i < 4; i++)
        for (int t = 0; t < 32; t += 16) { /* bytes t .. t + 15 of chunks 2 i and 2 i + 1 */
            const uint8x16_t b = vld1q_u8(qs + 32 * i + t);
            uint8x16_t lo = vandq_u8(b, m4), hi = vshrq_n_u8(b, 4);
            if (qh) {
                const uint8x16_t hb = vld1q_u8(qh + t);
                lo = vorrq_u8(lo, vshlq_n_u8(vandq_u8(vshlq_u8(hb, vdupq_n_s8((int8_t)(-2 * i))), one), 4));
                hi = vorrq_u8(hi, vshlq_n_u8(vandq_u8(vshlq_u8(hb, vdupq_n_s8((int8_t)(-2 * i - 1))), one), 4));
            }
            vst1q_s8(codes + 64 * i + t, vreinterpretq_s8_u8(lo));
            vst1q_s8(codes + 64 * i + 32 + t, vreinterpretq_s8_u8(hi));
        }
#else
    for (int j = 0; j < 8; j++)
        for (int t = 0; t < 32; t++) {
            const int lo = (qs[32 * (j / 2) + t] >> (4 * (j & 1))) & 15;
            codes[32 * j + t] = (int8_t)(qh ? lo | ((qh[t] >> j) & 1) << 4 : lo);
        }
#endif
}

/* The Q4_K (fmt 7) or Q5_K (fmt 5) superblock at p: codes[256] = q (kq_codes), and per chunk j
 * scale[j] = d * sc and minus[j] = -(dmin * mn) (both exact). */
INLINE void kq_superblock(const uint8_t *p, const int fmt, int8_t codes[Q6K_WEIGHTS], float scale[8], float minus[8]) {
    uint16_t dh, mh;
    memcpy(&dh, p, 2);
    memcpy(&mh, p + 2, 2);
    const float d = half_to_float(dh), dmin = half_to_float(mh);
    const uint8_t *s = p + 4;
    for (int j = 0; j < 8; j++) {
        const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
        scale[j] = d * (float)sc;
        minus[j] = -(dmin * (float)mn);
    }
    kq_codes(p + (fmt == 5 ? 48 : 16), fmt == 5 ? p + 16 : NULL, codes);
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

/* The 32 5-bit codes of a Q5_0 / Q5_1 block (split layout: qs[16] low nibbles as Q4's, then qh, 32 high
 * bits, bit j the fifth bit of weight j) as int8. */
INLINE void q5_codes(const uint8_t *q, int8_t codes[QB]) {
    uint32_t qh;
    memcpy(&qh, q + QB / 2, 4);
#if defined(__AVX2__)
    const __m128i b = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(15);
    const __m256i lo4 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m4), _mm_and_si128(b, m4));
    /* byte j of 32 gets bit j of qh: qh's byte j / 8 spread to 8 bytes, tested against 1 << (j % 8) */
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                                2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
    _mm256_storeu_si256((__m256i *)codes, _mm256_or_si256(lo4, high));
#else
    for (int j = 0; j < QB / 2; j++) {
        codes[j] = (int8_t)((q[j] & 15) | ((qh >> j) & 1) << 4);
        codes[j + QB / 2] = (int8_t)((q[j] >> 4) | ((qh >> (j + QB / 2)) & 1) << 4);
    }
#endif
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

/* Round to the nearest float with an fp16-sized mantissa (10 bits): the scale a GGUF stored. */
static float fp16_mantissa(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x1000u) & ~0x1FFFu;
    memcpy(&x, &u, 4);
    return x;
}

/* Returns 0 and fills out[N * K / 32 records] when W [N, K] is exactly affine4, 1 when it is not
 * (out is then garbage), -1 for bad arguments. */
EXPORT int specache_pack_affine4(const float *W, int64_t N, int64_t K, uint8_t *out) {
    if (N < 1 || K < QB || K % QB) return -1;
    for (int64_t b = 0; b < N * (K / QB); b++) {
        const float *w = W + b * QB;
        float lo = w[0], hi = w[0];
        for (int j = 1; j < QB; j++) { lo = w[j] < lo ? w[j] : lo; hi = w[j] > hi ? w[j] : hi; }
        const float d = fp16_mantissa((hi - lo) / 15.0f);
        affine4_block blk = {d, lo, {0}};
        for (int j = 0; j < QB; j++) {
            float q = d > 0.0f ? rintf((w[j] - lo) / d) : 0.0f;
            q = q < 0.0f ? 0.0f : (q > 15.0f ? 15.0f : q);
            if (fmaf(d, q, lo) != w[j]) return 1;
            blk.q[j % (QB / 2)] |= (uint8_t)((int)q << (j < QB / 2 ? 0 : 4));
        }
        memcpy(out + b * A4_BYTES, &blk, A4_BYTES);
    }
    return 0;
}

/* Same contract for scaled8 (out: N * K / 32 records of 36 bytes). */
EXPORT int specache_pack_scaled8(const float *W, int64_t N, int64_t K, uint8_t *out) {
    if (N < 1 || K < QB || K % QB) return -1;
    for (int64_t b = 0; b < N * (K / QB); b++) {
        const float *w = W + b * QB;
        float amax = 0.0f;
        for (int j = 0; j < QB; j++) amax = fabsf(w[j]) > amax ? fabsf(w[j]) : amax;
        scaled8_block blk = {amax / 127.0f, {0}};
        for (int j = 0; j < QB; j++) {
            float q = blk.d > 0.0f ? rintf(w[j] / blk.d) : 0.0f;
            q = q < -128.0f ? -128.0f : (q > 127.0f ? 127.0f : q);
            if (blk.d * q != w[j]) return 1;
            blk.q[j] = (int8_t)q;
        }
        memcpy(out + b * S8_BYTES, &blk, S8_BYTES);
    }
    return 0;
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
#define CASE(r) \
    case r * 16 + 0: linear_rows(x, x_s, W, 0, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 4: linear_rows(x, x_s, W, 4, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 8: linear_rows(x, x_s, W, 8, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 6: linear_rows(x, x_s, W, 6, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 5: linear_rows(x, x_s, W, 5, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 7: linear_rows(x, x_s, W, 7, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 2: linear_rows(x, x_s, W, 2, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 3: linear_rows(x, x_s, W, 3, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 9: linear_rows(x, x_s, W, 9, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 10: linear_rows(x, x_s, W, 10, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 11: linear_rows(x, x_s, W, 11, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 12: linear_rows(x, x_s, W, 12, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 13: linear_rows(x, x_s, W, 13, K, bias, y, y_s, n0, n1, r); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
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

static void linear_columns(const Linear *L, int64_t n0, int64_t n1) {
    linear_columns_of(L->x, L->x_s, L->R, L->fmt == 0 ? (const void *)L->W : (const void *)L->P, L->fmt, L->K,
                      L->bias, L->y, L->y_s, n0, n1);
}

/* Output columns [0, N), split evenly over the threads when there are enough of them. */
static void run_linear(const Linear *L, int64_t N, int64_t nthreads) {
    if (nthreads <= 1 || N < 256) {
        linear_columns(L, 0, N);
        return;
    }
#pragma omp parallel num_threads((int)nthreads)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        linear_columns(L, N * t / nt, N * (t + 1) / nt);
    }
}

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

/* Rebuild rows [n0, n1) of a packed weight into W [n1 - n0, K] fp32 (tests, and a check). */
EXPORT int specache_unpack(const uint8_t *P, int64_t fmt, int64_t n0, int64_t n1, int64_t K, float *W) {
    if (!valid_blocks(fmt, K) || n1 < n0) return -1;
    const int64_t per = SUPERBLOCK_FMT(fmt) ? Q6K_WEIGHTS : QB, nb = K / per; /* weights per block, blocks per row */
    const int64_t row_bytes = nb * (SUPERBLOCK_FMT(fmt) ? SUPERBLOCK_BYTES(fmt) : BLOCK_BYTES(fmt));
    for (int64_t n = n0; n < n1; n++)
        for (int64_t b = 0; b < nb; b++) unpack_block(P + n * row_bytes, nb, b, (int)fmt, W + (n - n0) * K + b * per);
    return 0;
}
