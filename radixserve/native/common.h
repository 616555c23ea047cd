/* What the CPU kernels share: the vector width, the OpenMP thread index, bfloat16 conversions
 * and e^x. */
#ifndef RADIXSERVE_COMMON_H
#define RADIXSERVE_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
static inline int thread_index(void) { return omp_get_thread_num(); }
#else
static inline int thread_index(void) { return 0; }
#endif

#define LANES 16 /* floats in the partial sums the compiler turns into one vector */

/* bfloat16 -> float32 is exact: the high half of the float's bits. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> bfloat16, rounded to nearest even as torch rounds (NaN stays a quiet NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}


/* Rounds v as storing it in a tensor of that dtype would (bf16: nonzero for bfloat16). */
static inline float rounded(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* e^x for x <= 0 in plain arithmetic, so that loops over it vectorise (libm's expf is a scalar
 * call). Cephes' expf: Cody-Waite reduction by ln 2 and a degree-6 polynomial, within 2 ulp
 * of expf, denormal results included (tests/test_native_sampling.py checks it against float64
 * exp); e^x underflows to exactly 0 below -104 as expf does, and NaN gives NaN as expf does
 * (the attention kernel relies on it: a NaN score must make its softmax NaN, as in SDPA).
 * The power of two is built as 2^(n + 64) * 2^-64 so that n down to -151 stays encodable. */
static inline float exp_nonpositive(float x) {
    x = x < -104.0f ? -104.0f : x; /* -inf too; NaN fails the comparison and stays NaN */
    /* n = x / ln 2 rounded to nearest by the 1.5 * 2^23 trick: plain adds, so it vectorises
     * (floorf does not without -fno-trapping-math). The sum's low mantissa bits hold n as an
     * integer: read from there, not by a float-to-int conversion (undefined for NaN). */
    float shifted = x * 1.44269504088896341f + 12582912.0f;
    float n = shifted - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t n_bits;
    memcpy(&n_bits, &shifted, sizeof n_bits);
    uint32_t bits = (uint32_t)(n_bits - 0x4B400000 + 64 + 127) << 23; /* 0x4B400000: 1.5 * 2^23 */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * 0x1p-64f; /* NaN: p is NaN, whatever the scale */
}
#endif
