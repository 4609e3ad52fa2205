/* The block formats of the decode linears (numbered as engine/model/block_formats.py numbers them) and their decoders, shared by the
 * fp32-exact kernel (linear_kernels.c) and the int8-activation kernel (int8_linear.c): format numbers, byte
 * layouts, fp16 scales, and the codes of Q6_K, Q4_K / Q5_K superblocks and Q5_0 / Q5_1 blocks. */
#ifndef SPECACHE_BLOCK_CODES_H
#define SPECACHE_BLOCK_CODES_H

#include <stdint.h>
#include <string.h>

#include "simd.h"

#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

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


#endif
