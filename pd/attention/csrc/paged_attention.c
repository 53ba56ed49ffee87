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
 *   q, out    (num_tokens, num_heads, head_size) float32; query heads h*group ..
 *             h*group+group-1 share KV head h; tile i covers tokens tiles[4i] ..
 *             tiles[4i] + tiles[4i+1] - 1, reads block-table row tiles[4i+2], and its
 *             first token is at position tiles[4i+3];
 *   cache     one layer's view: [block][k or v][slot][kv head][head_size];
 *   table     int32 block table (table_rows, s_row), column p / block_size;
 *   scratch   float32, (max_tile * group * max_span + 4 * head_size) elements for each of
 *             `threads` threads, max_span >= any tile's span of keys.
 * Tiles are checked against these bounds first (status 1 if one is out). (tile, KV head)
 * pairs are spread over `threads` OpenMP threads (never more: the scratch has that many
 * shares). Loaded into a process that has torch, the kernel shares torch's OpenMP runtime
 * (same soname), so these are torch's threads. Rows are taken four at a time so that four
 * independent sums are in flight.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_AHEAD 16

static inline float widen_bf16(const uint16_t *x, int64_t d) {
    uint32_t bits = (uint32_t)x[d] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float widen_f32(const float *x, int64_t d) { return x[d]; }

/* To the nearest bfloat16 (ties to even) and back; NaN and infinities pass. */
static inline float round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits += 0x7fffu + ((bits >> 16) & 1u);
    bits &= 0xffff0000u;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float round_f32(float f) { return f; }

#define DEFINE_PAGED_ATTENTION(NAME, T, WIDEN, ROUND)                                                     \
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
    static void NAME##_scores(const float *q, int64_t q_stride, int64_t m, const T *keys,        \
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
    static void NAME##_weigh(const float *w, int64_t m, const T *values, const int32_t *blocks,  \
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
    static inline int64_t NAME##_first_seen(int64_t pos, int64_t window) {                        \
        return (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;                       \
    }                                                                                             \
                                                                                                  \
    int NAME(const float *q, float *out, const T *cache, int64_t s_block, int64_t s_kv,           \
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
        const int64_t per_thread = max_tile * group * max_span + 4 * D;                           \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(threads)")             \
        for (int64_t i = 0; i < n_tiles; i++) {                                                   \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                          \
                float *mine = scratch + omp_get_thread_num() * per_thread;                        \
                const int64_t *tile = tiles + 4 * i;                                              \
                const int64_t m = tile[1], pos = tile[3];                                         \
                float *rows_buf = mine + m * group * max_span; /* 4 widened rows */               \
                const int64_t first = NAME##_first_seen(pos, window), nk = pos + m - first;       \
                const int32_t *blocks = table + tile[2] * s_row;                                  \
                const int64_t head = (tile[0] * num_heads + h * group) * D, stride = num_heads * D; \
                const T *keys = cache + h * s_head, *values = cache + s_kv + h * s_head;          \
                NAME##_scores(q + head, stride, m, keys, blocks, first, nk, group, D, block_size, \
                              s_block, s_slot, scale, mine, rows_buf);                            \
                for (int64_t v = 0; v < m * group; v++) {                                         \
                    /* token t sees keys [lo, hi] of the tile's nk; the rest weigh 0 */           \
                    const int64_t t = v / group;                                                  \
                    const int64_t lo = NAME##_first_seen(pos + t, window) - first, hi = pos + t - first; \
                    float *s = mine + v * nk, top = -INFINITY, total = 0.0f;                      \
                    for (int64_t j = lo; j <= hi; j++) top = s[j] > top ? s[j] : top;             \
                    for (int64_t j = lo; j <= hi; j++) {                                          \
                        const float e = expf(s[j] - top);                                         \
                        total += e;                                                               \
                        s[j] = ROUND(e); /* weights in the cache dtype, as SDPA's flash kernel */ \
                    }                                                                             \
                    for (int64_t j = lo; j <= hi; j++) s[j] /= total;                             \
                    for (int64_t j = 0; j < lo; j++) s[j] = 0.0f;                                 \
                    for (int64_t j = hi + 1; j < nk; j++) s[j] = 0.0f;                            \
                }                                                                                 \
                NAME##_weigh(mine, m, values, blocks, first, nk, group, D, block_size, s_block,   \
                             s_slot, out + head, stride, rows_buf);                               \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_PAGED_ATTENTION(paged_attention_bf16, uint16_t, widen_bf16, round_bf16)
DEFINE_PAGED_ATTENTION(paged_attention_f32, float, widen_f32, round_f32)
