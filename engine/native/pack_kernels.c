/* Packing fp32 weights whose values are exactly those of a block format into its blocks (affine4: fp16-sized d
 * and a float minimum per 32 weights, 4-bit codes; scaled8: a float scale per 32, int8 codes), for the decode
 * linears of linear_kernels.c, which rebuild each weight bit for bit (engine/model/held_weights.py packs a weight
 * whose values fit; engine/native/calibrate.py times the forms). The block layouts are block_codes.h's. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "block_codes.h"

#define EXPORT __attribute__((visibility("default")))

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
