// The native kernels (engine/native/*.c, compiled into this program) against the torch references
// stored in tests/data/kernels/*.bin (scripts/make_kernel_refs.py writes them; the format is in its
// docstring). Built and run by tests/test_arm64.py, with the library's compiler flags
// (engine/native/__init__.py FLAGS, without -shared), natively for each x86-64 level this CPU runs
// and cross-compiled for aarch64 under qemu; by hand (docs/engine.md, "Portable kernels"):
//
//   aarch64-linux-gnu-gcc -O3 -fopenmp -fPIC -std=gnu11 -fvisibility=hidden -Wno-psabi -march=armv8-a -static
//       -o /tmp/kernel_check tests/native/kernel_check.c engine/native/*.c -lm
//   qemu-aarch64 /tmp/kernel_check --isa neon --prefill 0 tests/data/kernels/*.bin
//
// Every check runs with 1 and 2 OpenMP threads and prints one line ("ok   ..." or "FAIL ...",
// lines starting with "#" are notes); the last line is exactly "N passed, M failed" and the exit
// status is nonzero when a check failed. Tolerances are those of the Python tests: linears
// rtol 1e-5 / atol 1e-4 (tests/test_linears.py), guide kernels rel 1e-4 of the largest reference
// value (tests/test_quant.py _close), fused decode rtol 1e-4 / atol 1e-4 (tests/test_fused.py);
// bit for bit: the packers' bytes, unpacking, packed == fp32 linear, and results that must not
// depend on the thread count (linears, the fused call).
//
// Options: --isa NAME (specache_native_isa() must say it), --prefill 0|1 (what
// specache_prefill_attention_available() must return), --abi N (specache_guide_abi_version()).
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---- the kernels' entry points (engine/native/__init__.py declares the same for ctypes) */
int specache_guide_abi_version(void);
int specache_guide_openmp(void);
const char *specache_native_isa(void);
int specache_guide_scores(const float *q, int64_t q_sb, int64_t q_sh, int64_t q_sq, const uint8_t *codes,
                          int64_t c_sb, int64_t c_sh, const uint16_t *scale, const uint16_t *zero, int64_t s_sb,
                          int64_t s_sh, float *out, int64_t B, int64_t H, int64_t Q, int64_t D, int64_t n, int64_t g,
                          int64_t bits, int64_t nthreads);
int specache_guide_weighted_values(const float *p, int64_t p_sb, int64_t p_sh, int64_t p_sq, const uint8_t *codes,
                                   int64_t c_sb, int64_t c_sh, const uint16_t *scale, const uint16_t *zero,
                                   int64_t s_sb, int64_t s_sh, float *out, int64_t B, int64_t H, int64_t Q, int64_t D,
                                   int64_t n, int64_t gv, int64_t bits, int64_t nthreads);
int specache_skinny_linear(const float *x, int64_t x_s, int64_t R, const float *W, int64_t N, int64_t K,
                           const float *bias, float *y, int64_t y_s, int64_t nthreads);
int specache_packed_linear(const float *x, int64_t x_s, int64_t R, const uint8_t *P, int64_t fmt, int64_t N,
                           int64_t K, const float *bias, float *y, int64_t y_s, int64_t nthreads);
int specache_pack_affine4(const float *W, int64_t N, int64_t K, uint8_t *out);
int specache_pack_scaled8(const float *W, int64_t N, int64_t K, uint8_t *out);
int specache_unpack(const uint8_t *P, int64_t fmt, int64_t n0, int64_t n1, int64_t K, void *W, int64_t bf16,
                    int64_t nthreads);
int specache_int8_linear(const float *x, int64_t x_s, int64_t R, const uint8_t *P, int64_t fmt, int64_t N,
                         int64_t K, const float *bias, float *y, int64_t y_s, int64_t nthreads, int64_t bits);
int specache_int8_quantize_row(const float *x, int64_t K, int64_t bits, void *q, float *d, float *s);
int specache_prefill_attention_available(void);
int specache_prefill_attention(const void *a);

#include "../../engine/native/decode_args.h" /* the kernels' own DecodeArgs */
#include "../../engine/native/simd.h"        /* this target's widening of bf16 store rows */
int specache_decode_attention(const DecodeArgs *a);

/* ---------------------------------------------------------------- results */

static int n_passed, n_failed;

static void check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs(ok ? "ok   " : "FAIL ", stdout);
    vprintf(fmt, ap);
    putchar('\n');
    va_end(ap);
    fflush(stdout);
    if (ok) n_passed++;
    else n_failed++;
}

/* got vs want, |got - want| <= atol + rtol |want| everywhere (NaN fails); a description in msg. */
static int close_to(const float *got, const float *want, int64_t n, double rtol, double atol, char *msg, size_t len) {
    int64_t bad = 0, first = -1;
    double max_err = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double e = fabs((double)got[i] - (double)want[i]);
        if (!(e <= atol + rtol * fabs((double)want[i]))) {
            if (first < 0) first = i;
            bad++;
        }
        if (e > max_err) max_err = e;
    }
    if (bad)
        snprintf(msg, len, "%lld of %lld values off (atol %.3g, rtol %.0e): first [%lld] got %.9g expected %.9g",
                 (long long)bad, (long long)n, atol, rtol, (long long)first, got[first], want[first]);
    else
        snprintf(msg, len, "max abs err %.3g (atol %.3g, rtol %.0e)", max_err, atol, rtol);
    return bad == 0;
}

static double max_abs(const float *x, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++) m = fabs(x[i]) > m ? fabs(x[i]) : m;
    return m;
}

/* index of the first differing byte, or -1 */
static int64_t diff_at(const void *a, const void *b, size_t n) {
    const uint8_t *x = a, *y = b;
    for (size_t i = 0; i < n; i++)
        if (x[i] != y[i]) return (int64_t)i;
    return -1;
}

/* ------------------------------------------------------------- blob file */

typedef struct {
    char *name;
    char tag; /* f float32, e float16, B uint8, b int8, i int32, q int64, s string */
    int ndim;
    int64_t shape[8], count;
    size_t nbytes;
    void *data; /* 64-byte aligned */
} Blob;

static Blob *blobs;
static int nblobs;

static size_t tag_size(char t) {
    switch (t) {
    case 'f': case 'i': return 4;
    case 'e': return 2;
    case 'B': case 'b': case 's': return 1;
    case 'q': return 8;
    default: return 0;
    }
}

static void *alloc64(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 64) / 64 * 64); /* room for a string's NUL */
    if (!p) { fprintf(stderr, "out of memory\n"); exit(3); }
    return p;
}

static void free_blobs(void) {
    for (int i = 0; i < nblobs; i++) free(blobs[i].name), free(blobs[i].data);
    free(blobs);
    blobs = NULL;
    nblobs = 0;
}

/* Reads a reference file into blobs; returns 0, or -1 with a reason in err. */
static int load(const char *path, char *err, size_t len) {
    FILE *f = fopen(path, "rb");
    char magic[8];
    uint32_t count = 0;
    if (!f) return snprintf(err, len, "cannot open"), -1;
    if (fread(magic, 1, 8, f) != 8 || memcmp(magic, "SPKREF1\n", 8) || fread(&count, 4, 1, f) != 1) goto bad;
    blobs = calloc(count, sizeof(Blob));
    for (uint32_t i = 0; i < count; i++, nblobs++) {
        Blob *b = &blobs[i];
        uint32_t nl;
        uint8_t nd;
        uint64_t nb;
        if (fread(&nl, 4, 1, f) != 1 || nl > 4096) goto bad;
        b->name = calloc(nl + 1, 1);
        if (fread(b->name, 1, nl, f) != nl || fread(&b->tag, 1, 1, f) != 1 || fread(&nd, 1, 1, f) != 1 || nd > 8)
            goto bad;
        b->ndim = nd;
        if (nd && fread(b->shape, 8, nd, f) != nd) goto bad;
        b->count = 1;
        for (int d = 0; d < nd; d++) b->count *= b->shape[d];
        if (fread(&nb, 8, 1, f) != 1 || !tag_size(b->tag) || nb != (uint64_t)b->count * tag_size(b->tag)) goto bad;
        b->nbytes = nb;
        b->data = alloc64(nb);
        if (fread(b->data, 1, nb, f) != nb) goto bad;
        ((char *)b->data)[nb] = 0;
    }
    if (fgetc(f) != EOF) goto bad;
    fclose(f);
    return 0;
bad:
    fclose(f);
    snprintf(err, len, "not a valid reference file (blob %d)", nblobs);
    return -1;
}

/* The blob "<cas>/<field>", else its base case's (field "base"), else NULL. */
static const Blob *find(const char *cas, const char *field) {
    char want[512];
    for (int depth = 0; depth < 4 && cas; depth++) {
        snprintf(want, sizeof want, "%s/%s", cas, field);
        const char *base = NULL;
        for (int i = 0; i < nblobs; i++) {
            if (!strcmp(blobs[i].name, want)) return &blobs[i];
            if (!strncmp(blobs[i].name, cas, strlen(cas)) && !strcmp(blobs[i].name + strlen(cas), "/base"))
                base = blobs[i].data;
        }
        cas = base;
    }
    return NULL;
}

static int missing; /* set by get() */

/* The field's blob with this dtype tag (and ndim, unless -1); records a failed check if absent. */
static const Blob *get(const char *cas, const char *field, char tag, int ndim) {
    const Blob *b = find(cas, field);
    if (!b || b->tag != tag || (ndim >= 0 && b->ndim != ndim)) {
        check(0, "%s: field %s missing or not of dtype %c / %d dims", cas, field, tag, ndim);
        missing = 1;
        return NULL;
    }
    return b;
}

static int64_t geti(const char *cas, const char *field) {
    const Blob *b = get(cas, field, 'q', 0);
    return b ? *(const int64_t *)b->data : 0;
}

#define F32(b) ((const float *)(b)->data)

/* an output buffer of n floats followed by a guard of 16 that the kernel must not write */
#define GUARD 16
static float *out_buffer(int64_t n) {
    float *p = alloc64((size_t)(n + GUARD) * sizeof(float));
    for (int64_t i = 0; i < n + GUARD; i++) p[i] = 12345.0f;
    return p;
}
static int guard_ok(const float *p, int64_t n) {
    for (int64_t i = n; i < n + GUARD; i++)
        if (p[i] != 12345.0f) return 0;
    return 1;
}

/* ----------------------------------------------------------------- linears */

static const int THREADS[2] = {1, 2};

/* y [R, N] in rows of y_s = N + 3 floats (the kernel takes a row stride; the gaps must stay) */
static float *linear_out(int64_t R, int64_t N) {
    return out_buffer(R * (N + 3));
}
static int gaps_ok(const float *y, int64_t R, int64_t N) {
    for (int64_t r = 0; r < R; r++)
        for (int64_t j = N; j < N + 3; j++)
            if (y[r * (N + 3) + j] != 12345.0f) return 0;
    return guard_ok(y, R * (N + 3));
}
static void gather_rows(const float *y, int64_t R, int64_t N, float *dst) {
    for (int64_t r = 0; r < R; r++) memcpy(dst + r * N, y + r * (N + 3), (size_t)N * sizeof(float));
}

/* For each reference ref_y_r<R>[_bias] of the case: the fp32 kernel (and, with P, the packed one)
 * with 1 and 2 threads against it; packed == fp32 and 2 threads == 1 thread bit for bit. */
static void linear_refs(const char *cas, const float *x, const float *w, const uint8_t *P, int64_t fmt,
                        const float *bias, int64_t N, int64_t K) {
    char msg[512];
    const char *kname = !P ? "skinny_linear" : fmt == 4 ? "packed_linear(affine4)" : fmt == 8 ? "packed_linear(scaled8)"
                      : fmt == 6 ? "packed_linear(q6k)" : fmt == 7 ? "packed_linear(q4k)" : fmt == 5 ? "packed_linear(q5k)"
                      : fmt == 2 ? "packed_linear(q4_0)" : fmt == 3 ? "packed_linear(q4_1)" : fmt == 9 ? "packed_linear(q8_0)"
                      : fmt == 10 ? "packed_linear(q5_0)" : fmt == 11 ? "packed_linear(q5_1)"
                      : fmt == 12 ? "packed_linear(bf16)" : "packed_linear(f16)";
    for (int i = 0; i < nblobs; i++) {
        const Blob *ref = &blobs[i];
        const size_t cl = strlen(cas);
        if (strncmp(ref->name, cas, cl) || strncmp(ref->name + cl, "/ref_y_r", 8)) continue;
        const int64_t R = atoll(ref->name + cl + 8);
        const int with_bias = strstr(ref->name + cl, "_bias") != NULL;
        if (ref->tag != 'f' || ref->ndim != 2 || ref->shape[0] != R || ref->shape[1] != N) {
            check(0, "%s: %s has the wrong shape", cas, ref->name);
            continue;
        }
        const float *b = with_bias ? bias : NULL;
        float *first[2] = {NULL, NULL}; /* [fp32, packed] results of 1 thread */
        for (int t = 0; t < 2; t++) {
            const int nt = THREADS[t];
            for (int packed = 0; packed <= (P != NULL); packed++) {
                const char *name = packed ? kname : "skinny_linear";
                float *y = linear_out(R, N), *dense = malloc((size_t)(R * N) * sizeof(float));
                const int rc = packed ? specache_packed_linear(x, K, R, P, fmt, N, K, b, y, N + 3, nt)
                                      : specache_skinny_linear(x, K, R, w, N, K, b, y, N + 3, nt);
                gather_rows(y, R, N, dense);
                int ok = rc == 0 && close_to(dense, F32(ref), R * N, 1e-5, 1e-4, msg, sizeof msg);
                if (rc) snprintf(msg, sizeof msg, "returned %d", rc);
                check(ok && gaps_ok(y, R, N), "%s %s rows %lld%s threads %d vs torch F.linear: %s%s", cas, name,
                      (long long)R, b ? " +bias" : "", nt, msg, gaps_ok(y, R, N) ? "" : "; wrote outside y");
                if (t == 0) {
                    first[packed] = dense;
                } else {
                    const int64_t at = diff_at(dense, first[packed], (size_t)(R * N) * sizeof(float));
                    check(at < 0, "%s %s rows %lld%s: 2 threads == 1 thread bit for bit%s", cas, name, (long long)R,
                          b ? " +bias" : "", at < 0 ? "" : " (they differ)");
                    free(dense);
                }
                free(y);
            }
            if (P && t == 0) {
                const int64_t at = diff_at(first[1], first[0], (size_t)(R * N) * sizeof(float));
                check(at < 0, "%s %s rows %lld%s == skinny_linear on its fp32 weight, bit for bit%s", cas, kname,
                      (long long)R, b ? " +bias" : "", at < 0 ? "" : " (they differ)");
                if (at >= 0)
                    printf("#   first difference: output %lld: packed %.9g, fp32 %.9g\n", (long long)(at / 4),
                           first[1][at / 4], first[0][at / 4]);
            }
        }
        free(first[0]);
        free(first[1]);
    }
}

static void check_skinny(const char *cas) {
    const Blob *x = get(cas, "x", 'f', 2), *w = get(cas, "w", 'f', 2), *bias = get(cas, "bias", 'f', 1);
    if (missing) return;
    linear_refs(cas, F32(x), F32(w), NULL, 0, F32(bias), w->shape[0], w->shape[1]);
}

/* packed:*  fmt 4 / 8 (packed by the packers, checked against the packing rule's bytes) or 6 / 7 / 5 (GGUF
 * Q6_K / Q4_K / Q5_K blocks: nothing packs them), 2 / 3 / 9 / 10 / 11 (GGUF Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 blocks),
 * 12 / 13 (bf16 / fp16 weights as they are); w the fp32 weight
 * torch rebuilds, packed its blocks [N, row bytes]. */
/* specache_unpack rebuilds the weight w [N, K] from the blocks P bit for bit: all rows (on 2 threads), and rows
 * 3..6; in bf16, every weight rounded to nearest even (a weight's rounding carried from its low half). */
static void check_unpack(const char *cas, const Blob *w, const Blob *P, int64_t fmt) {
    const int64_t N = w->shape[0], K = w->shape[1];
    float *wb = alloc64(w->nbytes);
    uint16_t *hb = alloc64(w->nbytes / 2);
    int rc = specache_unpack(P->data, fmt, 0, N, K, hb, 1, 2);
    int64_t bad = -1;
    for (int64_t i = 0; i < N * K && bad < 0; i++) {
        uint32_t u;
        memcpy(&u, F32(w) + i, 4);
        const uint32_t low = u & 0xFFFF, half = 0x8000;
        const uint16_t want = (uint16_t)((u >> 16) + (low > half || (low == half && (u >> 16) & 1)));
        if (hb[i] != want) bad = i;
    }
    check(rc == 0 && bad < 0, "%s unpack in bf16: every weight rounded to nearest even%s", cas, bad < 0 ? "" : " -- not");
    free(hb);
    rc = specache_unpack(P->data, fmt, 0, N, K, wb, 0, 2);
    int64_t at = diff_at(wb, w->data, w->nbytes);
    check(rc == 0 && at < 0, "%s unpack: rebuilds the weight bit for bit%s", cas, at < 0 ? "" : " -- it differs");
    if (at >= 0)
        printf("#   first difference: weight %lld: got %.9g expected %.9g\n", (long long)(at / 4), wb[at / 4],
               F32(w)[at / 4]);
    rc = specache_unpack(P->data, fmt, 3, 7, K, wb, 0, 1);
    at = diff_at(wb, F32(w) + 3 * K, (size_t)(4 * K) * sizeof(float));
    check(rc == 0 && at < 0, "%s unpack rows 3..6: bit for bit%s", cas, at < 0 ? "" : " -- they differ");
    free(wb);
}

/* ------------------------------------------------------------ integer-activation linears (int8_linear.c) */

static float half_f(const uint8_t *h) { /* an fp16 value as a float (normal and subnormal, no inf / NaN) */
    const uint16_t v = (uint16_t)(h[0] | h[1] << 8);
    const int e = (v >> 10) & 31, m = v & 1023;
    const float f = e ? ldexpf((float)(1024 + m), e - 25) : ldexpf((float)m, -24);
    return v >> 15 ? -f : f;
}

/* m[K / 32] of weight row n: each block of 32 weights is d q + m (engine/model/decode_kernels.py block_minus). */
static void block_minus(const uint8_t *P, int64_t fmt, int64_t n, int64_t K, float *m) {
    const int64_t nb = K / 32;
    if (fmt == 5 || fmt == 7) { /* Q5_K / Q4_K: -(dmin * mn) per chunk */
        const int64_t size = fmt == 7 ? 144 : 176;
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t *p = P + n * (K / 256) * size + sb * size, *s = p + 4;
            for (int j = 0; j < 8; j++) {
                const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | (s[j] >> 6) << 4;
                m[sb * 8 + j] = -(half_f(p + 2) * (float)mn);
            }
        }
        return;
    }
    const int64_t code = fmt == 9 ? 32 : fmt == 10 || fmt == 11 ? 20 : 16, size = fmt == 2 ? 18 : fmt == 3 ? 20
                       : fmt == 9 ? 34 : fmt == 10 ? 22 : 24;
    const uint8_t *row = P + n * nb * size, *dh = row + nb * code;
    for (int64_t b = 0; b < nb; b++)
        m[b] = fmt == 2 ? -8.0f * half_f(dh + 2 * b) : fmt == 10 ? -16.0f * half_f(dh + 2 * b)
             : fmt == 3 || fmt == 11 ? half_f(dh + 2 * nb + 2 * b) : 0.0f;
}

/* The integer kernel (bits 8 and 16) on GGUF blocks P against its reference in double: the activations as
 * specache_int8_quantize_row gives them, sum over blocks of (w - m) . (q dx) + m sum(x), w the fp32 weights;
 * rtol 1e-5 of the sum of the terms' magnitudes. Each row of an R-row call == the 1-row call, 2 threads == 1,
 * bit for bit. */
static void check_int_linear(const char *cas, const float *x, int64_t X, const float *w, const uint8_t *P,
                             int64_t fmt, const float *bias, int64_t N, int64_t K) {
    const int64_t nb = K / 32, R = X < 8 ? X : 8;
    float *m = malloc((size_t)(N * nb) * sizeof(float)), *d = malloc((size_t)nb * sizeof(float)),
          *s = malloc((size_t)nb * sizeof(float));
    int16_t *q = malloc((size_t)K * sizeof(int16_t));
    for (int64_t n = 0; n < N; n++) block_minus(P, fmt, n, K, m + n * nb);
    for (int bits = 8; bits <= 16; bits += 8) {
        float *y = linear_out(R, N), *y2 = linear_out(R, N), *y1 = linear_out(1, N);
        int rc = specache_int8_linear(x, K, R, P, fmt, N, K, bias, y, N + 3, 1, bits);
        rc |= specache_int8_linear(x, K, R, P, fmt, N, K, bias, y2, N + 3, 2, bits);
        int near = rc == 0, same = rc == 0, threads = rc == 0 && diff_at(y, y2, (size_t)(R * (N + 3)) * 4) < 0;
        for (int64_t r = 0; r < R && rc == 0; r++) {
            rc |= specache_int8_quantize_row(x + r * K, K, bits, q, d, s);
            rc |= specache_int8_linear(x + r * K, K, 1, P, fmt, N, K, bias, y1, N + 3, 1, bits);
            same &= rc == 0 && diff_at(y1, y + r * (N + 3), (size_t)N * 4) < 0;
            for (int64_t n = 0; n < N; n++) {
                double want = bias ? bias[n] : 0.0, mag = fabs(want);
                for (int64_t k = 0; k < K; k++) {
                    const double xq = (bits == 8 ? (double)((int8_t *)q)[k] : (double)q[k]) * d[k / 32];
                    const double t = ((double)w[n * K + k] - m[n * nb + k / 32]) * xq;
                    want += t, mag += fabs(t);
                }
                for (int64_t b = 0; b < nb; b++) want += (double)m[n * nb + b] * s[b], mag += fabs((double)m[n * nb + b] * s[b]);
                near &= fabs(y[r * (N + 3) + n] - want) <= 1e-5 * mag + 1e-6;
            }
        }
        check(rc == 0 && near && gaps_ok(y, R, N), "%s int8_linear bits %d rows %lld%s vs its double reference%s", cas,
              bits, (long long)R, bias ? " +bias" : "", rc ? ": returned nonzero" : near ? "" : ": too far");
        check(same && threads, "%s int8_linear bits %d: each row == its 1-row call, 2 threads == 1, bit for bit", cas, bits);
        free(y), free(y2), free(y1);
    }
    free(m), free(d), free(s), free(q);
}

static void check_packed(const char *cas) {
    const Blob *w = get(cas, "w", 'f', 2), *P = get(cas, "packed", 'B', 2), *x = get(cas, "x", 'f', 2),
               *bias = get(cas, "bias", 'f', 1);
    const int64_t fmt = geti(cas, "fmt");
    if (missing) return;
    const int64_t N = w->shape[0], K = w->shape[1];
    if (fmt == 6 || fmt == 7 || fmt == 5 || fmt == 2 || fmt == 3 || fmt == 9 || fmt == 10 || fmt == 11 || fmt == 12
        || fmt == 13) {
        const int64_t per = fmt == 5 || fmt == 6 || fmt == 7 ? 256 : 32;
        const int64_t size = fmt == 6 ? 210 : fmt == 7 ? 144 : fmt == 5 ? 176 : fmt == 2 ? 18 : fmt == 3 ? 20 : fmt == 9 ? 34
                           : fmt == 10 ? 22 : fmt == 11 ? 24 : 64;
        check(P->shape[0] == N && P->shape[1] == K / per * size, "%s: blocks of %lld bytes per %lld weights", cas,
              (long long)size, (long long)per);
        check_unpack(cas, w, P, fmt);
        linear_refs(cas, F32(x), F32(w), P->data, fmt, F32(bias), N, K);
        if (fmt != 12 && fmt != 13) check_int_linear(cas, F32(x), x->shape[0], F32(w), P->data, fmt, F32(bias), N, K);
        return;
    }
    const char *pname = fmt == 4 ? "pack_affine4" : "pack_scaled8";
    int (*pack)(const float *, int64_t, int64_t, uint8_t *) = fmt == 4 ? specache_pack_affine4 : specache_pack_scaled8;
    uint8_t *got = alloc64(P->nbytes);
    memset(got, 0xA5, P->nbytes);
    int rc = pack(F32(w), N, K, got);
    int64_t at = rc == 0 ? diff_at(got, P->data, P->nbytes) : -1;
    check(rc == 0 && at < 0, "%s %s: bytes equal the packing rule's (%zu bytes)%s", cas, pname, P->nbytes,
          rc ? " -- returned nonzero" : at >= 0 ? " -- they differ" : "");
    if (at >= 0)
        printf("#   first difference: byte %lld (record %lld, offset %lld): got 0x%02x expected 0x%02x\n",
               (long long)at, (long long)(at / (fmt == 4 ? 24 : 36)), (long long)(at % (fmt == 4 ? 24 : 36)),
               got[at], ((const uint8_t *)P->data)[at]);
    float *wb = alloc64(w->nbytes);
    memcpy(wb, w->data, w->nbytes);
    wb[37] = nextafterf(wb[37], INFINITY); /* one weight off its block's grid */
    rc = pack(wb, N, K, got);
    check(rc == 1, "%s %s: a weight off its block's grid is refused (returned %d, expected 1)", cas, pname, rc);
    free(got);
    free(wb);
    check_unpack(cas, w, P, fmt);
    linear_refs(cas, F32(x), F32(w), P->data, fmt, F32(bias), N, K);
}

/* ------------------------------------------------------------ guide kernels */

/* scores:*  q [B, H, Qmax, D], codes [B, H, J, bits, g/8, D], scale/zero fp16 [B, H, J, D];
 * ref_out_q<Q> [B, H, Q, n] for the first Q queries (a strided view of q). */
static void check_guide(const char *cas, int values) {
    const Blob *in = get(cas, values ? "p" : "q", 'f', 4), *codes = get(cas, "codes", 'B', 6),
               *scale = get(cas, "scale", 'e', 4), *zero = get(cas, "zero", 'e', 4);
    const int64_t n = geti(cas, "n"), grp = geti(cas, values ? "gv" : "g"), bits = geti(cas, "bits");
    if (missing) return;
    const int64_t B = in->shape[0], H = in->shape[1], Qmax = in->shape[2], D = codes->shape[5];
    const int64_t i_sq = in->shape[3], i_sh = Qmax * i_sq, i_sb = H * i_sh;
    const int64_t c_sh = codes->count / (B * H), c_sb = H * c_sh, s_sh = scale->count / (B * H), s_sb = H * s_sh;
    char msg[512], prefix[64];
    snprintf(prefix, sizeof prefix, "%s/ref_out_q", cas);
    for (int i = 0; i < nblobs; i++) {
        const Blob *ref = &blobs[i];
        if (strncmp(ref->name, prefix, strlen(prefix))) continue;
        const int64_t Q = atoll(ref->name + strlen(prefix)), cols = values ? D : n;
        if (ref->tag != 'f' || ref->ndim != 4 || ref->shape[2] != Q || ref->shape[3] != cols || Q > Qmax) {
            check(0, "%s has the wrong shape", ref->name);
            continue;
        }
        const double atol = 1e-4 * max_abs(F32(ref), ref->count) + 1e-6;
        for (int t = 0; t < 2; t++) {
            float *out = out_buffer(ref->count);
            const int rc = values ? specache_guide_weighted_values(F32(in), i_sb, i_sh, i_sq, codes->data, c_sb, c_sh,
                                                                   scale->data, zero->data, s_sb, s_sh, out, B, H, Q,
                                                                   D, n, grp, bits, THREADS[t])
                                  : specache_guide_scores(F32(in), i_sb, i_sh, i_sq, codes->data, c_sb, c_sh,
                                                          scale->data, zero->data, s_sb, s_sh, out, B, H, Q, D, n, grp,
                                                          bits, THREADS[t]);
            int ok = rc == 0 && close_to(out, F32(ref), ref->count, 1e-4, atol, msg, sizeof msg);
            if (rc) snprintf(msg, sizeof msg, "returned %d", rc);
            const int guard = guard_ok(out, ref->count);
            check(ok && guard, "%s %s %lld bit, group %lld, %lld queries, n %lld, threads %d vs torch: %s%s", cas,
                  values ? "guide_weighted_values" : "guide_scores", (long long)bits, (long long)grp, (long long)Q,
                  (long long)n, THREADS[t], msg, guard ? "" : "; wrote past its output");
            free(out);
        }
    }
}

/* -------------------------------------------------------- fused decode attention */

#define DECODE_I64(X)                                                                                                  \
    X(B) X(H) X(G) X(T) X(D) X(S) X(K) X(bits) X(g) X(gv) X(row0) X(select) X(keep) X(residual) X(select_both)        \
    X(current) X(q_sb) X(q_sh) X(sk_sb) X(sk_sh) X(rk_sb) X(rk_sh) X(fk_sb) X(fk_sh) X(fi_sb) X(fi_sh) X(st_sb)       \
    X(st_sh) X(kc_sb) X(kc_sh) X(ks_sb) X(ks_sh) X(vc_sb) X(vc_sh) X(vs_sb) X(vs_sh) X(correct)      \
    X(res_at_qend) X(O) X(oi_sb) X(oi_sh) X(oc_sb) X(oc_sh) X(os_sb) X(os_sh)

typedef struct { float *fk, *fv, *out; int64_t *fidx; uint8_t *fvalid; } DecodeRun;

static void free_run(DecodeRun *r) { free(r->fk), free(r->fv), free(r->out), free(r->fidx), free(r->fvalid); }

/* The fetched set the call chose (fidx / fvalid of its rows) is a top K of the weights the torch
 * path ranked, sel [B, H, L] (-1: not a candidate): as many positions as the torch path took,
 * distinct candidates, none more than 1e-4 below the K-th largest weight (near-ties may go either
 * way; the note says how many positions are the torch path's own choice). */
static void check_selection(const char *what, const DecodeArgs *a, const DecodeRun *r,
                            const Blob *sel, const Blob *ref_fidx, const Blob *ref_fvalid) {
    const int64_t L = sel->shape[2], K = a->K;
    int ok = 1, same = 0, total = 0;
    double worst = 0.0; /* the largest shortfall of a chosen weight below the K-th largest */
    char why[256] = "";
    float *sorted = malloc((size_t)L * sizeof(float));
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->H; h++) {
            const int64_t rr = a->row0 + b, o = rr * a->fi_sb + h * a->fi_sh;
            const float *w = F32(sel) + (b * a->H + h) * L;
            int64_t m = 0, chosen = 0;
            for (int64_t l = 0; l < L; l++) m += w[l] >= 0.0f;
            m = m < K ? m : K;
            for (int64_t i = 0; i < L; i++) { /* descending insertion sort (L is small) */
                int64_t j = i - 1;
                for (; j >= 0 && sorted[j] < w[i]; j--) sorted[j + 1] = sorted[j];
                sorted[j + 1] = w[i];
            }
            const float kth = m > 0 ? sorted[m - 1] : 0.0f;
            for (int64_t j = 0; j < K; j++) {
                if (!r->fvalid[o + j]) continue;
                const int64_t p = r->fidx[o + j];
                chosen++;
                for (int64_t i = 0; i < j; i++)
                    if (r->fvalid[o + i] && r->fidx[o + i] == p)
                        ok = 0, snprintf(why, sizeof why, "row %lld head %lld: position %lld chosen twice",
                                         (long long)rr, (long long)h, (long long)p);
                if (p < 0 || p >= L || w[p] < 0.0f) {
                    ok = 0;
                    snprintf(why, sizeof why, "row %lld head %lld: position %lld is not a candidate", (long long)rr,
                             (long long)h, (long long)p);
                    continue;
                }
                worst = kth - w[p] > worst ? kth - w[p] : worst;
                for (int64_t i = 0; ref_fidx && ref_fvalid && i < K; i++) {
                    const int64_t ro = (b * a->H + h) * K + i;
                    same += ((const uint8_t *)ref_fvalid->data)[ro] && ((const int64_t *)ref_fidx->data)[ro] == p;
                }
            }
            total += (int)m;
            if (chosen != m)
                ok = 0, snprintf(why, sizeof why, "row %lld head %lld: %lld positions chosen, expected %lld",
                                 (long long)rr, (long long)h, (long long)chosen, (long long)m);
        }
    free(sorted);
    if (worst > 1e-4)
        ok = 0, snprintf(why, sizeof why, "a chosen weight is %.3g below the K-th largest (tolerance 1e-4)", worst);
    check(ok, "%s, threads %lld: selects a top %lld of the torch path's weights (%d of %d as torch chose%s)%s%s",
          what, (long long)a->nthreads, (long long)K, same, total, worst > 0 ? ", near-ties differ" : "",
          ok ? "" : ": ", why);
}

/* Speculative prefetch: every valid fetched slot holds the store's exact K/V at its position. */
static void check_fetched_rows(const char *what, const DecodeArgs *a, const DecodeRun *r) {
    int64_t bad_row = -1, bad_head = -1, bad_slot = -1;
    for (int64_t b = 0; b < a->B; b++)
        for (int64_t h = 0; h < a->H; h++)
            for (int64_t j = 0; j < a->K; j++) {
                const int64_t rr = a->row0 + b, o = rr * a->fi_sb + h * a->fi_sh + j;
                if (!r->fvalid[o]) continue;
                const int64_t p = r->fidx[o], f = rr * a->fk_sb + h * a->fk_sh + j * a->D;
                const int64_t src = rr * a->st_sb + h * a->st_sh + p * a->D;
                if (p < 0 || memcmp(r->fk + f, (const float *)a->store_k + src, (size_t)a->D * 4)
                    || memcmp(r->fv + f, (const float *)a->store_v + src, (size_t)a->D * 4))
                    bad_row = rr, bad_head = h, bad_slot = j;
            }
    check(bad_row < 0, "%s, threads %lld: every valid fetched slot holds the store's exact K/V row%s", what,
          (long long)a->nthreads, bad_row < 0 ? "" : " -- one does not:");
    if (bad_row >= 0)
        printf("#   row %lld head %lld slot %lld\n", (long long)bad_row, (long long)bad_head, (long long)bad_slot);
}

/* fused:*  every buffer DecodeArgs points to and its scalar fields (nthreads aside); ref_out: the torch
 * path's output [B, H, G*T, D]; ref_sel_w [B, H, L]: the weights its top-k ranked (-1 outside the
 * candidates); ref_fidx / ref_fvalid: what it selected. */
static void check_fused(const char *cas) {
    DecodeArgs a;
    memset(&a, 0, sizeof a);
#define GET(f) a.f = geti(cas, #f);
    DECODE_I64(GET)
#undef GET
    const Blob *scaling = get(cas, "scaling", 'f', 0), *q = get(cas, "q", 'f', 4), *start = get(cas, "start", 'q', 1),
               *qend = get(cas, "qend", 'q', 1), *sink_k = get(cas, "sink_k", 'f', 4),
               *sink_v = get(cas, "sink_v", 'f', 4), *res_k = get(cas, "res_k", 'f', 4),
               *res_v = get(cas, "res_v", 'f', 4), *fk = get(cas, "fk", 'f', 4), *fv = get(cas, "fv", 'f', 4),
               *fidx = get(cas, "fidx", 'q', 3), *fvalid = get(cas, "fvalid", 'B', 3),
               *store_k = get(cas, "store_k", 'f', 4), *store_v = get(cas, "store_v", 'f', 4),
               *kc = get(cas, "kc", 'B', 6), *ks = get(cas, "ks", 'e', 4), *kz = get(cas, "kz", 'e', 4),
               *vc = get(cas, "vc", 'B', 6), *vs = get(cas, "vs", 'e', 4), *vz = get(cas, "vz", 'e', 4),
               *ref = get(cas, "ref_out", 'f', 4);
    if (missing) return;
    const Blob *sel = find(cas, "ref_sel_w"), *ref_fidx = find(cas, "ref_fidx"),
               *ref_fvalid = find(cas, "ref_fvalid"), *rot = find(cas, "rot"), *ref_reuse = find(cas, "ref_reuse");
    if (rot) a.rot = F32(rot);
    const Blob *oidx = find(cas, "oidx"), *oc = find(cas, "oc"), *os_ = find(cas, "os"), *oz = find(cas, "oz");
    if (oidx && oc && os_ && oz) a.oidx = oidx->data, a.oc = oc->data, a.os = os_->data, a.oz = oz->data;
    a.scaling = *F32(scaling);
    const Blob *softcap = find(cas, "softcap"); /* absent: no softcapping */
    a.softcap = softcap ? *F32(softcap) : 0.0f;
    a.q = F32(q), a.start = start->data, a.qend = qend->data, a.sink_k = F32(sink_k), a.sink_v = F32(sink_v);
    a.res_k = F32(res_k), a.res_v = F32(res_v), a.store_k = F32(store_k), a.store_v = F32(store_v);
    a.kc = kc->data, a.ks = ks->data, a.kz = kz->data, a.vc = vc->data, a.vs = vs->data, a.vz = vz->data;
    const int64_t rows = fidx->shape[0], K = fidx->shape[2], D = a.D;
    const int64_t nout = a.B * a.H * a.G * a.T * D;
    if (ref->count != nout || fk->shape[2] != K || K != a.K) {
        check(0, "%s: inconsistent shapes", cas);
        return;
    }
    char msg[512], what[512];
    snprintf(what, sizeof what, "%s decode_attention %s%s%s%s%s%s, %lld bit, rows %lld..%lld, %lld new token(s)", cas,
             a.current ? "prefetch current" : "speculative", a.select_both ? " select_both" : "",
             a.correct ? " corrected" : "", a.rot ? " rotated" : "", a.O ? " outliers" : "",
             a.softcap > 0 ? " softcapped" : "", (long long)a.bits,
             (long long)a.row0, (long long)(a.row0 + a.B - 1), (long long)a.T);
    DecodeRun run[2];
    for (int t = 0; t < 2; t++) {
        DecodeRun *r = &run[t];
        r->fk = alloc64(fk->nbytes), r->fv = alloc64(fv->nbytes), r->fidx = alloc64(fidx->nbytes);
        r->fvalid = alloc64(fvalid->nbytes), r->out = out_buffer(nout);
        memcpy(r->fk, fk->data, fk->nbytes), memcpy(r->fv, fv->data, fv->nbytes);
        memcpy(r->fidx, fidx->data, fidx->nbytes), memcpy(r->fvalid, fvalid->data, fvalid->nbytes);
        a.fk = r->fk, a.fv = r->fv, a.fidx = r->fidx, a.fvalid = r->fvalid, a.out = r->out;
        a.nthreads = THREADS[t];
        int64_t *reuse = a.correct && a.T > 1 ? calloc((size_t)(a.B * a.H * 2), sizeof(int64_t)) : NULL;
        a.reuse = reuse;
        const int rc = specache_decode_attention(&a);
        if (reuse && ref_reuse) { /* the counts of prefetch_reuse: the torch path's sums */
            int64_t hit = 0, all = 0;
            for (int64_t i = 0; i < a.B * a.H; i++) hit += reuse[2 * i], all += reuse[2 * i + 1];
            const int64_t *want = ref_reuse->data;
            check(hit == want[0] && all == want[1],
                  "%s, threads %d: reuse counts %lld of %lld (torch path: %lld of %lld)", what, THREADS[t],
                  (long long)hit, (long long)all, (long long)want[0], (long long)want[1]);
        }
        free(reuse);
        a.reuse = NULL;
        int ok = rc == 0 && close_to(r->out, F32(ref), nout, 1e-4, 1e-4, msg, sizeof msg);
        if (rc) snprintf(msg, sizeof msg, "returned %d", rc);
        const int guard = guard_ok(r->out, nout);
        check(ok && guard, "%s, threads %d: output vs the torch decode path: %s%s", what, THREADS[t], msg,
              guard ? "" : "; wrote past its output");
        if (sel) check_selection(what, &a, r, sel, ref_fidx, ref_fvalid);
        if (a.select >= 0 && !a.current) check_fetched_rows(what, &a, r);
        if (a.B < rows) { /* cache rows outside [row0, row0 + B) keep their fetched set */
            int ok2 = 1;
            for (int64_t rr = 0; rr < rows; rr++) {
                if (rr >= a.row0 && rr < a.row0 + a.B) continue;
                const size_t sk = (size_t)(a.H * K), sf = sk * (size_t)D;
                ok2 &= !memcmp(r->fidx + rr * sk, (const int64_t *)fidx->data + rr * sk, sk * 8);
                ok2 &= !memcmp(r->fvalid + rr * sk, (const uint8_t *)fvalid->data + rr * sk, sk);
                ok2 &= !memcmp(r->fk + rr * sf, F32(fk) + rr * sf, sf * 4);
                ok2 &= !memcmp(r->fv + rr * sf, F32(fv) + rr * sf, sf * 4);
            }
            check(ok2, "%s, threads %d: the other cache rows' fetched sets are untouched", what, THREADS[t]);
        }
    }
    const int same = !memcmp(run[0].out, run[1].out, (size_t)nout * 4)
                     && !memcmp(run[0].fidx, run[1].fidx, fidx->nbytes)
                     && !memcmp(run[0].fvalid, run[1].fvalid, fvalid->nbytes)
                     && !memcmp(run[0].fk, run[1].fk, fk->nbytes) && !memcmp(run[0].fv, run[1].fv, fv->nbytes);
    check(same, "%s: 2 threads == 1 thread bit for bit (output, fetched set and buffers)", what);
    free_run(&run[0]);
    free_run(&run[1]);
}

/* ------------------------------------------------------- sliding-window decode attention */

int specache_sliding_attention(const SlidingArgs *a);

/* sliding:*  the ring (k, v, pos), the queries, the rows' first new positions and the scalar fields of
 * SlidingArgs (softcap 0: none); ref_out: SlidingWindowLayer.attend_torch's output [B, H, G*T, D]. */
static void check_sliding(const char *cas) {
    SlidingArgs a;
    memset(&a, 0, sizeof a);
    a.B = geti(cas, "B"), a.H = geti(cas, "H"), a.G = geti(cas, "G"), a.T = geti(cas, "T"), a.D = geti(cas, "D");
    a.C = geti(cas, "C"), a.W = geti(cas, "W"), a.row0 = geti(cas, "row0");
    const Blob *scaling = get(cas, "scaling", 'f', 0), *q = get(cas, "q", 'f', 4), *k = get(cas, "k", 'f', 4),
               *v = get(cas, "v", 'f', 4), *pos = get(cas, "pos", 'q', 2), *start = get(cas, "start", 'q', 1),
               *ref = get(cas, "ref_out", 'f', 4);
    if (missing) return;
    const Blob *softcap = get(cas, "softcap", 'f', 0);
    if (missing) return;
    a.scaling = *F32(scaling), a.softcap = *F32(softcap);
    a.q = F32(q), a.q_sb = q->shape[1] * q->shape[2] * q->shape[3], a.q_sh = q->shape[2] * q->shape[3];
    a.k = F32(k), a.v = F32(v), a.k_sb = k->shape[1] * k->shape[2] * k->shape[3], a.k_sh = k->shape[2] * k->shape[3];
    a.pos = pos->data, a.pos_sb = pos->shape[1], a.start = start->data;
    const int64_t nout = a.B * a.H * a.G * a.T * a.D;
    if (ref->count != nout || q->count != nout || k->shape[2] != a.C || k->shape[3] != a.D) {
        check(0, "%s: inconsistent shapes", cas);
        return;
    }
    float *out[2];
    char msg[512];
    for (int t = 0; t < 2; t++) {
        out[t] = out_buffer(nout);
        a.out = out[t], a.nthreads = THREADS[t];
        const int rc = specache_sliding_attention(&a);
        int ok = rc == 0 && close_to(out[t], F32(ref), nout, 1e-4, 1e-4, msg, sizeof msg);
        if (rc) snprintf(msg, sizeof msg, "returned %d", rc);
        const int guard = guard_ok(out[t], nout);
        check(ok && guard,
              "%s sliding_attention%s, rows %lld..%lld, %lld new token(s), threads %d: output vs the torch reference: "
              "%s%s", cas, a.softcap > 0 ? " softcapped" : "", (long long)a.row0,
              (long long)(a.row0 + a.B - 1), (long long)a.T, THREADS[t], msg, guard ? "" : "; wrote past its output");
    }
    check(!memcmp(out[0], out[1], (size_t)nout * 4), "%s: 2 threads == 1 thread bit for bit", cas);
    free(out[0]), free(out[1]);
}

/* --------------------------------------------------------------------- main */

static void check_file(const char *path) {
    char err[256];
    printf("# %s\n", path);
    if (load(path, err, sizeof err)) {
        check(0, "%s: %s", path, err);
        free_blobs();
        return;
    }
    int cases = 0;
    for (int i = 0; i < nblobs; i++) { /* each case once, in file order */
        char cas[256];
        const char *slash = strchr(blobs[i].name, '/');
        const size_t len = slash ? (size_t)(slash - blobs[i].name) : strlen(blobs[i].name);
        snprintf(cas, sizeof cas, "%.*s", (int)len, blobs[i].name);
        int seen = 0;
        for (int j = 0; j < i && !seen; j++) seen = !strncmp(blobs[j].name, cas, len) && blobs[j].name[len] == '/';
        if (seen) continue;
        cases++;
        missing = 0;
        if (!strncmp(cas, "skinny:", 7)) check_skinny(cas);
        else if (!strncmp(cas, "packed:", 7)) check_packed(cas);
        else if (!strncmp(cas, "scores:", 7)) check_guide(cas, 0);
        else if (!strncmp(cas, "values:", 7)) check_guide(cas, 1);
        else if (!strncmp(cas, "fused:", 6)) check_fused(cas);
        else if (!strncmp(cas, "sliding:", 8)) check_sliding(cas);
        else check(0, "%s: unknown kind of case", cas);
    }
    if (!cases) check(0, "%s: no cases", path);
    free_blobs();
}

/* A bf16 exact store's rows widened by this target's vector code (simd.h vf_from_bf16, what the fused decode
 * reads a bf16 store with) equal the scalar rule: the bf16 bits are the float's high half. */
static void check_widening(void) {
    uint16_t b[64];
    float fb[64];
    int bad = 0;
    for (int i = 0; i < 64; i++) {
        const float x = (i - 31.5f) * 0.37f + (float)(i % 7) * 1e-3f;
        uint32_t u;
        memcpy(&u, &x, 4);
        b[i] = (uint16_t)(u >> 16);
    }
    for (int d = 0; d + VW <= 64; d += VW) vf_store(fb + d, vf_from_bf16(b + d));
    for (int i = 0; i < 64; i++) {
        const uint32_t u = (uint32_t)b[i] << 16;
        float want;
        memcpy(&want, &u, 4);
        bad += fb[i] != want;
    }
    check(bad == 0, "bf16 store rows widen exactly (%s vectors; %d wrong)", SIMD_ISA, bad);
}

int main(int argc, char **argv) {
    const char *isa = NULL;
    int prefill = -1, abi = -1, files = 0;
    const uint16_t one = 1;
    if (*(const uint8_t *)&one != 1) {
        puts("FAIL the reference files are little-endian: this host is not\n0 passed, 1 failed");
        return 1;
    }
    printf("# kernels built for %s, OpenMP %s\n", specache_native_isa(), specache_guide_openmp() ? "on" : "off");
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--isa") && i + 1 < argc) isa = argv[++i];
        else if (!strcmp(argv[i], "--prefill") && i + 1 < argc) prefill = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--abi") && i + 1 < argc) abi = atoi(argv[++i]);
    }
    if (isa) check(!strcmp(specache_native_isa(), isa), "specache_native_isa() is \"%s\" (expected \"%s\")",
                   specache_native_isa(), isa);
    if (abi >= 0) check(specache_guide_abi_version() == abi, "specache_guide_abi_version() is %d (expected %d)",
                        specache_guide_abi_version(), abi);
    if (prefill >= 0) {
        const int got = specache_prefill_attention_available();
        check(got == prefill, "specache_prefill_attention_available() is %d (expected %d)", got, prefill);
        if (!prefill) {
            const int rc = specache_prefill_attention(NULL);
            check(rc != 0, "specache_prefill_attention() declines without AVX512-BF16 (returned %d)", rc);
        }
    }
    int team = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(2)
#pragma omp single
    team = omp_get_num_threads();
#endif
    check(specache_guide_openmp() && team == 2, "OpenMP: the kernels are built with it and 2 threads run (%d)", team);
    check_widening();
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--isa") || !strcmp(argv[i], "--prefill") || !strcmp(argv[i], "--abi")) {
            i++;
            continue;
        }
        check_file(argv[i]);
        files++;
    }
    if (!files) check(0, "no reference files given");
    printf("%d passed, %d failed\n", n_passed, n_failed);
    return n_failed ? 1 : 0;
}
