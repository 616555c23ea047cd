/* Linear layers: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), float32 or bfloat16.
 *
 * At a decode step's few rows a linear layer reads each weight once and does two flops per
 * weight read: it is bound by memory bandwidth, and a whole model's weights fit in no cache.
 * The BLAS that torch ships reaches a fraction of the bandwidth there on some CPUs (it picks a
 * generic path on CPUs it does not recognise, and its matrix-vector product runs on one
 * thread), so this kernel streams the weights itself: threads take contiguous ranges of output
 * features. One or two input rows (a decode step of one or two sequences, the LM head) read
 * one weight row at a time, a single stream of memory with its lines prefetched ahead
 * (`dot_rows`); with more rows each tile reads four weight rows once and multiplies them with
 * up to four input rows held in registers; more input rows go round the same tile again from
 * the L1 cache, ROW_BLOCK rows per pass over the weights so that a prefill's rows stay in the
 * L2 cache.
 *
 * One call can run several weights over the same x (q, k and v; the outputs of each weight
 * kept apart), split between the threads as one range, and the gated MLP's two up projections
 * with silu(gate) * up applied as each tile finishes (no gate and up tensors in memory).
 *
 * AVX-512 (below), AVX2 with FMA (its own blocking: 16 vector registers, not 32), or portable C,
 * which is many times slower than torch's BLAS: `linear.vectorised` then leaves the layers to it.
 *
 * Accumulation is in float32, in 16 partial sums per dot product (8 on AVX2) added up at the end: the same
 * sum in another order than BLAS's, so results agree with torch's up to float rounding, and
 * each output is the same sum whatever the number of rows and threads. bfloat16 (dtype 1):
 * x, w, bias and out bfloat16, products and sums in float32, each result rounded to nearest
 * even where torch rounds it (the gated form rounds gate, up and silu(gate) as the separate
 * torch ops would).
 *
 * x [rows, k], each w [n, k] and out [rows, n] contiguous; bias [n] or NULL.
 */
#include "common.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#include <stdatomic.h>
#endif

#define TILE_ROWS 4    /* input rows per pass over a tile of weights */
#define TILE_OUTPUTS 8 /* weight rows per tile, at most */
#define ROW_BLOCK 64   /* input rows per pass over the weights */
#define MAX_SEGMENTS 8 /* weights per call */
#define CHUNK_OUTPUTS 64 /* outputs per piece of work the threads share (whole tiles) */
#ifndef CHUNK_BYTES
#define CHUNK_BYTES 65536 /* weights per piece of work at one or two rows */
#endif

/* One weight's part of a call: outputs [offset, offset + n) of the call's range. Gated: w is
 * the gate projection, w_up the up projection, out = silu(x w^T + bias) * (x w_up^T + bias_up). */
typedef struct {
    const void *w, *w_up, *bias, *bias_up;
    void *out;
    int64_t n;
} Segment;

static inline float element(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

#ifdef __AVX512F__
/* 16 elements from p (float32, or bfloat16 widened exactly), zeros past `mask`'s lanes. */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, __mmask16 mask, int bf16) {
    if (!bf16) return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
    __m256i halves = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

/* 16 whole elements from p, a plain load kept in a register: GCC otherwise folds a plain
 * load into every FMA that uses it as a memory operand, one load per use. */
static inline __attribute__((always_inline)) __m512 load16_whole(const void *p, int64_t i, int bf16) {
    __m512 v = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16))
                    : _mm512_loadu_ps((const float *)p + i);
    __asm__("" : "+v"(v));
    return v;
}

#ifdef __AVX512BF16__
/* bfloat16 with the CPU's bfloat16 dot product: 32 elements per instruction, pairs of
 * products added in float32 (inputs that are denormal count as zero, as the instruction
 * defines). */
static inline __attribute__((always_inline)) void tile_bf16(const void *x, const void *const w[TILE_OUTPUTS],
                                                            float sums[TILE_ROWS][TILE_OUTPUTS], int64_t k, int mr,
                                                            int nr, int64_t ahead) {
    __m512 acc[TILE_ROWS][TILE_OUTPUTS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    const uint16_t *xs = (const uint16_t *)x;
    for (int64_t kk = 0; kk < k; kk += 32) {
        __mmask32 mask = k - kk >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (k - kk)) - 1u);
        __m512bh wv[TILE_OUTPUTS];
        for (int j = 0; j < nr; j++) {
            wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, (const uint16_t *)w[j] + kk);
            _mm_prefetch((const char *)((const uint16_t *)w[j] + ahead + kk), _MM_HINT_T0);
        }
        for (int i = 0; i < mr; i++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xs + i * k + kk);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif

/* Columns [kk, kk + 16) of a tile into its accumulators: all 16 (`whole`, a constant: plain
 * loads) or the lanes of `mask`. Each weight line loaded has the line `ahead` elements further
 * prefetched. */
static inline __attribute__((always_inline)) void tile_columns(const void *x, const void *const w[TILE_OUTPUTS],
                                                               __m512 acc[TILE_ROWS][TILE_OUTPUTS], int64_t k, int64_t kk,
                                                               int whole, __mmask16 mask, int mr, int nr, int bf16,
                                                               int64_t ahead) {
    __m512 wv[TILE_OUTPUTS];
    for (int j = 0; j < nr; j++) {
        wv[j] = whole ? load16_whole(w[j], kk, bf16) : load16(w[j], kk, mask, bf16);
        _mm_prefetch((const char *)w[j] + (ahead + kk) * (bf16 ? 2 : 4), _MM_HINT_T0);
    }
    for (int i = 0; i < mr; i++) {
        __m512 xv = whole ? load16_whole(x, i * k + kk, bf16) : load16(x, i * k + kk, mask, bf16);
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
}

/* The dot products of `mr` input rows with `nr` weight rows into sums[i][j]; mr, nr and bf16
 * are constants at every call site, so the accumulators unroll into registers. Each weight
 * line loaded has the line `ahead` elements further prefetched: the same columns of the next
 * tile's rows (at a decode step's few rows the loads then find the weights already in the
 * cache: see docs/benchmark.md; a prefetch never faults, past the end included). */
static inline __attribute__((always_inline)) void tile(const void *x, const void *const w[TILE_OUTPUTS],
                                                       float sums[TILE_ROWS][TILE_OUTPUTS], int64_t k, int mr, int nr,
                                                       int bf16, int64_t ahead) {
#ifdef __AVX512BF16__
    if (bf16) {
        tile_bf16(x, w, sums, k, mr, nr, ahead);
        return;
    }
#endif
    __m512 acc[TILE_ROWS][TILE_OUTPUTS];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    if (mr <= 2) {
        /* A decode step's rows, bound by the weights' bandwidth: whole vectors with plain
         * loads, then the last k % 16 columns masked. */
        int64_t whole = k & ~(int64_t)15;
        for (int64_t kk = 0; kk < whole; kk += 16) tile_columns(x, w, acc, k, kk, 1, 0, mr, nr, bf16, ahead);
        if (whole < k) tile_columns(x, w, acc, k, whole, 0, (__mmask16)((1u << (k - whole)) - 1u), mr, nr, bf16, ahead);
    } else {
        /* More rows, bound by the FMAs: every column step masked (measured up to 20% faster
         * there than the plain loads, at k = 1536). */
        for (int64_t kk = 0; kk < k; kk += 16)
            tile_columns(x, w, acc, k, kk, 0, k - kk >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - kk)) - 1u), mr,
                         nr, bf16, ahead);
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
}

#define STREAM_AHEAD 1024 /* bytes of a weight stream prefetched ahead of its loads */

/* The dot products of `mr` (1 or 2, a constant) input rows with one weight row into sums[i],
 * in the tile's order (the same sums, so the same bits as a tile of any size): a single stream
 * of weights, each line loaded with the line STREAM_AHEAD bytes further prefetched (past the
 * row's end: the next row, read next). At a decode step's one or two rows this reads the
 * weights 5-15% faster than a tile's eight interleaved rows (docs/benchmark.md). */
static inline __attribute__((always_inline)) void dot_rows(const void *x, const void *w, float sums[2], int64_t k,
                                                           int mr, int bf16) {
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
#ifdef __AVX512BF16__
    if (bf16) {
        const uint16_t *xs = (const uint16_t *)x, *ws = (const uint16_t *)w;
        int64_t whole = k & ~(int64_t)31;
        for (int64_t kk = 0; kk < whole; kk += 32) {
            _mm_prefetch((const char *)(ws + kk) + STREAM_AHEAD, _MM_HINT_T0);
            __m512bh wv = (__m512bh)_mm512_loadu_si512(ws + kk);
            for (int i = 0; i < mr; i++) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(xs + i * k + kk), wv);
        }
        if (whole < k) {
            __mmask32 mask = (__mmask32)((1u << (k - whole)) - 1u);
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, ws + whole);
            for (int i = 0; i < mr; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_maskz_loadu_epi16(mask, xs + i * k + whole), wv);
        }
        for (int i = 0; i < mr; i++) sums[i] = _mm512_reduce_add_ps(acc[i]);
        return;
    }
#endif
    int64_t size = bf16 ? 2 : 4, whole = k & ~(int64_t)15;
    for (int64_t kk = 0; kk < whole; kk += 16) {
        _mm_prefetch((const char *)w + kk * size + STREAM_AHEAD, _MM_HINT_T0);
        __m512 wv = load16_whole(w, kk, bf16);
        for (int i = 0; i < mr; i++) acc[i] = _mm512_fmadd_ps(load16_whole(x, i * k + kk, bf16), wv, acc[i]);
    }
    if (whole < k) {
        __mmask16 mask = (__mmask16)((1u << (k - whole)) - 1u);
        __m512 wv = load16(w, whole, mask, bf16);
        for (int i = 0; i < mr; i++) acc[i] = _mm512_fmadd_ps(load16(x, i * k + whole, mask, bf16), wv, acc[i]);
    }
    for (int i = 0; i < mr; i++) sums[i] = _mm512_reduce_add_ps(acc[i]);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 without AVX-512 (AMD's Zen 2 and 3, Intel's client CPUs): 8 partial sums per dot product
 * in one 256-bit register, reduced by a fixed tree. With 16 registers, not 32, a tile goes
 * through its input rows two at a time and its weight rows four at a time (`block`: eight
 * accumulators, four weight vectors and an input vector); every dot product is the same
 * sequence of FMAs whatever the block, tile or stream it is part of, so the same bits. */

/* 8 elements from p (float32, or bfloat16 widened exactly). */
static inline __attribute__((always_inline)) __m256 load8(const void *p, int64_t i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + i);
    __m128i halves = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

/* The `left` (< 8) elements of p from i, zeros after them (AVX2 has no masked 16-bit load). */
static inline __m256 load_tail(const void *p, int64_t i, int64_t left, int bf16) {
    float buf[8] = {0};
    for (int64_t l = 0; l < left; l++) buf[l] = element(p, i + l, bf16);
    return _mm256_loadu_ps(buf);
}

/* The 8 partial sums added by a fixed tree: 8 -> 4 -> 2 -> 1. */
static inline float reduce8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Only the first pass of input rows over a tile prefetches the next tile: the later passes
 * find this tile in L1 and the next one already on its way, and a prefetch takes a load slot,
 * which AVX2's blocks run short of (one per 8 columns: 8-17% faster at 4-16 rows, 10% slower
 * at 64-200 rows than with none; docs/benchmark.md). */
#define PREFETCH_FIRST_PASS_ONLY 1

/* Input rows [i0, i0 + mr) (mr <= 2) with weight rows [j0, j0 + nr) (nr <= 4) into sums; each
 * weight vector loaded has the one `ahead` elements further prefetched (none when `ahead` is
 * negative: see PREFETCH_FIRST_PASS_ONLY). */
static inline __attribute__((always_inline)) void block(const void *x, const void *const w[TILE_OUTPUTS],
                                                        float sums[TILE_ROWS][TILE_OUTPUTS], int i0, int j0, int64_t k,
                                                        int mr, int nr, int bf16, int64_t ahead) {
    __m256 acc[2][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t whole = k & ~(int64_t)7;
    for (int64_t kk = 0; kk < whole; kk += 8) {
        __m256 wv[4];
        for (int j = 0; j < nr; j++) {
            wv[j] = load8(w[j0 + j], kk, bf16);
            if (ahead >= 0) _mm_prefetch((const char *)w[j0 + j] + (ahead + kk) * (bf16 ? 2 : 4), _MM_HINT_T0);
        }
        for (int i = 0; i < mr; i++) {
            __m256 xv = load8(x, (i0 + i) * k + kk, bf16);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (whole < k) {
        __m256 wv[4];
        for (int j = 0; j < nr; j++) wv[j] = load_tail(w[j0 + j], whole, k - whole, bf16);
        for (int i = 0; i < mr; i++) {
            __m256 xv = load_tail(x, (i0 + i) * k + whole, k - whole, bf16);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) sums[i0 + i][j0 + j] = reduce8(acc[i][j]);
}

/* The dot products of `mr` input rows with `nr` weight rows into sums[i][j] (mr, nr and bf16
 * constants at every call site), in blocks of at most 2 x 4. */
static inline __attribute__((always_inline)) void tile(const void *x, const void *const w[TILE_OUTPUTS],
                                                       float sums[TILE_ROWS][TILE_OUTPUTS], int64_t k, int mr, int nr,
                                                       int bf16, int64_t ahead) {
    for (int i0 = 0; i0 < mr; i0 += 2)
        for (int j0 = 0; j0 < nr; j0 += 4)
            block(x, w, sums, i0, j0, k, mr - i0 < 2 ? mr - i0 : 2, nr - j0 < 4 ? nr - j0 : 4, bf16, ahead);
}

#define STREAM_AHEAD 1024 /* bytes of a weight stream prefetched ahead of its loads */

/* The dot products of `mr` (1 or 2) input rows with one weight row, as one stream of weights
 * (the same sums as a tile's, so the same bits). */
static inline __attribute__((always_inline)) void dot_rows(const void *x, const void *w, float sums[2], int64_t k,
                                                           int mr, int bf16) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t size = bf16 ? 2 : 4, whole = k & ~(int64_t)7;
    for (int64_t kk = 0; kk < whole; kk += 8) {
        _mm_prefetch((const char *)w + kk * size + STREAM_AHEAD, _MM_HINT_T0);
        __m256 wv = load8(w, kk, bf16);
        for (int i = 0; i < mr; i++) acc[i] = _mm256_fmadd_ps(load8(x, i * k + kk, bf16), wv, acc[i]);
    }
    if (whole < k) {
        __m256 wv = load_tail(w, whole, k - whole, bf16);
        for (int i = 0; i < mr; i++) acc[i] = _mm256_fmadd_ps(load_tail(x, i * k + whole, k - whole, bf16), wv, acc[i]);
    }
    for (int i = 0; i < mr; i++) sums[i] = reduce8(acc[i]);
}
#else
/* Portable: the same sums in plain C, LANES partial sums that the compiler can vectorise. */
static inline void tile(const void *x, const void *const w[TILE_OUTPUTS], float sums[TILE_ROWS][TILE_OUTPUTS], int64_t k,
                        int mr, int nr, int bf16, int64_t ahead) {
    (void)ahead;
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            float part[LANES] = {0};
            for (int64_t kk = 0; kk < k; kk++) part[kk % LANES] += element(x, i * k + kk, bf16) * element(w[j], kk, bf16);
            float sum = 0.0f;
            for (int l = 0; l < LANES; l++) sum += part[l];
            sums[i][j] = sum;
        }
}

static inline void dot_rows(const void *x, const void *w, float sums[2], int64_t k, int mr, int bf16) {
    const void *rows[TILE_OUTPUTS] = {w};
    float tile_sums[TILE_ROWS][TILE_OUTPUTS];
    tile(x, rows, tile_sums, k, mr, 1, bf16, 0);
    for (int i = 0; i < mr; i++) sums[i] = tile_sums[i][0];
}
#endif

/* silu(g) = g / (1 + e^-g) = g * e^g / (1 + e^g): the form whose exponent is <= 0. */
static inline float silu(float g) {
    float e = exp_nonpositive(-fabsf(g));
    return g * (g >= 0.0f ? 1.0f : e) / (1.0f + e);
}

/* Output j of input row m from its dot product(s): the bias, (the gate,) stored in the output's
 * dtype. */
static inline __attribute__((always_inline)) void store_output(const Segment *seg, int64_t m, int64_t j, float sum, float sum_up,
                                                        int gated, int bf16) {
    float v = rounded(sum + (seg->bias ? element(seg->bias, j, bf16) : 0.0f), bf16);
    if (gated) {
        float up = rounded(sum_up + (seg->bias_up ? element(seg->bias_up, j, bf16) : 0.0f), bf16);
        v = rounded(silu(v), bf16) * up;
    }
    if (bf16)
        ((uint16_t *)seg->out)[m * seg->n + j] = f32_to_bf16(v);
    else
        ((float *)seg->out)[m * seg->n + j] = v;
}

#ifndef PREFETCH_FIRST_PASS_ONLY
#define PREFETCH_FIRST_PASS_ONLY 0
#endif

/* Rows [m, m + mr) x outputs [j, j + outputs) of `seg`: the sums, the bias, (the gate,) stored
 * in the output's dtype. A plain tile has `outputs` weight rows; a gated one 2 x `outputs`,
 * the gate's then the up projection's. `first`: the first pass of rows over these weights. */
static inline __attribute__((always_inline)) void tile_out(const void *x, const Segment *seg, int64_t m, int64_t j,
                                                           int64_t k, int mr, int outputs, int gated, int bf16,
                                                           int first) {
    int64_t size = bf16 ? 2 : 4;
    const void *rows[TILE_OUTPUTS];
    for (int jj = 0; jj < outputs; jj++) {
        rows[jj] = (const char *)seg->w + (j + jj) * k * size;
        if (gated) rows[outputs + jj] = (const char *)seg->w_up + (j + jj) * k * size;
    }
    float sums[TILE_ROWS][TILE_OUTPUTS];
    int64_t ahead = first || !PREFETCH_FIRST_PASS_ONLY ? outputs * k : -1;
    tile((const char *)x + m * k * size, rows, sums, k, mr, gated ? 2 * outputs : outputs, bf16, ahead);
    for (int i = 0; i < mr; i++)
        for (int jj = 0; jj < outputs; jj++) store_output(seg, m + i, j + jj, sums[i][jj], gated ? sums[i][outputs + jj] : 0.0f, gated, bf16);
}

/* Outputs [n0, n1) of `seg` for the `mr` (1 or 2) input rows from m: each output's weight row
 * (the gate's, then the up projection's) streamed alone (dot_rows). */
static inline __attribute__((always_inline)) void row_range(const void *x, const Segment *seg, int64_t m, int mr,
                                                            int64_t k, int64_t n0, int64_t n1, int gated, int bf16) {
    int64_t size = bf16 ? 2 : 4;
    const char *xm = (const char *)x + m * k * size;
    for (int64_t j = n0; j < n1; j++) {
        float sums[2], up[2] = {0.0f, 0.0f};
        dot_rows(xm, (const char *)seg->w + j * k * size, sums, k, mr, bf16);
        if (gated) dot_rows(xm, (const char *)seg->w_up + j * k * size, up, k, mr, bf16);
        for (int i = 0; i < mr; i++) store_output(seg, m + i, j, sums[i], up[i], gated, bf16);
    }
}

/* Outputs [j, j + outputs) of `seg` for rows [m0, m1), four rows at a time. */
static inline __attribute__((always_inline)) void weight_tile(const void *x, const Segment *seg, int64_t m0, int64_t m1,
                                                              int64_t j, int64_t k, int outputs, int gated, int bf16) {
    int64_t m = m0;
    for (; m + TILE_ROWS <= m1; m += TILE_ROWS) tile_out(x, seg, m, j, k, TILE_ROWS, outputs, gated, bf16, m == m0);
    switch (m1 - m) {
    case 3: tile_out(x, seg, m, j, k, 3, outputs, gated, bf16, m == m0); break;
    case 2: tile_out(x, seg, m, j, k, 2, outputs, gated, bf16, m == m0); break;
    case 1: tile_out(x, seg, m, j, k, 1, outputs, gated, bf16, m == m0); break;
    default: break;
    }
}

/* Outputs [n0, n1) of `seg` for every row. */
static inline __attribute__((always_inline)) void output_range(const void *x, const Segment *seg, int64_t rows,
                                                               int64_t k, int64_t n0, int64_t n1, int gated, int bf16) {
    int step = gated ? TILE_OUTPUTS / 4 : TILE_OUTPUTS / 2; /* outputs per full tile */
    for (int64_t m0 = 0; m0 < rows; m0 += ROW_BLOCK) {
        int64_t m1 = rows - m0 < ROW_BLOCK ? rows : m0 + ROW_BLOCK;
        int64_t j = n0;
        if (m1 - m0 == 1) {
            row_range(x, seg, m0, 1, k, n0, n1, gated, bf16);
            continue;
        }
        if (m1 - m0 == 2) {
            row_range(x, seg, m0, 2, k, n0, n1, gated, bf16);
            continue;
        }
        for (; j + step <= n1; j += step) weight_tile(x, seg, m0, m1, j, k, step, gated, bf16);
        for (; j < n1; j++) weight_tile(x, seg, m0, m1, j, k, 1, gated, bf16);
    }
}

static void range_f32(const void *x, const Segment *seg, int64_t rows, int64_t k, int64_t n0, int64_t n1) {
    if (seg->w_up)
        output_range(x, seg, rows, k, n0, n1, 1, 0);
    else
        output_range(x, seg, rows, k, n0, n1, 0, 0);
}

static void range_bf16(const void *x, const Segment *seg, int64_t rows, int64_t k, int64_t n0, int64_t n1) {
    if (seg->w_up)
        output_range(x, seg, rows, k, n0, n1, 1, 1);
    else
        output_range(x, seg, rows, k, n0, n1, 0, 1);
}

/* This thread's share [lo, hi) of the outputs of all segments laid end to end, in whole tiles. */
static void run_share(const void *x, const Segment *segs, int count, int64_t rows, int64_t k, int64_t lo, int64_t hi,
                      int bf16) {
    int64_t offset = 0;
    for (int s = 0; s < count; s++) {
        int64_t n0 = lo > offset ? lo - offset : 0, n1 = hi - offset < segs[s].n ? hi - offset : segs[s].n;
        if (n0 < n1) (bf16 ? range_bf16 : range_f32)(x, &segs[s], rows, k, n0, n1);
        offset += segs[s].n;
    }
}

#ifdef _OPENMP
/* A thread's share of a call's chunks, [front, back) packed in one word (front << 32 | back),
 * on a cache line of its own. */
typedef struct {
    _Alignas(64) _Atomic uint64_t range;
} Share;

/* The next chunk from the front of `share` (its owner's), or -1 when none is left. */
static int64_t take_front(Share *share) {
    uint64_t range = atomic_load_explicit(&share->range, memory_order_relaxed);
    for (;;) {
        uint64_t front = range >> 32, back = range & 0xffffffffu;
        if (front >= back) return -1;
        if (atomic_compare_exchange_weak(&share->range, &range, ((front + 1) << 32) | back)) return (int64_t)front;
    }
}

/* The last chunk of `share` (taken by a thread that finished its own), or -1 when none is left. */
static int64_t take_back(Share *share) {
    uint64_t range = atomic_load_explicit(&share->range, memory_order_relaxed);
    for (;;) {
        uint64_t front = range >> 32, back = range & 0xffffffffu;
        if (front >= back) return -1;
        if (atomic_compare_exchange_weak(&share->range, &range, (front << 32) | (back - 1))) return (int64_t)back - 1;
    }
}
#endif

/* Outputs per chunk: whole tiles; at one or two rows about CHUNK_BYTES of weights. */
static int64_t chunk_outputs(const Segment *segs, int64_t rows, int64_t k, int dtype) {
    int64_t row_bytes = k * (dtype ? 2 : 4) * (segs[0].w_up ? 2 : 1);
    if (rows > 2 || row_bytes <= 0) return CHUNK_OUTPUTS;
    int64_t outputs = (CHUNK_BYTES / row_bytes + TILE_OUTPUTS - 1) / TILE_OUTPUTS * TILE_OUTPUTS;
    return outputs < TILE_OUTPUTS ? TILE_OUTPUTS : outputs;
}

static void run(const void *x, const Segment *segs, int count, int64_t rows, int64_t k, int dtype, int threads) {
    int64_t total = 0;
    for (int s = 0; s < count; s++) total += segs[s].n;
    int64_t chunk = chunk_outputs(segs, rows, k, dtype), chunks = (total + chunk - 1) / chunk;
    if (threads > chunks) threads = (int)chunks;
    if (threads <= 1 || total < TILE_OUTPUTS * threads) {
        run_share(x, segs, count, rows, k, 0, total, dtype);
        return;
    }
#ifdef _OPENMP
    /* Each thread owns a contiguous run of chunks and takes them in order, so its weights are
     * one stream (the prefetch at the end of a chunk already runs into the next one); a thread
     * done with its own takes chunks from the back of another's, so that a thread the OS
     * deschedules mid-call (a busy machine, or the server's event loop on a core) leaves its
     * work to the others instead of holding the whole call up. */
    Share shares[threads];
    for (int t = 0; t < threads; t++)
        atomic_init(&shares[t].range, ((uint64_t)(chunks * t / threads) << 32) | (uint64_t)(chunks * (t + 1) / threads));
#pragma omp parallel num_threads(threads)
    {
        int me = omp_get_thread_num();
        for (;;) {
            int64_t c = take_front(&shares[me]);
            for (int v = 1; c < 0 && v < threads; v++) c = take_back(&shares[(me + v) % threads]);
            if (c < 0) break;
            run_share(x, segs, count, rows, k, c * chunk, (c + 1) * chunk < total ? (c + 1) * chunk : total, dtype);
        }
    }
#else
    run_share(x, segs, count, rows, k, 0, total, dtype);
#endif
}

/* The vector path this library was built with: 16 floats (AVX-512), 8 (AVX2 with FMA), or 0,
 * the portable loops, which torch's BLAS outruns many times over (`linear.vectorised`). */
int radixserve_linear_vector_width(void) {
#if defined(__AVX512F__)
    return 16;
#elif defined(__AVX2__) && defined(__FMA__)
    return 8;
#else
    return 0;
#endif
}

void radixserve_linear(const void *x, const void *w, const void *bias, void *out, int64_t rows, int64_t k, int64_t n,
                       int dtype, int threads) {
    Segment seg = {w, NULL, bias, NULL, out, n};
    run(x, &seg, 1, rows, k, dtype, threads);
}

/* `count` (<= MAX_SEGMENTS) weights over the same x, each into its own out. */
void radixserve_linear_many(const void *x, int count, const void *const *w, const void *const *bias, void *const *out,
                            const int64_t *n, int64_t rows, int64_t k, int dtype, int threads) {
    Segment segs[MAX_SEGMENTS];
    count = count < MAX_SEGMENTS ? count : MAX_SEGMENTS;
    for (int s = 0; s < count; s++) segs[s] = (Segment){w[s], NULL, bias[s], NULL, out[s], n[s]};
    run(x, segs, count, rows, k, dtype, threads);
}

/* out = silu(x @ w_gate^T + bias_gate) * (x @ w_up^T + bias_up), out [rows, n]. */
void radixserve_gated_linear(const void *x, const void *w_gate, const void *w_up, const void *bias_gate,
                             const void *bias_up, void *out, int64_t rows, int64_t k, int64_t n, int dtype, int threads) {
    Segment seg = {w_gate, w_up, bias_gate, bias_up, out, n};
    run(x, &seg, 1, rows, k, dtype, threads);
}
