/* A decode linear's output columns split over threads: one rule for linear_kernels.c and int8_linear.c. */
#ifndef SPECACHE_COLUMNS_H
#define SPECACHE_COLUMNS_H

#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

typedef void (*ColumnsFn)(const void *ctx, int64_t n0, int64_t n1);

/* fn(ctx, n0, n1) over columns [0, N): split evenly over nthreads when there are enough of them (N >= 256), else
 * one call. */
static inline void split_columns(int64_t N, int64_t nthreads, ColumnsFn fn, const void *ctx) {
    if (nthreads <= 1 || N < 256) {
        fn(ctx, 0, N);
        return;
    }
#pragma omp parallel num_threads((int)nthreads)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        fn(ctx, N * t / nt, N * (t + 1) / nt);
    }
}

#endif
