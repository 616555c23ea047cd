/* The small element-wise steps of a decoder layer, each one pass instead of several torch ops:
 *
 * - add_rms_norm: x += delta (the residual stream; skipped when delta is NULL), then
 *   out = x / rms(x) * weight, normalised in float32 (as HF does: the mean of squares in float32,
 *   the normalised value cast to the model's dtype before the scale);
 * - rope: q and k rotated in place by their token's cos/sin (rotate-half convention);
 * - silu_mul: out = silu(gate) * up, all [rows, dim].
 *
 * dtype 0: float32; dtype 1: bfloat16 (each result rounded to nearest even once, where torch
 * rounds it). Rows are independent; at a decode step's few rows a parallel region would cost
 * more than the work, so only calls with many rows are split between threads.
 */
#include "common.h"

#define PARALLEL_MIN_ELEMENTS 65536 /* below this the call runs on one thread */

static inline float load(const void *p, int64_t i, int dtype) {
    return dtype ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Stores v as the tensor's dtype and returns the value stored (rounded for bfloat16). */
static inline float store(void *p, int64_t i, float v, int dtype) {
    if (dtype) {
        uint16_t h = f32_to_bf16(v);
        ((uint16_t *)p)[i] = h;
        return bf16_to_f32(h);
    }
    ((float *)p)[i] = v;
    return v;
}


void radixserve_add_rms_norm(void *x, const void *delta, const void *weight, void *out,
                             int64_t rows, int64_t dim, float eps, int dtype, int num_threads) {
    int threads = rows * dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        int64_t base = r * dim;
        float partial[LANES] = {0};
        for (int64_t j = 0; j < dim; ++j) {
            float v = load(x, base + j, dtype);
            if (delta) v = store(x, base + j, v + load(delta, base + j, dtype), dtype);
            partial[j % LANES] += v * v;
        }
        float sum = 0.0f;
        for (int l = 0; l < LANES; ++l) sum += partial[l];
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t j = 0; j < dim; ++j) {
            float normed = rounded(load(x, base + j, dtype) * inv, dtype);
            store(out, base + j, load(weight, j, dtype) * normed, dtype);
        }
    }
}

/* q [tokens, q_heads, head_dim], k [tokens, k_heads, head_dim] (rows of q_stride / k_stride
 * elements between tokens), cos/sin [tokens, head_dim] in the tensors' dtype. */
void radixserve_rope(void *q, void *k, const void *cos, const void *sin, int64_t tokens,
                     int64_t q_heads, int64_t k_heads, int64_t head_dim, int64_t q_stride,
                     int64_t k_stride, int dtype, int num_threads) {
    int64_t half = head_dim / 2;
    int threads = tokens * (q_heads + k_heads) * head_dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t h = 0; h < q_heads + k_heads; ++h) {
            void *base = h < q_heads ? q : k;
            int64_t row = h < q_heads ? t * q_stride + h * head_dim : t * k_stride + (h - q_heads) * head_dim;
            for (int64_t j = 0; j < half; ++j) {
                float x1 = load(base, row + j, dtype), x2 = load(base, row + half + j, dtype);
                float c1 = load(cos, t * head_dim + j, dtype), s1 = load(sin, t * head_dim + j, dtype);
                float c2 = load(cos, t * head_dim + half + j, dtype), s2 = load(sin, t * head_dim + half + j, dtype);
                /* x * cos + rotate_half(x) * sin, each product rounded as torch's ops round it */
                store(base, row + j, rounded(x1 * c1, dtype) + rounded(-x2 * s1, dtype), dtype);
                store(base, row + half + j, rounded(x2 * c2, dtype) + rounded(x1 * s2, dtype), dtype);
            }
        }
    }
}

/* silu(g) = g / (1 + e^-g) = g * e^g / (1 + e^g): the form whose exponent is <= 0. */
void radixserve_silu_mul(const void *gate, const void *up, void *out, int64_t rows, int64_t dim,
                         int dtype, int num_threads) {
    int threads = rows * dim >= PARALLEL_MIN_ELEMENTS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < dim; ++j) {
            float g = load(gate, r * dim + j, dtype), u = load(up, r * dim + j, dtype);
            /* e^-|g| never overflows, and exp_nonpositive vectorises (expf is a libm call) */
            float e = exp_nonpositive(-fabsf(g));
            float silu = rounded(g * (g >= 0.0f ? 1.0f : e) / (1.0f + e), dtype);
            store(out, r * dim + j, silu * u, dtype);
        }
    }
}
