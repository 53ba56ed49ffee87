/* Paged attention on CPU, read straight from the paged KV cache: a whole step's queries
 * (prefill chunks and decodes alike) in one call, no gather, no copy, no mask. Each
 * visible key and value row is widened to float32 as it is used; scores, softmax and the
 * weighted sum are float32. Only positions a query sees are weighed, and only positions
 * some query of its tile sees are read, so unwritten or stale slots are never touched.
 *
 * The work comes as tiles: `m` consecutive query tokens of one request (a decode is a
 * tile of one), at positions pos .. pos + m - 1, token t seeing keys
 * [max(0, pos + t - window + 1), pos + t] (window 0: from 0). A tile's keys are read
 * once for its m x group query vectors, so a prefill chunk widens each key row
 * 1 / (tile size) times per query token, not once per token.
 *
 * Layouts (element strides, the last dim contiguous):
 *   q, out    (num_tokens, num_heads, head_size) in the cache's dtype; query heads h*group ..
 *             h*group+group-1 share KV head h; tile i covers tokens tiles[4i] ..
 *             tiles[4i] + tiles[4i+1] - 1, reads block-table row tiles[4i+2], and its
 *             first token is at position tiles[4i+3];
 *   cache     one layer's view: [block][k or v][slot][kv head][head_size];
 *   table     int32 block table (table_rows, s_row), column p / block_size;
 *   scratch   float32, (max_tile * group * (max_span + 2 * head_size) + 4 * head_size) for each of
 *             `threads` threads, max_span >= any tile's span of keys.
 * Tiles are checked against these bounds first (status 1 if one is out). (tile, KV head)
 * pairs are handed out one at a time (their costs differ: a decode against a prefill
 * tile) to `threads` OpenMP threads (never more: the scratch has that many
 * shares). Loaded into a process that has torch, the kernel shares torch's OpenMP runtime
 * (same soname), so these are torch's threads. Rows are taken four at a time so that four
 * independent sums are in flight.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define PREFETCH_AHEAD 16

/* 16 float32 lanes (one AVX-512 register; two or four narrower ones elsewhere). */
typedef float f32x16 __attribute__((vector_size(64)));

static inline f32x16 load16(const float *p) {
    f32x16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, f32x16 v) { memcpy(p, &v, sizeof v); }

static inline float sum16(f32x16 v) {
    float total = 0.0f;
    for (int i = 0; i < 16; i++) total += v[i];
    return total;
}

#define DEFINE_PAGED_ATTENTION(NAME, T, WIDEN, STORE, ROUND)                                                     \
    static inline const T *NAME##_row(const T *cache, const int32_t *blocks, int64_t p,           \
                                      int64_t bs, int64_t s_block, int64_t s_slot) {              \
        return cache + blocks[p / bs] * s_block + (p % bs) * s_slot;                              \
    }                                                                                             \
                                                                                                  \
    /* Widen `count` rows from position first + t into `rows` (float32, D apart), and ask   \
     * for the 4 rows PREFETCH_AHEAD positions later: rows sit in scattered blocks, so the    \
     * hardware prefetcher loses the stream at each block boundary. */                         \
    static inline void NAME##_widen(const T *base, const int32_t *blocks, int64_t first,         \
                                    int64_t t, int64_t count, int64_t nk, int64_t D, int64_t bs, \
                                    int64_t s_block, int64_t s_slot, float *rows) {              \
        for (int64_t i = 0; t + PREFETCH_AHEAD + 4 <= nk && i < 4; i++) {                         \
            const char *ahead = (const char *)NAME##_row(base, blocks, first + t + PREFETCH_AHEAD + i, \
                                                         bs, s_block, s_slot);                   \
            for (int64_t b = 0; b < D * (int64_t)sizeof(T); b += 64) __builtin_prefetch(ahead + b); \
        }                                                                                         \
        for (int64_t i = 0; i < count; i++) {                                                     \
            const T *row = NAME##_row(base, blocks, first + t + i, bs, s_block, s_slot);          \
            for (int64_t d = 0; d < D; d++) rows[i * D + d] = WIDEN(row, d);                      \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* Scores of m tokens x group heads (query vector (t, g) at q + t * q_stride + g * D)    \
     * against the nk keys from position `first`, into scores[(t * group + g) * nk + j]. */   \
    static void NAME##_scores_any(const float *q, int64_t q_stride, int64_t m, const T *keys,        \
                              const int32_t *blocks, int64_t first, int64_t nk, int64_t group,    \
                              int64_t D, int64_t bs, int64_t s_block, int64_t s_slot, float scale, \
                              float *scores, float *rows) {                                       \
        int64_t j = 0;                                                                            \
        for (; j + 4 <= nk; j += 4) {                                                             \
            NAME##_widen(keys, blocks, first, j, 4, nk, D, bs, s_block, s_slot, rows);           \
            for (int64_t v = 0; v < m * group; v++) {                                             \
                const float *qv = q + (v / group) * q_stride + (v % group) * D;                   \
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;                                 \
                for (int64_t d = 0; d < D; d++) {                                                 \
                    a0 += qv[d] * rows[d];                                                        \
                    a1 += qv[d] * rows[D + d];                                                    \
                    a2 += qv[d] * rows[2 * D + d];                                                \
                    a3 += qv[d] * rows[3 * D + d];                                                \
                }                                                                                 \
                float *s = scores + v * nk + j;                                                   \
                s[0] = a0 * scale, s[1] = a1 * scale, s[2] = a2 * scale, s[3] = a3 * scale;       \
            }                                                                                     \
        }                                                                                         \
        for (; j < nk; j++) {                                                                     \
            NAME##_widen(keys, blocks, first, j, 1, nk, D, bs, s_block, s_slot, rows);           \
            for (int64_t v = 0; v < m * group; v++) {                                             \
                const float *qv = q + (v / group) * q_stride + (v % group) * D;                   \
                float a = 0.0f;                                                                   \
                for (int64_t d = 0; d < D; d++) a += qv[d] * rows[d];                             \
                scores[v * nk + j] = a * scale;                                                   \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* out vector (t, g) = sum_j w[(t * group + g) * nk + j] * value_j, same layout as q. */    \
    static void NAME##_weigh_any(const float *w, int64_t m, const T *values, const int32_t *blocks,  \
                             int64_t first, int64_t nk, int64_t group, int64_t D, int64_t bs,     \
                             int64_t s_block, int64_t s_slot, float *out, int64_t out_stride,     \
                             float *rows) {                                                       \
        for (int64_t t = 0; t < m; t++) memset(out + t * out_stride, 0, group * D * sizeof(float)); \
        int64_t j = 0;                                                                            \
        for (; j + 4 <= nk; j += 4) {                                                             \
            NAME##_widen(values, blocks, first, j, 4, nk, D, bs, s_block, s_slot, rows);         \
            for (int64_t v = 0; v < m * group; v++) {                                             \
                const float *wv = w + v * nk + j;                                                 \
                float *o = out + (v / group) * out_stride + (v % group) * D;                      \
                for (int64_t d = 0; d < D; d++)                                                   \
                    o[d] += wv[0] * rows[d] + wv[1] * rows[D + d] + wv[2] * rows[2 * D + d]       \
                          + wv[3] * rows[3 * D + d];                                              \
            }                                                                                     \
        }                                                                                         \
        for (; j < nk; j++) {                                                                     \
            NAME##_widen(values, blocks, first, j, 1, nk, D, bs, s_block, s_slot, rows);         \
            for (int64_t v = 0; v < m * group; v++) {                                             \
                const float wj = w[v * nk + j];                                                   \
                float *o = out + (v / group) * out_stride + (v % group) * D;                      \
                for (int64_t d = 0; d < D; d++) o[d] += wj * rows[d];                             \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* The same, head_size a multiple of 16, in explicit 16-lane vectors: four query       \
     * vectors against four keys at a time (16 sums in flight, 8 loads per 16 FMAs). */      \
    static void NAME##_scores16(const float *q, int64_t q_stride, int64_t m, const T *keys,      \
                                const int32_t *blocks, int64_t first, int64_t nk, int64_t group,  \
                                int64_t D, int64_t bs, int64_t s_block, int64_t s_slot,           \
                                float scale, float *scores, float *rows) {                        \
        const int64_t V = m * group;                                                              \
        for (int64_t j = 0; j < nk; j += 4) {                                                     \
            const int64_t count = nk - j < 4 ? nk - j : 4;                                        \
            NAME##_widen(keys, blocks, first, j, count, nk, D, bs, s_block, s_slot, rows);       \
            if (count < 4) memset(rows + count * D, 0, (4 - count) * D * sizeof(float));          \
            int64_t v = 0;                                                                        \
            for (; v + 4 <= V; v += 4) {                                                          \
                const float *qs[4];                                                               \
                for (int64_t i = 0; i < 4; i++) qs[i] = q + ((v + i) / group) * q_stride + ((v + i) % group) * D; \
                f32x16 acc[4][4] = {{{0}}};                                                       \
                for (int64_t d = 0; d < D; d += 16) {                                             \
                    const f32x16 k0 = load16(rows + d), k1 = load16(rows + D + d);                \
                    const f32x16 k2 = load16(rows + 2 * D + d), k3 = load16(rows + 3 * D + d);    \
                    for (int64_t i = 0; i < 4; i++) {                                             \
                        const f32x16 x = load16(qs[i] + d);                                       \
                        acc[i][0] += x * k0, acc[i][1] += x * k1;                                 \
                        acc[i][2] += x * k2, acc[i][3] += x * k3;                                 \
                    }                                                                             \
                }                                                                                 \
                for (int64_t i = 0; i < 4; i++)                                                   \
                    for (int64_t k = 0; k < count; k++) scores[(v + i) * nk + j + k] = sum16(acc[i][k]) * scale; \
            }                                                                                     \
            for (; v < V; v++) {                                                                  \
                const float *x = q + (v / group) * q_stride + (v % group) * D;                    \
                f32x16 acc[4] = {{0}};                                                            \
                for (int64_t d = 0; d < D; d += 16)                                               \
                    for (int64_t k = 0; k < 4; k++) acc[k] += load16(x + d) * load16(rows + k * D + d); \
                for (int64_t k = 0; k < count; k++) scores[v * nk + j + k] = sum16(acc[k]) * scale; \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    static void NAME##_weigh16(const float *w, int64_t m, const T *values, const int32_t *blocks, \
                               int64_t first, int64_t nk, int64_t group, int64_t D, int64_t bs,   \
                               int64_t s_block, int64_t s_slot, float *out, int64_t out_stride,   \
                               float *rows) {                                                     \
        const int64_t V = m * group;                                                              \
        for (int64_t t = 0; t < m; t++) memset(out + t * out_stride, 0, group * D * sizeof(float)); \
        for (int64_t j = 0; j < nk; j += 4) {                                                     \
            const int64_t count = nk - j < 4 ? nk - j : 4;                                        \
            NAME##_widen(values, blocks, first, j, count, nk, D, bs, s_block, s_slot, rows);     \
            if (count < 4) memset(rows + count * D, 0, (4 - count) * D * sizeof(float));          \
            int64_t v = 0;                                                                        \
            for (; v + 4 <= V; v += 4) {                                                          \
                float wv[4][4] = {{0.0f}};                                                        \
                float *o[4];                                                                      \
                for (int64_t i = 0; i < 4; i++) {                                                 \
                    for (int64_t k = 0; k < count; k++) wv[i][k] = w[(v + i) * nk + j + k];      \
                    o[i] = out + ((v + i) / group) * out_stride + ((v + i) % group) * D;          \
                }                                                                                 \
                for (int64_t d = 0; d < D; d += 16) {                                             \
                    const f32x16 k0 = load16(rows + d), k1 = load16(rows + D + d);                \
                    const f32x16 k2 = load16(rows + 2 * D + d), k3 = load16(rows + 3 * D + d);    \
                    for (int64_t i = 0; i < 4; i++)                                               \
                        store16(o[i] + d, load16(o[i] + d) + wv[i][0] * k0 + wv[i][1] * k1        \
                                              + wv[i][2] * k2 + wv[i][3] * k3);                   \
                }                                                                                 \
            }                                                                                     \
            for (; v < V; v++) {                                                                  \
                float wv[4] = {0.0f, 0.0f, 0.0f, 0.0f};                                           \
                for (int64_t k = 0; k < count; k++) wv[k] = w[v * nk + j + k];                    \
                float *o = out + (v / group) * out_stride + (v % group) * D;                      \
                for (int64_t d = 0; d < D; d += 16)                                               \
                    store16(o + d, load16(o + d) + wv[0] * load16(rows + d) + wv[1] * load16(rows + D + d) \
                                   + wv[2] * load16(rows + 2 * D + d) + wv[3] * load16(rows + 3 * D + d)); \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    static inline int64_t NAME##_first_seen(int64_t pos, int64_t window) {                        \
        return (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;                       \
    }                                                                                             \
                                                                                                  \
    int NAME(const T *q, T *out, const T *cache, int64_t s_block, int64_t s_kv,                   \
             int64_t s_slot, int64_t s_head, const int32_t *table, int64_t s_row, int64_t table_rows, \
             const int64_t *tiles, int64_t n_tiles, int64_t max_tile, int64_t num_tokens,          \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,      \
             int64_t window, float scale, float *scratch, int64_t max_span, int64_t threads) {    \
        if (num_kv_heads <= 0 || num_heads % num_kv_heads || max_tile < 1) return 1;              \
        for (int64_t i = 0; i < n_tiles; i++) {                                                   \
            const int64_t *tile = tiles + 4 * i;                                                  \
            if (tile[1] < 1 || tile[1] > max_tile || tile[0] < 0 || tile[0] + tile[1] > num_tokens \
                || tile[2] < 0 || tile[2] >= table_rows || tile[3] < 0                            \
                || (tile[3] + tile[1] - 1) / block_size >= s_row                                  \
                || tile[3] + tile[1] - NAME##_first_seen(tile[3], window) > max_span)             \
                return 1;                                                                         \
        }                                                                                         \
        const int64_t group = num_heads / num_kv_heads, D = head_size;                            \
        const int64_t per_thread = max_tile * group * (max_span + 2 * D) + 4 * D;                 \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)")             \
        for (int64_t i = 0; i < n_tiles; i++) {                                                   \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                          \
                float *mine = scratch + omp_get_thread_num() * per_thread;                        \
                const int64_t *tile = tiles + 4 * i;                                              \
                const int64_t m = tile[1], pos = tile[3];                                         \
                float *rows_buf = mine + m * group * max_span; /* 4 widened rows */               \
                float *q32 = rows_buf + 4 * D, *o32 = q32 + m * group * D; /* the tile's vectors */ \
                const int64_t first = NAME##_first_seen(pos, window), nk = pos + m - first;       \
                const int32_t *blocks = table + tile[2] * s_row;                                  \
                const int64_t head = (tile[0] * num_heads + h * group) * D, stride = num_heads * D; \
                const T *keys = cache + h * s_head, *values = cache + s_kv + h * s_head;          \
                for (int64_t t = 0; t < m; t++)                                                   \
                    for (int64_t d = 0; d < group * D; d++) q32[t * group * D + d] = WIDEN(q + head + t * stride, d); \
                if (D % 16 == 0)                                                                  \
                    NAME##_scores16(q32, group * D, m, keys, blocks, first, nk, group, D, block_size, \
                                    s_block, s_slot, scale, mine, rows_buf);                      \
                else                                                                              \
                    NAME##_scores_any(q32, group * D, m, keys, blocks, first, nk, group, D, block_size, \
                                      s_block, s_slot, scale, mine, rows_buf);                    \
                for (int64_t v = 0; v < m * group; v++) {                                         \
                    /* token t sees keys [lo, hi] of the tile's nk; the rest weigh 0 */           \
                    const int64_t t = v / group;                                                  \
                    const int64_t lo = NAME##_first_seen(pos + t, window) - first, hi = pos + t - first; \
                    float *s = mine + v * nk, top = -INFINITY, total = 0.0f;                      \
                    for (int64_t j = lo; j <= hi; j++) top = s[j] > top ? s[j] : top;             \
                    for (int64_t j = lo; j <= hi; j++) {                                          \
                        const float e = exp_f32(s[j] - top);                                         \
                        total += e;                                                               \
                        s[j] = ROUND(e); /* weights in the cache dtype, as SDPA's flash kernel */ \
                    }                                                                             \
                    for (int64_t j = lo; j <= hi; j++) s[j] /= total;                             \
                    for (int64_t j = 0; j < lo; j++) s[j] = 0.0f;                                 \
                    for (int64_t j = hi + 1; j < nk; j++) s[j] = 0.0f;                            \
                }                                                                                 \
                if (D % 16 == 0)                                                                  \
                    NAME##_weigh16(mine, m, values, blocks, first, nk, group, D, block_size, s_block, \
                                   s_slot, o32, group * D, rows_buf);                             \
                else                                                                              \
                    NAME##_weigh_any(mine, m, values, blocks, first, nk, group, D, block_size, s_block, \
                                     s_slot, o32, group * D, rows_buf);                           \
                for (int64_t t = 0; t < m; t++)                                                   \
                    for (int64_t d = 0; d < group * D; d++) STORE(out + head + t * stride, d, o32[t * group * D + d]); \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, load_bf16, store_bf16, round_bf16)
DEFINE_PAGED_ATTENTION(paged_attention_f32, float, load_f32, store_f32, round_f32)
