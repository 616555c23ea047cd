/* Every decoder layer of a Llama-family model over one decode step, in one call.
 *
 * A decode step at a few rows spends as much time between the kernels as in them: per layer a
 * Python forward makes about ten calls (norms, q/k/v, RoPE, the K/V write, attention, o, the
 * gated MLP, down, the residual add), each with its checks, its output tensor and its ctypes
 * call. This file runs the same kernels in the same order from C, layer after layer, with the
 * step's buffers allocated once: the results are the Python forward's bit for bit (each kernel
 * is the very function the per-op path calls, with the same arguments and thread count; the K/V
 * write is a copy and the residual add one float addition per element, as in torch).
 *
 * It takes steps where every row decodes (one new token per sequence, attention by the paged
 * kernel); the binding (decoder.py) checks everything before C runs. dtype 0: float32; 1:
 * bfloat16 (x, weights, caches, cos/sin and workspace; each kernel rounds where it does when
 * called alone, and the residual add rounds its sum once, as torch's bfloat16 add does).
 */
#include "fused_ops.c"
#include "linear.c"
#include "paged_attention.c"

/* One layer's tensors, as pointers in this order (biases NULL when the model has none). */
enum {
    INPUT_NORM, Q_WEIGHT, K_WEIGHT, V_WEIGHT, Q_BIAS, K_BIAS, V_BIAS, O_WEIGHT, O_BIAS,
    POST_NORM, GATE_WEIGHT, UP_WEIGHT, GATE_BIAS, UP_BIAS, DOWN_WEIGHT, DOWN_BIAS, K_CACHE, V_CACHE,
    LAYER_POINTERS
};

/* The decode rows of one attention window (see paged_attention.c), planned once per step. */
typedef struct {
    const int32_t *kv_indices;
    const int64_t *rows, *page_start, *lo, *hi;
    int64_t count, max_keys;
} RowSet;

/* The model's shape and the step's constants. */
typedef struct {
    int64_t hidden, q_heads, kv_heads, head_dim, intermediate, page_size;
    float eps, scale;
} Dims;

/* x [tokens, hidden]: the residual stream, updated in place through every layer.
 * layers: num_layers * LAYER_POINTERS pointers; row_set_of_layer[l]: which of row_sets layer l
 * attends with (its window). cos, sin [tokens, head_dim]; slots [tokens]: each token's flat K/V
 * slot (page * page_size + offset). workspace: tokens * (3 * hidden + 2 * q_heads * head_dim
 * + 2 * kv_heads * head_dim + intermediate) elements of the dtype; scratch: the attention
 * kernel's, for `threads` threads and `tokens` rows at the largest max_keys. final_norm: the
 * model's last norm weight [hidden], or NULL; given, normed [tokens, hidden] receives every row
 * of x through it after the last layer (the LM head's input: at a decode step every row yields
 * logits). */
void radixserve_decoder_layers(void *x, int64_t tokens, const void *const *layers, int64_t num_layers,
                               const RowSet *row_sets, const int64_t *row_set_of_layer, const void *cos,
                               const void *sin, const int64_t *slots, const Dims *dims, void *workspace,
                               float *scratch, int threads, int dtype, const void *final_norm, void *normed_out) {
    int64_t hidden = dims->hidden, q_width = dims->q_heads * dims->head_dim;
    int64_t kv_width = dims->kv_heads * dims->head_dim;
    size_t size = dtype ? 2 : 4; /* bytes per element */
    char *normed = workspace, *q = normed + tokens * hidden * size, *k = q + tokens * q_width * size;
    char *v = k + tokens * kv_width * size, *attended = v + tokens * kv_width * size;
    char *projected = attended + tokens * q_width * size, *gated = projected + tokens * hidden * size;
    char *down = gated + tokens * dims->intermediate * size;
    size_t kv_row = (size_t)kv_width * size;
    for (int64_t l = 0; l < num_layers; ++l) {
        const void *const *w = layers + l * LAYER_POINTERS;
        char *k_cache = (char *)w[K_CACHE], *v_cache = (char *)w[V_CACHE];
        radixserve_add_rms_norm(x, NULL, w[INPUT_NORM], normed, tokens, hidden, dims->eps, dtype, threads);
        const void *qkv_weights[3] = {w[Q_WEIGHT], w[K_WEIGHT], w[V_WEIGHT]};
        const void *qkv_biases[3] = {w[Q_BIAS], w[K_BIAS], w[V_BIAS]};
        void *qkv_out[3] = {q, k, v};
        const int64_t qkv_sizes[3] = {q_width, kv_width, kv_width};
        radixserve_linear_many(normed, 3, qkv_weights, qkv_biases, qkv_out, qkv_sizes, tokens, hidden, dtype, threads);
        radixserve_rope(q, k, cos, sin, tokens, dims->q_heads, dims->kv_heads, dims->head_dim, q_width, kv_width,
                        dtype, threads);
        for (int64_t t = 0; t < tokens; ++t) {
            memcpy(k_cache + slots[t] * kv_row, k + t * kv_row, kv_row);
            memcpy(v_cache + slots[t] * kv_row, v + t * kv_row, kv_row);
        }
        const RowSet *rs = &row_sets[row_set_of_layer[l]];
        /* As the binding runs it: no more threads than parts of rows (a spare one would only wait). */
        int64_t parts = rs->count * (((rs->max_keys > 1 ? rs->max_keys : 1) + KEY_PART - 1) / KEY_PART);
        int attention_threads = threads < parts ? threads : (int)parts;
        radixserve_paged_attention(q, k_cache, v_cache, rs->kv_indices, rs->rows, rs->page_start, rs->lo, rs->hi,
                                   rs->count, (int)dims->q_heads, (int)dims->kv_heads, (int)dims->head_dim,
                                   (int)dims->page_size, dims->scale, rs->max_keys, attended, scratch,
                                   attention_threads, dtype);
        radixserve_linear(attended, w[O_WEIGHT], w[O_BIAS], projected, tokens, q_width, hidden, dtype, threads);
        radixserve_add_rms_norm(x, projected, w[POST_NORM], normed, tokens, hidden, dims->eps, dtype, threads);
        radixserve_gated_linear(normed, w[GATE_WEIGHT], w[UP_WEIGHT], w[GATE_BIAS], w[UP_BIAS], gated, tokens, hidden,
                                dims->intermediate, dtype, threads);
        radixserve_linear(gated, w[DOWN_WEIGHT], w[DOWN_BIAS], down, tokens, dims->intermediate, hidden, dtype,
                          threads);
        if (dtype == 0) {
            float *xf = x;
            const float *df = (const float *)down;
            for (int64_t i = 0; i < tokens * hidden; ++i) xf[i] += df[i];
        } else {
            uint16_t *xh = x;
            const uint16_t *dh = (const uint16_t *)down;
            for (int64_t i = 0; i < tokens * hidden; ++i) xh[i] = f32_to_bf16(bf16_to_f32(xh[i]) + bf16_to_f32(dh[i]));
        }
    }
    if (final_norm) radixserve_add_rms_norm(x, NULL, final_norm, normed_out, tokens, hidden, dims->eps, dtype, threads);
}
