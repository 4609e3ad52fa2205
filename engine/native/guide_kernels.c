/* Native CPU kernels for the SpeCache guide (engine/kvcache/quant.py): scores q @ K^T and the
 * weighted sum p @ V over 1/2-bit packed KIVI codes, without a dequantized copy.
 *
 * Plain C ABI (ctypes), raw pointers + sizes + strides; no torch headers. Built and loaded
 * by engine/native/__init__.py (cc -O3 -march=native -fopenmp -shared -fPIC).
 *
 * Layouts (engine/kvcache/quant.py module docstring: "bit-sliced", one byte per channel, bit i of
 * byte row r of a block of R rows is token i*R + r):
 *   keys   codes [B, H, J, bits, g/8, D]   scale/zero fp16 [B, H, J, D]
 *   values codes [B, H, nb, bits, 8, D]    scale/zero fp16 [B, H, L, D/gv]   (64-token blocks)
 * The lookups read 64-bit words of 64 elements of one bit plane along the reduction axis,
 * regrouped from that layout with a few SIMD instructions per 64 bytes:
 *   keys: a token's channel bits = bit i of the D bytes of its row: per row of 64 bytes one
 *         GFNI affine 8x8 bit transpose + one byte permutation (AVX-512 VBMI + GFNI), else
 *         one vptestmb per bit (AVX-512BW) or shift + movemask (AVX2), else one multiply per
 *         8 bytes and bit (NEON, plain C);
 *         gathered one group ahead of the lookups;
 *   values: a channel's token bits = its byte in each of the block's 8 rows (an 8 x D byte
 *         transpose per block and plane); word bit 8r + i is token i*8 + r, which the table
 *         build follows.
 *
 * Method: 4-bit lookup tables with the queries in SIMD lanes (8 fp32 lanes; more queries
 * are processed in blocks of 8). Every reduction is a sum over a bit plane of
 * weight[e] * bit[e] (e = channel for keys, token for values); for each run of 4
 * consecutive elements a 16-entry table holds the 16 subset sums of their 4 weight
 * vectors, so one table lookup + one vector add replaces 4 x 8 multiply-adds.
 *   keys:   within a key group j, K[l, d] = s[j, d] c[l, d] + z[j, d], so
 *           score[q, l] = sum_d (q[q, d] s[j, d]) c[l, d] + sum_d q[q, d] z[j, d];
 *           the D/4 tables (weights q * s[j]) are built once per group and read by its g
 *           tokens; a token costs D/4 lookups per plane.
 *   values: V[l, d] = s[l, jv] c[l, d] + z[l, jv] (jv = d / gv), so
 *           out[q, d] = sum_l (p[q, l] s[l, jv]) c[l, d] + sum_l p[q, l] z[l, jv];
 *           the 16 tables of a 64-token block (weights p * s) are built once per block and
 *           channel group and read by its channels; a channel costs 16 lookups per plane.
 * 2-bit codes are plane0 + 2 * plane1: both planes read the same tables.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "decode_args.h"
#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include "simd.h"

#define LANES 8
#define ALIGN 64

typedef float v8sf __attribute__((vector_size(32)));

#define EXPORT __attribute__((visibility("default")))
#define INLINE static inline __attribute__((always_inline))

EXPORT int specache_guide_abi_version(void) { return 12; }

EXPORT int specache_guide_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------ small helpers */

INLINE v8sf vload(const float *p) { return *(const v8sf *)p; } /* 32-byte aligned */
INLINE void vstore(float *p, v8sf v) { *(v8sf *)p = v; }
INLINE v8sf vsplat(float x) { return (v8sf){x, x, x, x, x, x, x, x}; }

INLINE uint64_t load_u64(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    w = __builtin_bswap64(w);
#endif
    return w;
}

static void halves_to_floats(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = half_to_float(src[i]);
}

/* Byte offset of the table entry selected by nibble c of w: ((w >> 4c) & 15) * 32, as a
 * rotation (one non-destructive rorx with BMI2) and a mask. */
INLINE size_t nib_off(uint64_t w, int c) {
    const unsigned r = (unsigned)(4 * c - 5) & 63u;
    return (size_t)(((w >> r) | (w << ((64u - r) & 63u))) & 0x1E0u);
}

/* The 16 subset sums of a, b, c, d (bit 0 -> a, ..., bit 3 -> d), 16 x 8 floats at T. */
INLINE void build_table(float *T, v8sf a, v8sf b, v8sf c, v8sf d) {
    v8sf *t = (v8sf *)T;
    v8sf ab = a + b;
    t[0] = vsplat(0.0f);
    t[1] = a;
    t[2] = b;
    t[3] = ab;
    t[4] = c;
    t[5] = a + c;
    t[6] = b + c;
    t[7] = ab + c;
    t[8] = d;
    t[9] = a + d;
    t[10] = b + d;
    t[11] = ab + d;
    v8sf cd = c + d;
    t[12] = cd;
    t[13] = a + cd;
    t[14] = b + cd;
    t[15] = ab + cd;
}

/* Sum of the 16 entries that the 16 nibbles of w select in 16 consecutive tables at T. */
INLINE v8sf lookup64(const float *T, uint64_t w) {
    const char *base = (const char *)T;
#define LK(c) (*(const v8sf *)(base + (c) * 512 + nib_off(w, (c))))
    v8sf a0 = LK(0), a1 = LK(1), a2 = LK(2), a3 = LK(3); /* 4 chains of adds */
    for (int c = 4; c < 16; c += 4) {
        a0 += LK(c);
        a1 += LK(c + 1);
        a2 += LK(c + 2);
        a3 += LK(c + 3);
    }
#undef LK
    return (a0 + a1) + (a2 + a3);
}

/* Like lookup64 for the first `nib` (< 16) nibbles of w only (a row's last, partial word). */
static v8sf lookup_tail(const float *T, uint64_t w, int nib) {
    v8sf a0 = vsplat(0.0f), a1 = a0;
    for (int c = 0; c + 1 < nib; c += 2) {
        a0 += vload(T + ((size_t)c * 16 + ((w >> (4 * c)) & 15)) * LANES);
        a1 += vload(T + ((size_t)(c + 1) * 16 + ((w >> (4 * c + 4)) & 15)) * LANES);
    }
    if (nib & 1) a0 += vload(T + ((size_t)(nib - 1) * 16 + ((w >> (4 * nib - 4)) & 15)) * LANES);
    return a0 + a1;
}

/* dst[l * ld + i] = tile[i][l] for i < rows, l < nl: 8 x 8 block transposes (rows % 8 == 0
 * takes the vector path only). */
static void store_transposed(const float *tile /* [rows][8] */, int rows, float *dst, int64_t ld, int nl) {
    int i = 0;
#ifdef __AVX__
    for (; i + 8 <= rows; i += 8) {
        const float *t = tile + (size_t)i * LANES;
        __m256 r0 = _mm256_load_ps(t), r1 = _mm256_load_ps(t + 8), r2 = _mm256_load_ps(t + 16),
               r3 = _mm256_load_ps(t + 24), r4 = _mm256_load_ps(t + 32), r5 = _mm256_load_ps(t + 40),
               r6 = _mm256_load_ps(t + 48), r7 = _mm256_load_ps(t + 56);
        __m256 u0 = _mm256_unpacklo_ps(r0, r1), u1 = _mm256_unpackhi_ps(r0, r1);
        __m256 u2 = _mm256_unpacklo_ps(r2, r3), u3 = _mm256_unpackhi_ps(r2, r3);
        __m256 u4 = _mm256_unpacklo_ps(r4, r5), u5 = _mm256_unpackhi_ps(r4, r5);
        __m256 u6 = _mm256_unpacklo_ps(r6, r7), u7 = _mm256_unpackhi_ps(r6, r7);
        __m256 s0 = _mm256_shuffle_ps(u0, u2, 0x44), s1 = _mm256_shuffle_ps(u0, u2, 0xEE);
        __m256 s2 = _mm256_shuffle_ps(u1, u3, 0x44), s3 = _mm256_shuffle_ps(u1, u3, 0xEE);
        __m256 s4 = _mm256_shuffle_ps(u4, u6, 0x44), s5 = _mm256_shuffle_ps(u4, u6, 0xEE);
        __m256 s6 = _mm256_shuffle_ps(u5, u7, 0x44), s7 = _mm256_shuffle_ps(u5, u7, 0xEE);
        __m256 c[8];
        c[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
        c[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
        c[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
        c[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
        c[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
        c[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
        c[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
        c[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
        for (int l = 0; l < nl; l++) _mm256_storeu_ps(dst + l * ld + i, c[l]);
    }
#endif
    for (; i < rows; i++)
        for (int l = 0; l < nl; l++) dst[l * ld + i] = tile[(size_t)i * LANES + l];
}

/* tile[i][l] = src[l * ld + i] for i < cnt, l < nl; zero for i in [cnt, rows) or l >= nl. */
static void load_transposed(const float *src, int64_t ld, int nl, int cnt, float *tile, int rows) {
    int i = 0;
#ifdef __AVX__
    for (; i + 8 <= cnt; i += 8) {
        __m256 r[8];
        for (int l = 0; l < 8; l++) r[l] = l < nl ? _mm256_loadu_ps(src + l * ld + i) : _mm256_setzero_ps();
        __m256 u0 = _mm256_unpacklo_ps(r[0], r[1]), u1 = _mm256_unpackhi_ps(r[0], r[1]);
        __m256 u2 = _mm256_unpacklo_ps(r[2], r[3]), u3 = _mm256_unpackhi_ps(r[2], r[3]);
        __m256 u4 = _mm256_unpacklo_ps(r[4], r[5]), u5 = _mm256_unpackhi_ps(r[4], r[5]);
        __m256 u6 = _mm256_unpacklo_ps(r[6], r[7]), u7 = _mm256_unpackhi_ps(r[6], r[7]);
        __m256 s0 = _mm256_shuffle_ps(u0, u2, 0x44), s1 = _mm256_shuffle_ps(u0, u2, 0xEE);
        __m256 s2 = _mm256_shuffle_ps(u1, u3, 0x44), s3 = _mm256_shuffle_ps(u1, u3, 0xEE);
        __m256 s4 = _mm256_shuffle_ps(u4, u6, 0x44), s5 = _mm256_shuffle_ps(u4, u6, 0xEE);
        __m256 s6 = _mm256_shuffle_ps(u5, u7, 0x44), s7 = _mm256_shuffle_ps(u5, u7, 0xEE);
        float *t = tile + (size_t)i * LANES;
        _mm256_store_ps(t + 0, _mm256_permute2f128_ps(s0, s4, 0x20));
        _mm256_store_ps(t + 8, _mm256_permute2f128_ps(s1, s5, 0x20));
        _mm256_store_ps(t + 16, _mm256_permute2f128_ps(s2, s6, 0x20));
        _mm256_store_ps(t + 24, _mm256_permute2f128_ps(s3, s7, 0x20));
        _mm256_store_ps(t + 32, _mm256_permute2f128_ps(s0, s4, 0x31));
        _mm256_store_ps(t + 40, _mm256_permute2f128_ps(s1, s5, 0x31));
        _mm256_store_ps(t + 48, _mm256_permute2f128_ps(s2, s6, 0x31));
        _mm256_store_ps(t + 56, _mm256_permute2f128_ps(s3, s7, 0x31));
    }
#endif
    for (; i < cnt; i++)
        for (int l = 0; l < LANES; l++) tile[(size_t)i * LANES + l] = l < nl ? src[l * ld + i] : 0.0f;
    if (cnt < rows) memset(tile + (size_t)cnt * LANES, 0, (size_t)(rows - cnt) * LANES * sizeof(float));
}

static void *scratch_alloc(size_t floats) {
    size_t bytes = (floats * sizeof(float) + ALIGN - 1) / ALIGN * ALIGN;
    return aligned_alloc(ALIGN, bytes);
}

/* parallel_items(items, floats, nthreads, fn, ctx): fn(ctx, it, scratch) for it < items, spread over
 * nthreads OpenMP threads (static schedule; one thread when nthreads <= 1 or items <= 1), each thread
 * with its own scratch of `floats` floats (ALIGN-aligned). Returns 0, or -1 when a scratch could not
 * be allocated (the items of that thread are then skipped). */
typedef void (*item_fn)(const void *ctx, int64_t it, float *scratch);

static int parallel_items(int64_t items, size_t floats, int64_t nthreads, item_fn fn, const void *ctx) {
    int failed = 0;
#pragma omp parallel num_threads((int)nthreads) if (nthreads > 1 && items > 1) reduction(| : failed)
    {
        float *scratch = scratch_alloc(floats);
        if (!scratch) failed = 1;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++)
            if (scratch) fn(ctx, it, scratch);
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------- bit gathering */

#define MAX_WORDS 16 /* head_dim <= 1024 */

/* gather_bit_planes(src, out): out[i] = the bits i of the 64 bytes at src, i < 8, bit e of
 * out[i] from byte chan_of_bit(e). With GFNI + AVX512-VBMI: one affine bit transpose of each
 * 8 x 8 bit block (which leaves the bits of a byte in reverse order) and one byte
 * permutation; otherwise one test (AVX-512BW) or shift + movemask (AVX2) per bit. */
#if defined(__AVX512BW__) && defined(__AVX512VBMI__) && defined(__GFNI__)
#define BIT_REVERSED 1
static const uint8_t TRANSPOSE8x8[64] = {
    0, 8,  16, 24, 32, 40, 48, 56, 1, 9,  17, 25, 33, 41, 49, 57, 2, 10, 18, 26, 34, 42,
    50, 58, 3, 11, 19, 27, 35, 43, 51, 59, 4, 12, 20, 28, 36, 44, 52, 60, 5, 13, 21, 29,
    37, 45, 53, 61, 6, 14, 22, 30, 38, 46, 54, 62, 7, 15, 23, 31, 39, 47, 55, 63};
static inline void gather_bit_planes(const uint8_t *src, uint64_t out[8]) {
    const __m512i v = _mm512_loadu_si512((const void *)src);
    /* byte k of qword q: bit m = bit k of src byte 8q + 7 - m */
    const __m512i t = _mm512_gf2p8affine_epi64_epi8(_mm512_set1_epi64((long long)0x8040201008040201ULL), v, 0);
    /* qword k byte q = byte k of qword q */
    const __m512i idx = _mm512_loadu_si512((const void *)TRANSPOSE8x8);
    _mm512_storeu_si512((void *)out, _mm512_permutexvar_epi8(idx, t));
}
#else
#define BIT_REVERSED 0
static inline void gather_bit_planes(const uint8_t *src, uint64_t out[8]) {
#if defined(__AVX512BW__)
    const __m512i v = _mm512_loadu_si512((const void *)src);
    for (int i = 0; i < 8; i++) out[i] = (uint64_t)_mm512_test_epi8_mask(v, _mm512_set1_epi8((char)(1 << i)));
#elif defined(__AVX2__)
    const __m256i a = _mm256_loadu_si256((const __m256i *)src), b = _mm256_loadu_si256((const __m256i *)(src + 32));
#define GB(i)                                                                                         \
    out[i] = (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(a, 7 - (i))) |                \
             (uint64_t)(uint32_t)_mm256_movemask_epi8(_mm256_slli_epi16(b, 7 - (i))) << 32
    GB(0); GB(1); GB(2); GB(3); GB(4); GB(5); GB(6); GB(7);
#undef GB
#else
    /* Portable (NEON, plain C): per 8 bytes, bit i of each byte moved to one byte by a multiply:
     * ((w >> i) & 0x01..01) * 0x0102040810204080 has bit 56 + j = bit i of byte j (every partial
     * product lands on its own bit, no carries), so its top byte is the 8 bits in byte order. */
    for (int i = 0; i < 8; i++) out[i] = 0;
    for (int c = 0; c < 8; c++) {
        uint64_t w;
        memcpy(&w, src + 8 * c, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        w = __builtin_bswap64(w);
#endif
        for (int i = 0; i < 8; i++)
            out[i] |= ((((w >> i) & 0x0101010101010101ULL) * 0x0102040810204080ULL) >> 56) << (8 * c);
    }
#endif
}
#endif

/* The byte (channel within 64) whose bit lands in bit e of a gathered word. */
static inline int chan_of_bit(int e) { return BIT_REVERSED ? (e & ~7) | (7 - (e & 7)) : e; }

/* The few-query key kernels' words of one group in token order: word w of token i*R + r, plane k, at
 * wb[k * wplane + w * g + i*R + r] (g = 8R tokens, wplane = g * words). */
INLINE void gather_group_tokens(const uint8_t *cj, uint64_t *wb, int bits, int R, int D, int words, size_t wplane) {
    const size_t plane = (size_t)R * D, g = (size_t)R * 8;
    uint64_t bitw[8];
    for (int k = 0; k < bits; k++)
        for (int r = 0; r < R; r++)
            for (int w = 0; w < words; w++) {
                gather_bit_planes(cj + (size_t)k * plane + (size_t)r * D + 64 * w, bitw);
                uint64_t *dst = wb + k * wplane + (size_t)w * g + r;
                for (int i = 0; i < 8; i++) dst[i * R] = bitw[i]; /* token i*R + r */
            }
}

/* qs[l] = q[l] * s (per channel), zq[l] = q[l] . z for the nl queries of a key group (D % VW == 0). */
INLINE void scale_queries(const float *q, int64_t q_sq, int nl, const float *s, const float *z, int D, float *qs,
                          float *zq) {
    for (int l = 0; l < nl; l++) {
        const float *ql = q + l * q_sq;
        vf acc = vf_zero();
        for (int d = 0; d < D; d += VW) {
            const vf x = vf_load(ql + d);
            vf_store(qs + l * D + d, vf_mul(x, vf_load(s + d)));
            acc = vf_fma(x, vf_load(z + d), acc);
        }
        zq[l] = vf_hsum(acc);
    }
}

/* ------------------------------------------- few-query kernels (AVX-512 permutes) */

/* With at most PERM_MAX queries (decode with one new token: a GQA group of 3) the 8-lane
 * tables above leave most lanes idle. Here the tables are turned around: one table of 16
 * floats per query and run of 4 reduction elements sits in one 512-bit register, and one
 * permute (vpermps: the low 4 bits of each 32-bit index lane pick an entry) looks up 16
 * outputs at once (16 tokens for keys, 16 channels for values); the index lanes hold 32
 * code bits each, shifted by 4 per run. Same sums as the tables above, in another order. */

#if defined(__AVX512F__)
#define PERM_MAX 3 /* 4 queries cost more than the 8-lane tables (measured on Zen 4) */
#define HAVE_PERM 1

/* The 16 subset sums of w0..w3 (bit b of the entry index -> w_b) in one register. */
INLINE __m512 perm_table(float w0, float w1, float w2, float w3) {
    __m512 t = _mm512_maskz_mov_ps(0xAAAA, _mm512_set1_ps(w0));
    t = _mm512_mask_add_ps(t, 0xCCCC, t, _mm512_set1_ps(w1));
    t = _mm512_mask_add_ps(t, 0xF0F0, t, _mm512_set1_ps(w2));
    return _mm512_mask_add_ps(t, 0xFF00, t, _mm512_set1_ps(w3));
}

/* The 32-bit halves of 16 consecutive 64-bit words: lo[i] = bits 0..31, hi[i] = bits 32..63. */
INLINE void split_words(const uint64_t *w, __m512i *lo, __m512i *hi) {
    const __m512i a = _mm512_loadu_si512((const void *)w), b = _mm512_loadu_si512((const void *)(w + 8));
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    *lo = _mm512_permutex2var_epi32(a, even, b);
    *hi = _mm512_permutex2var_epi32(a, odd, b);
}

/* a_l += the entries that the nibbles c of each lane of x select in tables T[c][l], and b_l +=
 * those of y in tables T[8 + c][l], c < 8, l < nl (tables PERM_MAX * 16 floats apart per run;
 * two sets of accumulators: shorter dependency chains). nl is a constant where this is expanded,
 * so the accumulators stay in registers. */
#define PERM_LOOKUP(a0, a1, a2, b0, b1, b2, x, y, T, nl)                                   \
    do {                                                                                            \
        for (int c_ = 0; c_ < 8; c_++) {                                                            \
            const __m512i i_ = c_ ? _mm512_srli_epi32((x), 4 * c_) : (x);                           \
            const __m512i j_ = c_ ? _mm512_srli_epi32((y), 4 * c_) : (y);                           \
            const float *t_ = (T) + (size_t)c_ * PERM_MAX * 16, *u_ = t_ + 8 * PERM_MAX * 16;       \
            a0 = _mm512_add_ps(a0, _mm512_permutexvar_ps(i_, _mm512_load_ps(t_)));                  \
            b0 = _mm512_add_ps(b0, _mm512_permutexvar_ps(j_, _mm512_load_ps(u_)));                  \
            if ((nl) > 1) {                                                                         \
                a1 = _mm512_add_ps(a1, _mm512_permutexvar_ps(i_, _mm512_load_ps(t_ + 16)));         \
                b1 = _mm512_add_ps(b1, _mm512_permutexvar_ps(j_, _mm512_load_ps(u_ + 16)));         \
            }                                                                                       \
            if ((nl) > 2) {                                                                         \
                a2 = _mm512_add_ps(a2, _mm512_permutexvar_ps(i_, _mm512_load_ps(t_ + 32)));         \
                b2 = _mm512_add_ps(b2, _mm512_permutexvar_ps(j_, _mm512_load_ps(u_ + 32)));         \
            }                                                                                       \
        }                                                                                           \
    } while (0)

/* The sums of 16 outputs over a run of 64-bit code words (one per plane), for nl queries:
 * res[l] = plane 0 + 2 * plane 1. */
#define PERM_SUMS(res, w0, w1, T, bits, nl)                                                         \
    __m512 res[PERM_MAX];                                                                           \
    do {                                                                                            \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;               \
        __m512 c0 = a0, c1 = a0, c2 = a0, d0 = a0, d1 = a0, d2 = a0;                                \
        __m512i lo_, hi_;                                                                           \
        split_words((w0), &lo_, &hi_);                                                              \
        PERM_LOOKUP(a0, a1, a2, b0, b1, b2, lo_, hi_, (T), nl);                             \
        if ((bits) == 2) {                                                                          \
            split_words((w1), &lo_, &hi_);                                                          \
            PERM_LOOKUP(c0, c1, c2, d0, d1, d2, lo_, hi_, (T), nl);                         \
        }                                                                                           \
        const __m512 p_[PERM_MAX] = {_mm512_add_ps(a0, b0), _mm512_add_ps(a1, b1), _mm512_add_ps(a2, b2)}; \
        const __m512 q_[PERM_MAX] = {_mm512_add_ps(c0, d0), _mm512_add_ps(c1, d1), _mm512_add_ps(c2, d2)}; \
        for (int l_ = 0; l_ < PERM_MAX; l_++) res[l_] = _mm512_add_ps(p_[l_], _mm512_add_ps(q_[l_], q_[l_])); \
    } while (0)

/* The keys' table steps (keys_table_body) for nl <= PERM_MAX queries, D % 64 == 0, g % 16 == 0: 16 tokens
 * in the lanes, tables [D/4][PERM_MAX][16] of 4 channels each. */
#define KT_MAX PERM_MAX
#define KT_STEP 16
#define KT_TAKES(D, g) ((D) % 64 == 0 && (g) % 16 == 0)
#define KT_FLOATS(D) ((size_t)(D) / 4 * PERM_MAX * 16)

INLINE void key_tables(float *T, const float *qs, const int nl, int D) {
    for (int c = 0; c < D / 4; c++) {
        const int e = 4 * c, base = 64 * (e / 64);
        const int d0 = base + chan_of_bit(e % 64), d1 = base + chan_of_bit(e % 64 + 1);
        const int d2 = base + chan_of_bit(e % 64 + 2), d3 = base + chan_of_bit(e % 64 + 3);
        for (int l = 0; l < nl; l++) {
            const float *w = qs + l * D;
            _mm512_store_ps(T + ((size_t)c * PERM_MAX + l) * 16, perm_table(w[d0], w[d1], w[d2], w[d3]));
        }
    }
}

/* out[l * n + 0..15] = the scores of 16 tokens, whose words ([words][g] per plane, planes wplane apart)
 * start at wb, plus zq[l]. */
INLINE void key_sums(float *out, int64_t n, const uint64_t *wb, size_t wplane, const float *T, int bits,
                     const int nl, int g, int words, const float *zq) {
    if (words == 1) { /* head dim 64 */
        PERM_SUMS(res, wb, wb + wplane, T, bits, nl);
        for (int l = 0; l < nl; l++) _mm512_storeu_ps(out + l * n, _mm512_add_ps(res[l], _mm512_set1_ps(zq[l])));
        return;
    }
    __m512 tot[PERM_MAX];
    for (int l = 0; l < nl; l++) tot[l] = _mm512_set1_ps(zq[l]);
    for (int w = 0; w < words; w++) {
        const size_t o = (size_t)w * g;
        PERM_SUMS(res, wb + o, wb + wplane + o, T + (size_t)w * 16 * PERM_MAX * 16, bits, nl);
        for (int l = 0; l < nl; l++) tot[l] = _mm512_add_ps(tot[l], res[l]);
    }
    for (int l = 0; l < nl; l++) _mm512_storeu_ps(out + l * n, tot[l]);
}
#else
#define HAVE_PERM 0
#endif

/* ------------------------------------------------- few-query keys (AVX2 permutes) */

/* The AVX2 analogue for keys: 8 tokens in the lanes; a run of 3 channels has an 8-entry table of
 * the subset sums of its 3 weights (one 256-bit register), and one permute (vpermps: the low 3 bits
 * of each 32-bit index lane pick an entry) looks up 8 tokens at once. A 32-bit half of a token's
 * code word holds 32 channels = 10 runs of 3 + 1 of 2 (its table's upper entries are never
 * picked: the shifted lane has zeros above bit 1). Head dim 64 (one word per token and plane). */
#if !HAVE_PERM && defined(__AVX2__) && defined(__FMA__)
#define HAVE_PERM8 1
#define PERM8_MAX 3
#define PERM8_RUNS 22 /* runs per 64 channels */

/* The 32-bit halves of 8 consecutive 64-bit words, in word order. */
INLINE void split_words8(const uint64_t *w, __m256i *lo, __m256i *hi) {
    const __m256 a = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)w));
    const __m256 b = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(w + 4)));
    const __m256 l = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)); /* w0 w1 w4 w5 | w2 w3 w6 w7 */
    const __m256 h = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    *lo = _mm256_castpd_si256(_mm256_permute4x64_pd(_mm256_castps_pd(l), _MM_SHUFFLE(3, 1, 2, 0)));
    *hi = _mm256_castpd_si256(_mm256_permute4x64_pd(_mm256_castps_pd(h), _MM_SHUFFLE(3, 1, 2, 0)));
}

/* acc_l += the table entries that each run's 3 bits of the lanes of x (a 32-bit half) select,
 * tables T[run][l] (PERM8_MAX * 8 floats apart per run), runs r0 .. r0 + 10. */
#define PERM8_LOOKUP(acc, x, T, r0, nl)                                                              \
    do {                                                                                             \
        for (int r_ = 0; r_ < 11; r_++) {                                                            \
            const __m256i i_ = r_ ? _mm256_srli_epi32((x), 3 * r_) : (x);                            \
            const float *t_ = (T) + (size_t)((r0) + r_) * PERM8_MAX * 8;                              \
            for (int l_ = 0; l_ < (nl); l_++)                                                        \
                acc[l_] = _mm256_add_ps(acc[l_], _mm256_permutevar8x32_ps(_mm256_load_ps(t_ + 8 * l_), i_)); \
        }                                                                                            \
    } while (0)

/* The 8 subset sums of w0..w2 (bit b of the entry index -> w_b) in one register; w2 = 0 for a 2-bit run. */
INLINE __m256 perm8_table(float w0, float w1, float w2) {
    const __m256 m0 = _mm256_setr_ps(0, 1, 0, 1, 0, 1, 0, 1), m1 = _mm256_setr_ps(0, 0, 1, 1, 0, 0, 1, 1);
    const __m256 m2 = _mm256_setr_ps(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256 t = _mm256_fmadd_ps(_mm256_set1_ps(w1), m1, _mm256_mul_ps(_mm256_set1_ps(w0), m0));
    return _mm256_fmadd_ps(_mm256_set1_ps(w2), m2, t);
}

/* res[l] = the sums of the table entries T (PERM8_RUNS runs) that 8 lanes' 1- or 2-bit code words select:
 * plane 0 at w, plane 1 at w + plane (counted twice). */
INLINE void perm8_sums(__m256 *res, const uint64_t *w, size_t plane, const float *T, int bits, const int nl) {
    __m256 p0[PERM8_MAX], p1[PERM8_MAX];
    for (int l = 0; l < PERM8_MAX; l++) p0[l] = p1[l] = _mm256_setzero_ps();
    __m256i lo, hi;
    split_words8(w, &lo, &hi);
    PERM8_LOOKUP(p0, lo, T, 0, nl);
    PERM8_LOOKUP(p0, hi, T, 11, nl);
    if (bits == 2) {
        split_words8(w + plane, &lo, &hi);
        PERM8_LOOKUP(p1, lo, T, 0, nl);
        PERM8_LOOKUP(p1, hi, T, 11, nl);
    }
    for (int l = 0; l < nl; l++) res[l] = _mm256_add_ps(p0[l], _mm256_add_ps(p1[l], p1[l]));
}

/* The keys' table steps (keys_table_body) for nl <= PERM8_MAX queries, D == 64, g % 8 == 0. */
#define KT_MAX PERM8_MAX
#define KT_STEP 8
#define KT_TAKES(D, g) ((D) == 64 && (g) % 8 == 0)
#define KT_FLOATS(D) ((size_t)PERM8_RUNS * PERM8_MAX * 8)

INLINE void key_tables(float *T, const float *qs, const int nl, int D) {
    for (int run = 0; run < PERM8_RUNS; run++) { /* channels e, e+1, e+2 of the run (2 in the last of a half) */
        const int e = 32 * (run / 11) + 3 * (run % 11), two = run % 11 == 10;
        for (int l = 0; l < nl; l++) {
            const float *w = qs + l * D;
            _mm256_store_ps(T + ((size_t)run * PERM8_MAX + l) * 8, perm8_table(w[e], w[e + 1], two ? 0.0f : w[e + 2]));
        }
    }
}

/* out[l * n + 0..7] = the scores of 8 tokens, whose words (one per token and plane) start at wb, plus zq[l]. */
INLINE void key_sums(float *out, int64_t n, const uint64_t *wb, size_t wplane, const float *T, int bits,
                     const int nl, int g, int words, const float *zq) {
    (void)g, (void)words;
    __m256 res[PERM8_MAX];
    perm8_sums(res, wb, wplane, T, bits, nl);
    for (int l = 0; l < nl; l++) _mm256_storeu_ps(out + l * n, _mm256_add_ps(res[l], _mm256_set1_ps(zq[l])));
}
#else
#define HAVE_PERM8 0
#endif

#if HAVE_PERM || HAVE_PERM8
/* keys_item for nl <= KT_MAX queries where KT_TAKES(D, g) (same arguments): per group, the words gathered
 * in token order, [bits][words][g] (one group ahead of the lookups, two buffers, so that the lookups never
 * wait for the stores that wrote them), the queries scaled by the group's scale (key_tables' weights),
 * then KT_STEP tokens per key_sums. */
INLINE void keys_table_body(const float *q, int64_t q_sq, const int nl, const uint8_t *codes, const uint16_t *sc,
                            const uint16_t *zr, float *out, int64_t n, int64_t j0, int64_t j1, int D, int g,
                            int bits, float *scratch, uint64_t *wbuf) {
    const int words = D / 64, R = g / 8;
    float *T = scratch;                     /* KT_FLOATS(D) */
    float *sz = T + KT_FLOATS(D);           /* 2 * D: the group's scale and zero */
    float *qs = sz + 2 * (size_t)D;         /* [KT_MAX][D] */
    const size_t gbytes = (size_t)R * D * (size_t)bits, wplane = (size_t)g * words;
    for (int64_t j = j0; j <= j1; j++) {
        if (j < j1)
            gather_group_tokens(codes + (size_t)j * gbytes, wbuf + (size_t)(j & 1) * bits * wplane, bits, R, D,
                                words, wplane);
        if (j == j0) continue;
        const int64_t jj = j - 1; /* the previous group, whose words are ready */
        const uint64_t *wb = wbuf + (size_t)(jj & 1) * bits * wplane;
        halves_to_floats(sc + jj * D, sz, D);
        halves_to_floats(zr + jj * D, sz + D, D);
        float zq[KT_MAX];
        scale_queries(q, q_sq, nl, sz, sz + D, D, qs, zq);
        key_tables(T, qs, nl, D);
        for (int t = 0; t < g; t += KT_STEP) key_sums(out + jj * g + t, n, wb + t, wplane, T, bits, nl, g, words, zq);
    }
}

/* keys_table_body with the query count nl (1, 2, else 3) a constant: the compiler unrolls the lookups. */
static void keys_item_table(const float *q, int64_t q_sq, int nl, const uint8_t *codes, const uint16_t *sc,
                            const uint16_t *zr, float *out, int64_t n, int64_t j0, int64_t j1, int D, int g, int bits,
                            float *scratch, uint64_t *wbuf) {
    switch (nl) {
    case 1: keys_table_body(q, q_sq, 1, codes, sc, zr, out, n, j0, j1, D, g, bits, scratch, wbuf); break;
    case 2: keys_table_body(q, q_sq, 2, codes, sc, zr, out, n, j0, j1, D, g, bits, scratch, wbuf); break;
    default: keys_table_body(q, q_sq, 3, codes, sc, zr, out, n, j0, j1, D, g, bits, scratch, wbuf); break;
    }
}
#endif

/* --------------------------------------------------------------------------- keys */

/* Scores of query block [nl <= 8 queries] against key groups [j0, j1) of one (b, h). */
static void keys_item(const float *q, int64_t q_sq, int nl, const uint8_t *codes, const uint16_t *sc,
                      const uint16_t *zr, float *out, int64_t n, int64_t j0, int64_t j1, int D, int g,
                      int bits, float *scratch, uint64_t *wbuf /* [bits][g][words] */) {
#if HAVE_PERM || HAVE_PERM8
    if (nl <= KT_MAX && KT_TAKES(D, g)) {
        keys_item_table(q, q_sq, nl, codes, sc, zr, out, n, j0, j1, D, g, bits, scratch, wbuf);
        return;
    }
#endif
    const int nw = D / 64, nchunk = D / 4, tail = D % 64; /* full words, channels of a last partial one */
    const int words = nw + (tail > 0), R = g / 8;
    float *T = scratch;                          /* nchunk * 16 * 8 */
    float *qT = T + (size_t)nchunk * 16 * LANES; /* D * 8 */
    float *tile = qT + (size_t)D * LANES;        /* g * 8 */
    float *sz = tile + (size_t)g * LANES;        /* 2 * D */
    const size_t plane = (size_t)R * D, gbytes = plane * (size_t)bits, wplane = (size_t)g * words;
    uint8_t pad[64];
    uint64_t bitw[8];
    int chan[1024];

    memset(qT, 0, (size_t)D * LANES * sizeof(float));
    for (int l = 0; l < nl; l++)
        for (int d = 0; d < D; d++) qT[d * LANES + l] = q[l * q_sq + d];
    for (int e = 0; e < D; e++) chan[e] = 64 * (e / 64) + chan_of_bit(e % 64);

    /* A group's words: word w of token i*R + r, plane k, at wb[k][r*8 + i][w] holds bit i
     * of the row-r bytes of channels 64w .. 64w+63. They are gathered one group ahead (two
     * buffers), so that the lookups never wait for the wide stores that wrote them. */
    for (int64_t j = j0; j <= j1; j++) {
        if (j < j1) {
        const uint8_t *cj = codes + (size_t)j * gbytes;
        uint64_t *wb = wbuf + (size_t)(j & 1) * bits * wplane;
        for (int k = 0; k < bits; k++)
            for (int r = 0; r < R; r++) {
                const uint8_t *row = cj + (size_t)k * plane + (size_t)r * D;
                uint64_t *dst = wb + k * wplane + (size_t)r * 8 * words;
                for (int w = 0; w < words; w++) {
                    const uint8_t *src = row + 64 * w;
                    if (w == nw) { /* partial last word: zero padded */
                        memset(pad, 0, sizeof pad);
                        memcpy(pad, src, (size_t)tail);
                        src = pad;
                    }
                    if (words == 1) {
                        gather_bit_planes(src, dst);
                    } else {
                        gather_bit_planes(src, bitw);
                        for (int i = 0; i < 8; i++) dst[i * words + w] = bitw[i];
                    }
                }
            }
        }
        if (j == j0) continue;
        j--; /* now the previous group, whose words are ready */
        const uint64_t *wb = wbuf + (size_t)(j & 1) * bits * wplane;
        halves_to_floats(sc + j * D, sz, D);
        halves_to_floats(zr + j * D, sz + D, D);
        v8sf z0 = vsplat(0.0f), z1 = z0, z2 = z0, z3 = z0;
        for (int c = 0; c < nchunk; c++) {
            const int d = 4 * c, d0 = chan[d], d1 = chan[d + 1], d2 = chan[d + 2], d3 = chan[d + 3];
            v8sf q0 = vload(qT + d0 * LANES), q1 = vload(qT + d1 * LANES);
            v8sf q2 = vload(qT + d2 * LANES), q3 = vload(qT + d3 * LANES);
            z0 += q0 * sz[D + d0];
            z1 += q1 * sz[D + d1];
            z2 += q2 * sz[D + d2];
            z3 += q3 * sz[D + d3];
            build_table(T + (size_t)c * 16 * LANES, q0 * sz[d0], q1 * sz[d1], q2 * sz[d2], q3 * sz[d3]);
        }
        const v8sf zq = (z0 + z1) + (z2 + z3);
        if (words == 1 && tail == 0) { /* head_dim 64: one word per token and plane */
            for (int t = 0; t < g; t += 2) { /* two tokens at a time: independent chains */
                v8sf acc = lookup64(T, wb[t]), acc2 = lookup64(T, wb[t + 1]);
                if (bits == 2) {
                    const v8sf h1 = lookup64(T, wb[wplane + t]), h2 = lookup64(T, wb[wplane + t + 1]);
                    acc += h1 + h1;
                    acc2 += h2 + h2;
                }
                const int r = t / 8, i = t % 8; /* word t = r*8 + i is token i*R + r */
                vstore(tile + (size_t)(i * R + r) * LANES, acc + zq);
                vstore(tile + (size_t)((i + 1) * R + r) * LANES, acc2 + zq);
            }
        } else {
            const float *Tt = T + (size_t)nw * 16 * 16 * LANES;
            for (int t = 0; t < g; t++) {
                v8sf acc = zq, hi = vsplat(0.0f);
                for (int k = 0; k < bits; k++) {
                    const uint64_t *wt = wb + k * wplane + (size_t)t * words;
                    v8sf a = vsplat(0.0f);
                    for (int w = 0; w < nw; w++) a += lookup64(T + (size_t)w * 16 * 16 * LANES, wt[w]);
                    if (tail) a += lookup_tail(Tt, wt[nw], tail / 4);
                    if (k == 0)
                        acc += a;
                    else
                        hi = a;
                }
                vstore(tile + (size_t)((t % 8) * R + t / 8) * LANES, acc + (hi + hi));
            }
        }
        store_transposed(tile, g, out + j * g, n, nl);
        j++;
    }
}

/* keys_item's scratch: floats for its tables, transposed queries, tile and scale/zero, followed
 * by its gathered bit words (two groups, uint64) at keys_words(); the words take
 * keys_words_floats() floats. */
static size_t keys_scratch_floats(int64_t D, int64_t g) {
    return (size_t)(D / 4) * 16 * LANES + (size_t)D * LANES + (size_t)g * LANES + 2 * (size_t)D;
}
static size_t keys_words_floats(int64_t D, int64_t g, int64_t bits) {
    return 2 * (2 * (size_t)bits * g * ((D + 63) / 64)); /* 2 floats per uint64 */
}
static uint64_t *keys_words(float *scratch, int64_t D, int64_t g) {
    return (uint64_t *)(scratch + keys_scratch_floats(D, g));
}

/* The arguments of specache_guide_scores and specache_guide_weighted_values (below) and their split into
 * work items: item it is the query block (it / split) % nqb of (b, h) = it / split / nqb, and part it % split
 * of its `blocks` (key groups, or value blocks). x: the queries (scores) or the probabilities (values);
 * out: the scores, or the items' partial sums (part_floats floats each). */
typedef struct {
    const float *x;
    int64_t x_sb, x_sh, x_sq;
    const uint8_t *codes;
    int64_t c_sb, c_sh;
    const uint16_t *scale, *zero;
    int64_t s_sb, s_sh;
    float *out;
    size_t part_floats;
    int64_t H, Q, D, n, g, bits, blocks, nqb, split;
} GuideRun;

/* A work item's (b, h), first query q0 and query count nl, and its blocks [k0, k1). */
typedef struct {
    int64_t b, h, q0, k0, k1;
    int nl;
} GuideItem;

static GuideItem guide_item(const GuideRun *a, int64_t it) {
    const int64_t part = it % a->split, bhq = it / a->split, qb = bhq % a->nqb, bh = bhq / a->nqb, q0 = qb * LANES;
    return (GuideItem){bh / a->H, bh % a->H, q0, a->blocks * part / a->split, a->blocks * (part + 1) / a->split,
                       (int)(a->Q - q0 < LANES ? a->Q - q0 : LANES)};
}

/* Parts per (b, h, query block): ~4 work items per thread over the `base` ones, at most one per block. */
static int64_t guide_split(int64_t base, int64_t blocks, int64_t nthreads) {
    int64_t split = 1;
    if (nthreads > 1) split = (4 * nthreads + base - 1) / base;
    return split > blocks ? blocks : split;
}

static void scores_item(const void *ctx, int64_t it, float *scratch) {
    const GuideRun *a = ctx;
    const GuideItem w = guide_item(a, it);
    keys_item(a->x + w.b * a->x_sb + w.h * a->x_sh + w.q0 * a->x_sq, a->x_sq, w.nl,
              a->codes + w.b * a->c_sb + w.h * a->c_sh, a->scale + w.b * a->s_sb + w.h * a->s_sh,
              a->zero + w.b * a->s_sb + w.h * a->s_sh, a->out + ((w.b * a->H + w.h) * a->Q + w.q0) * a->n, a->n,
              w.k0, w.k1, (int)a->D, (int)a->g, (int)a->bits, scratch, keys_words(scratch, a->D, a->g));
}

/* scores[b, h, q, l] = sum_d q[b, h, q, d] * K[b, h, l, d] for l < n (n % g == 0).
 * q: fp32, element (b, h, i, d) at q + b*q_sb + h*q_sh + i*q_sq + d.
 * codes: (b, h) block at codes + b*c_sb + h*c_sh, groups contiguous [J][bits][g][D/8].
 * scale/zero: (b, h) block at + b*s_sb + h*s_sh, [J][D] contiguous.
 * out: fp32 [B, H, Q, n] contiguous. Returns 0, or -1 (bad arguments / out of memory). */
EXPORT int specache_guide_scores(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_sq, const uint8_t *codes,
                                 int64_t c_sb, int64_t c_sh, const uint16_t *scale, const uint16_t *zero,
                                 int64_t s_sb, int64_t s_sh, float *out, int64_t B, int64_t H, int64_t Q,
                                 int64_t D, int64_t n, int64_t g, int64_t bits, int64_t nthreads) {
    if (B <= 0 || H <= 0 || Q <= 0 || n <= 0) return 0;
    if (D <= 0 || D % 8 || D > 64 * MAX_WORDS || g <= 0 || g % 8 || n % g || (bits != 1 && bits != 2)) return -1;
    const int64_t J = n / g, nqb = (Q + LANES - 1) / LANES, base = B * H * nqb;
    const int64_t split = guide_split(base, J, nthreads);
    const GuideRun a = {q, q_sb, q_sh, q_sq, codes, c_sb, c_sh, scale, zero, s_sb, s_sh, out, 0,
                        H, Q, D, n, g, bits, J, nqb, split};
    return parallel_items(base * split, keys_scratch_floats(D, g) + keys_words_floats(D, g, bits), nthreads,
                          scores_item, &a);
}

/* ------------------------------------------------------------------------- values */

#define VB 64 /* tokens per value block */

/* out[d] byte r = rows[r * D + d]: the 8 x D byte matrix of a value block's plane, transposed. */
static void transpose_rows(const uint8_t *rows, int D, uint64_t *out) {
    int d = 0;
#ifdef __AVX2__
    for (; d + 32 <= D; d += 32) {
        __m256i r[8];
        for (int k = 0; k < 8; k++) r[k] = _mm256_loadu_si256((const __m256i *)(rows + (size_t)k * D + d));
        /* per 128-bit lane (channels d + 16 lane + 0..15): bytes -> pairs -> quads -> words */
        const __m256i a0 = _mm256_unpacklo_epi8(r[0], r[1]), a1 = _mm256_unpackhi_epi8(r[0], r[1]);
        const __m256i a2 = _mm256_unpacklo_epi8(r[2], r[3]), a3 = _mm256_unpackhi_epi8(r[2], r[3]);
        const __m256i a4 = _mm256_unpacklo_epi8(r[4], r[5]), a5 = _mm256_unpackhi_epi8(r[4], r[5]);
        const __m256i a6 = _mm256_unpacklo_epi8(r[6], r[7]), a7 = _mm256_unpackhi_epi8(r[6], r[7]);
        const __m256i b0 = _mm256_unpacklo_epi16(a0, a2), b1 = _mm256_unpackhi_epi16(a0, a2); /* ch 0-3, 4-7 */
        const __m256i b2 = _mm256_unpacklo_epi16(a1, a3), b3 = _mm256_unpackhi_epi16(a1, a3); /* ch 8-11, 12-15 */
        const __m256i c0 = _mm256_unpacklo_epi16(a4, a6), c1 = _mm256_unpackhi_epi16(a4, a6);
        const __m256i c2 = _mm256_unpacklo_epi16(a5, a7), c3 = _mm256_unpackhi_epi16(a5, a7);
        __m256i w[8];
        w[0] = _mm256_unpacklo_epi32(b0, c0); /* ch 0, 1 */
        w[1] = _mm256_unpackhi_epi32(b0, c0); /* ch 2, 3 */
        w[2] = _mm256_unpacklo_epi32(b1, c1); /* ch 4, 5 */
        w[3] = _mm256_unpackhi_epi32(b1, c1);
        w[4] = _mm256_unpacklo_epi32(b2, c2); /* ch 8, 9 */
        w[5] = _mm256_unpackhi_epi32(b2, c2);
        w[6] = _mm256_unpacklo_epi32(b3, c3);
        w[7] = _mm256_unpackhi_epi32(b3, c3);
        for (int k = 0; k < 8; k++) { /* lane 0 -> channels d + 2k, +1; lane 1 -> channels d + 16 + 2k, +1 */
            _mm_storeu_si128((__m128i *)(out + d + 2 * k), _mm256_castsi256_si128(w[k]));
            _mm_storeu_si128((__m128i *)(out + d + 16 + 2 * k), _mm256_extracti128_si256(w[k], 1));
        }
    }
#endif
    for (; d < D; d++) {
        uint64_t w = 0;
        for (int r = 0; r < 8; r++) w |= (uint64_t)rows[(size_t)r * D + d] << (8 * r);
        out[d] = w;
    }
}

/* Value block k of the few-query kernels: the nl queries' probabilities pw [nl][VB], scales s and zeros
 * z [VB][ng] (tokens past n weigh 0, no 0 * inf garbage), the planes' code words (transpose_rows). */
INLINE void load_value_block(const float *p, int64_t p_sq, int nl, int64_t n, int64_t k, const uint8_t *codes,
                             const uint16_t *sc, const uint16_t *zr, int D, int ng, int bits, float *pw, float *s,
                             float *z, uint64_t *words) {
    const int64_t t0 = k * VB;
    const int cnt = (int)(n - t0 < VB ? n - t0 : VB);
    const size_t plane = (size_t)8 * D;
    for (int l = 0; l < nl; l++) {
        memcpy(pw + l * VB, p + l * p_sq + t0, (size_t)cnt * sizeof(float));
        if (cnt < VB) memset(pw + l * VB + cnt, 0, (size_t)(VB - cnt) * sizeof(float));
    }
    halves_to_floats(sc + t0 * ng, s, (int64_t)cnt * ng);
    halves_to_floats(zr + t0 * ng, z, (int64_t)cnt * ng);
    if (cnt < VB) {
        memset(s + (size_t)cnt * ng, 0, (size_t)(VB - cnt) * ng * sizeof(float));
        memset(z + (size_t)cnt * ng, 0, (size_t)(VB - cnt) * ng * sizeof(float));
    }
    const uint8_t *ck = codes + (size_t)k * plane * (size_t)bits;
    for (int pl = 0; pl < bits; pl++) transpose_rows(ck + (size_t)pl * plane, D, words + (size_t)pl * D);
}

/* The value table kernels: per block of VB tokens and channel group jv, tables of subset sums of the
 * block's p * scale, looked up by the channels' code words (transpose_rows). Each instruction set gives
 * the queries it takes (VT_MAX), the channels per lookup (VT_STEP), the tables' floats (VT_FLOATS) and
 * three steps: value_zero_sum (p . zero of one query), value_tables and value_lookup. */
#if HAVE_PERM
/* AVX-512: 16 tables [16 runs][PERM_MAX][16] of a run of 4 bits (bits i = 4 (c % 2) .. +3 of byte
 * r = c / 2: tokens i*8 + r), one vpermps per 16 channels. */
#define VT_MAX PERM_MAX
#define VT_STEP 16
#define VT_FLOATS (16 * PERM_MAX * 16)

INLINE float value_zero_sum(const float *pl, const float *z, int ng, int jv) {
    __m512 za = _mm512_setzero_ps();
    if (ng == 1) {
        for (int t = 0; t < VB; t += 16) za = _mm512_fmadd_ps(_mm512_load_ps(pl + t), _mm512_loadu_ps(z + t), za);
    } else {
        for (int t = 0; t < VB; t += 16) {
            const __m512i ix = _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(t),
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)), _mm512_set1_epi32(ng));
            za = _mm512_fmadd_ps(_mm512_load_ps(pl + t), _mm512_i32gather_ps(ix, z + jv, 4), za);
        }
    }
    return _mm512_reduce_add_ps(za);
}

INLINE void value_tables(float *T, const float *pw, const float *s, const int nl, int ng, int jv) {
    for (int c = 0; c < 16; c++) {
        const int r = c >> 1, i = 4 * (c & 1);
        const int u0 = i * 8 + r, u1 = u0 + 8, u2 = u0 + 16, u3 = u0 + 24;
        const float s0 = s[u0 * ng + jv], s1 = s[u1 * ng + jv], s2 = s[u2 * ng + jv], s3 = s[u3 * ng + jv];
        for (int l = 0; l < nl; l++) {
            const float *pl = pw + l * VB;
            _mm512_store_ps(T + ((size_t)c * PERM_MAX + l) * 16,
                            perm_table(pl[u0] * s0, pl[u1] * s1, pl[u2] * s2, pl[u3] * s3));
        }
    }
}

INLINE void value_lookup(float *sum, const uint64_t *words, const float *T, int bits, const int nl, int D, int d) {
    PERM_SUMS(res, words + d, words + D + d, T, bits, nl);
    for (int l = 0; l < nl; l++) {
        float *o = sum + l * D + d;
        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), res[l]));
    }
}
#endif

#if HAVE_PERM8
/* AVX2: 8 channels in the lanes; a run of 3 bits of a channel's code word (bit b is token
 * (b % 8) * 8 + b / 8, transpose_rows) has an 8-entry table of the subset sums of its 3 tokens' p * s,
 * one vpermps per 8 channels. Runs as for the keys: 11 per 32-bit half (the last of 2 bits). */
#define VT_MAX PERM8_MAX
#define VT_STEP 8
#define VT_FLOATS (PERM8_RUNS * PERM8_MAX * 8)

INLINE float value_zero_sum(const float *pl, const float *z, int ng, int jv) {
    float za = 0.0f;
    for (int t = 0; t < VB; t++) za += pl[t] * z[t * ng + jv];
    return za;
}

INLINE void value_tables(float *T, const float *pw, const float *s, const int nl, int ng, int jv) {
    for (int run = 0; run < PERM8_RUNS; run++) {
        const int b = 32 * (run / 11) + 3 * (run % 11), two = run % 11 == 10;
        const int u0 = (b % 8) * 8 + b / 8, u1 = ((b + 1) % 8) * 8 + (b + 1) / 8;
        const int u2 = two ? u1 : ((b + 2) % 8) * 8 + (b + 2) / 8;
        const float s0 = s[u0 * ng + jv], s1 = s[u1 * ng + jv], s2 = two ? 0.0f : s[u2 * ng + jv];
        for (int l = 0; l < nl; l++) {
            const float *pl = pw + l * VB;
            _mm256_store_ps(T + ((size_t)run * PERM8_MAX + l) * 8, perm8_table(pl[u0] * s0, pl[u1] * s1, pl[u2] * s2));
        }
    }
}

INLINE void value_lookup(float *sum, const uint64_t *words, const float *T, int bits, const int nl, int D, int d) {
    __m256 res[PERM8_MAX];
    perm8_sums(res, words + d, (size_t)D, T, bits, nl);
    for (int l = 0; l < nl; l++) {
        float *o = sum + l * D + d;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), res[l]));
    }
}
#endif

#if HAVE_PERM || HAVE_PERM8
/* The per-query sums of values_table_body, sum [nl][D] and zs [nl][ng], in values_item's layout:
 * acc[d][lane], zacc[jv][lane] (lanes past nl zero). */
static void write_value_sums(const float *sum, const float *zs, int nl, int D, int ng, float *acc, float *zacc) {
    for (int d = 0; d < D; d++)
        for (int l = 0; l < LANES; l++) acc[d * LANES + l] = l < nl ? sum[l * D + d] : 0.0f;
    for (int jv = 0; jv < ng; jv++)
        for (int l = 0; l < LANES; l++) zacc[jv * LANES + l] = l < nl ? zs[l * ng + jv] : 0.0f;
}

/* values_item for nl <= VT_MAX queries and gv % VT_STEP == 0 (same arguments and outputs); the sums are
 * kept per query, [VT_MAX][D], and written in values_item's layout at the end. */
INLINE void values_table_body(const float *p, int64_t p_sq, const int nl, int64_t n, const uint8_t *codes,
                              const uint16_t *sc, const uint16_t *zr, int64_t k0, int64_t k1, int D, int gv,
                              int bits, float *acc, float *zacc, float *scratch, uint64_t *words) {
    const int ng = D / gv;
    float *T = scratch;                       /* VT_FLOATS */
    float *pw = T + VT_FLOATS;                /* [VT_MAX][64] probabilities of the block */
    float *s = pw + VT_MAX * VB;              /* 64 * ng */
    float *z = s + (size_t)VB * ng;           /* 64 * ng */
    float *sum = z + (size_t)VB * ng;         /* [VT_MAX][D] */
    float zs[VT_MAX * MAX_WORDS * (64 / VT_STEP)]; /* [VT_MAX][ng], ng <= D / VT_STEP */
    memset(sum, 0, (size_t)VT_MAX * D * sizeof(float));
    memset(zs, 0, sizeof zs);
    for (int64_t k = k0; k < k1; k++) {
        load_value_block(p, p_sq, nl, n, k, codes, sc, zr, D, ng, bits, pw, s, z, words);
        for (int jv = 0; jv < ng; jv++) {
            for (int l = 0; l < nl; l++) zs[l * ng + jv] += value_zero_sum(pw + l * VB, z, ng, jv);
            value_tables(T, pw, s, nl, ng, jv);
            for (int d = jv * gv; d < (jv + 1) * gv; d += VT_STEP) value_lookup(sum, words, T, bits, nl, D, d);
        }
    }
    write_value_sums(sum, zs, nl, D, ng, acc, zacc);
}

/* values_table_body with the query count nl (1, 2, else 3) a constant. */
static void values_item_table(const float *p, int64_t p_sq, int nl, int64_t n, const uint8_t *codes,
                              const uint16_t *sc, const uint16_t *zr, int64_t k0, int64_t k1, int D, int gv,
                              int bits, float *acc, float *zacc, float *scratch, uint64_t *words) {
    switch (nl) {
    case 1: values_table_body(p, p_sq, 1, n, codes, sc, zr, k0, k1, D, gv, bits, acc, zacc, scratch, words); break;
    case 2: values_table_body(p, p_sq, 2, n, codes, sc, zr, k0, k1, D, gv, bits, acc, zacc, scratch, words); break;
    default: values_table_body(p, p_sq, 3, n, codes, sc, zr, k0, k1, D, gv, bits, acc, zacc, scratch, words); break;
    }
}
#endif

/* values_item's scratch: floats for its tables, transposed probabilities and scale/zero,
 * followed by its transposed code words ([2][D] uint64, 4 D floats) at values_words(). */
static size_t values_scratch_floats(int64_t ng) { return 16 * 16 * LANES + VB * LANES + 2 * (size_t)VB * ng; }
static uint64_t *values_words(float *scratch, int64_t ng) {
    return (uint64_t *)(scratch + values_scratch_floats(ng));
}

/* Partial p @ V of query block [nl <= 8] over value blocks [k0, k1) of one (b, h):
 * acc[d][lane] (codes term) and zacc[jv][lane] (zero term), both overwritten. */
static void values_item(const float *p, int64_t p_sq, int nl, int64_t n, const uint8_t *codes, const uint16_t *sc,
                        const uint16_t *zr, int64_t k0, int64_t k1, int D, int gv, int bits, float *acc,
                        float *zacc, float *scratch, uint64_t *words /* [2][D] */) {
#if HAVE_PERM || HAVE_PERM8
    if (nl <= VT_MAX && gv % VT_STEP == 0 && D <= 256) {
        values_item_table(p, p_sq, nl, n, codes, sc, zr, k0, k1, D, gv, bits, acc, zacc, scratch, words);
        return;
    }
#endif
    const int ng = D / gv;
    float *T = scratch;               /* 16 * 16 * 8 */
    float *pT = T + 16 * 16 * LANES;  /* 64 * 8 */
    float *s = pT + VB * LANES;       /* 64 * ng */
    float *z = s + (size_t)VB * ng;   /* 64 * ng */
    const size_t plane = (size_t)8 * D, bbytes = plane * (size_t)bits;

    memset(acc, 0, (size_t)D * LANES * sizeof(float));
    memset(zacc, 0, (size_t)ng * LANES * sizeof(float));
    for (int64_t k = k0; k < k1; k++) {
        const int64_t t0 = k * VB;
        const int cnt = (int)(n - t0 < VB ? n - t0 : VB);
        load_transposed(p + t0, p_sq, nl, cnt, pT, VB); /* tokens past n weigh 0 */
        halves_to_floats(sc + t0 * ng, s, (int64_t)cnt * ng);
        halves_to_floats(zr + t0 * ng, z, (int64_t)cnt * ng);
        if (cnt < VB) { /* no garbage (0 * inf) past n */
            memset(s + (size_t)cnt * ng, 0, (size_t)(VB - cnt) * ng * sizeof(float));
            memset(z + (size_t)cnt * ng, 0, (size_t)(VB - cnt) * ng * sizeof(float));
        }
        const uint8_t *ck = codes + (size_t)k * bbytes;
        for (int pl = 0; pl < bits; pl++) /* word[d] byte r = row r, channel d: bit 8r + i is token i*8 + r */
            transpose_rows(ck + (size_t)pl * plane, D, words + (size_t)pl * D);
        for (int jv = 0; jv < ng; jv++) {
            v8sf za = vsplat(0.0f), zb = za;
            for (int c = 0; c < 16; c++) {
                /* word bits 4c .. 4c+3: row r = c / 2, bits i = 4 (c % 2) .. +3: tokens i*8 + r */
                const int r = c >> 1, i = 4 * (c & 1);
                const int t0_ = i * 8 + r, t1_ = t0_ + 8, t2_ = t0_ + 16, t3_ = t0_ + 24;
                v8sf p0 = vload(pT + t0_ * LANES), p1 = vload(pT + t1_ * LANES);
                v8sf p2 = vload(pT + t2_ * LANES), p3 = vload(pT + t3_ * LANES);
                za += p0 * z[t0_ * ng + jv] + p2 * z[t2_ * ng + jv];
                zb += p1 * z[t1_ * ng + jv] + p3 * z[t3_ * ng + jv];
                build_table(T + c * 16 * LANES, p0 * s[t0_ * ng + jv], p1 * s[t1_ * ng + jv],
                            p2 * s[t2_ * ng + jv], p3 * s[t3_ * ng + jv]);
            }
            vstore(zacc + jv * LANES, vload(zacc + jv * LANES) + (za + zb));
            int d = jv * gv;
            const int dend = (jv + 1) * gv;
            for (; d + 2 <= dend; d += 2) {
                v8sf a = lookup64(T, words[d]), a2 = lookup64(T, words[d + 1]);
                if (bits == 2) {
                    v8sf hi = lookup64(T, words[D + d]), hi2 = lookup64(T, words[D + d + 1]);
                    a += hi + hi;
                    a2 += hi2 + hi2;
                }
                vstore(acc + d * LANES, vload(acc + d * LANES) + a);
                vstore(acc + (d + 1) * LANES, vload(acc + (d + 1) * LANES) + a2);
            }
            for (; d < dend; d++) {
                v8sf a = lookup64(T, words[d]);
                if (bits == 2) {
                    v8sf hi = lookup64(T, words[D + d]);
                    a += hi + hi;
                }
                vstore(acc + d * LANES, vload(acc + d * LANES) + a);
            }
        }
    }
}

/* Work item it of specache_guide_weighted_values (GuideRun): its value blocks summed into its own part of
 * `out` (part_floats floats: D channels, then D / gv zero terms, LANES queries each). */
static void weighted_item(const void *ctx, int64_t it, float *scratch) {
    const GuideRun *a = ctx;
    const GuideItem w = guide_item(a, it);
    float *acc = a->out + (size_t)it * a->part_floats;
    values_item(a->x + w.b * a->x_sb + w.h * a->x_sh + w.q0 * a->x_sq, a->x_sq, w.nl, a->n,
                a->codes + w.b * a->c_sb + w.h * a->c_sh, a->scale + w.b * a->s_sb + w.h * a->s_sh,
                a->zero + w.b * a->s_sb + w.h * a->s_sh, w.k0, w.k1, (int)a->D, (int)a->g, (int)a->bits, acc,
                acc + (size_t)a->D * LANES, scratch, values_words(scratch, a->D / a->g));
}

/* out[b, h, q, d] = sum_{l < n} p[b, h, q, l] * V[b, h, l, d].
 * p: fp32, element (b, h, i, l) at p + b*p_sb + h*p_sh + i*p_sq + l.
 * codes: (b, h) block at codes + b*c_sb + h*c_sh, blocks contiguous [nb][bits][D][8].
 * scale/zero: (b, h) block at + b*s_sb + h*s_sh, [L][D/gv] contiguous.
 * out: fp32 [B, H, Q, D] contiguous. Returns 0, or -1 (bad arguments / out of memory). */
EXPORT int specache_guide_weighted_values(const float *p, int64_t p_sb, int64_t p_sh, int64_t p_sq,
                                          const uint8_t *codes, int64_t c_sb, int64_t c_sh, const uint16_t *scale,
                                          const uint16_t *zero, int64_t s_sb, int64_t s_sh, float *out, int64_t B,
                                          int64_t H, int64_t Q, int64_t D, int64_t n, int64_t gv, int64_t bits,
                                          int64_t nthreads) {
    if (B <= 0 || H <= 0 || Q <= 0 || D <= 0) return 0;
    if (gv <= 0 || D % gv || (bits != 1 && bits != 2)) return -1;
    if (n <= 0) {
        memset(out, 0, (size_t)(B * H * Q * D) * sizeof(float));
        return 0;
    }
    const int64_t nb = (n + VB - 1) / VB, nqb = (Q + LANES - 1) / LANES, base = B * H * nqb, ng = D / gv;
    const int64_t split = guide_split(base, nb, nthreads), items = base * split;
    const size_t part_floats = (size_t)(D + ng) * LANES;
    float *parts = scratch_alloc(part_floats * (size_t)items);
    if (!parts) return -1;
    const GuideRun a = {p, p_sb, p_sh, p_sq, codes, c_sb, c_sh, scale, zero, s_sb, s_sh, parts, part_floats,
                        H, Q, D, n, gv, bits, nb, nqb, split};
    const int failed = parallel_items(items, values_scratch_floats(ng) + 4 * (size_t)D, nthreads, weighted_item, &a);
    if (!failed) {
        for (int64_t bhq = 0; bhq < base; bhq++) {
            const int64_t qb = bhq % nqb, bh = bhq / nqb, q0 = qb * LANES;
            const int nl = (int)(Q - q0 < LANES ? Q - q0 : LANES);
            const float *first = parts + (size_t)(bhq * split) * part_floats;
            float *o = out + (bh * Q + q0) * D;
            for (int l = 0; l < nl; l++) {
                for (int64_t d = 0; d < D; d++) {
                    float v = 0.0f;
                    for (int64_t s = 0; s < split; s++) v += first[(size_t)s * part_floats + d * LANES + l];
                    float zt = 0.0f;
                    for (int64_t s = 0; s < split; s++)
                        zt += first[(size_t)s * part_floats + (D + d / gv) * LANES + l];
                    o[l * D + d] = v + zt;
                }
            }
        }
    }
    free(parts);
    return failed ? -1 : 0;
}

/* ------------------------------------------------------- fused decode attention */

/* One decode pass of one layer (engine/kvcache/guided.py GuidedLayer.attend_decode, same semantics):
 * per cache row b and KV head h, the Q = G*T grouped queries (query i is query head i / T of
 * the group, new token i % T) attend to
 *   [0, n)          n = qend[b]: guide scores, replaced by exact ones at the sinks
 *                   (positions < min(S, n)) and at the valid fetched positions fidx;
 *   [n, n + nres)   the residual window (exact), causal: position n + j is seen by new token
 *                   t iff n + j <= start[b] + t;
 * one softmax; output = exact values at sinks, fetched and residual positions + the guide's
 * values weighted by the remaining probabilities. With select >= 0, the probabilities of new
 * token `select`, summed over the G query heads, choose the top-k positions in [S, next_q)
 * (next_q: the quantized boundary after this pass), which become the new fidx / fvalid, and
 * their exact K/V are copied from the host store into the fetched buffers fk / fv.
 * With current (non-speculative prefetch, T = 1), the same selection is made first, from the
 * new token's own probabilities with guide scores (sinks and residual exact) over [S, n), and
 * the pass then attends with that fetched set. With softcap > 0 (Gemma 2) every score, exact or
 * the guide's, is capped (c tanh(s / c)) before the softmax and before any selection reads it.
 * Arrays indexed by cache row use row0 + b; q, out, start use b. All strides in elements.
 * The argument block, DecodeArgs, is in decode_args.h. */

/* The target's own vector width (VW floats, simd.h) as GCC vectors with int32 lanes beside them:
 * comparisons and selects on a wider GCC vector than the target has are done lane by lane. */
typedef float vnf __attribute__((vector_size(VW * 4)));
typedef int32_t vni __attribute__((vector_size(VW * 4)));
#define VN_SPLAT(x) ((vnf){0} + (x))

INLINE vnf vn_select(vni mask, vnf a, vnf b) { /* mask lanes are -1 (take a) or 0 (take b) */
    return (vnf)(((vni)a & mask) | ((vni)b & ~mask));
}
INLINE vnf vn_load(const float *p) { vnf v; memcpy(&v, p, sizeof v); return v; }
INLINE void vn_store(float *p, vnf v) { memcpy(p, &v, sizeof v); }

/* exp(x) per lane as 2^n * p(r), x = n ln2 + r, |r| <= ln2/2, degree-6 polynomial (relative error
 * ~2e-7); x below -87 (also -inf and NaN) gives 0. */
INLINE vnf vn_exp(vnf x) {
    const vni keep = x >= VN_SPLAT(-87.0f);
    x = vn_select(keep, x, VN_SPLAT(-87.0f));
    const vnf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const vnf r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    vnf p = VN_SPLAT(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const vni e = (__builtin_convertvector(n, vni) + 127) << 23;
    return (vnf)((vni)(p * (vnf)e) & keep);
}

/* row[l] = exp(row[l] - m) for l < L, VW at a time (the tail through a padded copy). */
static void exp_shifted(float *row, int64_t L, float m) {
    int64_t l = 0;
    for (; l + VW <= L; l += VW) vn_store(row + l, vn_exp(vn_load(row + l) - m));
    if (l < L) {
        float tail[VW] = {0};
        memcpy(tail, row + l, (size_t)(L - l) * sizeof(float));
        vn_store(tail, vn_exp(vn_load(tail) - m));
        memcpy(row + l, tail, (size_t)(L - l) * sizeof(float));
    }
}

/* Sum (op 0) or maximum (op 1) of x[0, L), with 16 independent lanes (16 / VW vectors) reduced in a
 * fixed order: the same float on every target. */
static float reduce16(const float *x, int64_t L, int op) {
    enum { NV = 16 / VW };
    vnf acc[NV];
    for (int k = 0; k < NV; k++) acc[k] = VN_SPLAT(op ? -__builtin_inff() : 0.0f);
    int64_t l = 0;
    if (op)
        for (; l + 16 <= L; l += 16)
            for (int k = 0; k < NV; k++) {
                const vnf v = vn_load(x + l + k * VW);
                acc[k] = vn_select(v > acc[k], v, acc[k]);
            }
    else
        for (; l + 16 <= L; l += 16)
            for (int k = 0; k < NV; k++) acc[k] += vn_load(x + l + k * VW);
    float lanes[16];
    memcpy(lanes, acc, sizeof lanes);
    for (; l < L; l++) lanes[0] = op ? (x[l] > lanes[0] ? x[l] : lanes[0]) : lanes[0] + x[l];
    float r = lanes[0];
    for (int i = 1; i < 16; i++) r = op ? (lanes[i] > r ? lanes[i] : r) : r + lanes[i];
    return r;
}

/* Attention-logit softcapping (Gemma 2), per lane: c * tanh(s / c), a masked score (-inf) kept.
 * tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) and |x| clamped to 9 (tanh(9) is 1 in
 * float): absolute error ~2e-7 c, the torch path's tanh rounded differently. */
INLINE vnf vn_softcap(vnf s, float c, float inv_c) {
    const vni masked = s == VN_SPLAT(-__builtin_inff());
    const vnf x = s * inv_c;
    const vni neg = x < VN_SPLAT(0.0f);
    vnf a = vn_select(neg, -x, x);
    a = vn_select(a > VN_SPLAT(9.0f), VN_SPLAT(9.0f), a);
    const vnf e = vn_exp(a * -2.0f);
    vnf t = (1.0f - e) / (1.0f + e) * c;
    t = vn_select(neg, -t, t);
    return vn_select(masked, s, t);
}

/* row[l] = c * tanh(row[l] / c) for l < L (c > 0; -inf stays), VW at a time (the tail through a padded copy). */
static void softcap_row(float *row, int64_t L, float c) {
    const float inv = 1.0f / c;
    int64_t l = 0;
    for (; l + VW <= L; l += VW) vn_store(row + l, vn_softcap(vn_load(row + l), c, inv));
    if (l < L) {
        float tail[VW] = {0};
        memcpy(tail, row + l, (size_t)(L - l) * sizeof(float));
        vn_store(tail, vn_softcap(vn_load(tail), c, inv));
        memcpy(row + l, tail, (size_t)(L - l) * sizeof(float));
    }
}

/* softmax of row[0, L) in place (entries may be -inf; at least one is finite). */
static void softmax_row(float *row, int64_t L) {
    exp_shifted(row, L, reduce16(row, L, 1));
    const float inv = 1.0f / reduce16(row, L, 0);
    for (int64_t l = 0; l < L; l++) row[l] *= inv;
}

INLINE float dot(const float *a, const float *b, int64_t D) { /* D % 8 == 0 */
    float acc[8] = {0};
    for (int64_t d = 0; d < D; d += 8)
        for (int i = 0; i < 8; i++) acc[i] += a[d + i] * b[d + i];
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

/* o[0, D) += sum_{j < m} w[j] * rows[j * D + .]: the output block stays in registers. */
static void add_weighted_rows(float *restrict o, const float *restrict rows, const float *restrict w, int64_t m,
                              int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        float acc[64];
        const float *r = rows + d0;
        if (D - d0 >= 64) {
            memcpy(acc, o + d0, sizeof acc);
            for (int64_t j = 0; j < m; j++)
                for (int dd = 0; dd < 64; dd++) acc[dd] += w[j] * r[j * D + dd];
            memcpy(o + d0, acc, sizeof acc);
        } else {
            const int64_t dn = D - d0;
            for (int64_t j = 0; j < m; j++)
                for (int64_t dd = 0; dd < dn; dd++) o[d0 + dd] += w[j] * r[j * D + dd];
        }
    }
}


/* Exact parts over scattered store rows (prefetch "current"): each row is read once, a few rows
 * ahead are prefetched, and every query uses it while it is in L1.
 * ex[i * ld + j] = q[i * D + .] . base[idx[j] * D + .] for i < nq, j < m. */
static void dots_gather(const float *q, int64_t nq, const float *base, const int32_t *idx, int64_t m, int64_t D,
                        float *ex, int64_t ld) {
    for (int64_t j = 0; j < m; j++) {
        if (j + 8 < m)
            for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(base + (int64_t)idx[j + 8] * D + d);
        const float *r = base + (int64_t)idx[j] * D;
        for (int64_t i = 0; i < nq; i++) ex[i * ld + j] = dot(q + i * D, r, D);
    }
}

/* Queries per block of add_weighted_gather: their accumulators (4 vectors each) plus a row vector and
 * the weights must stay in registers (32 vector registers with AVX-512 and NEON, 16 with AVX2 / SSE). */
#if VW == 16 || defined(__aarch64__)
#define GATHER_QB 4
#else
#define GATHER_QB 3
#endif

/* o[i * D + .] += sum_{j < m} w[i * ld + j] * base[idx[j] * D + .] for i < nq (same reading order):
 * per block of 4 vectors of the output and GATHER_QB queries, the accumulators stay in registers
 * while the rows stream through (a row is read once per block, from L1 after the first). */
static void add_weighted_gather(float *o, int64_t nq, const float *base, const int32_t *idx, const float *w,
                                int64_t ld, int64_t m, int64_t D) {
    if (D % (4 * VW) == 0) {
        for (int64_t d0 = 0; d0 < D; d0 += 4 * VW)
            for (int64_t i0 = 0; i0 < nq; i0 += GATHER_QB) {
                const int64_t ni = nq - i0 < GATHER_QB ? nq - i0 : GATHER_QB;
                vf acc[GATHER_QB][4];
                for (int64_t i = 0; i < GATHER_QB; i++)
                    for (int c = 0; c < 4; c++) acc[i][c] = i < ni ? vf_load(o + (i0 + i) * D + d0 + c * VW) : vf_zero();
                for (int64_t j = 0; j < m; j++) {
                    if (j + 8 < m)
                        for (int64_t d = d0; d < d0 + 4 * VW; d += 16) simd_prefetch(base + (int64_t)idx[j + 8] * D + d);
                    const float *r = base + (int64_t)idx[j] * D + d0;
                    vf wi[GATHER_QB];
                    for (int64_t i = 0; i < GATHER_QB; i++) wi[i] = vf_set1(i < ni ? w[(i0 + i) * ld + j] : 0.0f);
                    for (int c = 0; c < 4; c++) {
                        const vf rc = vf_load(r + c * VW);
                        for (int64_t i = 0; i < GATHER_QB; i++) acc[i][c] = vf_fma(wi[i], rc, acc[i][c]);
                    }
                }
                for (int64_t i = 0; i < ni; i++)
                    for (int c = 0; c < 4; c++) vf_store(o + (i0 + i) * D + d0 + c * VW, acc[i][c]);
            }
        return;
    }
    for (int64_t j = 0; j < m; j++) {
        const float *r = base + (int64_t)idx[j] * D;
        for (int64_t i = 0; i < nq; i++)
            for (int64_t d = 0; d < D; d++) o[i * D + d] += w[i * ld + j] * r[d];
    }
}

/* Indices (into val) of the k largest of val[0, m) (k < m, every val >= 0) written to idx
 * (in no particular order; ties at the threshold go to the lowest positions). Radix select
 * on the float bits, which order non-negative floats: a histogram of the top 11 bits finds
 * the bin of the k-th largest; one more pass takes every element above that bin and moves
 * the bin's elements (usually few) to `spill`, where 11 + 10 more bits find the exact k-th
 * largest. Two branch-light passes over the data, much faster than a quickselect's
 * data-dependent branches. hist: 2048 ints; spill: m uint32 + m int32. */
static void top_k(const float *val, int64_t m, int64_t k, int32_t *idx, int32_t *hist, uint32_t *spill_u,
                  int32_t *spill_i) {
    const uint32_t *u = (const uint32_t *)val; /* may alias a float array: only read */
    memset(hist, 0, 2048 * sizeof(int32_t));
    for (int64_t l = 0; l < m; l++) hist[u[l] >> 21]++;
    int64_t need = k;
    uint32_t bin = 2047;
    for (; bin > 0 && hist[bin] < need; bin--) need -= hist[bin];
    int64_t c = 0, ns = 0;
    for (int64_t l = 0; l < m; l++) {
        const uint32_t top = u[l] >> 21;
        if (top > bin) idx[c++] = (int32_t)l;
        else if (top == bin) {
            spill_u[ns] = u[l];
            spill_i[ns++] = (int32_t)l;
        }
    }
    /* the `need` largest of the spill (all share the top 11 bits): two more histogram passes */
    uint32_t prefix = bin << 21, pmask = 0x7FFu << 21;
    static const int shift[2] = {10, 0}, width[2] = {11, 10};
    for (int pass = 0; pass < 2; pass++) {
        const int sh = shift[pass], nb = 1 << width[pass];
        memset(hist, 0, (size_t)nb * sizeof(int32_t));
        for (int64_t l = 0; l < ns; l++)
            if ((spill_u[l] & pmask) == prefix) hist[(spill_u[l] >> sh) & (uint32_t)(nb - 1)]++;
        int b = nb - 1;
        for (; b > 0 && hist[b] < need; b--) need -= hist[b];
        prefix |= (uint32_t)b << sh;
        pmask |= (uint32_t)(nb - 1) << sh;
    }
    for (int64_t l = 0; l < ns; l++) /* prefix: the k-th largest; above it all, equal to it `need` */
        if (spill_u[l] > prefix || (spill_u[l] == prefix && need > 0)) {
            need -= spill_u[l] == prefix;
            idx[c++] = spill_i[l];
        }
}

/* dst[i][e] = sum_d src[i][d] R[d][e] for m rows of D (R [D][D] row-major): the rows rotated. */
static void rotate_rows(float *restrict dst, const float *restrict src, int64_t m, const float *restrict R, int64_t D) {
    for (int64_t i = 0; i < m; i++) {
        float *y = dst + i * D;
        memset(y, 0, (size_t)D * sizeof(float));
        for (int64_t d = 0; d < D; d++) {
            const float x = src[i * D + d], *r = R + d * D;
            for (int64_t e = 0; e < D; e++) y[e] += x * r[e];
        }
    }
}

/* Scratch floats one (b, h) item needs for up to L columns. */
static size_t decode_scratch_floats(const DecodeArgs *a, int64_t L) {
    const int64_t Q = a->G * a->T, D = a->D, ng = D / a->gv;
    const size_t keys = keys_scratch_floats(D, a->g) + keys_words_floats(D, a->g, a->bits);
    const size_t vals = values_scratch_floats(ng) + 4 * (size_t)D + (size_t)(D + ng) * LANES; /* + acc, zacc */
    size_t big = keys > vals ? keys : vals;
    big = big > 2048 ? big : 2048; /* top_k's histogram */
    const size_t wide = a->store_dtype == STORE_F32 ? 0 : (size_t)a->K * (D + 1); /* widen_rows' rows and iota */
    return (size_t)Q * L + 4 * (size_t)L + 2 * (size_t)Q * D + D + 3 * (size_t)a->K + 2 * (size_t)Q + (size_t)Q * a->K
           + (size_t)a->K / 4 + 1 + wide + big + 64;
}

/* The (at most) K positions of [S, hi) with the largest weights agg[l], into cidx (unordered);
 * returns how many. */
static int64_t select_top(const DecodeArgs *a, const float *agg, int64_t hi, int32_t *cidx, uint32_t *spill_u,
                          int32_t *spill_i, float *work) {
    const int64_t lo = a->S, m = hi - lo; /* candidates: positions lo .. hi - 1 */
    const int64_t chosen = m <= 0 ? 0 : m < a->K ? m : a->K;
    if (m > a->K) {
        top_k(agg + lo, m, a->K, cidx, (int32_t *)work, spill_u, spill_i);
    } else {
        for (int64_t j = 0; j < chosen; j++) cidx[j] = (int32_t)j;
    }
    for (int64_t j = 0; j < chosen; j++) cidx[j] += (int32_t)lo;
    return chosen;
}

/* The host store's elements of row r, head h, position pos (DecodeArgs.store_dtype: 4 or 2 bytes each). */
static const void *store_row(const DecodeArgs *a, const void *base, int64_t r, int64_t h, int64_t pos) {
    const int64_t at = r * a->st_sb + h * a->st_sh + pos * a->D;
    return (const char *)base + at * (a->store_dtype == STORE_F32 ? 4 : 2);
}

/* dst[0, D) = a store row of `dt` elements (STORE_F32 / STORE_BF16), widened to floats. */
static void widen_row(float *restrict dst, const void *restrict src, int64_t dt, int64_t D) {
    if (dt == STORE_F32) {
        memcpy(dst, src, (size_t)D * sizeof(float));
        return;
    }
    const uint16_t *s = src;
    int64_t d = 0;
    for (; d + VW <= D; d += VW) vf_store(dst + d, vf_from_bf16(s + d));
    for (; d < D; d++) dst[d] = bf16_to_float(s[d]);
}

/* wide[j * D + .] = the store rows at positions cidx[j], j < m, widened (a bf16 store read in place by
 * prefetch "current": the chosen rows then feed the fp32 kernels as a contiguous block; iota[j] = j). */
static void widen_rows(const DecodeArgs *a, const void *base, int64_t r, int64_t h, const int32_t *cidx, int64_t m,
                       float *wide, int32_t *iota) {
    for (int64_t j = 0; j < m; j++) {
        if (j + 4 < m) __builtin_prefetch(store_row(a, base, r, h, cidx[j + 4]));
        widen_row(wide + j * a->D, store_row(a, base, r, h, cidx[j]), a->store_dtype, a->D);
        iota[j] = (int32_t)j;
    }
}

/* The K positions of [S, hi) with the largest weights agg[l] (all of them if there are fewer)
 * become the fetched set of (row r, head h): slots of positions that stay selected are kept,
 * the new positions' exact K/V are copied from the host store into the freed slots. */
static void fetch_top(const DecodeArgs *a, int64_t r, int64_t h, const float *agg, int64_t hi, int64_t Lmax,
                      int32_t *cidx, uint32_t *spill_u, int32_t *spill_i, uint8_t *keep, float *work) {
    const int64_t D = a->D;
    int64_t *fidx = a->fidx + r * a->fi_sb + h * a->fi_sh;
    uint8_t *fvalid = a->fvalid + r * a->fi_sb + h * a->fi_sh;
    float *fk = a->fk + r * a->fk_sb + h * a->fk_sh, *fv = a->fv + r * a->fk_sb + h * a->fk_sh;
    const int64_t chosen = select_top(a, agg, hi, cidx, spill_u, spill_i, work);
    /* Consecutive steps select mostly the same positions: keep the slots of positions that
     * stay selected and copy only the new ones from the host store (scattered rows, bound
     * by memory latency), into the slots that were freed. */
    int32_t *slot_of = (int32_t *)spill_u; /* [Lmax] position -> old slot (the spill is free now) */
    memset(slot_of, 0xFF, (size_t)Lmax * sizeof(int32_t));
    for (int64_t j = 0; j < a->K; j++)
        if (fvalid[j] && fidx[j] < Lmax) slot_of[fidx[j]] = (int32_t)j;
    memset(keep, 0, (size_t)a->K);
    int64_t nnew = 0;
    for (int64_t j = 0; j < chosen; j++) {
        const int32_t s0 = slot_of[cidx[j]];
        if (s0 >= 0) keep[s0] = 1;
        else cidx[nnew++] = cidx[j]; /* to fetch (compacted in place: nnew <= j) */
    }
    int64_t next = 0; /* the next new position to place */
    for (int64_t j = 0; j < a->K; j++) {
        if (keep[j]) continue;
        if (next < nnew) {
            const int32_t pos = cidx[next++];
            if (next + 3 < nnew) { /* ask for a row a few ahead */
                const char *pk = store_row(a, a->store_k, r, h, cidx[next + 3]);
                const char *pv = store_row(a, a->store_v, r, h, cidx[next + 3]);
                for (int64_t d = 0; d < D * (a->store_dtype == STORE_F32 ? 4 : 2); d += 64) {
                    __builtin_prefetch(pk + d);
                    __builtin_prefetch(pv + d);
                }
            }
            fidx[j] = pos;
            fvalid[j] = 1;
            widen_row(fk + j * D, store_row(a, a->store_k, r, h, pos), a->store_dtype, D); /* (a 16-bit store */
            widen_row(fv + j * D, store_row(a, a->store_v, r, h, pos), a->store_dtype, D); /* widened here) */
        } else {
            fidx[j] = 0;
            fvalid[j] = 0;
        }
    }
}

/* dst[l] += bias + sum_o w[o] c[l][o] for the m tokens l of one group, c[l][o] the 4-bit code of outlier channel o
 * (two a byte, low nibble first). Each token's sum runs in the order of o, as a token-at-a-time loop would add it,
 * so every token gets the same float; inlined with O a constant (outlier_scores), the token loop vectorises. */
SIMD_INLINE void outlier_tokens(const uint8_t *restrict c, int64_t O, const float *restrict w, float bias, int64_t m,
                                float *restrict dst) {
    const int64_t bytes = (O + 1) / 2;
    for (int64_t l = 0; l < m; l++) {
        float acc = bias;
        for (int64_t o = 0; o < O; o++) acc += w[o] * (float)((c[l * bytes + o / 2] >> (4 * (o % 2))) & 15);
        dst[l] += acc;
    }
}

/* scores[i][l] += sum_o q[i][idx_o] * (s[l/g][o] c[l][o] + z[l/g][o]) for l < n: the outlier channels'
 * side guide (engine/kvcache/outliers.py OutlierKeys.scores), q the scaled, unrotated queries [Q][D].
 * The defaults' channel counts (2 for a 2-bit guide: a byte a token; 4 for 1 bit) get loops of their own. */
static void outlier_scores(const DecodeArgs *a, int64_t r, int64_t h, const float *q, int64_t Q, int64_t D, int64_t n,
                           float *scores, int64_t Lmax) {
    const int64_t O = a->O, g = a->g, bytes = (O + 1) / 2;
    const int64_t *idx = a->oidx + r * a->oi_sb + h * a->oi_sh;
    const uint8_t *codes = a->oc + r * a->oc_sb + h * a->oc_sh;
    const uint16_t *sc = a->os + r * a->os_sb + h * a->os_sh, *zc = a->oz + r * a->os_sb + h * a->os_sh;
    float w[16], bias;
    for (int64_t i = 0; i < Q; i++) {
        float *row = scores + i * Lmax;
        for (int64_t j = 0; j < n / g; j++) {
            bias = 0.0f;
            for (int64_t o = 0; o < O; o++) {
                const float qo = q[i * D + idx[o]];
                w[o] = qo * half_to_float(sc[j * O + o]);
                bias += qo * half_to_float(zc[j * O + o]);
            }
            const uint8_t *c = codes + j * g * bytes;
            if (O == 2) outlier_tokens(c, 2, w, bias, g, row + j * g);
            else if (O == 4) outlier_tokens(c, 4, w, bias, g, row + j * g);
            else outlier_tokens(c, O, w, bias, g, row + j * g);
        }
    }
}

static void decode_item(const DecodeArgs *a, int64_t b, int64_t h, float *scratch, int64_t Lmax) {
    const int64_t Q = a->G * a->T, D = a->D, T = a->T, r = a->row0 + b;
    const int64_t n = a->qend[r], start = a->start[b], nres = start + T - n, L = n + nres;
    const int64_t S = a->S < n ? a->S : n;
    const int cap = a->softcap > 0.0f; /* every score softcapped before the softmax (DecodeArgs.softcap) */
    float *scores = scratch;                    /* [Q][Lmax] */
    float *agg = scores + (size_t)Q * Lmax;     /* [Lmax] */
    int32_t *cidx = (int32_t *)(agg + Lmax);    /* [Lmax] */
    uint32_t *spill_u = (uint32_t *)(cidx + Lmax); /* [Lmax] top_k's spill */
    int32_t *spill_i = (int32_t *)(spill_u + Lmax);
    float *q = (float *)(spill_i + Lmax);       /* [Q][D] queries times the score scaling */
    float *qr = q + Q * D;                      /* [Q][D] q R: the guide's queries (rot), else unused */
    float *gout = qr + Q * D;                   /* [D] one query's guide output before R^T (rot) */
    int64_t *fpos = (int64_t *)(gout + D);      /* [K] position of each fetched slot, -1 if unused */
    float *fw = (float *)(fpos + a->K);         /* [K] a query's weights of the fetched slots */
    float *mx = fw + a->K, *zs = mx + Q;        /* [Q] each query's row maximum and sum of exponentials */
    float *exq = zs + Q;                        /* [Q][K] exact scores, then weights, of the chosen rows */
    uint8_t *keep = (uint8_t *)(exq + Q * a->K); /* [K] fetched slots that stay selected */
    float *wide = (float *)keep + a->K / 4 + 1; /* [K][D] a 16-bit store's chosen rows, widened (direct) */
    int32_t *iota = (int32_t *)(wide + (a->store_dtype == STORE_F32 ? 0 : a->K * D)); /* [K] 0, 1, ... */
    float *work = (float *)(iota + (a->store_dtype == STORE_F32 ? 0 : a->K)); /* kernels' scratch, aligned below */
    work = (float *)(((uintptr_t)work + ALIGN - 1) / ALIGN * ALIGN);
    const float *q_in = a->q + b * a->q_sb + h * a->q_sh;
    for (int64_t i = 0; i < Q * D; i++) q[i] = q_in[i] * a->scaling;
    const float *qg = q; /* the queries the guide's keys take */
    if (a->rot && n > 0) {
        rotate_rows(qr, q, Q, a->rot, D);
        qg = qr;
    }
    const float *sk = a->sink_k + r * a->sk_sb + h * a->sk_sh, *sv = a->sink_v + r * a->sk_sb + h * a->sk_sh;
    const int64_t r0 = a->res_at_qend ? n * D : 0; /* the window's first slot */
    const float *rk = a->res_k + r * a->rk_sb + h * a->rk_sh + r0, *rv = a->res_v + r * a->rk_sb + h * a->rk_sh + r0;
    float *fk = a->fk + r * a->fk_sb + h * a->fk_sh, *fv = a->fv + r * a->fk_sb + h * a->fk_sh;
    int64_t *fidx = a->fidx + r * a->fi_sb + h * a->fi_sh;
    uint8_t *fvalid = a->fvalid + r * a->fi_sb + h * a->fi_sh;
    float *out = a->out + ((b * a->H + h) * Q) * D;
    /* With current (the host store is this memory): the pass selects its own set from its guide
     * attention and reads those rows straight from the store, without copying them into the
     * fetched buffers; the exponentials of the selection pass are reused for the softmax.
     * Otherwise the fetched slots hold the positions fpos (-1: unused). */
    const int direct = (a->current || a->correct) && a->K > 0 && n > 0;
    const int use_fetched = n > 0 && a->K > 0 && !direct;
    if (use_fetched)
        for (int64_t j = 0; j < a->K; j++) fpos[j] = fvalid[j] && fidx[j] >= S && fidx[j] < n ? fidx[j] : -1;

    /* 1. scores */
    if (n > 0) {
        const int64_t g = a->g;
        for (int64_t q0 = 0; q0 < Q; q0 += LANES) {
            const int nl = (int)(Q - q0 < LANES ? Q - q0 : LANES);
            keys_item(qg + q0 * D, D, nl, a->kc + r * a->kc_sb + h * a->kc_sh, a->ks + r * a->ks_sb + h * a->ks_sh,
                      a->kz + r * a->ks_sb + h * a->ks_sh, scores + q0 * Lmax, Lmax, 0, n / g, (int)D, (int)g,
                      (int)a->bits, work, keys_words(work, D, g));
        }
        if (a->O > 0)
            outlier_scores(a, r, h, q, Q, D, n, scores, Lmax);
    }
    for (int64_t i = 0; i < Q; i++) {
        float *row = scores + i * Lmax;
        const float *qi = q + i * D;
        for (int64_t s = 0; s < S; s++) row[s] = dot(qi, sk + s * D, D);
        const int64_t last = start + i % T; /* the newest position this query sees */
        for (int64_t j = 0; j < nres; j++)
            row[n + j] = n + j <= last ? dot(qi, rk + j * D, D) : -__builtin_inff();
        if (cap) softcap_row(row, L, a->softcap); /* guide, sink and residual scores alike */
    }
    int64_t chosen = 0;
    if (direct) {
        for (int64_t l = 0; l < n; l++) agg[l] = 0.0f;
        for (int64_t i = 0; i < Q; i++) {
            float *row = scores + i * Lmax;
            mx[i] = reduce16(row, L, 1);
            exp_shifted(row, L, mx[i]);
            zs[i] = reduce16(row, L, 0);
            const float inv = 1.0f / zs[i];
            if (i % T == 0) /* token 0's queries choose (current: T = 1, all of them) */
                for (int64_t l = 0; l < n; l++) agg[l] += row[l] * inv;
        }
        chosen = select_top(a, agg, n, cidx, spill_u, spill_i, work);
        if (a->reuse) { /* how many of the chosen positions the prefetched set holds */
            uint8_t *held = (uint8_t *)spill_u; /* [n] (the spill is free until fetch_top) */
            memset(held, 0, (size_t)n);
            for (int64_t j = 0; j < a->K; j++)
                if (fvalid[j] && fidx[j] >= 0 && fidx[j] < n) held[fidx[j]] = 1;
            int64_t hit = 0;
            for (int64_t j = 0; j < chosen; j++) hit += held[cidx[j]];
            a->reuse[(b * a->H + h) * 2] = hit;
            a->reuse[(b * a->H + h) * 2 + 1] = chosen;
        }
        if (!a->correct)
            for (int64_t j = 0; j < a->K; j++) {
                fidx[j] = j < chosen ? cidx[j] : 0;
                fvalid[j] = j < chosen;
            }
        if (a->store_dtype == STORE_F32) {
            dots_gather(q, Q, store_row(a, a->store_k, r, h, 0), cidx, chosen, D, exq, a->K);
        } else {
            widen_rows(a, a->store_k, r, h, cidx, chosen, wide, iota);
            dots_gather(q, Q, wide, iota, chosen, D, exq, a->K);
        }
        for (int64_t i = 0; i < Q; i++) {
            float *row = scores + i * Lmax, *ex = exq + i * a->K;
            if (cap) softcap_row(ex, chosen, a->softcap);
            float emax = mx[i], z = zs[i];
            for (int64_t j = 0; j < chosen; j++) emax = ex[j] > emax ? ex[j] : emax;
            if (emax > mx[i]) { /* an exact score above the row's maximum: rescale (rare) */
                const float c = expf(mx[i] - emax);
                for (int64_t l = 0; l < L; l++) row[l] *= c;
                z *= c;
            }
            exp_shifted(ex, chosen, emax);
            for (int64_t j = 0; j < chosen; j++) {
                z += ex[j] - row[cidx[j]];
                row[cidx[j]] = ex[j];
            }
            const float inv = 1.0f / z;
            for (int64_t l = 0; l < L; l++) row[l] *= inv;
        }
    } else {
        for (int64_t i = 0; i < Q; i++) {
            float *row = scores + i * Lmax;
            const float *qi = q + i * D;
            if (use_fetched) {
                for (int64_t j = 0; j < a->K; j++) fw[j] = fpos[j] >= 0 ? dot(qi, fk + j * D, D) : 0.0f;
                if (cap) softcap_row(fw, a->K, a->softcap);
                for (int64_t j = 0; j < a->K; j++)
                    if (fpos[j] >= 0) row[fpos[j]] = fw[j];
            }
            /* 2. softmax */
            softmax_row(row, L);
        }
    }
    /* 3. selection weights (before the exact positions are taken out of the guide's share) */
    if (a->select >= 0)
        for (int64_t l = 0; l < L; l++) {
            float s = 0.0f;
            if (a->select_both)
                for (int64_t i = 0; i < Q; i++) s += scores[i * Lmax + l];
            else
                for (int64_t gi = 0; gi < a->G; gi++) s += scores[(gi * T + a->select) * Lmax + l];
            agg[l] = s;
        }
    /* 4. exact parts of the output, then the guide's values weighted by what is left */
    for (int64_t i = 0; i < Q; i++) {
        float *row = scores + i * Lmax, *o = out + i * D;
        memset(o, 0, (size_t)D * sizeof(float));
        add_weighted_rows(o, rv, row + n, nres, D);
        add_weighted_rows(o, sv, row, S, D);
        for (int64_t s = 0; s < S; s++) row[s] = 0.0f;
        if (direct) { /* the chosen rows' weights, added below for all queries at once */
            for (int64_t j = 0; j < chosen; j++) {
                exq[i * a->K + j] = row[cidx[j]];
                row[cidx[j]] = 0.0f;
            }
        } else if (use_fetched) {
            for (int64_t j = 0; j < a->K; j++) fw[j] = fpos[j] >= 0 ? row[fpos[j]] : 0.0f;
            add_weighted_rows(o, fv, fw, a->K, D);
            for (int64_t j = 0; j < a->K; j++)
                if (fpos[j] >= 0) row[fpos[j]] = 0.0f;
        }
    }
    if (direct && a->store_dtype == STORE_F32) {
        add_weighted_gather(out, Q, store_row(a, a->store_v, r, h, 0), cidx, exq, a->K, chosen, D);
    } else if (direct) {
        widen_rows(a, a->store_v, r, h, cidx, chosen, wide, iota);
        add_weighted_gather(out, Q, wide, iota, exq, a->K, chosen, D);
    }
    if (n > 0) {
        const int64_t ng = D / a->gv;
        float *acc = work, *zacc = acc + (size_t)D * LANES, *vscr = zacc + (size_t)ng * LANES;
        vscr = (float *)(((uintptr_t)vscr + ALIGN - 1) / ALIGN * ALIGN);
        for (int64_t q0 = 0; q0 < Q; q0 += LANES) {
            const int nl = (int)(Q - q0 < LANES ? Q - q0 : LANES);
            values_item(scores + q0 * Lmax, Lmax, nl, n, a->vc + r * a->vc_sb + h * a->vc_sh,
                        a->vs + r * a->vs_sb + h * a->vs_sh, a->vz + r * a->vs_sb + h * a->vs_sh, 0,
                        (n + VB - 1) / VB, (int)D, (int)a->gv, (int)a->bits, acc, zacc, vscr,
                        values_words(vscr, ng));
            for (int l = 0; l < nl; l++) {
                float *o = out + (q0 + l) * D;
                if (a->rot) { /* o += gout R^T: o[e] += sum_d gout[d] R[e][d] */
                    for (int64_t d = 0; d < D; d++) gout[d] = acc[d * LANES + l] + zacc[(d / a->gv) * LANES + l];
                    for (int64_t e = 0; e < D; e++) o[e] += dot(gout, a->rot + e * D, D);
                } else {
                    for (int64_t d = 0; d < D; d++) o[d] += acc[d * LANES + l] + zacc[(d / a->gv) * LANES + l];
                }
            }
        }
    }
    /* 5. next fetched set and its prefetch from the host store */
    if (a->select >= 0 && a->K > 0) {
        const int64_t len = start + a->keep, nq = (len - a->residual) > 0 ? (len - a->residual) / a->g * a->g : 0;
        fetch_top(a, r, h, agg, nq, Lmax, cidx, spill_u, spill_i, keep, work);
    }
}

typedef struct {
    const DecodeArgs *a;
    int64_t Lmax;
} DecodeRun;

static void decode_run_item(const void *ctx, int64_t it, float *scratch) {
    const DecodeRun *run = ctx;
    decode_item(run->a, it / run->a->H, it % run->a->H, scratch, run->Lmax);
}

/* Returns 0, or -1 for bad arguments / out of memory. */
EXPORT int specache_decode_attention(const DecodeArgs *a) {
    if (a->B <= 0 || a->H <= 0) return 0;
    if (a->D % 8 || a->D > 64 * MAX_WORDS || a->g % 8 || a->gv <= 0 || a->D % a->gv || (a->bits != 1 && a->bits != 2)
        || a->T < 1 || a->G < 1 || a->O < 0 || a->O > 16 || (a->O > 0 && !(a->oidx && a->oc && a->os && a->oz))
        || a->store_dtype < STORE_F32 || a->store_dtype > STORE_BF16)
        return -1;
    int64_t Lmax = 1;
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t L = a->start[b] + a->T;
        if (a->qend[a->row0 + b] % a->g || a->qend[a->row0 + b] > a->start[b]) return -1;
        Lmax = L > Lmax ? L : Lmax;
    }
    Lmax = (Lmax + 15) / 16 * 16;
    const DecodeRun run = {a, Lmax};
    return parallel_items(a->B * a->H, decode_scratch_floats(a, Lmax), a->nthreads, decode_run_item, &run);
}

/* ------------------------------------------------------- sliding-window decode attention */

/* A sliding-window layer's decode pass (engine/kvcache/sliding.py SlidingWindowLayer.attend, whose torch code
 * is the reference): per cache row b, KV head h and grouped query i (query head i / T of the group, new token
 * t = i % T at position p = start[b] + t), the slots c of the ring whose position pos[c] lies in (p - W, p]
 * are attended (only those: a ring holds up to W + a chunk): scores q . k * scaling (softcapped when
 * softcap > 0), one softmax, the values weighted. A query that sees no slot gets zeros.
 * One work item is a block of the query heads of one new token (they see the same slots): each visible key
 * and value row is read once for the block (a ring of Gemma 3 270M is ~1 MiB of fp32 keys: read once per
 * query it left L2 for every one of the 4 heads). The block is the whole group where the rows and KV heads
 * give every thread an item, else a share of it, so a batch-1 model with one KV head still spreads over the
 * threads. Each query's floats are the same whatever its block (its own scores, softmax and sums, in order).
 * Returns 0, or -1 for bad arguments / out of memory. */
/* out[j * ld] = q_j . k for the nq queries q [nq, D] (D % 8 == 0): up to 4 queries a pass over k, two vector
 * accumulators each (8 independent FMA chains where `dot` has one), so one key row feeds every head of a group. */
static void dots_block(const float *q, int64_t nq, const float *k, int64_t D, float *out, int64_t ld) {
    if (D % (2 * VW)) {
        for (int64_t j = 0; j < nq; j++) out[j * ld] = dot(q + j * D, k, D);
        return;
    }
    for (int64_t j0 = 0; j0 < nq; j0 += 4) {
        const int64_t nj = nq - j0 < 4 ? nq - j0 : 4;
        vf acc[4][2];
        for (int j = 0; j < 4; j++) acc[j][0] = acc[j][1] = vf_zero();
        for (int64_t d = 0; d < D; d += 2 * VW) {
            const vf k0 = vf_load(k + d), k1 = vf_load(k + d + VW);
            for (int64_t j = 0; j < nj; j++) {
                const float *qj = q + (j0 + j) * D + d;
                acc[j][0] = vf_fma(vf_load(qj), k0, acc[j][0]);
                acc[j][1] = vf_fma(vf_load(qj + VW), k1, acc[j][1]);
            }
        }
        for (int64_t j = 0; j < nj; j++) out[(j0 + j) * ld] = vf_hsum(vf_add(acc[j][0], acc[j][1]));
    }
}

typedef struct {
    const SlidingArgs *a;
    int64_t qb, blocks, cpad; /* query heads per item, items per (row, KV head, token), padded slots */
} SlidingRun;

static void sliding_run_item(const void *ctx, int64_t it, float *scratch) {
    const SlidingRun *run = ctx;
    const SlidingArgs *a = run->a;
    const int64_t D = a->D, C = a->C, T = a->T, cpad = run->cpad;
    const int64_t blk = it % run->blocks, t = it / run->blocks % T, h = it / (run->blocks * T) % a->H;
    const int64_t b = it / (run->blocks * T * a->H), r = a->row0 + b, p = a->start[b] + t;
    const int64_t g0 = blk * run->qb, nq = a->G - g0 < run->qb ? a->G - g0 : run->qb;
    const float *k = a->k + r * a->k_sb + h * a->k_sh, *v = a->v + r * a->k_sb + h * a->k_sh;
    const int64_t *pos = a->pos + r * a->pos_sb;
    float *rows = scratch, *q = scratch + run->qb * cpad + cpad, *o = q + run->qb * D;
    int32_t *idx = (int32_t *)(scratch + run->qb * cpad);
    for (int64_t j = 0; j < nq; j++) {
        const float *qi = a->q + b * a->q_sb + h * a->q_sh + ((g0 + j) * T + t) * D;
        for (int64_t d = 0; d < D; d++) q[j * D + d] = qi[d] * a->scaling;
    }
    int64_t m = 0; /* the visible slots, compacted: scores rows[j * cpad + 0, m), slots idx[0, m) */
    for (int64_t c = 0; c < C; c++)
        if (pos[c] >= 0 && pos[c] <= p && pos[c] > p - a->W) {
            idx[m] = (int32_t)c;
            dots_block(q, nq, k + c * D, D, rows + m, cpad);
            m++;
        }
    memset(o, 0, (size_t)(nq * D) * sizeof(float));
    if (m) {
        for (int64_t j = 0; j < nq; j++) {
            if (a->softcap > 0.0f) softcap_row(rows + j * cpad, m, a->softcap);
            softmax_row(rows + j * cpad, m);
        }
        add_weighted_gather(o, nq, v, idx, rows, cpad, m, D);
    }
    for (int64_t j = 0; j < nq; j++) /* query i = (g0 + j) * T + t of out [B, H, G*T, D] */
        memcpy(a->out + ((b * a->H + h) * a->G * T + (g0 + j) * T + t) * D, o + j * D, (size_t)D * sizeof(float));
}

EXPORT int specache_sliding_attention(const SlidingArgs *a) {
    if (a->B <= 0 || a->H <= 0 || a->C <= 0) return 0;
    if (a->D % 8 || a->D <= 0 || a->G < 1 || a->T < 1 || a->W < 1) return -1;
    const int64_t base = a->B * a->H * a->T, nthreads = a->nthreads > 1 ? a->nthreads : 1;
    const int64_t want = base >= nthreads ? 1 : (nthreads + base - 1) / base; /* blocks per group wanted */
    const int64_t split = want < a->G ? want : a->G, qb = (a->G + split - 1) / split;
    const int64_t blocks = (a->G + qb - 1) / qb, cpad = (a->C + 15) / 16 * 16;
    const SlidingRun run = {a, qb, blocks, cpad};
    /* scores (qb rows of cpad), slot indices (cpad), the scaled queries and their outputs (qb x D each) */
    const size_t floats = (size_t)(qb * cpad + cpad + 2 * qb * a->D);
    return parallel_items(base * blocks, floats, a->nthreads, sliding_run_item, &run);
}
