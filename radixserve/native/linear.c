/* A linear layer: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), float32 or bfloat16.
 *
 * At a decode step's few rows a linear layer reads each weight once and does two flops per
 * weight read: it is bound by memory bandwidth, and a whole model's weights fit in no cache.
 * The BLAS that torch ships reaches a fraction of the bandwidth there on some CPUs (it picks a
 * generic path on CPUs it does not recognise), so this kernel streams the weights itself:
 * threads take contiguous ranges of output features; each tile reads four weight rows once and
 * multiplies them with up to four input rows held in registers; more input rows go round the
 * same tile again from the L1 cache, ROW_BLOCK rows per pass over the weights so that a
 * prefill's rows stay in the L2 cache.
 *
 * Accumulation is in float32, in 16 partial sums per dot product added up at the end: the same
 * sum in another order than BLAS's, so results agree with torch's up to float rounding, and
 * each output is the same sum whatever the number of rows and threads. bfloat16 (dtype 1):
 * x, w, bias and out bfloat16, products and sums in float32, the result rounded to nearest
 * even once, where torch rounds it.
 *
 * x [rows, k], w [n, k], out [rows, n] contiguous; bias [n] or NULL.
 */
#include "common.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define TILE_ROWS 4    /* input rows per pass over a tile of weights */
#define TILE_OUTPUTS 4 /* weight rows (output features) per tile */
#define ROW_BLOCK 64   /* input rows per pass over the weights */

static inline float bf16_value(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float element(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_value(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#ifdef __AVX512F__
/* 16 elements from p (float32, or bfloat16 widened exactly), zeros past `mask`'s lanes. */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, __mmask16 mask, int bf16) {
    if (!bf16) return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
    __m256i halves = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

#ifdef __AVX512BF16__
/* bfloat16 with the CPU's bfloat16 dot product: 32 elements per instruction, pairs of
 * products added in float32 (inputs that are denormal count as zero, as the instruction
 * defines). */
static inline __attribute__((always_inline)) void tile_bf16(const void *x, const void *w,
                                                            float sums[TILE_ROWS][TILE_OUTPUTS], int64_t k, int mr,
                                                            int nr) {
    __m512 acc[TILE_ROWS][TILE_OUTPUTS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    const uint16_t *xs = (const uint16_t *)x, *ws = (const uint16_t *)w;
    for (int64_t kk = 0; kk < k; kk += 32) {
        __mmask32 mask = k - kk >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - kk)) - 1u);
        __m512bh wv[TILE_OUTPUTS];
        for (int j = 0; j < nr; j++) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + j * k + kk);
        for (int i = 0; i < mr; i++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs + i * k + kk);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif

/* The dot products of `mr` input rows with `nr` weight rows into sums[i][j]; mr, nr and bf16
 * are constants at every call site, so the accumulators unroll into registers. */
static inline __attribute__((always_inline)) void tile(const void *x, const void *w, float sums[TILE_ROWS][TILE_OUTPUTS],
                                                       int64_t k, int mr, int nr, int bf16) {
#ifdef __AVX512BF16__
    if (bf16) {
        tile_bf16(x, w, sums, k, mr, nr);
        return;
    }
#endif
    __m512 acc[TILE_ROWS][TILE_OUTPUTS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 16) {
        /* The last k % 16 columns through a masked load. */
        __mmask16 mask = k - kk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - kk)) - 1u);
        __m512 wv[TILE_OUTPUTS];
        for (int j = 0; j < nr; j++) wv[j] = load16(w, j * k + kk, mask, bf16);
        for (int i = 0; i < mr; i++) {
            __m512 xv = load16(x, i * k + kk, mask, bf16);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}
#else
/* Portable: the same sums in plain C, LANES partial sums that the compiler can vectorise. */
static inline void tile(const void *x, const void *w, float sums[TILE_ROWS][TILE_OUTPUTS], int64_t k, int mr, int nr,
                        int bf16) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float part[LANES] = {0};
            for (int64_t kk = 0; kk < k; kk++) part[kk % LANES] += element(x, i * k + kk, bf16) * element(w, j * k + kk, bf16);
            float sum = 0.0f;
            for (int l = 0; l < LANES; l++) sum += part[l];
            sums[i][j] = sum;
        }
}
#endif

/* Rows [m, m + mr) x outputs [j, j + nr): the sums, the bias, stored in the output's dtype. */
static inline __attribute__((always_inline)) void tile_out(const void *x, const void *w, const void *bias, void *out,
                                                           int64_t m, int64_t j, int64_t k, int64_t n, int mr, int nr,
                                                           int bf16) {
    float sums[TILE_ROWS][TILE_OUTPUTS];
    int64_t element_size = bf16 ? 2 : 4;
    tile((const char *)x + m * k * element_size, (const char *)w + j * k * element_size, sums, k, mr, nr, bf16);
    for (int i = 0; i < mr; i++)
        for (int jj = 0; jj < nr; jj++) {
            float v = sums[i][jj] + (bias ? element(bias, j + jj, bf16) : 0.0f);
            if (bf16)
                ((uint16_t *)out)[(m + i) * n + j + jj] = bf16_round(v);
            else
                ((float *)out)[(m + i) * n + j + jj] = v;
        }
}

/* One tile of nr weight rows against rows [m0, m1), four rows at a time. */
static inline __attribute__((always_inline)) void weight_tile(const void *x, const void *w, const void *bias, void *out,
                                                              int64_t m0, int64_t m1, int64_t j, int64_t k, int64_t n,
                                                              int nr, int bf16) {
    int64_t m = m0;
    for (; m + TILE_ROWS <= m1; m += TILE_ROWS) tile_out(x, w, bias, out, m, j, k, n, TILE_ROWS, nr, bf16);
    switch (m1 - m) {
    case 3: tile_out(x, w, bias, out, m, j, k, n, 3, nr, bf16); break;
    case 2: tile_out(x, w, bias, out, m, j, k, n, 2, nr, bf16); break;
    case 1: tile_out(x, w, bias, out, m, j, k, n, 1, nr, bf16); break;
    default: break;
    }
}

/* Output features [n0, n1) of every row. */
static inline __attribute__((always_inline)) void output_range(const void *x, const void *w, const void *bias, void *out,
                                                               int64_t rows, int64_t k, int64_t n, int64_t n0,
                                                               int64_t n1, int bf16) {
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
        int64_t m1 = rows - m0 < ROW_BLOCK ? rows : m0 + ROW_BLOCK;
        int64_t j = n0;
        for (; j + TILE_OUTPUTS <= n1; j += TILE_OUTPUTS)
            weight_tile(x, w, bias, out, m0, m1, j, k, n, TILE_OUTPUTS, bf16);
        for (; j < n1; j++) weight_tile(x, w, bias, out, m0, m1, j, k, n, 1, bf16);
    }
}

static void output_range_f32(const void *x, const void *w, const void *bias, void *out, int64_t rows, int64_t k,
                             int64_t n, int64_t n0, int64_t n1) {
    output_range(x, w, bias, out, rows, k, n, n0, n1, 0);
}

static void output_range_bf16(const void *x, const void *w, const void *bias, void *out, int64_t rows, int64_t k,
                              int64_t n, int64_t n0, int64_t n1) {
    output_range(x, w, bias, out, rows, k, n, n0, n1, 1);
}

void radixserve_linear(const void *x, const void *w, const void *bias, void *out, int64_t rows, int64_t k, int64_t n,
                       int dtype, int threads) {
    void (*range)(const void *, const void *, const void *, void *, int64_t, int64_t, int64_t, int64_t, int64_t) =
        dtype ? output_range_bf16 : output_range_f32;
    if (threads <= 1 || n < 2 * TILE_OUTPUTS * threads) {
        range(x, w, bias, out, rows, k, n, 0, n);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        int count = omp_get_num_threads();
        /* Contiguous ranges of whole tiles: each thread streams its own part of w. */
        int64_t tiles = (n + TILE_OUTPUTS - 1) / TILE_OUTPUTS;
        int64_t t = thread_index();
        int64_t n0 = (tiles * t / count) * TILE_OUTPUTS;
        int64_t n1 = (tiles * (t + 1) / count) * TILE_OUTPUTS;
        range(x, w, bias, out, rows, k, n, n0, n1 < n ? n1 : n);
    }
#else
    range(x, w, bias, out, rows, k, n, 0, n);
#endif
}
