/* All of a step's Gemma 3 decoder layers in one call (`pd/models/native_decoder.py`): the
 * kernels a native layer plan (pd/models/native_layers.py) calls one at a time from Python,
 * called here in the same order on the same inputs, so the bytes are the plans'. Each kernel
 * lives in its own library (fused.c, gguf_linear.c, paged_attention.c) and is reached through
 * the function pointer Python read from it; nothing here computes. What this saves is Python
 * between the kernels: ~12 calls a layer, each with its tensors made and its arguments
 * converted by ctypes.
 *
 * Per layer, for tokens x (T x hidden, the previous layer's output):
 *   h = rms(x); qkv = qkv_proj(h); q, k = qk_norm_rope(qkv); the K/V rows written into the
 *   layer's cache (v: qkv's last kv_heads x D columns); a = attention(q); o = o_proj(a);
 *   x1 = rms(o) + x; h = rms(x1); g = gate_up_proj(h); m = act(g[:, :I]) g[:, I:];
 *   d = down_proj(m); out = rms(d) + x1.
 * The buffers are the caller's: x1 goes to `x1` and out to `out` in every layer, so a layer
 * reads its input from `out` after the first (x1 is written before out is, and out only once
 * x is no longer read).
 */
#include <stddef.h>
#include <stdint.h>

typedef int (*rms_norm_fn)(const void *x, int64_t x_stride, const void *residual, int64_t residual_stride,
                           void *out, int64_t out_stride, const float *weight, int64_t rows, int64_t cols,
                           float eps, int64_t threads);
typedef int (*qk_norm_rope_fn)(const void *qkv, int64_t qkv_stride, int64_t tokens, int64_t q_heads,
                               int64_t k_heads, int64_t D, const float *q_weight, const float *k_weight,
                               float eps, const int64_t *positions, const float *cos_table,
                               const float *sin_table, int64_t rot, int64_t table_rows, void *q_out,
                               void *k_out, int64_t threads);
typedef int (*act_mul_fn)(const void *x, int64_t x_stride, void *out, int64_t out_stride, int64_t rows,
                          int64_t inter, int64_t act, int64_t threads);
typedef int (*segments_fn)(const void *x, int64_t x_stride, int64_t rows, int64_t k, int64_t n_seg,
                           const uint8_t *const *w, const int64_t *n_out, const int64_t *bs,
                           const int64_t *scales, const int64_t *bits, const int64_t *first, void *out,
                           int64_t out_stride, int64_t threads);
typedef int (*write_kv_fn)(const char *key, const char *value, int64_t s_key, int64_t s_value, char *cache,
                           int64_t s_block, int64_t s_kv, int64_t s_slot, int64_t s_head,
                           const int64_t *blocks, const int64_t *offsets, int64_t tokens, int64_t kv_heads,
                           int64_t row_bytes);
typedef int (*attention_fn)(const void *q, void *out, const void *cache, int64_t s_block, int64_t s_kv,
                            int64_t s_slot, int64_t s_head, const int32_t *table, int64_t s_row,
                            int64_t table_rows, const int64_t *tiles, int64_t n_tiles, int64_t max_tile,
                            int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                            int64_t block_size, int64_t window, float scale, float *scratch, int64_t max_span,
                            int64_t threads);

/* The kernels, for the model's dtype. */
typedef struct {
    rms_norm_fn rms_norm;
    qk_norm_rope_fn qk_norm_rope;
    act_mul_fn act_mul;
    segments_fn segments;
    write_kv_fn write_kv;
    attention_fn attention;
} Kernels;

/* One GGUF linear: gguf_segments' arguments that do not change (`SegmentsCall`'s). */
typedef struct {
    int64_t in_features, out_features, n_seg;
    const uint8_t *const *weights;
    const int64_t *n_out, *bs, *scales, *bits, *first;
} Linear;

/* One layer's weights and cache. Norms: input, post-attention, pre- and post-feedforward. */
typedef struct {
    Linear qkv, o, gate_up, down;
    const float *norm[4];
    float eps[4];
    const float *q_norm, *k_norm; /* NULL: not normed */
    float qk_eps;
    const float *cos, *sin; /* (table_rows, rot) float32 */
    int64_t rot, table_rows;
    void *cache;              /* (blocks, 2, block_size, kv_heads, D) */
    int64_t cache_strides[4]; /* elements: block, k or v, slot, head */
    int64_t group;            /* its KV cache group: index into the step's groups */
    int64_t window;           /* 0: none */
    float scale;
} Layer;

/* A KV cache group's attention metadata for this step (`NativeTiles`, the slots). */
typedef struct {
    const int32_t *table;
    int64_t table_cols, table_rows;
    const int64_t *tiles;
    int64_t n_tiles, max_tile, max_span;
    const int64_t *slot_blocks, *slot_offsets;
    float *scratch;
} Group;

/* The model's sizes. */
typedef struct {
    int64_t hidden, heads, kv_heads, head_size, inter, act, block_size, element_size;
} Shape;

/* The step's buffers, rows of T: h (hidden), qkv, q (heads D), k (kv_heads D), a (heads D),
 * o (hidden), x1 (hidden), g (2 inter), m (inter), d (hidden), out (hidden). */
typedef struct {
    void *h, *qkv, *q, *k, *a, *o, *x1, *g, *m, *d, *out;
} Buffers;

static inline int linear(const Kernels *kn, const Linear *l, const void *x, int64_t rows, void *out,
                         int64_t threads) {
    return kn->segments(x, l->in_features, rows, l->in_features, l->n_seg, l->weights, l->n_out, l->bs,
                        l->scales, l->bits, l->first, out, l->out_features, threads);
}

/* 0, or where it stopped: 16 * (layer + 1) + the kernel (1 qkv, 2 q/k norm and rope, 3 the
 * KV write, 4 attention, 5 o, 6 gate/up, 7 act, 8 down, 9 a norm). */
int decoder_layers(const Kernels *kn, const Shape *s, const Layer *layers, int64_t n_layers, const Group *groups,
                   const void *x, const int64_t *positions, int64_t tokens, const Buffers *b, int64_t threads) {
    const int64_t H = s->hidden, D = s->head_size, qkv_width = (s->heads + 2 * s->kv_heads) * D;
    const int64_t es = s->element_size;
    for (int64_t i = 0; i < n_layers; i++) {
        const Layer *L = layers + i;
        const Group *G = groups + L->group;
        const void *in = i == 0 ? x : b->out;
        const int base = 16 * (int)(i + 1);
        if (kn->rms_norm(in, H, NULL, 0, b->h, H, L->norm[0], tokens, H, L->eps[0], threads)) return base + 9;
        if (linear(kn, &L->qkv, b->h, tokens, b->qkv, threads)) return base + 1;
        if (kn->qk_norm_rope(b->qkv, qkv_width, tokens, s->heads, s->kv_heads, D, L->q_norm, L->k_norm, L->qk_eps,
                             positions, L->cos, L->sin, L->rot, L->table_rows, b->q, b->k, threads))
            return base + 2;
        const char *v = (const char *)b->qkv + (s->heads + s->kv_heads) * D * es;
        if (kn->write_kv(b->k, v, s->kv_heads * D * es, qkv_width * es, L->cache, L->cache_strides[0] * es,
                         L->cache_strides[1] * es, L->cache_strides[2] * es, L->cache_strides[3] * es,
                         G->slot_blocks, G->slot_offsets, tokens, s->kv_heads, D * es))
            return base + 3;
        if (kn->attention(b->q, b->a, L->cache, L->cache_strides[0], L->cache_strides[1], L->cache_strides[2],
                          L->cache_strides[3], G->table, G->table_cols, G->table_rows, G->tiles, G->n_tiles,
                          G->max_tile, tokens, s->heads, s->kv_heads, D, s->block_size, L->window, L->scale,
                          G->scratch, G->max_span, threads))
            return base + 4;
        if (linear(kn, &L->o, b->a, tokens, b->o, threads)) return base + 5;
        if (kn->rms_norm(b->o, H, in, H, b->x1, H, L->norm[1], tokens, H, L->eps[1], threads)) return base + 9;
        if (kn->rms_norm(b->x1, H, NULL, 0, b->h, H, L->norm[2], tokens, H, L->eps[2], threads)) return base + 9;
        if (linear(kn, &L->gate_up, b->h, tokens, b->g, threads)) return base + 6;
        if (kn->act_mul(b->g, 2 * s->inter, b->m, s->inter, tokens, s->inter, s->act, threads)) return base + 7;
        if (linear(kn, &L->down, b->m, tokens, b->d, threads)) return base + 8;
        if (kn->rms_norm(b->d, H, b->x1, H, b->out, H, L->norm[3], tokens, H, L->eps[3], threads)) return base + 9;
    }
    return 0;
}
