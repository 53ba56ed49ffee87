/* Paged decode attention on CPU: one query token per request, read straight from the
 * paged KV cache. Each visible key and value row is read once (no gather, no copy) and
 * widened to float32 as it is used; scores, softmax and the weighted sum are float32.
 * Only positions a query sees are touched, so unwritten or stale slots are never read.
 *
 * Layouts (element strides, the last dim contiguous):
 *   q, out    (n, num_heads, head_size) float32; query heads h*group .. h*group+group-1
 *             share KV head h;
 *   cache     one layer's view: [block][k or v][slot][kv head][head_size];
 *   table     int32 block table, row rows[r] for decode r, column p / block_size;
 *   scratch   float32, (group * max_span + 4 * head_size) elements for each of `threads`
 *             threads, max_span >= the longest visible span.
 * (request, KV head) pairs are spread over `threads` OpenMP threads (never more: the
 * scratch has that many shares). Loaded into a process that has torch, the kernel shares
 * torch's OpenMP runtime (same soname), so these are torch's threads.
 * Rows are taken four at a time so that four independent sums are in flight.
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

#define DEFINE_PAGED_DECODE(NAME, T, WIDEN)                                                     \
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
    static void NAME##_scores(const float *q, const T *keys, const int32_t *blocks, int64_t first, \
                              int64_t nk, int64_t group, int64_t D, int64_t bs, int64_t s_block,  \
                              int64_t s_slot, float scale, float *scores, float *rows) {           \
        int64_t t = 0;                                                                            \
        for (; t + 4 <= nk; t += 4) {                                                             \
            NAME##_widen(keys, blocks, first, t, 4, nk, D, bs, s_block, s_slot, rows);           \
            for (int64_t g = 0; g < group; g++) {                                                 \
                const float *qg = q + g * D;                                                      \
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;                                 \
                for (int64_t d = 0; d < D; d++) {                                                 \
                    a0 += qg[d] * rows[d];                                                        \
                    a1 += qg[d] * rows[D + d];                                                    \
                    a2 += qg[d] * rows[2 * D + d];                                                \
                    a3 += qg[d] * rows[3 * D + d];                                                \
                }                                                                                 \
                float *s = scores + g * nk + t;                                                   \
                s[0] = a0 * scale, s[1] = a1 * scale, s[2] = a2 * scale, s[3] = a3 * scale;       \
            }                                                                                     \
        }                                                                                         \
        for (; t < nk; t++) {                                                                     \
            NAME##_widen(keys, blocks, first, t, 1, nk, D, bs, s_block, s_slot, rows);           \
            for (int64_t g = 0; g < group; g++) {                                                 \
                float a = 0.0f;                                                                   \
                for (int64_t d = 0; d < D; d++) a += q[g * D + d] * rows[d];                      \
                scores[g * nk + t] = a * scale;                                                   \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    static void NAME##_weigh(const float *w, const T *values, const int32_t *blocks, int64_t first, \
                             int64_t nk, int64_t group, int64_t D, int64_t bs, int64_t s_block,   \
                             int64_t s_slot, float *out, float *rows) {                           \
        memset(out, 0, group * D * sizeof(float));                                                \
        int64_t t = 0;                                                                            \
        for (; t + 4 <= nk; t += 4) {                                                             \
            NAME##_widen(values, blocks, first, t, 4, nk, D, bs, s_block, s_slot, rows);         \
            for (int64_t g = 0; g < group; g++) {                                                 \
                const float *wg = w + g * nk + t;                                                 \
                float *o = out + g * D;                                                           \
                for (int64_t d = 0; d < D; d++)                                                   \
                    o[d] += wg[0] * rows[d] + wg[1] * rows[D + d] + wg[2] * rows[2 * D + d]       \
                          + wg[3] * rows[3 * D + d];                                              \
            }                                                                                     \
        }                                                                                         \
        for (; t < nk; t++) {                                                                     \
            NAME##_widen(values, blocks, first, t, 1, nk, D, bs, s_block, s_slot, rows);         \
            for (int64_t g = 0; g < group; g++) {                                                 \
                const float wt = w[g * nk + t];                                                   \
                float *o = out + g * D;                                                           \
                for (int64_t d = 0; d < D; d++) o[d] += wt * rows[d];                             \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    int NAME(const float *q, float *out, const T *cache, int64_t s_block, int64_t s_kv,           \
             int64_t s_slot, int64_t s_head, const int32_t *table, int64_t s_row,                 \
             const int64_t *rows, const int64_t *positions, int64_t n, int64_t num_heads,         \
             int64_t num_kv_heads, int64_t head_size, int64_t block_size, int64_t window,         \
             float scale, float *scratch, int64_t max_span, int64_t threads) {                                                       \
        if (num_kv_heads <= 0 || num_heads % num_kv_heads) return 1;                              \
        const int64_t group = num_heads / num_kv_heads, D = head_size;                            \
        const int64_t per_thread = group * max_span + 4 * D;                                      \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(threads)")             \
        for (int64_t r = 0; r < n; r++) {                                                         \
            for (int64_t h = 0; h < num_kv_heads; h++) {                                          \
                float *mine = scratch + omp_get_thread_num() * per_thread;                        \
                float *rows_buf = mine + group * max_span; /* 4 widened rows */                   \
                const int64_t pos = positions[r];                                                 \
                const int64_t first = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0; \
                const int64_t nk = pos - first + 1;                                               \
                const int32_t *blocks = table + rows[r] * s_row;                                  \
                const int64_t head = (r * num_heads + h * group) * D;                             \
                const T *keys = cache + h * s_head, *values = cache + s_kv + h * s_head;          \
                NAME##_scores(q + head, keys, blocks, first, nk, group, D, block_size, s_block,   \
                              s_slot, scale, mine, rows_buf);                                     \
                for (int64_t g = 0; g < group; g++) {                                             \
                    float *s = mine + g * nk, top = -INFINITY, total = 0.0f;                      \
                    for (int64_t t = 0; t < nk; t++) top = s[t] > top ? s[t] : top;               \
                    for (int64_t t = 0; t < nk; t++) total += (s[t] = expf(s[t] - top));          \
                    for (int64_t t = 0; t < nk; t++) s[t] /= total;                               \
                }                                                                                 \
                NAME##_weigh(mine, values, blocks, first, nk, group, D, block_size, s_block,      \
                             s_slot, out + head, rows_buf);                                       \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_PAGED_DECODE(paged_decode_bf16, uint16_t, widen_bf16)
DEFINE_PAGED_DECODE(paged_decode_f32, float, widen_f32)
