/* What the CPU kernels share: the vector width, the OpenMP thread index, and e^x. */
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

/* e^x for x <= 0 in plain arithmetic, so that loops over it vectorise (libm's expf is a scalar
 * call). Cephes' expf: Cody-Waite reduction by ln 2 and a degree-6 polynomial, within 2 ulp
 * of expf, denormal results included (checked over 10^6 points); e^x underflows to exactly 0
 * below -104 as expf does.
 * The power of two is built as 2^(n + 64) * 2^-64 so that n down to -151 stays encodable. */
static inline float exp_nonpositive(float x) {
    x = x >= -104.0f ? x : -104.0f; /* -inf too */
    /* n = x / ln 2 rounded to nearest by the 1.5 * 2^23 trick: plain adds, so it vectorises
     * (floorf does not without -fno-trapping-math). */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 64 + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale * 0x1p-64f;
}
#endif
