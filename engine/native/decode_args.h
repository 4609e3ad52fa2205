/* The argument block of specache_decode_attention (guide_kernels.c, which documents the call; engine/native/
 * __init__.py mirrors it with ctypes), one definition for the kernels and for tests/native/kernel_check.c. */
#ifndef SPECACHE_DECODE_ARGS_H
#define SPECACHE_DECODE_ARGS_H

#include <stdint.h>

typedef struct {
    int64_t B, H, G, T, D, S, K, bits, g, gv, row0, select, keep, residual, nthreads, select_both, current;
    float scaling;
    const float *q; /* [B, H, G*T, D]: (b, h, i, d) at b*q_sb + h*q_sh + i*D + d */
    int64_t q_sb, q_sh;
    const int64_t *start, *qend; /* start [B] (q rows); qend [rows] (cache rows, row0 + b) */
    const float *sink_k, *sink_v; /* [rows, H, >= S, D] */
    int64_t sk_sb, sk_sh;
    const float *res_k, *res_v; /* [rows, H, W, D] */
    int64_t rk_sb, rk_sh;
    float *fk, *fv; /* fetched exact K/V [rows, H, K, D] */
    int64_t fk_sb, fk_sh;
    int64_t *fidx; /* [rows, H, K] */
    uint8_t *fvalid;
    int64_t fi_sb, fi_sh;
    const void *store_k, *store_v; /* host store [rows, H, L, D] of store_dtype elements (strides in elements) */
    int64_t st_sb, st_sh;
    const uint8_t *kc; /* guide keys / values: layouts of specache_guide_scores / _weighted_values */
    int64_t kc_sb, kc_sh;
    const uint16_t *ks, *kz;
    int64_t ks_sb, ks_sh;
    const uint8_t *vc;
    int64_t vc_sb, vc_sh;
    const uint16_t *vs, *vz;
    int64_t vs_sb, vs_sh;
    float *out; /* [B, H, G*T, D] contiguous */
    const float *rot; /* NULL, or the guide's rotation R [D, D] (engine/kvcache/rotation.py): the guide
                       * holds K R and V R, so its scores take q R and its value output is rotated back */
    int64_t correct;  /* speculative, corrected: new token 0 picks the pass's set from its own guide attention
                       * and reads it from the host store (as current does); fidx / fvalid (the prefetched
                       * set, what fk / fv hold) are left for step 5 */
    int64_t *reuse;   /* NULL, or [B, H, 2]: of the set token 0 picked, the positions the prefetch held, and all */
    int64_t res_at_qend; /* the residual window is the host store (res_k = store_k, same strides): a row's
                          * window starts at its position qend, not at slot 0 */
    int64_t O; /* outlier key channels beside the guide (engine/kvcache/outliers.py), 0: none. Their term
                * q_O . k4_O (unrotated queries) is added to the guide scores */
    const int64_t *oidx; /* [rows, H, O] the channels */
    int64_t oi_sb, oi_sh;
    const uint8_t *oc; /* [rows, H, L, ceil(O/2)] 4-bit codes, channel 2i in the low nibble of byte i */
    int64_t oc_sb, oc_sh;
    const uint16_t *os, *oz; /* fp16 [rows, H, L/g, O] scale and zero */
    int64_t os_sb, os_sh;
    float softcap; /* > 0: attention-logit softcapping (Gemma 2), every score s (exact or the guide's, already
                    * scaled) becomes softcap * tanh(s / softcap) before the softmax; 0: none */
    int64_t store_dtype; /* the host store's elements: STORE_F32 (0) or STORE_BF16 (1); a bf16 store's rows are
                          * widened to floats as they are read (fetched or attended in place) */
} DecodeArgs;

enum { STORE_F32 = 0, STORE_BF16 = 1 };

/* The argument block of specache_sliding_attention (guide_kernels.c): a sliding-window layer's decode attention
 * over its ring (engine/kvcache/sliding.py). */
typedef struct {
    int64_t B, H, G, T, D, C, W, row0, nthreads;
    float scaling, softcap;   /* softcap > 0: every score s becomes softcap * tanh(s / softcap); 0: none */
    const float *q;           /* [B, H, G*T, D]: (b, h, i, d) at b*q_sb + h*q_sh + i*D + d */
    int64_t q_sb, q_sh;
    const float *k, *v;       /* the ring [rows, H, C, D]: (r, h, c, d) at r*k_sb + h*k_sh + c*D + d (v alike) */
    int64_t k_sb, k_sh;
    const int64_t *pos;       /* [rows, C]: the position slot c holds (-1: none), at r*pos_sb + c */
    int64_t pos_sb;
    const int64_t *start;     /* [B]: the position of row b's first new token */
    float *out;               /* [B, H, G*T, D] contiguous */
} SlidingArgs;

#endif
