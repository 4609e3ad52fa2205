/* Native CPU kernels for the SpeCache guide (engine/quant.py): scores q @ K^T and the
 * weighted sum p @ V over 1/2-bit packed KIVI codes, without a dequantized copy.
 *
 * Plain C ABI (ctypes), raw pointers + sizes + strides; no torch headers. Built and loaded
 * by engine/native/__init__.py (cc -O3 -march=native -fopenmp -shared -fPIC).
 *
 * Layouts (engine/quant.py module docstring), bits packed little-endian (bit i of byte r
 * is element 8r + i), so a 64-bit load is 64 consecutive elements of one bit plane:
 *   keys   codes [B, H, J, bits, g, D/8]   one D-bit row per token and plane: the channels
 *          scale/zero fp16 [B, H, J, D]
 *   values codes [B, H, nb, bits, D, 8]    one 64-bit word per channel and plane: 64 tokens
 *          scale/zero fp16 [B, H, L, D/gv]
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
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define LANES 8
#define ALIGN 64

typedef float v8sf __attribute__((vector_size(32)));

#define EXPORT __attribute__((visibility("default")))
#define INLINE static inline __attribute__((always_inline))

EXPORT int specache_guide_abi_version(void) { return 1; }

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

static float half_to_float_sw(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, bits;
    float f;
    if (e == 0) {
        f = (float)m * 5.9604644775390625e-08f; /* subnormal (or zero): m * 2^-24 */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7f800000u | (m << 13);
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static void halves_to_floats(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = half_to_float_sw(src[i]);
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
    v8sf a0, a1, a2, a3;
#define LK(c) (*(const v8sf *)(base + (c) * 512 + nib_off(w, (c))))
    a0 = LK(0);
    a1 = LK(1);
    a2 = LK(2);
    a3 = LK(3);
    a0 += LK(4);
    a1 += LK(5);
    a2 += LK(6);
    a3 += LK(7);
    a0 += LK(8);
    a1 += LK(9);
    a2 += LK(10);
    a3 += LK(11);
    a0 += LK(12);
    a1 += LK(13);
    a2 += LK(14);
    a3 += LK(15);
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

/* The first `bytes` (< 8) bytes at p as a little-endian word, zero above. */
static uint64_t load_tail(const uint8_t *p, int bytes) {
    uint64_t w = 0;
    for (int i = 0; i < bytes; i++) w |= (uint64_t)p[i] << (8 * i);
    return w;
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

/* --------------------------------------------------------------------------- keys */

/* Scores of query block [nl <= 8 queries] against key groups [j0, j1) of one (b, h). */
static void keys_item(const float *q, int64_t q_sq, int nl, const uint8_t *codes, const uint16_t *sc,
                      const uint16_t *zr, float *out, int64_t n, int64_t j0, int64_t j1, int D, int g,
                      int bits, float *scratch) {
    const int nw = D / 64, nchunk = D / 4, tail = (D % 64) / 8; /* full words, bytes of a last partial one */
    float *T = scratch;                        /* nchunk * 16 * 8 */
    float *qT = T + (size_t)nchunk * 16 * LANES; /* D * 8 */
    float *tile = qT + (size_t)D * LANES;      /* g * 8 */
    float *sz = tile + (size_t)g * LANES;      /* 2 * D */
    const size_t row = (size_t)D / 8, plane = (size_t)g * row, gbytes = plane * (size_t)bits;

    memset(qT, 0, (size_t)D * LANES * sizeof(float));
    for (int l = 0; l < nl; l++)
        for (int d = 0; d < D; d++) qT[d * LANES + l] = q[l * q_sq + d];

    for (int64_t j = j0; j < j1; j++) {
        halves_to_floats(sc + j * D, sz, D);
        halves_to_floats(zr + j * D, sz + D, D);
        v8sf z0 = vsplat(0.0f), z1 = z0, z2 = z0, z3 = z0;
        for (int c = 0; c < nchunk; c++) {
            const int d = 4 * c;
            v8sf q0 = vload(qT + (d + 0) * LANES), q1 = vload(qT + (d + 1) * LANES);
            v8sf q2 = vload(qT + (d + 2) * LANES), q3 = vload(qT + (d + 3) * LANES);
            z0 += q0 * sz[D + d];
            z1 += q1 * sz[D + d + 1];
            z2 += q2 * sz[D + d + 2];
            z3 += q3 * sz[D + d + 3];
            build_table(T + (size_t)c * 16 * LANES, q0 * sz[d], q1 * sz[d + 1], q2 * sz[d + 2], q3 * sz[d + 3]);
        }
        const v8sf zq = (z0 + z1) + (z2 + z3);
        const uint8_t *cj = codes + (size_t)j * gbytes;
        for (int t = 0; t < g && nw == 0; t++) vstore(tile + (size_t)t * LANES, zq);
        for (int t = 0; t < g && nw > 0; t += 2) { /* two tokens at a time: independent chains */
            const uint8_t *r0 = cj + (size_t)t * row;
            v8sf acc = lookup64(T, load_u64(r0)), acc2 = lookup64(T, load_u64(r0 + row));
            for (int w = 1; w < nw; w++) {
                acc += lookup64(T + (size_t)w * 16 * 16 * LANES, load_u64(r0 + 8 * w));
                acc2 += lookup64(T + (size_t)w * 16 * 16 * LANES, load_u64(r0 + row + 8 * w));
            }
            if (bits == 2) {
                const uint8_t *r1 = r0 + plane;
                v8sf hi = lookup64(T, load_u64(r1)), hi2 = lookup64(T, load_u64(r1 + row));
                for (int w = 1; w < nw; w++) {
                    hi += lookup64(T + (size_t)w * 16 * 16 * LANES, load_u64(r1 + 8 * w));
                    hi2 += lookup64(T + (size_t)w * 16 * 16 * LANES, load_u64(r1 + row + 8 * w));
                }
                acc += hi + hi;
                acc2 += hi2 + hi2;
            }
            vstore(tile + (size_t)t * LANES, acc + zq);
            vstore(tile + (size_t)(t + 1) * LANES, acc2 + zq);
        }
        if (tail) { /* head_dim % 64 != 0: the channels of the last, partial word */
            const float *Tt = T + (size_t)nw * 16 * 16 * LANES;
            for (int t = 0; t < g; t++) {
                const uint8_t *r0 = cj + (size_t)t * row + 8 * (size_t)nw;
                v8sf a = lookup_tail(Tt, load_tail(r0, tail), 2 * tail);
                if (bits == 2) {
                    const v8sf hi = lookup_tail(Tt, load_tail(r0 + plane, tail), 2 * tail);
                    a += hi + hi;
                }
                vstore(tile + (size_t)t * LANES, vload(tile + (size_t)t * LANES) + a);
            }
        }
        store_transposed(tile, g, out + j * g, n, nl);
    }
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
    if (D <= 0 || D % 8 || g <= 0 || g % 8 || n % g || (bits != 1 && bits != 2)) return -1;
    const int64_t J = n / g, nqb = (Q + LANES - 1) / LANES, base = B * H * nqb;
    int64_t split = 1;
    if (nthreads > 1) split = (4 * nthreads + base - 1) / base; /* ~4 items per thread */
    if (split > J) split = J;
    const int64_t items = base * split;
    const size_t sfloats = (size_t)(D / 4) * 16 * LANES + (size_t)D * LANES + (size_t)g * LANES + 2 * (size_t)D;
    int failed = 0;
#pragma omp parallel num_threads((int)nthreads) if (nthreads > 1 && items > 1) reduction(| : failed)
    {
        float *scratch = scratch_alloc(sfloats);
        if (!scratch) failed = 1;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (!scratch) continue;
            const int64_t part = it % split, bhq = it / split, qb = bhq % nqb, bh = bhq / nqb;
            const int64_t b = bh / H, h = bh % H;
            const int64_t j0 = J * part / split, j1 = J * (part + 1) / split;
            const int64_t q0 = qb * LANES;
            const int nl = (int)(Q - q0 < LANES ? Q - q0 : LANES);
            keys_item(q + b * q_sb + h * q_sh + q0 * q_sq, q_sq, nl, codes + b * c_sb + h * c_sh,
                      scale + b * s_sb + h * s_sh, zero + b * s_sb + h * s_sh,
                      out + ((b * H + h) * Q + q0) * n, n, j0, j1, (int)D, (int)g, (int)bits, scratch);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------------- values */

#define VB 64 /* tokens per value block */

/* Partial p @ V of query block [nl <= 8] over value blocks [k0, k1) of one (b, h):
 * acc[d][lane] (codes term) and zacc[jv][lane] (zero term), both overwritten. */
static void values_item(const float *p, int64_t p_sq, int nl, int64_t n, const uint8_t *codes, const uint16_t *sc,
                        const uint16_t *zr, int64_t k0, int64_t k1, int D, int gv, int bits, float *acc,
                        float *zacc, float *scratch) {
    const int ng = D / gv;
    float *T = scratch;               /* 16 * 16 * 8 */
    float *pT = T + 16 * 16 * LANES;  /* 64 * 8 */
    float *s = pT + VB * LANES;       /* 64 * ng */
    float *z = s + (size_t)VB * ng;   /* 64 * ng */
    const size_t plane = (size_t)D * 8, bbytes = plane * (size_t)bits;

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
        for (int jv = 0; jv < ng; jv++) {
            v8sf za = vsplat(0.0f), zb = za;
            for (int c = 0; c < 16; c++) {
                const int i = 4 * c;
                v8sf p0 = vload(pT + i * LANES), p1 = vload(pT + (i + 1) * LANES);
                v8sf p2 = vload(pT + (i + 2) * LANES), p3 = vload(pT + (i + 3) * LANES);
                za += p0 * z[i * ng + jv] + p2 * z[(i + 2) * ng + jv];
                zb += p1 * z[(i + 1) * ng + jv] + p3 * z[(i + 3) * ng + jv];
                build_table(T + c * 16 * LANES, p0 * s[i * ng + jv], p1 * s[(i + 1) * ng + jv],
                            p2 * s[(i + 2) * ng + jv], p3 * s[(i + 3) * ng + jv]);
            }
            vstore(zacc + jv * LANES, vload(zacc + jv * LANES) + (za + zb));
            int d = jv * gv;
            const int dend = (jv + 1) * gv;
            for (; d + 2 <= dend; d += 2) {
                const uint8_t *cd = ck + (size_t)d * 8;
                v8sf a = lookup64(T, load_u64(cd)), a2 = lookup64(T, load_u64(cd + 8));
                if (bits == 2) {
                    v8sf hi = lookup64(T, load_u64(cd + plane)), hi2 = lookup64(T, load_u64(cd + plane + 8));
                    a += hi + hi;
                    a2 += hi2 + hi2;
                }
                vstore(acc + d * LANES, vload(acc + d * LANES) + a);
                vstore(acc + (d + 1) * LANES, vload(acc + (d + 1) * LANES) + a2);
            }
            for (; d < dend; d++) {
                v8sf a = lookup64(T, load_u64(ck + (size_t)d * 8));
                if (bits == 2) {
                    v8sf hi = lookup64(T, load_u64(ck + plane + (size_t)d * 8));
                    a += hi + hi;
                }
                vstore(acc + d * LANES, vload(acc + d * LANES) + a);
            }
        }
    }
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
    int64_t split = 1;
    if (nthreads > 1) split = (4 * nthreads + base - 1) / base;
    if (split > nb) split = nb;
    const int64_t items = base * split;
    const size_t part_floats = (size_t)(D + ng) * LANES;
    float *parts = scratch_alloc(part_floats * (size_t)items);
    if (!parts) return -1;
    const size_t sfloats = 16 * 16 * LANES + VB * LANES + 2 * (size_t)VB * ng;
    int failed = 0;
#pragma omp parallel num_threads((int)nthreads) if (nthreads > 1 && items > 1) reduction(| : failed)
    {
        float *scratch = scratch_alloc(sfloats);
        if (!scratch) failed = 1;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            if (!scratch) continue;
            const int64_t part = it % split, bhq = it / split, qb = bhq % nqb, bh = bhq / nqb;
            const int64_t b = bh / H, h = bh % H;
            const int64_t k0 = nb * part / split, k1 = nb * (part + 1) / split;
            const int64_t q0 = qb * LANES;
            const int nl = (int)(Q - q0 < LANES ? Q - q0 : LANES);
            float *acc = parts + (size_t)it * part_floats;
            values_item(p + b * p_sb + h * p_sh + q0 * p_sq, p_sq, nl, n, codes + b * c_sb + h * c_sh,
                        scale + b * s_sb + h * s_sh, zero + b * s_sb + h * s_sh, k0, k1, (int)D, (int)gv, (int)bits,
                        acc, acc + (size_t)D * LANES, scratch);
        }
        free(scratch);
    }
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
