/* Paged attention on the CPU, read straight from the pages: no gathered copy of K/V.
 *
 * Built at first use by radixserve/native/build.py (the machine's C compiler, -O3
 * -march=native) and called through ctypes by radixserve/native/paged_attention.py. float32,
 * or bfloat16 (dtype 1: q, the caches and out bfloat16; each row converted to float32 as it is
 * read, every sum in float32, the output rounded once). It trusts its inputs: radixserve/native/checks.py refuses, before every call, page
 * indices outside the pool, rows or key ranges out of bounds, and tensors of the wrong dtype,
 * layout or shape.
 *
 * Work item: query row i, every head. Its queries attend over keys lo[i] .. hi[i] - 1 of their
 * sequence, whose pages are kv_indices[page_start[i] ...]; query head j reads KV head
 * j / (Hq / Hkv). Cache layout (FlashInfer's NHD): [num_pages, page_size, Hkv, D], so a key's
 * row of every KV head is contiguous and is read once per item. Only keys in [lo, hi) are
 * read: never-written slots are never touched. Softmax as SDPA's math: scores, their maximum,
 * max-shifted exponentials, normalised. A NaN score (a NaN in q or in a key the head reads)
 * makes the head's output NaN: the maximum skips it, but e^NaN is NaN (exp_nonpositive), so
 * the sum, every weight and the output are NaN. SDPA gives the same NaN for a NaN key; for a
 * NaN query, whose every score is NaN, torch's CPU SDPA returns 0 as for a fully masked row,
 * where this kernel keeps the NaN rather than hide it.
 *
 * The dot products keep 16 independent partial sums in one vector register, reduced by a
 * fixed tree, so they vectorise without letting the compiler reassociate floating-point
 * additions (no -ffast-math). bfloat16 caches on AVX-512 run the same sums 16 keys at a time
 * (attend_part_wide): the same bits, the tree shared by 16 scores.
 */
#include "common.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* GCC/Clang vector types: one register of 16 floats, halves of 8 and 4 for the reduction
 * (memcpy loads them from any address and compiles to plain vector moves). */
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

static inline float dot(const float *a, const float *b, int d) {
    float sum = 0.0f;
    int i = 0;
    if (d >= LANES) {
        vec16 acc = {0}, x, y;
        for (; i + LANES <= d; i += LANES) {
            memcpy(&x, a + i, sizeof x);
            memcpy(&y, b + i, sizeof y);
            acc += x * y;
        }
        vec8 lo, hi;  /* a fixed tree: 16 -> 8 -> 4 -> 1 */
        memcpy(&lo, &acc, sizeof lo);
        memcpy(&hi, (const char *)&acc + sizeof lo, sizeof hi);
        lo += hi;
        vec4 l4, h4;
        memcpy(&l4, &lo, sizeof l4);
        memcpy(&h4, (const char *)&lo + sizeof l4, sizeof h4);
        l4 += h4;
        sum = (l4[0] + l4[2]) + (l4[1] + l4[3]);
    }
    for (; i < d; ++i) sum += a[i] * b[i];
    return sum;
}

/* The cache slot of key t (counted from the first listed page). */
static inline int64_t key_slot(const int32_t *pages, int64_t t, int page_size) {
    return (int64_t)pages[t / page_size] * page_size + t % page_size;
}

/* The row of every KV head of key t (counted from the first listed page). */
static inline const float *key_row(const float *cache, const int32_t *pages, int64_t t,
                                   int page_size, int64_t row_stride) {
    return cache + key_slot(pages, t, page_size) * row_stride;
}

/* The row AHEAD keys on is asked for before it is needed: pages are scattered, so the
 * hardware cannot guess the jump to the next one, and the load overlaps the arithmetic.
 * bfloat16 caches (bf16 != 0): the row is widened into `buf` (exact) and buf returned. */
#define AHEAD 8
static inline __attribute__((always_inline)) const float *prefetched_row(const void *cache, const int32_t *pages,
                                                                        int64_t t, int64_t n, int page_size,
                                                                        int64_t row_stride, int bf16, float *buf) {
    if (!bf16) {
        const float *f = (const float *)cache;
        if (t + AHEAD < n)
            for (int64_t i = 0; i < row_stride; i += LANES)
                __builtin_prefetch(key_row(f, pages, t + AHEAD, page_size, row_stride) + i);
        return key_row(f, pages, t, page_size, row_stride);
    }
    const uint16_t *h = (const uint16_t *)cache;
    if (t + AHEAD < n) {
        const uint16_t *ahead = h + key_slot(pages, t + AHEAD, page_size) * row_stride;
        for (int64_t i = 0; i < row_stride; i += 2 * LANES) __builtin_prefetch(ahead + i);
    }
    const uint16_t *row = h + key_slot(pages, t, page_size) * row_stride;
    for (int64_t i = 0; i < row_stride; ++i) buf[i] = bf16_to_f32(row[i]);
    return buf;
}

/* Keys per work item: a row's keys are split into parts of KEY_PART, each attended on its own
 * and the parts combined, so that one long row spreads over the threads. The split depends
 * on the keys only (never on the thread count or the other rows): a row's output is the same
 * whoever computes it and whatever it is batched with. */
#define KEY_PART 64

/* What a part leaves for the combination: per head its scores' maximum, the sum of e^(score
 * - maximum), and those weights times the values, unnormalised ([Hq], [Hq], [Hq, D]). */
typedef struct {
    float *max, *sum, *acc;
} Partial;

static inline Partial partial_at(float *base, int num_qo_heads, int d) {
    return (Partial){base, base + num_qo_heads, base + 2 * num_qo_heads};
}

/* The largest of n scores, NaNs skipped (-inf when all are NaN): exact in any order, so
 * AVX-512 takes 16 at a time (max_ps(x, m) keeps m where x is NaN, as the comparison does). */
static inline float scores_max(const float *row, int64_t n) {
    float m = -INFINITY;
    int64_t t = 0;
#ifdef __AVX512F__
    if (n >= 16) {
        __m512 lanes = _mm512_set1_ps(-INFINITY);
        for (; t + 16 <= n; t += 16) lanes = _mm512_max_ps(_mm512_loadu_ps(row + t), lanes);
        m = _mm512_reduce_max_ps(lanes);
    }
#endif
    for (; t < n; ++t) m = row[t] > m ? row[t] : m;
    return m;
}

/* sums[h] = row h's n values added one after another in key order, for `heads` rows at once
 * (HEADS, a constant at each call): each sum is one serial chain of additions, so running
 * several side by side is what keeps the adder busy; the order, and so the bits, are each
 * row's own. */
static inline __attribute__((always_inline)) void sum_rows(const float *rows, int64_t n, float *sums, int heads) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t t = 0; t < n; ++t)
        for (int h = 0; h < heads; ++h) s[h] += rows[h * n + t];
    for (int h = 0; h < heads; ++h) sums[h] = s[h];
}

/* Each head's n scores (scores[head * n + t]) -> e^(score - the head's maximum), in place;
 * the maximum and the exponentials' sum go to `part`. The exponentials are elementwise, so
 * their loop vectorises; each head's sum stays one float32 sum in key order (sum_rows). */
static inline void exponentiate_scores(float *scores, int64_t n, Partial part, int num_qo_heads) {
    for (int head = 0; head < num_qo_heads; ++head) {
        float *row = scores + head * n;
        float m = scores_max(row, n);
        for (int64_t t = 0; t < n; ++t) row[t] = exp_nonpositive(row[t] - m);
        part.max[head] = m;
    }
    int head = 0;
    for (; head + 4 <= num_qo_heads; head += 4) sum_rows(scores + head * n, n, part.sum + head, 4);
    for (; head < num_qo_heads; ++head) sum_rows(scores + head * n, n, part.sum + head, 1);
}

#ifdef __AVX512F__
/* 16 floats of a cache row from element i: float32, or bfloat16 widened exactly. */
static inline __attribute__((always_inline)) __m512 row16(const void *row, int64_t i, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)row + i);
    __m256i halves = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

/* The sums of 16 partial-sum vectors, key t's in lane t, each added up by dot()'s own tree
 * (lanes j and j + 8, then j and j + 4, then (0 + 2) + (1 + 3)), so every score has the bits
 * dot() gives it: the tree's levels run on four keys' lanes per instruction instead of one. */
static inline __attribute__((always_inline)) __m512 sums16(const __m512 acc[16]) {
    __m512 halves[8], quarters[4], pairs[2];
    for (int p = 0; p < 8; ++p) /* [a.lo + a.hi | b.lo + b.hi] for keys 2p, 2p + 1 */
        halves[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0x44),
                                  _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0xEE));
    for (int p = 0; p < 4; ++p) /* 128-bit lane j: key 4p + j, its lanes j and j + 4 added */
        quarters[p] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * p], halves[2 * p + 1], 0x88),
                                    _mm512_shuffle_f32x4(halves[2 * p], halves[2 * p + 1], 0xDD));
    for (int p = 0; p < 2; ++p) /* per key (0 + 2) and (1 + 3) */
        pairs[p] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * p], quarters[2 * p + 1], 0x44),
                                 _mm512_shuffle_ps(quarters[2 * p], quarters[2 * p + 1], 0xEE));
    __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
    /* element 4j + m now holds key j + 4m */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sums);
}

/* Query heads that share one pass over their KV head's values (4 x 4 vectors of sums fit
 * the 32 registers beside the value rows). */
#define VALUE_HEADS 4

/* out[h * d + 16 c + lane] = sum over keys t, in key order, of weights[h * n_stride + t] times
 * value t's element column + 16 c + lane, for `heads` query heads and `vectors` blocks of 16
 * (both constants at every call): each value row is read and widened once for all the heads. */
static inline __attribute__((always_inline)) void value_sums(const void *v_cache, const int32_t *pages, int64_t start,
                                                             int64_t n, int page_size, int64_t row_stride,
                                                             int64_t column, const float *weights, int64_t n_stride,
                                                             float *out, int d, int heads, int vectors, int bf16) {
    int64_t size = bf16 ? 2 : 4;
    __m512 acc[VALUE_HEADS][4];
    for (int h = 0; h < heads; ++h)
        for (int c = 0; c < vectors; ++c) acc[h][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; ++t) {
        const char *v = (const char *)v_cache + (key_slot(pages, start + t, page_size) * row_stride + column) * size;
        __m512 values[4];
        for (int c = 0; c < vectors; ++c) values[c] = row16(v, 16 * c, bf16);
        for (int h = 0; h < heads; ++h) {
            __m512 p = _mm512_set1_ps(weights[h * n_stride + t]);
            for (int c = 0; c < vectors; ++c) acc[h][c] = _mm512_fmadd_ps(p, values[c], acc[h][c]);
        }
    }
    for (int h = 0; h < heads; ++h)
        for (int c = 0; c < vectors; ++c) _mm512_storeu_ps(out + (int64_t)h * d + 16 * c, acc[h][c]);
}

/* attend_part for bfloat16 caches where D is a multiple of 16, with the same bits as the
 * per-key path over the widened rows: each score by dot()'s products and tree (sums16), each
 * value sum in key order. Scores go 16 keys at a time per head (the keys' rows stay in the L1
 * cache across the heads, widened in registers, and one tree serves 16 scores), values for up
 * to four query heads of a KV head and 64 dimensions at a time in registers (value_sums: each
 * value row read and widened once per KV head, not once per query head). With half float32's bytes per key,
 * bfloat16 attention is bound by that arithmetic, which this halves; float32 keeps the per-key
 * path, whose prefetch one key at a time keeps more of its (twice as many) bytes in flight
 * (docs/benchmark.md). This block's V rows go to the L2 cache while its scores are computed. */
static inline __attribute__((always_inline)) void attend_part_wide(const float *q, const void *k_cache,
                                                                   const void *v_cache, const int32_t *pages,
                                                                   int64_t start, int64_t n, int64_t end,
                                                                   Partial part, int num_qo_heads, int num_kv_heads,
                                                                   int d, int page_size, float scale,
                                                                   float *scores, int bf16) {
    int group = num_qo_heads / num_kv_heads;
    int64_t row_stride = (int64_t)num_kv_heads * d, size = bf16 ? 2 : 4;
    const char *k_rows[16];
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
        int count = n - t0 < 16 ? (int)(n - t0) : 16;
        for (int u = 0; u < count; ++u) {
            int64_t t = start + t0 + u, ahead = t + 16;
            int64_t offset = key_slot(pages, t, page_size) * row_stride * size;
            k_rows[u] = (const char *)k_cache + offset;
            for (int64_t b = 0; b < row_stride * size; b += 64) _mm_prefetch((const char *)v_cache + offset + b, _MM_HINT_T1);
            if (ahead < end) {
                const char *next = (const char *)k_cache + key_slot(pages, ahead, page_size) * row_stride * size;
                for (int64_t b = 0; b < row_stride * size; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
            }
        }
        for (int kv_head = 0, head = 0; kv_head < num_kv_heads; ++kv_head)
            for (int g = 0; g < group; ++g, ++head) {
                __m512 acc[16];
                for (int u = 0; u < 16; ++u) acc[u] = _mm512_setzero_ps();
                for (int i = 0; i < d; i += 16) {
                    __m512 qv = _mm512_loadu_ps(q + (int64_t)head * d + i);
                    for (int u = 0; u < count; ++u)
                        acc[u] = _mm512_fmadd_ps(qv, row16(k_rows[u], (int64_t)kv_head * d + i, bf16), acc[u]);
                }
                __m512 s = _mm512_mul_ps(sums16(acc), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(scores + head * n + t0, (__mmask16)((1u << count) - 1u), s);
            }
    }
    exponentiate_scores(scores, n, part, num_qo_heads);
    for (int kv_head = 0; kv_head < num_kv_heads; ++kv_head)
        for (int g = 0; g < group; g += VALUE_HEADS) {
            int head = kv_head * group + g, heads = group - g < VALUE_HEADS ? group - g : VALUE_HEADS;
            for (int i0 = 0; i0 < d; i0 += 64) {
                const float *w = scores + (int64_t)head * n;
                float *out = part.acc + (int64_t)head * d + i0;
                int64_t column = (int64_t)kv_head * d + i0;
                if (d - i0 < 64) { /* a tail of 16, 32 or 48 dimensions: one head at a time */
                    for (int h = 0; h < heads; ++h)
                        value_sums(v_cache, pages, start, n, page_size, row_stride, column, w + h * n, n, out + h * d,
                                   d, 1, (d - i0) / 16, bf16);
                    continue;
                }
                switch (heads) { /* constants, so the 4 x 4 sums stay in registers */
                case 1: value_sums(v_cache, pages, start, n, page_size, row_stride, column, w, n, out, d, 1, 4, bf16); break;
                case 2: value_sums(v_cache, pages, start, n, page_size, row_stride, column, w, n, out, d, 2, 4, bf16); break;
                case 3: value_sums(v_cache, pages, start, n, page_size, row_stride, column, w, n, out, d, 3, 4, bf16); break;
                default: value_sums(v_cache, pages, start, n, page_size, row_stride, column, w, n, out, d, 4, 4, bf16);
                }
            }
        }
}
#endif

/* Keys [first, last) of one query row (counted from the row's first key, lo), all heads: keys
 * are read once each, a whole row (every KV head) at a time. pages: the row's list from its
 * first page; q: the row's float32 query (the caller widens bfloat16 ones); buf holds one
 * widened K or V row (bfloat16 caches). */
static inline __attribute__((always_inline)) void attend_part(const float *q, const void *k_cache, const void *v_cache,
                                                              const int32_t *pages, int64_t lo, int64_t first,
                                                              int64_t last, Partial part, int num_qo_heads,
                                                              int num_kv_heads, int d, int page_size, float scale,
                                                              float *scores, int bf16, float *buf) {
    int64_t n = last - first, end = lo % page_size + last;
    int group = num_qo_heads / num_kv_heads;
    int64_t row_stride = (int64_t)num_kv_heads * d;
    pages += lo / page_size; /* key t of this row is key lo + t: start at lo's page */
    int64_t start = lo % page_size + first;
#ifdef __AVX512F__
    if (bf16 && d % 16 == 0) {
        attend_part_wide(q, k_cache, v_cache, pages, start, n, end, part, num_qo_heads, num_kv_heads, d, page_size,
                         scale, scores, 1); /* a constant: the widening folds in */
        return;
    }
#endif
    for (int64_t t = 0; t < n; ++t) {
        const float *k = prefetched_row(k_cache, pages, start + t, end, page_size, row_stride, bf16, buf);
        for (int kv_head = 0, head = 0; kv_head < num_kv_heads; ++kv_head)
            for (int g = 0; g < group; ++g, ++head)
                scores[head * n + t] = dot(q + (int64_t)head * d, k + (int64_t)kv_head * d, d) * scale;
    }
    exponentiate_scores(scores, n, part, num_qo_heads);
    memset(part.acc, 0, sizeof(float) * (size_t)num_qo_heads * d);
    for (int64_t t = 0; t < n; ++t) {
        const float *v = prefetched_row(v_cache, pages, start + t, end, page_size, row_stride, bf16, buf);
        for (int kv_head = 0, head = 0; kv_head < num_kv_heads; ++kv_head)
            for (int g = 0; g < group; ++g, ++head) {
                float p = scores[head * n + t];
                const float *vh = v + (int64_t)kv_head * d;
                float *a = part.acc + (int64_t)head * d;
                for (int j = 0; j < d; ++j) a[j] += p * vh[j];
            }
    }
}

/* out (float32 [Hq, D]) <- the softmax-weighted values of a row from its `count` parts, in
 * order: each part's sums rescaled from its maximum to the row's. A NaN anywhere in a head's
 * parts makes its output NaN. */
static inline void combine_parts(const float *partials, int64_t count, float *out, int num_qo_heads, int d) {
    int64_t stride = (int64_t)num_qo_heads * (d + 2);
    for (int head = 0; head < num_qo_heads; ++head) {
        float m = -INFINITY;
        for (int64_t p = 0; p < count; ++p) {
            float part_max = partials[p * stride + head];
            m = part_max > m ? part_max : m;
        }
        float *o = out + (int64_t)head * d, total = 0.0f;
        for (int j = 0; j < d; ++j) o[j] = 0.0f;
        for (int64_t p = 0; p < count; ++p) {
            Partial part = partial_at((float *)partials + p * stride, num_qo_heads, d);
            float w = exp_nonpositive(part.max[head] - m);
            total += w * part.sum[head];
            const float *a = part.acc + (int64_t)head * d;
            for (int j = 0; j < d; ++j) o[j] += w * a[j];
        }
        float inv = 1.0f / total;
        for (int j = 0; j < d; ++j) o[j] *= inv;
    }
}

/* Returns 0, or -1 when the heads cannot be grouped (the binding's checks refuse that first).
 * scratch: num_threads * Hq * (min(max_keys, KEY_PART) + 3 * D) floats (per thread: a part's
 * scores, the widened query and one K/V row for bfloat16, the output), then num_rows *
 * ceil(max_keys / KEY_PART) * Hq * (D + 2) floats for the parts; max_keys >= every hi - lo;
 * thread t uses slice t, so num_threads must be the count the scratch was sized for. dtype 0:
 * float32, 1: bfloat16. */
int radixserve_paged_attention(const void *q, const void *k_cache, const void *v_cache,
                               const int32_t *kv_indices, const int64_t *rows,
                               const int64_t *page_start, const int64_t *lo, const int64_t *hi,
                               int64_t num_rows, int num_qo_heads, int num_kv_heads,
                               int head_dim, int page_size, float scale, int64_t max_keys,
                               void *out, float *scratch, int num_threads, int dtype) {
    if (num_kv_heads < 1 || num_qo_heads % num_kv_heads != 0) return -1;
    int64_t width = (int64_t)num_qo_heads * head_dim;
    max_keys = max_keys > 1 ? max_keys : 1;
    int64_t part_keys = max_keys < KEY_PART ? max_keys : KEY_PART, parts = (max_keys + KEY_PART - 1) / KEY_PART;
    int64_t per_thread = (int64_t)num_qo_heads * (part_keys + 3 * head_dim), stride = width + 2 * num_qo_heads;
    float *partials = scratch + num_threads * per_thread;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *scores = scratch + thread_index() * per_thread;
        float *query = scores + (int64_t)num_qo_heads * part_keys, *buf = query + width, *combined = buf + width;
        /* Items: (row, part) over a rectangle of num_rows x parts; a row with fewer keys
         * skips the parts past its end. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_rows * parts; ++item) {
            int64_t i = item / parts, first = item % parts * KEY_PART, n = hi[i] - lo[i];
            if (first >= n) continue; /* every row has a key (hi > lo): part 0 always runs */
            int64_t last = first + KEY_PART < n ? first + KEY_PART : n;
            const float *row_q = (const float *)q + rows[i] * width;
            if (dtype != 0) {
                const uint16_t *qh = (const uint16_t *)q + rows[i] * width;
                for (int64_t j = 0; j < width; ++j) query[j] = bf16_to_f32(qh[j]);
                row_q = query;
            }
            attend_part(row_q, k_cache, v_cache, kv_indices + page_start[i], lo[i], first, last,
                        partial_at(partials + item * stride, num_qo_heads, head_dim), num_qo_heads, num_kv_heads,
                        head_dim, page_size, scale, scores, dtype != 0, buf);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_rows; ++i) {
            int64_t count = (hi[i] - lo[i] + KEY_PART - 1) / KEY_PART;
            if (dtype == 0) {
                combine_parts(partials + i * parts * stride, count, (float *)out + rows[i] * width, num_qo_heads,
                              head_dim);
            } else {
                combine_parts(partials + i * parts * stride, count, combined, num_qo_heads, head_dim);
                uint16_t *oh = (uint16_t *)out + rows[i] * width;
                for (int64_t j = 0; j < width; ++j) oh[j] = f32_to_bf16(combined[j]);
            }
        }
    }
    return 0;
}
