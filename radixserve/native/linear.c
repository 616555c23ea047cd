/* A linear layer for the few rows of a decode step: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
 *
 * At a handful of rows a linear layer reads each weight once and does two flops per weight
 * read: it is bound by memory bandwidth, and the weights of a whole model do not fit in any
 * cache. The BLAS that torch ships reaches a fraction of the bandwidth there on some CPUs (it
 * picks a generic path on CPUs it does not recognise), so this kernel streams the weights
 * itself: threads take contiguous ranges of output features, each tile reads four weight rows
 * once and multiplies them with up to four input rows held in registers (more input rows go
 * round the same tile again, from the L1 cache). Accumulation is in float32, in 16 partial
 * sums per dot product summed at the end: the same sum in another order than BLAS's, so
 * results agree with torch's up to float rounding.
 *
 * x [rows, k], w [n, k], out [rows, n] contiguous float32; bias [n] or NULL.
 */
#include "common.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define TILE_ROWS 4     /* input rows per pass over a tile of weights */
#define TILE_OUTPUTS 4  /* weight rows (output features) per tile */
#define ROW_BLOCK 64    /* input rows per pass over the weights */

#ifdef __AVX512F__
/* The dot products of `mr` input rows with `nr` weight rows; mr, nr <= 4 are constants at
 * every call site, so the compiler unrolls the accumulators into registers. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *out, int64_t k,
                                                       int64_t out_stride, int mr, int nr) {
    __m512 acc[TILE_ROWS][TILE_OUTPUTS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t kk = 0;
    for (; kk + 16 <= k; kk += 16) {
        __m512 wv[TILE_OUTPUTS];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_loadu_ps(w + j * k + kk);
        for (int i = 0; i < mr; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * k + kk);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (kk < k) { /* the last k % 16 columns, through a masked load (zeros past the end) */
        __mmask16 mask = (__mmask16)((1u << (k - kk)) - 1u);
        __m512 wv[TILE_OUTPUTS];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * k + kk);
        for (int i = 0; i < mr; i++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * k + kk);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) out[i * out_stride + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#else
/* Portable: the same tile in plain C, LANES partial sums that the compiler can vectorise. */
static inline void tile(const float *x, const float *w, float *out, int64_t k, int64_t out_stride, int mr, int nr) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float part[LANES] = {0};
            int64_t kk = 0;
            for (; kk + LANES <= k; kk += LANES)
                for (int l = 0; l < LANES; l++) part[l] += x[i * k + kk + l] * w[j * k + kk + l];
            for (; kk < k; kk++) part[0] += x[i * k + kk] * w[j * k + kk];
            float sum = 0.0f;
            for (int l = 0; l < LANES; l++) sum += part[l];
            out[i * out_stride + j] = sum;
        }
}
#endif

/* One tile of weights against every input row, four rows at a time. */
static inline __attribute__((always_inline)) void weight_tile(const float *x, const float *w, float *out,
                                                              int64_t rows, int64_t k, int64_t n, int nr) {
    int64_t m = 0;
    for (; m + TILE_ROWS <= rows; m += TILE_ROWS) tile(x + m * k, w, out + m * n, k, n, TILE_ROWS, nr);
    switch (rows - m) {
    case 3: tile(x + m * k, w, out + m * n, k, n, 3, nr); break;
    case 2: tile(x + m * k, w, out + m * n, k, n, 2, nr); break;
    case 1: tile(x + m * k, w, out + m * n, k, n, 1, nr); break;
    default: break;
    }
}

/* Output features [n0, n1) of every row. A prefill's rows go ROW_BLOCK at a time, so that the
 * block of x that every tile of weights passes over stays in the L2 cache. */
static void output_range(const float *x, const float *w, const float *bias, float *out, int64_t rows, int64_t k,
                         int64_t n, int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
        int64_t block = rows - m0 < ROW_BLOCK ? rows - m0 : ROW_BLOCK;
        const float *xb = x + m0 * k;
        float *ob = out + m0 * n;
        int64_t j = n0;
        for (; j + TILE_OUTPUTS <= n1; j += TILE_OUTPUTS) weight_tile(xb, w + j * k, ob + j, block, k, n, TILE_OUTPUTS);
        for (; j < n1; j++) weight_tile(xb, w + j * k, ob + j, block, k, n, 1);
    }
    if (bias)
        for (int64_t m = 0; m < rows; m++)
            for (int64_t jj = n0; jj < n1; jj++) out[m * n + jj] += bias[jj];
}

void radixserve_linear(const float *x, const float *w, const float *bias, float *out, int64_t rows, int64_t k,
                       int64_t n, int threads) {
    if (threads <= 1 || n < 2 * TILE_OUTPUTS * threads) {
        output_range(x, w, bias, out, rows, k, n, 0, n);
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
        output_range(x, w, bias, out, rows, k, n, n0, n1 < n ? n1 : n);
    }
#else
    output_range(x, w, bias, out, rows, k, n, 0, n);
#endif
}
