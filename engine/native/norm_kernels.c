/* A decode step's RMSNorms and rotary embeddings in one call each (engine/model/decode_norms.py calls them and
 * holds their torch references; the tests hold the two together). In a decode step these ops act on 1-8 rows
 * of a few hundred floats: torch spends ~3-5 us of dispatch per op and a norm is six of them, a Gemma 3 layer's
 * norms, q/k norms and ropes ~45; here each is one call. Not the torch ops' floats bit for bit (the sum of
 * squares runs in 16 lanes, the rope's multiply-adds may fuse): a declared choice beside the exact path
 * (engine/model/decode_kernels.py), taken only where the decode linears are not the exact kernel either.
 *
 *   specache_rms_norm     out = res + (x * rsqrt(mean(x^2) + eps)) * w   per row (res may be NULL, out may be res)
 *   specache_norm_rope    in place, per row and head of x [rows, heads * d]: the same norm when w is not NULL,
 *                         then x * cos + roll(x, d / 2) * sin with the signed sin table (engine/model/llama.py
 *                         rope_tables), cos / sin rows [cs_rows, d]: row r takes cs_rows == rows ? r : r % cs_rows
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>

#define EXPORT __attribute__((visibility("default")))
#define LANES 16
#define MAX_D 1024 /* the widest head the rope takes (a scratch row on the stack) */

/* 1 / sqrt(mean of squares + eps) of x[0..n) */
static float inv_rms(const float *x, int64_t n, float eps) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * x[i + j];
    float ss = 0.0f;
    for (int j = 0; j < LANES; j++) ss += acc[j];
    for (; i < n; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss / (float)n + eps);
}

EXPORT int specache_rms_norm(const float *x, const float *w, const float *res, float *out, int64_t rows, int64_t n,
                             float eps) {
    if (rows < 0 || n <= 0) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        const float *rr = res ? res + r * n : NULL;
        float *o = out + r * n;
        const float s = inv_rms(xr, n, eps);
        if (rr)
            for (int64_t i = 0; i < n; i++) o[i] = rr[i] + (xr[i] * s) * w[i];
        else
            for (int64_t i = 0; i < n; i++) o[i] = (xr[i] * s) * w[i];
    }
    return 0;
}

EXPORT int specache_norm_rope(float *x, int64_t rows, int64_t heads, int64_t d, const float *w, float eps,
                              const float *cos_t, const float *sin_t, int64_t cs_rows) {
    if (rows < 0 || heads <= 0 || d <= 0 || d % 2 || d > MAX_D || cs_rows <= 0) return -1;
    const int64_t half = d / 2;
    float t[MAX_D];
    for (int64_t r = 0; r < rows; r++) {
        const int64_t cr = cs_rows == rows ? r : r % cs_rows;
        const float *c = cos_t + cr * d, *sn = sin_t + cr * d;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + (r * heads + h) * d;
            if (w) {
                const float s = inv_rms(v, d, eps);
                for (int64_t i = 0; i < d; i++) t[i] = (v[i] * s) * w[i];
            } else {
                for (int64_t i = 0; i < d; i++) t[i] = v[i];
            }
            for (int64_t i = 0; i < half; i++) v[i] = t[i] * c[i] + t[i + half] * sn[i];
            for (int64_t i = half; i < d; i++) v[i] = t[i] * c[i] + t[i - half] * sn[i];
        }
    }
    return 0;
}
