/* Next tokens from logits on the CPU: greedy, or temperature, top-k, min-p, top-p and an
 * inverse-transform draw, fused per row. Built by radixserve/native/build.py, called through
 * ctypes by radixserve/native/sampling.py after radixserve/native/checks.py has checked the
 * call (float32 logits with rows of unit stride, one parameter per row, temperature >= 0,
 * u in [0, 1]); the semantics are radixserve/engine/sampler.py's:
 *
 *   x = (logits - max) / T; top-k keeps x >= the k-th largest; p = softmax(x); min-p drops
 *   p < min_p * max p; top-p keeps the most likely tokens until the mass before one reaches
 *   top_p (at least one; ties with the last kept one are kept); the token drawn is the first
 *   whose cumulative mass, in token-id order, exceeds u * total (capped below total).
 *
 * Top-p needs only the tokens near the top: a pass sums the mass of the tokens above a bar
 * (1/16 of the top probability, then 4 times lower each time) until it reaches top_p, and only
 * those candidates are sorted. The draw then runs over the kept tokens alone:
 * the cumulative sum over every token in id order adds zeros elsewhere, which changes nothing
 * in floating point, so both give the same token.
 *
 * radixserve_greedy serves the steps whose rows are all greedy and some constrained by a
 * grammar: each row's mask, maximum and first index of it in one pass (torch.argmax's token).
 */
#include <stdlib.h>

#include "common.h"

typedef struct {
    float p;
    int32_t id;
} Candidate;

static int by_probability_descending(const void *a, const void *b) {
    float x = ((const Candidate *)a)->p, y = ((const Candidate *)b)->p;
    return (x < y) - (x > y);
}

static int by_id(const void *a, const void *b) {
    return ((const Candidate *)a)->id - ((const Candidate *)b)->id;
}

static void insertion_sort(Candidate *items, int64_t n, int (*before)(const void *, const void *)) {
    for (int64_t i = 1; i < n; ++i) {
        Candidate item = items[i];
        int64_t j = i;
        for (; j > 0 && before(&items[j - 1], &item) > 0; --j) items[j] = items[j - 1];
        items[j] = item;
    }
}

/* Most likely first. A handful (the usual case) by insertion; more by an LSD radix sort on
 * the probabilities' bits (p >= 0, so the bits order as the values): linear, so a flat
 * distribution with top_p near 1, which keeps most of the vocabulary, costs a few passes
 * instead of a comparison sort. Ties keep no particular order; equal values sum alike. */
static void sort_descending(Candidate *items, int64_t n, Candidate *temp) {
    if (n <= 32) {
        insertion_sort(items, n, by_probability_descending);
        return;
    }
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t start[257] = {0};
        for (int64_t i = 0; i < n; ++i) {
            uint32_t bits;
            memcpy(&bits, &items[i].p, sizeof bits);
            start[(~bits >> shift & 0xFF) + 1] += 1;
        }
        for (int b = 0; b < 256; ++b) start[b + 1] += start[b];
        for (int64_t i = 0; i < n; ++i) {
            uint32_t bits;
            memcpy(&bits, &items[i].p, sizeof bits);
            temp[start[~bits >> shift & 0xFF]++] = items[i];
        }
        memcpy(items, temp, sizeof(Candidate) * (size_t)n);
    }
}

/* The sum of x[0..n) in LANES partial sums and a fixed tree (so it vectorises). */
static float lane_sum(const float *restrict x, int64_t n) {
    float lane[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; ++j) lane[j] += x[i + j];
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
    float sum = lane[0];
    for (; i < n; ++i) sum += x[i];
    return sum;
}

/* One word of a grammar's token mask on the n <= 32 logits it covers, in place: y[b] becomes
 * -inf where bit b of word is clear (int32 words, bit t % 32 of word t / 32: xgrammar's
 * layout). A select without a branch, so the loop vectorises. */
static inline void mask_word(float *y, uint32_t word, int64_t n) {
    for (int64_t b = 0; b < n; ++b) y[b] = (word >> b) & 1u ? y[b] : -INFINITY;
}

/* The largest value of x[0..n) and whether any is NaN, after a grammar's token mask (NULL:
 * none) is applied to the row in place (mask_word for each word; a word with every bit set,
 * the common case inside a JSON string, writes nothing): the row is read once for both, 32
 * tokens at a time, in 32 lanes (two vectors of independent maxima, so it vectorises). */
static float masked_max_value(float *x, int64_t n, const uint32_t *mask, int *has_nan) {
    float lane[32];
    int nan_lane[32] = {0};
    for (int j = 0; j < 32; ++j) lane[j] = -INFINITY;
    int64_t w = 0;
    for (; w * 32 + 32 <= n; ++w) {
        float *y = x + w * 32;
        if (mask != NULL && mask[w] != 0xFFFFFFFFu) mask_word(y, mask[w], 32);
        for (int b = 0; b < 32; ++b) {
            float v = y[b];
            nan_lane[b] |= v != v;
            lane[b] = v > lane[b] ? v : lane[b];
        }
    }
    float m = -INFINITY;
    int nan = 0;
    for (int j = 0; j < 32; ++j) {
        m = lane[j] > m ? lane[j] : m;
        nan |= nan_lane[j];
    }
    if (mask != NULL && w * 32 < n) mask_word(x + w * 32, mask[w], n - w * 32); /* the last, partial word */
    for (int64_t t = w * 32; t < n; ++t) {
        nan |= x[t] != x[t];
        m = x[t] > m ? x[t] : m;
    }
    *has_nan = nan;
    return m;
}

/* torch.argmax of the row masked by `mask` (NULL: none; see masked_max_value): the first
 * maximum, or the first NaN. */
static int64_t argmax(float *x, int64_t n, const uint32_t *mask) {
    int has_nan;
    float m = masked_max_value(x, n, mask, &has_nan);
    for (int64_t i = 0; i < n; ++i)
        if (has_nan ? x[i] != x[i] : x[i] == m) return i;
    return 0;
}

/* The first index of x[0..n) that holds m, one of the row's values: 32 tokens compared at a
 * time (the loop vectorises), then the index inside the first block that holds it. */
static int64_t first_index_of(const float *x, int64_t n, float m) {
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        int hit = 0;
        for (int b = 0; b < 32; ++b) hit |= x[i + b] == m;
        if (hit) break;
    }
    for (; i < n; ++i)
        if (x[i] == m) return i;
    return 0; /* not reached: m is in the row */
}

/* torch.argmax of the row masked by `mask` (NULL: none; see masked_max_value), or -1 where
 * that argmax would be no token (the row holds a NaN, or every allowed logit is -inf: the
 * torch path flags those rows alike, by the logit it chose). */
static int64_t greedy_token(float *x, int64_t n, const uint32_t *mask) {
    int has_nan;
    float m = masked_max_value(x, n, mask, &has_nan);
    return has_nan || m == -INFINITY ? -1 : first_index_of(x, n, m);
}

/* The k-th largest of values[0..n) (1 <= k <= n); reorders values. */
static float kth_largest(float *values, int64_t n, int64_t k) {
    if (k > n) k = n; /* callers pass k <= n; never read past the values */
    int64_t lo = 0, hi = n - 1, target = k - 1;
    while (lo < hi) {
        float pivot = values[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) { /* descending: larger values to the left */
            while (values[i] > pivot) ++i;
            while (values[j] < pivot) --j;
            if (i <= j) {
                float t = values[i];
                values[i++] = values[j];
                values[j--] = t;
            }
        }
        if (target <= j) hi = j;
        else if (target >= i) lo = i;
        else break;
    }
    return values[target];
}

/* The k-th largest of x[0..n) (x <= 0, max 0; 1 <= k < n). The candidates are the values at
 * or above a bar that starts at -1 and is multiplied by 1.5 until at least k are at or above
 * it (or it passes -2^100: then every value counts, -inf included); only they go to the
 * selection (a few passes over the row instead of a quickselect of all of it). */
static float kth_of_row(const float *restrict x, int64_t n, int64_t k, float *restrict work) {
    float bar = -1.0f;
    for (;;) {
        int64_t above = 0;
        for (int64_t i = 0; i < n; ++i) above += x[i] >= bar;
        if (above >= k || !(bar > -0x1p100f)) break;
        bar *= 1.5f;
    }
    if (!(bar > -0x1p100f)) bar = -INFINITY; /* every value counts, -inf included */
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i)
        if (x[i] >= bar) work[count++] = x[i];
    return kth_largest(work, count, k);
}

/* Filters one row into p (softmax probabilities, dropped tokens 0, not renormalised), after
 * masking it in place by `mask` (NULL: none; see masked_max_value).
 * Returns -1 for non-finite logits, else the number of kept tokens listed in `kept` by id,
 * or 0 when they were not listed (neither top-p nor top-k: the draw scans the whole row). */
static int64_t filter_row(float *restrict logits, int64_t vocab, const uint32_t *mask, float temperature,
                          int64_t top_k, float top_p, float min_p, float *restrict p,
                          float *restrict work, Candidate *restrict kept,
                          Candidate *restrict temp) {
    int has_nan;
    float m = masked_max_value(logits, vocab, mask, &has_nan);
    if (has_nan || isinf(m)) return -1; /* +inf, or every logit -inf: no distribution */
    int64_t i;
    if (top_k > 0 && top_k < vocab) {
        for (i = 0; i < vocab; ++i) p[i] = (logits[i] - m) / temperature;
        float kth = kth_of_row(p, vocab, top_k, work);
        for (i = 0; i < vocab; ++i) p[i] = exp_nonpositive(p[i] < kth ? -INFINITY : p[i]);
    } else {
        for (i = 0; i < vocab; ++i) p[i] = exp_nonpositive((logits[i] - m) / temperature);
    }
    float sum = lane_sum(p, vocab);
    for (i = 0; i < vocab; ++i) p[i] /= sum;
    float largest = 1.0f / sum; /* the top logit's e^0 is exactly 1 */
    if (min_p > 0.0f) {
        float floor_p = min_p * largest;
        for (i = 0; i < vocab; ++i) p[i] = p[i] < floor_p ? 0.0f : p[i];
    }
    if (!(top_p < 1.0f)) {
        if (!(top_k > 0 && top_k < vocab)) return 0;
        int64_t listed = 0; /* top-k kept a few: the draw runs over them alone */
        for (i = 0; i < vocab; ++i)
            if (p[i] > 0.0f) {
                kept[listed].p = p[i];
                kept[listed++].id = (int32_t)i;
            }
        return listed;
    }
    /* Candidates: tokens of at least `bar`, lowered until their mass reaches top_p. Every
     * token below the bar then has at least that mass before it and is dropped. */
    for (float bar = largest * 0x1p-4f, next;; bar = next) {
        next = bar > 0x1p-60f ? bar * 0x1p-2f : 0.0f;
        float mass_lane[LANES] = {0};
        for (i = 0; i + LANES <= vocab; i += LANES)
            for (int j = 0; j < LANES; ++j) mass_lane[j] += p[i + j] >= bar ? p[i + j] : 0.0f;
        float mass = 0.0f;
        for (int j = 0; j < LANES; ++j) mass += mass_lane[j];
        for (; i < vocab; ++i) mass += p[i] >= bar ? p[i] : 0.0f;
        if (mass < top_p && bar > 0.0f) continue;
        int64_t n = 0;
        for (i = 0; i < vocab; i += LANES) { /* skip blocks with no candidate */
            int64_t end = i + LANES < vocab ? i + LANES : vocab;
            int any = 0;
            for (int64_t t = i; t < end; ++t) any |= p[t] >= bar;
            if (!any) continue;
            for (int64_t t = i; t < end; ++t)
                if (p[t] >= bar) {
                    kept[n].p = p[t];
                    kept[n++].id = (int32_t)t;
                }
        }
        sort_descending(kept, n, temp);
        int64_t count = 0;
        float cumulative = 0.0f;
        for (int64_t j = 0; j < n; ++j) {
            cumulative += kept[j].p;
            count += (cumulative - kept[j].p) < top_p;
        }
        if (cumulative < top_p && bar > 0.0f) { /* rounding: the mass fell short; take all */
            next = 0.0f;
            continue;
        }
        float threshold = kept[(count > 1 ? count : 1) - 1].p;
        for (i = 0; i < vocab; ++i) p[i] = p[i] < threshold ? 0.0f : p[i];
        int64_t listed = 0;
        for (int64_t j = 0; j < n; ++j)
            if (kept[j].p >= threshold && kept[j].p > 0.0f) kept[listed++] = kept[j];
        if (listed <= 32) {
            insertion_sort(kept, listed, by_id);
        } else { /* many kept: list them in id order by one pass over the row */
            listed = 0;
            for (i = 0; i < vocab; ++i)
                if (p[i] > 0.0f) {
                    kept[listed].p = p[i];
                    kept[listed++].id = (int32_t)i;
                }
        }
        return listed;
    }
}

/* The token whose cumulative interval, in id order, holds u * total. */
static int64_t draw(const float *p, int64_t vocab, const Candidate *kept, int64_t listed, double u) {
    float total = 0.0f;
    if (listed > 0)
        for (int64_t j = 0; j < listed; ++j) total += kept[j].p;
    else
        for (int64_t i = 0; i < vocab; ++i) total += p[i];
    float x = (float)(u * (double)total);
    float cap = nextafterf(total, 0.0f);
    if (x > cap) x = cap;
    float cumulative = 0.0f;
    int64_t last = 0;
    if (listed > 0) {
        for (int64_t j = 0; j < listed; ++j) {
            cumulative += kept[j].p;
            if (cumulative > x) return kept[j].id;
        }
        return kept[listed - 1].id;
    }
    for (int64_t i = 0; i < vocab; ++i) {
        if (p[i] > 0.0f) last = i;
        cumulative += p[i];
        if (cumulative > x) return i;
    }
    return last;
}

/* Each logits row's grammar mask row, into *out: NULL without a mask (mask NULL or
 * mask_count 0), else a lookup by logits row (mask row i for row mask_rows[i], NULL for rows
 * without one; the caller frees it). Returns -1 when the lookup cannot be allocated. */
static int row_masks(const uint32_t ***out, int64_t rows, const uint32_t *mask, const int64_t *mask_rows,
                     int64_t mask_count, int64_t mask_words) {
    *out = NULL;
    if (mask == NULL || mask_count <= 0) return 0;
    const uint32_t **row_mask = calloc((size_t)rows, sizeof *row_mask);
    if (row_mask == NULL) return -1;
    for (int64_t i = 0; i < mask_count; ++i) row_mask[mask_rows[i]] = mask + i * mask_words;
    *out = row_mask;
    return 0;
}

/* One token per row into tokens[r] (-1: non-finite logits); returns the number of such rows,
 * or -1 (nothing done) when the grammar mask's row lookup cannot be allocated.
 * temperature[r] == 0 is greedy. probs, when not NULL, receives each sampled row's filtered
 * probabilities ([rows, vocab]). scratch: num_threads * 6 * vocab floats (thread t uses slice
 * t: p, the selection's work, then the kept and temp candidate lists of 2 * vocab floats each),
 * so num_threads must be the count the scratch was sized for. With a grammar mask (mask not
 * NULL, mask_count > 0), logits row mask_rows[i] gets mask row i (mask_words words each)
 * applied in place, by the thread that samples it and in the pass that finds the row's
 * maximum (masked_max_value): the row is read once for both. radixserve/native/checks.py has
 * checked that every mask_rows[i] lies in [0, rows). */
int64_t radixserve_sample(float *logits, int64_t row_stride, int64_t rows, int64_t vocab,
                          const float *temperature, const int64_t *top_k, const float *top_p,
                          const float *min_p, const double *u, int64_t *tokens, float *probs,
                          const uint32_t *mask, const int64_t *mask_rows, int64_t mask_count,
                          int64_t mask_words, float *scratch, int num_threads) {
    const uint32_t **row_mask; /* each logits row's mask row, or NULL */
    if (row_masks(&row_mask, rows, mask, mask_rows, mask_count, mask_words) < 0) return -1;
    int64_t failed = 0;
#pragma omp parallel for schedule(dynamic, 8) num_threads(num_threads) if (num_threads > 1) reduction(+ : failed)
    for (int64_t r = 0; r < rows; ++r) {
        float *row = logits + r * row_stride;
        const uint32_t *masked = row_mask != NULL ? row_mask[r] : NULL;
        if (temperature[r] == 0.0f) {
            tokens[r] = argmax(row, vocab, masked);
            continue;
        }
        float *mine = scratch + (int64_t)thread_index() * 6 * vocab;
        float *p = probs ? probs + r * vocab : mine;
        Candidate *kept = (Candidate *)(mine + 2 * vocab);
        int64_t listed = filter_row(row, vocab, masked, temperature[r], top_k[r], top_p[r], min_p[r], p,
                                    mine + vocab, kept, (Candidate *)(mine + 4 * vocab));
        if (listed < 0) {
            tokens[r] = -1;
            failed += 1;
            continue;
        }
        tokens[r] = draw(p, vocab, kept, listed, u[r]);
    }
    free(row_mask);
    return failed;
}

/* The greedy token of every row into tokens[r] (greedy_token: torch.argmax, -1 for a row
 * with a NaN or no allowed finite logit), each masked row masked in place first, in the same
 * pass (as in radixserve_sample: logits row mask_rows[i] gets mask row i). For steps whose
 * rows are all greedy and some constrained: one pass over each row instead of the mask's pass
 * and then torch's argmax. Returns the number of -1 rows, or -1 (nothing done) when the mask's
 * row lookup cannot be allocated. radixserve/native/checks.py has checked the mask against
 * the logits (`token_mask_call`). */
int64_t radixserve_greedy(float *logits, int64_t row_stride, int64_t rows, int64_t vocab, const uint32_t *mask,
                          const int64_t *mask_rows, int64_t mask_count, int64_t mask_words, int64_t *tokens,
                          int num_threads) {
    const uint32_t **row_mask;
    if (row_masks(&row_mask, rows, mask, mask_rows, mask_count, mask_words) < 0) return -1;
    int64_t failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && rows > 1) reduction(+ : failed)
    for (int64_t r = 0; r < rows; ++r) {
        tokens[r] = greedy_token(logits + r * row_stride, vocab, row_mask != NULL ? row_mask[r] : NULL);
        failed += tokens[r] < 0;
    }
    free(row_mask);
    return failed;
}

/* exp_nonpositive over an array (the tests check it against float64 exp). */
void radixserve_exp_nonpositive(const float *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = exp_nonpositive(x[i]);
}

/* A grammar's token mask on one row, in place (mask_word for each word): a word with every
 * bit set (the common case inside a JSON string) is skipped without touching its logits. */
static void mask_row(float *x, int64_t vocab, const uint32_t *mask) {
    for (int64_t w = 0; w * 32 < vocab; ++w)
        if (mask[w] != 0xFFFFFFFFu) mask_word(x + w * 32, mask[w], vocab - w * 32 < 32 ? vocab - w * 32 : 32);
}

/* The grammar mask alone (for rows sampled elsewhere): logits[rows[i]] gets mask row i.
 * radixserve/native/checks.py has checked the rows and sizes (`token_mask_call`). */
void radixserve_apply_token_mask(float *logits, int64_t row_stride, int64_t vocab, const int64_t *rows,
                                 int64_t num_rows, const uint32_t *bitmask, int64_t words) {
    for (int64_t i = 0; i < num_rows; ++i) mask_row(logits + rows[i] * row_stride, vocab, bitmask + i * words);
}
