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
 * Built into the same library as guide_kernels.c (engine/native/__init__.py).
 */
#include <stddef.h>
#include <stdint.h>
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

/* y[r, n] = sum_k x[r, k] * W[n, k] (+ bias[n]) for r < R <= 8.
 * x: fp32, row r at x + r * x_s (contiguous along k); W: fp32 [N, K] contiguous;
 * bias: fp32 [N] or NULL; y: fp32, row r at y + r * y_s. Returns 0, or -1 for bad arguments. */
EXPORT int specache_skinny_linear(const float *x, int64_t x_s, int64_t R, const float *W, int64_t N, int64_t K,
                                  const float *bias, float *y, int64_t y_s, int64_t nthreads) {
    if (R < 1 || R > MAX_ROWS || N < 0 || K < 1) return -1;
    if (nthreads <= 1 || N < 256) {
        linear_range(x, x_s, R, W, K, bias, y, y_s, 0, N);
        return 0;
    }
#pragma omp parallel num_threads((int)nthreads)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t n0 = N * t / nt, n1 = N * (t + 1) / nt;
        linear_range(x, x_s, R, W, K, bias, y, y_s, n0, n1);
    }
    return 0;
}
