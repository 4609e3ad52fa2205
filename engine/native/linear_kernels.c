/* Native CPU kernel for decode-step linears: y = x @ W^T (+ bias) for a few rows of x.
 *
 * A decode step multiplies 1-8 activation rows by every weight matrix of the model, so it
 * is bound by reading the weights once. The CPU BLAS behind torch reads them at about half
 * the memory bandwidth for such skinny shapes (measured on a 2-core AVX-512 machine: 11-14
 * GB/s vs 25 GB/s for a plain sequential sum); this kernel streams the weight rows in memory
 * order through 16-wide fused multiply-adds against all activation rows, so each weight
 * byte is read once per call. Summation order differs from the BLAS: results agree to float
 * rounding. Without AVX-512 it is plain C (the compiler's vectorisation).
 *
 * Packed weights (below): a weight matrix whose values are exactly those of a block format
 * (the embedded model's GGUF stores its linears as Q4_1 and its embedding as Q8_0, and the
 * fp32 copy transformers makes is their exact dequantization) is kept a second time in that
 * format, 5 or 9 bits per weight instead of 32. The kernels rebuild each weight bit-exactly
 * before the same multiply-adds, so their results equal the fp32 kernel's bit for bit; they
 * only read 6.4x (4-bit) or 3.6x (8-bit) fewer bytes.
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

#define EXPORT __attribute__((visibility("default")))
#define INLINE static inline __attribute__((always_inline))
#define MAX_ROWS 8
#define VL 16
#define PREFETCH 1024 /* floats ahead (4 KiB): with it, 2 rows ran 57 -> 37 ms and 8 rows 97 -> 78 ms
                         per 708 MB of weights on the 2-core AVX-512 machine */

#ifdef __AVX512F__
#include <immintrin.h>

/* Output columns [n0, n1) of y[R, N] for R activation rows (R a compile-time constant after
 * inlining). One weight row at a time, in memory order: a single sequential stream, which
 * the hardware prefetcher follows at full bandwidth (interleaving several weight rows
 * measured ~40% slower), plus a software prefetch a few KiB ahead, which the hardware
 * prefetcher alone did not match when several activation rows make the loop longer. */
INLINE void linear_rows(const float *x, int64_t x_s, const float *W, int64_t K, const float *bias, float *y,
                        int64_t y_s, int64_t n0, int64_t n1, const int R) {
    const int64_t kv = K / VL * VL;
    for (int64_t n = n0; n < n1; n++) {
        const float *w = W + n * K;
        __m512 acc[MAX_ROWS], acc2 = _mm512_setzero_ps();
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        int64_t k = 0;
        if (R == 1) { /* two chains, so one row is not bound by the add latency */
            for (; k + 2 * VL <= kv; k += 2 * VL) {
                acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), acc[0]);
                acc2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + k + VL), _mm512_loadu_ps(x + k + VL), acc2);
            }
        }
        for (; k < kv; k += VL) {
            _mm_prefetch((const char *)(w + k + PREFETCH), _MM_HINT_T0);
            const __m512 u = _mm512_loadu_ps(w + k);
            for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(u, _mm512_loadu_ps(x + r * x_s + k), acc[r]);
        }
        acc[0] = _mm512_add_ps(acc[0], acc2);
        for (int r = 0; r < R; r++) {
            float s = _mm512_reduce_add_ps(acc[r]);
            for (int64_t j = kv; j < K; j++) s += w[j] * x[r * x_s + j];
            y[r * y_s + n] = bias ? s + bias[n] : s;
        }
    }
}
#else
INLINE void linear_rows(const float *x, int64_t x_s, const float *W, int64_t K, const float *bias, float *y,
                        int64_t y_s, int64_t n0, int64_t n1, const int R) {
    for (int64_t n = n0; n < n1; n++) {
        const float *w = W + n * K;
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += w[k] * x[r * x_s + k];
            y[r * y_s + n] = bias ? s + bias[n] : s;
        }
    }
}
#endif

static void linear_range(const float *x, int64_t x_s, int64_t R, const float *W, int64_t K, const float *bias,
                         float *y, int64_t y_s, int64_t n0, int64_t n1) {
    switch (R) {
#define CASE(r) \
    case r: linear_rows(x, x_s, W, K, bias, y, y_s, n0, n1, r); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    default: break;
    }
}

/* ---- packed weights -------------------------------------------------------------------
 * Blocks of QB = 32 consecutive weights of one row (along K). Each block is stored as one
 * record, so a row is a single sequential stream:
 *   affine4: float d, float m, 16 bytes of codes; w[j] = fma(d, q[j], m), q in 0..15, byte j
 *            holds q[j] (low nibble) and q[j + 16] (high nibble)           (24 bytes / 32 weights)
 *   scaled8: float d, 32 int8 codes; w[j] = d * q[j]                        (36 bytes / 32 weights)
 * The packers accept a matrix only if every block rebuilds to exactly the given floats. */
#define QB 32
#define A4_BYTES 24
#define S8_BYTES 36

typedef struct { float d, m; uint8_t q[QB / 2]; } affine4_block;
typedef struct { float d; int8_t q[QB]; } scaled8_block;
_Static_assert(sizeof(affine4_block) == A4_BYTES, "affine4 record");
_Static_assert(sizeof(scaled8_block) == S8_BYTES, "scaled8 record");

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

/* Rebuild the 32 weights of block b of a row into w[32] (the portable path and the tests). */
static void unpack_block(const uint8_t *row, int64_t b, int fmt, float *w) {
    if (fmt == 4) {
        affine4_block blk;
        memcpy(&blk, row + b * A4_BYTES, A4_BYTES);
        for (int j = 0; j < QB / 2; j++) {
            w[j] = fmaf(blk.d, (float)(blk.q[j] & 15), blk.m);
            w[j + QB / 2] = fmaf(blk.d, (float)(blk.q[j] >> 4), blk.m);
        }
    } else {
        scaled8_block blk;
        memcpy(&blk, row + b * S8_BYTES, S8_BYTES);
        for (int j = 0; j < QB; j++) w[j] = blk.d * (float)blk.q[j];
    }
}

#ifdef __AVX512F__
/* The two 16-weight vectors of block p (fmt a compile-time constant after inlining). */
INLINE void unpack16x2(const uint8_t *p, const int fmt, const __m512 iota, __m512 *w0, __m512 *w1) {
    float d;
    memcpy(&d, p, 4);
    if (fmt == 4) {
        float m;
        memcpy(&m, p + 4, 4);
        const __m512 tbl = _mm512_fmadd_ps(_mm512_set1_ps(d), iota, _mm512_set1_ps(m));
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 8)));
        *w0 = _mm512_permutexvar_ps(idx, tbl); /* uses the low 4 bits of each lane */
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), tbl);
    } else {
        const __m512 dv = _mm512_set1_ps(d);
        *w0 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 4)))));
        *w1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 20)))));
    }
}

/* The fp32 kernel's loop with each pair of 16-wide weight vectors rebuilt from a block: same
 * multiply-adds in the same order (two chains for one row), so the same result bit for bit.
 * (Two output rows at a time for one activation row, sharing its loads, measured 30% slower.) */
INLINE void packed_rows(const float *x, int64_t x_s, const uint8_t *P, const int fmt, int64_t K, const float *bias,
                        float *y, int64_t y_s, int64_t n0, int64_t n1, const int R) {
    const int64_t nb = K / QB, rec = fmt == 4 ? A4_BYTES : S8_BYTES;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = P + n * nb * rec;
        __m512 acc[MAX_ROWS], acc2 = _mm512_setzero_ps();
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *p = row + b * rec;
            _mm_prefetch((const char *)(p + 2048), _MM_HINT_T0);
            __m512 w0, w1;
            unpack16x2(p, fmt, iota, &w0, &w1);
            const int64_t k = b * QB;
            if (R == 1) {
                acc[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + k), acc[0]);
                acc2 = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + k + VL), acc2);
            } else {
                for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * x_s + k), acc[r]);
                for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * x_s + k + VL), acc[r]);
            }
        }
        acc[0] = _mm512_add_ps(acc[0], acc2);
        for (int r = 0; r < R; r++) {
            const float s = _mm512_reduce_add_ps(acc[r]);
            y[r * y_s + n] = bias ? s + bias[n] : s;
        }
    }
}
#else
INLINE void packed_rows(const float *x, int64_t x_s, const uint8_t *P, const int fmt, int64_t K, const float *bias,
                        float *y, int64_t y_s, int64_t n0, int64_t n1, const int R) {
    const int64_t nb = K / QB, rec = fmt == 4 ? A4_BYTES : S8_BYTES;
    float w[QB];
    for (int64_t n = n0; n < n1; n++) {
        float s[MAX_ROWS] = {0};
        for (int64_t b = 0; b < nb; b++) {
            unpack_block(P + n * nb * rec, b, fmt, w);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < QB; j++) s[r] += w[j] * x[r * x_s + b * QB + j];
        }
        for (int r = 0; r < R; r++) y[r * y_s + n] = bias ? s[r] + bias[n] : s[r];
    }
}
#endif

static void packed_range(const float *x, int64_t x_s, int64_t R, const uint8_t *P, int fmt, int64_t K,
                         const float *bias, float *y, int64_t y_s, int64_t n0, int64_t n1) {
    switch (R * 16 + fmt) { /* rows and format as compile-time constants */
#define CASE(r) \
    case r * 16 + 4: packed_rows(x, x_s, P, 4, K, bias, y, y_s, n0, n1, r); break; \
    case r * 16 + 8: packed_rows(x, x_s, P, 8, K, bias, y, y_s, n0, n1, r); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
    default: break;
    }
}

/* One call's operands: W (fp32, fmt 0) or P (a packed weight, fmt 4 or 8), as the entry points
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
    if (L->fmt == 0) linear_range(L->x, L->x_s, L->R, L->W, L->K, L->bias, L->y, L->y_s, n0, n1);
    else packed_range(L->x, L->x_s, L->R, L->P, L->fmt, L->K, L->bias, L->y, L->y_s, n0, n1);
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

/* specache_skinny_linear for a packed weight (fmt 4: affine4, 8: scaled8; P as the packers wrote it). */
EXPORT int specache_packed_linear(const float *x, int64_t x_s, int64_t R, const uint8_t *P, int64_t fmt, int64_t N,
                                  int64_t K, const float *bias, float *y, int64_t y_s, int64_t nthreads) {
    if (R < 1 || R > MAX_ROWS || N < 0 || K < QB || K % QB || (fmt != 4 && fmt != 8)) return -1;
    const Linear L = {x, x_s, R, NULL, P, (int)fmt, K, bias, y, y_s};
    run_linear(&L, N, nthreads);
    return 0;
}

/* Rebuild rows [n0, n1) of a packed weight into W [n1 - n0, K] fp32 (tests, and a check). */
EXPORT int specache_unpack(const uint8_t *P, int64_t fmt, int64_t n0, int64_t n1, int64_t K, float *W) {
    if (K < QB || K % QB || (fmt != 4 && fmt != 8) || n1 < n0) return -1;
    const int64_t nb = K / QB, rec = fmt == 4 ? A4_BYTES : S8_BYTES;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t b = 0; b < nb; b++) unpack_block(P + n * nb * rec, b, (int)fmt, W + (n - n0) * K + b * QB);
    return 0;
}
