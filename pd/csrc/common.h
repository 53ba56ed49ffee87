/* Scalar helpers shared by the native kernels, written so that loops over them
 * vectorize: bfloat16 <-> float32, and exp. */
#ifndef PD_CSRC_COMMON_H
#define PD_CSRC_COMMON_H

#include <stdint.h>
#include <string.h>

static inline float load_bf16(const uint16_t *x, int64_t i) {
    uint32_t bits = (uint32_t)x[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* To the nearest bfloat16, ties to even; NaN stays NaN. */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline void store_bf16(uint16_t *x, int64_t i, float f) { x[i] = to_bf16(f); }

static inline float round_bf16(float f) {
    uint16_t h = to_bf16(f);
    return load_bf16(&h, 0);
}

static inline float load_f32(const float *x, int64_t i) { return x[i]; }
static inline void store_f32(float *x, int64_t i, float f) { x[i] = f; }
static inline float round_f32(float f) { return f; }

/* exp(x) to about 1 ulp (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial for e^r, 2^n from the bits); exp(-inf) = 0, large x saturates. */
static inline float exp_f32(float x) {
    x = x > 88.3762626647949f ? 88.3762626647949f : x;
    x = x < -87.3365447505531f ? -87.3365447505531f : x;
    float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return y * scale;
}

#endif
