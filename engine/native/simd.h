/* The vector type the native kernels are written against, one definition per instruction set.
 *
 * A kernel written with these helpers compiles for every target the library is built for
 * (engine/native/__init__.py, $SPECACHE_NATIVE_ARCH): the lanes are
 *   AVX-512F (x86-64-v4)      16 floats, __m512
 *   AVX2 + FMA (x86-64-v3)     8 floats, __m256
 *   NEON (every ARM64 CPU)      4 floats, float32x4_t
 *   anything else               4 floats, a GCC vector (SSE2 on x86-64-v1/v2), no fused multiply-add
 * vf_fma(a, b, c) is a * b + c rounded once wherever the target has fused multiply-adds (all but
 * the last row); without them it is a multiply and an add (vf_fused_fma() says which). Kernels
 * that must rebuild a value bit for bit as fmaf() would (the packed weights) use vf_fmaf, exact on
 * every target. Sums of a vector's lanes (vf_hsum) run in one fixed order per target, so two
 * kernels that feed the same products through the same helpers give the same float. */
#ifndef SPECACHE_SIMD_H
#define SPECACHE_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define SIMD_INLINE static inline __attribute__((always_inline))

/* The operations both x86 targets name alike but for the width prefix (_mm512 / _mm256); both fuse
 * multiply-adds, so vf_fmaf is vf_fma. */
#define X86_VF_OPS(mm) \
    SIMD_INLINE vf vf_load(const float *p) { return mm##_loadu_ps(p); } \
    SIMD_INLINE void vf_store(float *p, vf v) { mm##_storeu_ps(p, v); } \
    SIMD_INLINE vf vf_zero(void) { return mm##_setzero_ps(); } \
    SIMD_INLINE vf vf_set1(float x) { return mm##_set1_ps(x); } \
    SIMD_INLINE vf vf_add(vf a, vf b) { return mm##_add_ps(a, b); } \
    SIMD_INLINE vf vf_mul(vf a, vf b) { return mm##_mul_ps(a, b); } \
    SIMD_INLINE vf vf_fma(vf a, vf b, vf c) { return mm##_fmadd_ps(a, b, c); } \
    SIMD_INLINE vf vf_fmaf(vf a, vf b, vf c) { return mm##_fmadd_ps(a, b, c); } \
    SIMD_INLINE void simd_prefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T0); }

#if defined(__AVX512F__)
#include <immintrin.h>
#define SIMD_ISA "avx512"
#define VW 16
typedef __m512 vf;
X86_VF_OPS(_mm512)
SIMD_INLINE float vf_hsum(vf v) { return _mm512_reduce_add_ps(v); }
/* lanes i of 16 consecutive int8 / uint8 at p, as floats */
SIMD_INLINE vf vf_from_i8(const void *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SIMD_ISA "avx2"
#define VW 8
typedef __m256 vf;
X86_VF_OPS(_mm256)
SIMD_INLINE float vf_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
SIMD_INLINE vf vf_from_i8(const void *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define SIMD_ISA "neon"
#define VW 4
typedef float32x4_t vf;
SIMD_INLINE vf vf_load(const float *p) { return vld1q_f32(p); }
SIMD_INLINE void vf_store(float *p, vf v) { vst1q_f32(p, v); }
SIMD_INLINE vf vf_zero(void) { return vdupq_n_f32(0.0f); }
SIMD_INLINE vf vf_set1(float x) { return vdupq_n_f32(x); }
SIMD_INLINE vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
SIMD_INLINE vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
SIMD_INLINE vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
SIMD_INLINE float vf_hsum(vf v) { return vaddvq_f32(v); }
#define vf_fmaf vf_fma
SIMD_INLINE vf vf_from_i8(const void *p) {
    int8_t b[8] = {0};
    memcpy(b, p, 4);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vld1_s8(b)))));
}
SIMD_INLINE void simd_prefetch(const void *p) { __builtin_prefetch(p); }

#else
#define SIMD_ISA "generic"
#define VW 4
typedef float vf __attribute__((vector_size(16)));
SIMD_INLINE vf vf_load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
SIMD_INLINE void vf_store(float *p, vf v) { memcpy(p, &v, sizeof v); }
SIMD_INLINE vf vf_zero(void) { return (vf){0.0f, 0.0f, 0.0f, 0.0f}; }
SIMD_INLINE vf vf_set1(float x) { return (vf){x, x, x, x}; }
SIMD_INLINE vf vf_add(vf a, vf b) { return a + b; }
SIMD_INLINE vf vf_mul(vf a, vf b) { return a * b; }
#ifdef __FP_FAST_FMAF
SIMD_INLINE vf vf_fma(vf a, vf b, vf c) { return (vf){fmaf(a[0], b[0], c[0]), fmaf(a[1], b[1], c[1]), fmaf(a[2], b[2], c[2]), fmaf(a[3], b[3], c[3])}; }
#else
SIMD_INLINE vf vf_fma(vf a, vf b, vf c) { return a * b + c; }
#endif
/* exact fmaf per lane (software fmaf where the target has no fused multiply-add: slow, exact) */
SIMD_INLINE vf vf_fmaf(vf a, vf b, vf c) { return (vf){fmaf(a[0], b[0], c[0]), fmaf(a[1], b[1], c[1]), fmaf(a[2], b[2], c[2]), fmaf(a[3], b[3], c[3])}; }
SIMD_INLINE float vf_hsum(vf v) { return (v[0] + v[2]) + (v[1] + v[3]); }
SIMD_INLINE vf vf_from_i8(const void *p) {
    const int8_t *b = (const int8_t *)p;
    return (vf){(float)b[0], (float)b[1], (float)b[2], (float)b[3]};
}
SIMD_INLINE void simd_prefetch(const void *p) { __builtin_prefetch(p); }
#endif

/* An fp16 value (its bits) as a float: exact (subnormals too; inf and NaN kept). The conversion
 * instruction where the target has one (F16C on x86-64-v3 and up, every ARM64 CPU), else bit by bit;
 * all exact, so all the same float (NaN payloads aside). */
SIMD_INLINE float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#elif defined(__aarch64__)
    __fp16 x;
    memcpy(&x, &h, 2);
    return (float)x;
#else
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    uint32_t u;
    if (e == 31) {
        u = sign | 0x7F800000u | m << 13;
    } else if (e) {
        u = sign | (e + 112) << 23 | m << 13;
    } else {
        float f = (float)m * 0x1p-24f; /* subnormal (or zero): m 2^-24, exact */
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* A bf16 value (its bits) as a float: the float's high half, so a 16-bit shift (exact, every target). */
SIMD_INLINE float bf16_to_float(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* VW consecutive bf16 values at p as floats (the widening of a bf16 exact store's rows): a shift into the
 * high half of each lane, exact, so every target gives the same floats. */
SIMD_INLINE vf vf_from_bf16(const uint16_t *p) {
#if defined(__AVX512F__)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif defined(__AVX2__) && defined(__FMA__)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#elif defined(__aarch64__) && defined(__ARM_NEON)
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
#else
    return (vf){bf16_to_float(p[0]), bf16_to_float(p[1]), bf16_to_float(p[2]), bf16_to_float(p[3])};
#endif
}

SIMD_INLINE int vf_fused_fma(void) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || (defined(__aarch64__) && defined(__ARM_NEON)) || defined(__FP_FAST_FMAF)
    return 1;
#else
    return 0;
#endif
}

#endif
