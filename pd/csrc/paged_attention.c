/* Paged attention on CPU, read straight from the paged KV cache: a whole step's queries
 * (prefill chunks and decodes alike) in one call, no gather, no copy, no mask. Each
 * visible key and value row is widened to float32 as it is used; scores, softmax and the
 * weighted sum are float32 (a bfloat16 cache and model on a CPU with AVX512-BF16 multiply
 * bfloat16 pairs instead, summing in float32: `fast_item`). Only positions a query sees are weighed, and only positions
 * some query of its tile sees are read, so unwritten or stale slots are never touched.
 *
 * The work comes as tiles: `m` consecutive query tokens of one request (a decode is a
 * tile of one), at positions pos .. pos + m - 1, token t seeing keys
 * [max(0, pos + t - window + 1), pos + t] (window 0: from 0). A tile's keys are read
 * once for its m x group query vectors, so a prefill chunk widens each key row
 * 1 / (tile size) times per query token, not once per token.
 *
 * Layouts (element strides, the last dim contiguous):
 *   q, out    (num_tokens, num_heads, head_size) in the model's dtype (bfloat16 or float32;
 *             a cache in 8-bit floats, --kv-cache-dtype fp8_e4m3, is read by the _fp8
 *             variants, an int8 one, whose rows end in a float32 scale, by the _i8 ones);
 *             query heads h*group ..
 *             h*group+group-1 share KV head h; tile i covers tokens tiles[4i] ..
 *             tiles[4i] + tiles[4i+1] - 1, reads block-table row tiles[4i+2], and its
 *             first token is at position tiles[4i+3];
 *   cache     one layer's view: [block][k or v][slot][kv head][head_size];
 *   table     int32 block table (table_rows, s_row), column p / block_size;
 *   scratch   float32, (max_tile * group * (max_span + 2 * P) + 4 * P) for each of
 *             `threads` threads, P = head_size rounded up to 16 (vectors are padded
 *             with zeros to 16 lanes), max_span >= any tile's span of keys.
 * Tiles are checked against these bounds first (status 1 if one is out). (tile, KV head)
 * pairs are handed out one at a time (their costs differ: a decode against a prefill
 * tile) to `threads` OpenMP threads (never more: the scratch has that many
 * shares). With fewer pairs than threads (a lone decode over one KV head) each pair's keys
 * are split among the threads instead: scores in parallel, one softmax, each thread's
 * weighted values summed apart and added in thread order (float32 rounding apart, the
 * unsplit result). Loaded into a process that has torch, the kernel shares torch's OpenMP
 * runtime (same soname), so these are torch's threads. Rows are taken four at a time so
 * that four independent sums are in flight.
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

static inline int64_t first_seen(int64_t pos, int64_t window) {
    return (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
}

/* Scores of V query vectors (P floats each, consecutive in q, zero past the head size)
 * against four widened key rows (P apart), `count` of them real: scores[v * nk + k].
 * Four query vectors against the four keys at a time: 16 sums in flight, 8 loads per
 * 16 FMAs. */
static void score_four(const float *q, int64_t V, const float *rows, int64_t P, int64_t count, float scale,
                       float *scores, int64_t nk) {
    int64_t v = 0;
    for (; v + 4 <= V; v += 4) {
        f32x16 acc[4][4] = {{{0}}};
        for (int64_t d = 0; d < P; d += 16) {
            const f32x16 k0 = load16(rows + d), k1 = load16(rows + P + d);
            const f32x16 k2 = load16(rows + 2 * P + d), k3 = load16(rows + 3 * P + d);
            for (int64_t i = 0; i < 4; i++) {
                const f32x16 x = load16(q + (v + i) * P + d);
                acc[i][0] += x * k0, acc[i][1] += x * k1;
                acc[i][2] += x * k2, acc[i][3] += x * k3;
            }
        }
        for (int64_t i = 0; i < 4; i++)
            for (int64_t k = 0; k < count; k++) scores[(v + i) * nk + k] = sum16(acc[i][k]) * scale;
    }
    for (; v < V; v++) {
        f32x16 acc[4] = {{0}};
        for (int64_t d = 0; d < P; d += 16)
            for (int64_t k = 0; k < 4; k++) acc[k] += load16(q + v * P + d) * load16(rows + k * P + d);
        for (int64_t k = 0; k < count; k++) scores[v * nk + k] = sum16(acc[k]) * scale;
    }
}

/* out vector v (P floats, consecutive) += sum_k w[v * nk + k] * row k, for four widened
 * value rows (P apart), `count` of them real; four output vectors at a time. */
static void weigh_four(const float *w, int64_t nk, int64_t V, const float *rows, int64_t P, int64_t count,
                       float *out) {
    int64_t v = 0;
    for (; v + 4 <= V; v += 4) {
        float wv[4][4] = {{0.0f}};
        for (int64_t i = 0; i < 4; i++)
            for (int64_t k = 0; k < count; k++) wv[i][k] = w[(v + i) * nk + k];
        for (int64_t d = 0; d < P; d += 16) {
            const f32x16 k0 = load16(rows + d), k1 = load16(rows + P + d);
            const f32x16 k2 = load16(rows + 2 * P + d), k3 = load16(rows + 3 * P + d);
            for (int64_t i = 0; i < 4; i++) {
                float *o = out + (v + i) * P + d;
                store16(o, load16(o) + wv[i][0] * k0 + wv[i][1] * k1 + wv[i][2] * k2 + wv[i][3] * k3);
            }
        }
    }
    for (; v < V; v++) {
        float wv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t k = 0; k < count; k++) wv[k] = w[v * nk + k];
        for (int64_t d = 0; d < P; d += 16) {
            float *o = out + v * P + d;
            store16(o, load16(o) + wv[0] * load16(rows + d) + wv[1] * load16(rows + P + d)
                           + wv[2] * load16(rows + 2 * P + d) + wv[3] * load16(rows + 3 * P + d));
        }
    }
}

/* Softmax of each query vector's scores over the keys its token sees, [lo, hi] of the
 * tile's nk (token t = v / group, at position pos + t); the rest weigh 0. Weights are
 * rounded by `round` (to the cache dtype, as SDPA's flash kernel does) before they are
 * divided by the unrounded sum. */
static void softmax_visible(float *scores, int64_t V, int64_t group, int64_t nk, int64_t pos, int64_t first,
                            int64_t window, float (*round)(float)) {
    for (int64_t v = 0; v < V; v++) {
        const int64_t t = v / group;
        const int64_t lo = first_seen(pos + t, window) - first, hi = pos + t - first;
        float *s = scores + v * nk, top = -INFINITY, total = 0.0f;
        for (int64_t j = lo; j <= hi; j++) top = s[j] > top ? s[j] : top;
        for (int64_t j = lo; j <= hi; j++) {
            const float e = exp_f32(s[j] - top);
            total += e;
            s[j] = round(e);
        }
        for (int64_t j = lo; j <= hi; j++) s[j] /= total;
        for (int64_t j = 0; j < lo; j++) s[j] = 0.0f;
        for (int64_t j = hi + 1; j < nk; j++) s[j] = 0.0f;
    }
}

/* One item (tile, KV head) as both paths see it. keys, values and q are in the cache's and
 * the model's dtypes (q the model's queries on the fast path, their float32 copy, P apart, on
 * the widened one); scores is V x nk floats, in share 0; each share's outputs are V x P
 * floats. */
typedef struct {
    const void *keys, *values, *q;
    const int32_t *blocks;
    int64_t first, nk, pos, window, V, group, D, P, bs, s_block, s_slot, head, stride;
    int64_t rows, outputs; /* where a share's 4 widened rows and its outputs start, in floats */
    float scale;
    float *scores, *totals;
} item_view;

/* A part of an item's work over its keys [j0, j1): its scores, or its weighted values into
 * `own` (a thread's share: the scratch its rows are widened in, and its outputs). */
typedef void (*item_part)(const item_view *it, int64_t j0, int64_t j1, float *own);

/* An item's scores, softmax and weighted values, with the keys split among `split` threads
 * (split 1, or fewer than 8 keys: all in share 0): each thread scores its quad-aligned range
 * of keys into the shared scores; after a barrier one thread takes the softmax; each thread
 * weighs its range's values into its own share's outputs, added into share 0's in thread
 * order (so the weights are the unsplit ones).
 * Never called inside a parallel region with split > 1: a nested region would start threads
 * of its own. */
static inline __attribute__((always_inline)) void split_keys(const item_view *it, int64_t split, float *share,
                                                             int64_t per_thread, item_part scores,
                                                             void (*softmax)(const item_view *), item_part weigh) {
    const int64_t nk = it->nk, quads = (nk + 3) / 4;
    if (split == 1 || quads < 2) {
        scores(it, 0, nk, share);
        softmax(it);
        weigh(it, 0, nk, share);
        return;
    }
    int64_t used = 1;
    _Pragma("omp parallel num_threads(split)")
    {
        const int64_t t = omp_get_thread_num(), n_t = omp_get_num_threads();
        const int64_t j0 = quads * t / n_t * 4, j1 = quads * (t + 1) / n_t * 4;
        const int64_t end = j1 < nk ? j1 : nk;
        scores(it, j0, end, share + t * per_thread);
        _Pragma("omp barrier")
        _Pragma("omp single")
        {
            softmax(it);
            used = n_t;
        }
        weigh(it, j0, end, share + t * per_thread);
    }
    float *o = share + it->outputs;
    for (int64_t t = 1; t < used; t++) {
        const float *part = share + t * per_thread + it->outputs;
        for (int64_t e = 0; e < it->V * it->P; e++) o[e] += part[e];
    }
}

/* Item (tile, KV head h)'s view over a cache of `elem`-byte elements (strides in elements),
 * in a share laid out as the scratch says: the scores (V x max_span), 4 rows of P, the queries'
 * floats (or the sums), the outputs. */
static inline item_view view_item(const void *q, const void *cache, int64_t elem, int64_t s_block, int64_t s_kv,
                                  int64_t s_slot, int64_t s_head, const int32_t *table, int64_t s_row,
                                  const int64_t *tile, int64_t h, int64_t num_heads, int64_t group, int64_t D,
                                  int64_t P, int64_t bs, int64_t window, float scale, float *share,
                                  int64_t max_span) {
    const int64_t m = tile[1], pos = tile[3], V = m * group, first = first_seen(pos, window);
    const char *layer = (const char *)cache + h * s_head * elem;
    return (item_view){
        .keys = layer, .values = layer + s_kv * elem, .q = q, .blocks = table + tile[2] * s_row,
        .first = first, .nk = pos + m - first, .pos = pos, .window = window, .V = V, .group = group, .D = D, .P = P,
        .bs = bs, .s_block = s_block, .s_slot = s_slot, .head = (tile[0] * num_heads + h * group) * D,
        .stride = num_heads * D, .rows = V * max_span, .outputs = V * max_span + 4 * P + V * P, .scale = scale,
        .scores = share, .totals = share + V * max_span + 4 * P,
    };
}

/* An 8-bit float (e4m3fn: 4 exponent bits biased by 7, 3 mantissa bits, no infinities) as
 * float32: its 7 magnitude bits under float32's exponent field, the exponent rebiased by
 * adding 120 to it, are a normal's value. A subnormal (exponent 0: m / 8 * 2^-6) comes out
 * as (1 + m / 8) 2^-7, so it is doubled less 2^-6. No float32 subnormal is ever formed (as
 * a multiply by 2^120 of the bits would: 0.54 against 0.33 ms a Gemma layer here). The
 * cache never holds NaN (writes saturate at +-448). */
static inline float load_fp8(const uint8_t *x, int64_t i) {
    const uint32_t v = x[i];
    const uint32_t bits = ((v & 0x7fu) << 20) + (120u << 23);
    float f;
    memcpy(&f, &bits, sizeof f);
    f = (v & 0x78u) ? f : 2.0f * f - 0x1p-6f;
    return (v & 0x80u) ? -f : f;
}

static inline float load_i8(const int8_t *x, int64_t i) { return (float)x[i]; }

/* A cache row's scale: 1, or (int8 rows) the float32 after its D values. */
static inline float unscaled(const void *row, int64_t D) {
    (void)row, (void)D;
    return 1.0f;
}
static inline float row_scale(const int8_t *row, int64_t D) {
    float s;
    memcpy(&s, row + D, sizeof s);
    return s;
}

/* A bfloat16 cache read by bfloat16 queries, head size a multiple of 32, on a CPU with
 * AVX512-BF16 (`fast_item`): the same arithmetic without widening a row to float32 first.
 * vdpbf16ps multiplies bfloat16 pairs exactly and sums in float32, so a score is the
 * widened path's, float32 summation order apart. The softmax's weights are bfloat16 values
 * already (rounded as SDPA's flash kernel rounds them), so they too are multiplied in pairs,
 * two keys' value rows interleaved; each output is divided by its unrounded sum once, at
 * the end, as the flash kernel does (the widened path divides each weight first: float32
 * rounding apart). While summed, an output's values d .. d + 31 lie as the interleave leaves
 * them: value d + 8 L + t (128-bit lane L) at d + 4 L + t for t < 4, at d + 16 + 4 L + t - 4
 * for t >= 4. */
#if defined(__AVX512BF16__) && !defined(PD_PLAIN)
#include <immintrin.h>
#define FAST_KEYS 32 /* value rows weighed per pass over the outputs: 16 KB at head size 256 */

static inline const uint16_t *fast_row(const uint16_t *base, const int32_t *blocks, int64_t p, int64_t bs,
                                       int64_t s_block, int64_t s_slot) {
    return base + blocks[p / bs] * s_block + (p % bs) * s_slot;
}

static inline void prefetch_row(const uint16_t *row, int64_t D) {
    for (int64_t b = 0; b < D * 2; b += 64) __builtin_prefetch((const char *)row + b, 0, 1);
}

/* The sums of a's, b's, c's and d's 16 lanes. */
static inline __m128 sum_lanes4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    const __m512 all = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                     _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(all), _mm512_extractf32x8_ps(all, 1));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

/* Query vector v of the item (head: its first, stride: a token's). */
static inline const uint16_t *fast_query(const uint16_t *q, int64_t head, int64_t stride, int64_t group, int64_t D,
                                         int64_t v) {
    return q + head + (v / group) * stride + (v % group) * D;
}

/* scores[v * nk + j] = (query v . key j) scale for keys [j0, j1) (j0 a multiple of 4) and
 * v < V: four keys against four query vectors at a time. */
static void fast_scores(const uint16_t *keys, const int32_t *blocks, int64_t first, int64_t j0, int64_t j1,
                        int64_t nk, int64_t D, int64_t bs, int64_t s_block, int64_t s_slot, const uint16_t *q,
                        int64_t head, int64_t stride, int64_t group, int64_t V, float scale, float *scores) {
    for (int64_t j = j0; j < j1; j += 4) {
        const int64_t count = j1 - j < 4 ? j1 - j : 4;
        const uint16_t *r[4];
        for (int64_t k = 0; k < 4; k++)
            r[k] = fast_row(keys, blocks, first + j + (k < count ? k : count - 1), bs, s_block, s_slot);
        for (int64_t i = 0; j + PREFETCH_AHEAD + 4 <= nk && i < 4; i++)
            prefetch_row(fast_row(keys, blocks, first + j + PREFETCH_AHEAD + i, bs, s_block, s_slot), D);
        for (int64_t v0 = 0; v0 < V; v0 += 4) {
            const uint16_t *x[4];
            for (int64_t i = 0; i < 4; i++) x[i] = fast_query(q, head, stride, group, D, v0 + i < V ? v0 + i : V - 1);
            __m512 acc[4][4];
            for (int i = 0; i < 4; i++)
                for (int k = 0; k < 4; k++) acc[i][k] = _mm512_setzero_ps();
            for (int64_t d = 0; d < D; d += 32) {
                __m512bh kk[4];
                for (int k = 0; k < 4; k++) kk[k] = (__m512bh)_mm512_loadu_si512(r[k] + d);
                for (int i = 0; i < 4; i++) {
                    const __m512bh xi = (__m512bh)_mm512_loadu_si512(x[i] + d);
                    for (int k = 0; k < 4; k++) acc[i][k] = _mm512_dpbf16_ps(acc[i][k], xi, kk[k]);
                }
            }
            for (int64_t i = 0; i < 4 && v0 + i < V; i++) {
                float s[4];
                _mm_storeu_ps(s, _mm_mul_ps(sum_lanes4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]),
                                            _mm_set1_ps(scale)));
                for (int64_t k = 0; k < count; k++) scores[(v0 + i) * nk + j + k] = s[k];
            }
        }
    }
}

/* exp_f32's steps on 16 lanes. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-87.3365447505531f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

/* Lanes j .. j + 15 of [lo, hi]. */
static inline __mmask16 seen16(int64_t j, int64_t lo, int64_t hi) {
    const int64_t from = lo > j ? lo - j : 0, to = hi - j + 1 < 16 ? hi - j + 1 : 16;
    return from >= to ? 0 : (__mmask16)(((1u << to) - 1) & ~((1u << from) - 1));
}

/* softmax_visible's weights for the fast weigh, 16 keys at a time: exp of each seen score
 * less the top one, summed unrounded into totals[v], rounded to bfloat16 (0 where unseen)
 * and left undivided; stored in place as row v's bfloat16 weights, 2 bytes a key, one 0 past
 * an odd nk, so that uint32 p of the row is the pair of keys 2 p (low half) and 2 p + 1. */
static void fast_softmax(float *scores, int64_t V, int64_t group, int64_t nk, int64_t pos, int64_t first,
                         int64_t window, float *totals) {
    const int64_t padded = nk + (nk & 1);
    for (int64_t v = 0; v < V; v++) {
        const int64_t t = v / group;
        const int64_t lo = first_seen(pos + t, window) - first, hi = pos + t - first;
        float *s = scores + v * nk;
        __m512 top = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
        for (int64_t j = lo / 16 * 16; j <= hi; j += 16)
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, seen16(j, lo, hi), s + j));
        const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
        uint16_t *w = (uint16_t *)s; /* 32 bytes written at 2 j after 64 read at 4 j: behind the reads */
        for (int64_t j = 0; j < padded; j += 16) {
            const __mmask16 seen = seen16(j, lo, hi);
            const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(seen, s + j), most)));
            total = _mm512_add_ps(total, e);
            const __mmask16 kept = padded - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (padded - j)) - 1);
            _mm256_mask_storeu_epi16(w + j, kept, (__m256i)_mm512_cvtneps_pbh(e));
        }
        totals[v] = _mm512_reduce_add_ps(total);
    }
}

/* o (V rows of D, interleaved as above) += the pairs' weights times value rows rows[0 ..
 * n) (n even), for the `chunks` x 32 values from d0; four query vectors at a time. */
static inline __attribute__((always_inline)) void fast_weigh_span(const uint16_t *const *rows, int64_t n,
                                                                  const uint32_t *pairs, int64_t nk, int64_t V,
                                                                  int64_t D, int64_t d0, int chunks, float *o) {
    for (int64_t v0 = 0; v0 < V; v0 += 4) {
        const uint32_t *w[4];
        __m512 acc[4][4];
        for (int64_t i = 0; i < 4; i++) {
            const int64_t v = v0 + i < V ? v0 + i : V - 1;
            w[i] = pairs + v * nk;
            for (int c = 0; c < 2 * chunks; c++) acc[i][c] = _mm512_loadu_ps(o + v * D + d0 + 16 * c);
        }
        for (int64_t j = 0; j < n; j += 2) {
            __m512bh lo[2], hi[2];
            for (int c = 0; c < chunks; c++) {
                const __m512i a = _mm512_loadu_si512(rows[j] + d0 + 32 * c);
                const __m512i b = _mm512_loadu_si512(rows[j + 1] + d0 + 32 * c);
                lo[c] = (__m512bh)_mm512_unpacklo_epi16(a, b), hi[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
            for (int i = 0; i < 4; i++) {
                const __m512bh wi = (__m512bh)_mm512_set1_epi32((int32_t)w[i][j / 2]);
                for (int c = 0; c < chunks; c++) {
                    acc[i][2 * c] = _mm512_dpbf16_ps(acc[i][2 * c], lo[c], wi);
                    acc[i][2 * c + 1] = _mm512_dpbf16_ps(acc[i][2 * c + 1], hi[c], wi);
                }
            }
        }
        for (int64_t i = 0; i < 4 && v0 + i < V; i++)
            for (int c = 0; c < 2 * chunks; c++) _mm512_storeu_ps(o + (v0 + i) * D + d0 + 16 * c, acc[i][c]);
    }
}

/* o (V x D, interleaved) = the weighted sum of value rows [j0, j1) (j0 even): FAST_KEYS rows
 * at a time, read while in L1 for every 64 of an output's values; the next rows asked for. */
static void fast_weigh(const uint16_t *values, const int32_t *blocks, int64_t first, int64_t j0, int64_t j1,
                       int64_t D, int64_t bs, int64_t s_block, int64_t s_slot, const uint32_t *pairs, int64_t nk,
                       int64_t V, float *o) {
    memset(o, 0, (size_t)(V * D) * sizeof(float));
    for (int64_t kb = j0; kb < j1; kb += FAST_KEYS) {
        const int64_t n = j1 - kb < FAST_KEYS ? j1 - kb : FAST_KEYS;
        const uint16_t *rows[FAST_KEYS + 1];
        for (int64_t j = 0; j < n; j++) rows[j] = fast_row(values, blocks, first + kb + j, bs, s_block, s_slot);
        rows[n] = rows[n - 1]; /* an odd count's partner: weight 0 */
        for (int64_t j = kb + n; j < kb + n + FAST_KEYS && j < j1; j++)
            prefetch_row(fast_row(values, blocks, first + j, bs, s_block, s_slot), D);
        const int64_t even = n + (n & 1);
        int64_t d0 = 0;
        for (; d0 + 64 <= D; d0 += 64) fast_weigh_span(rows, even, pairs + kb / 2, nk, V, D, d0, 2, o);
        if (d0 < D) fast_weigh_span(rows, even, pairs + kb / 2, nk, V, D, d0, 1, o);
    }
}

/* fast_scores, fast_softmax and fast_weigh as an item's parts (split_keys'). */
static void fast_scores_part(const item_view *it, int64_t j0, int64_t j1, float *own) {
    (void)own;
    fast_scores(it->keys, it->blocks, it->first, j0, j1, it->nk, it->D, it->bs, it->s_block, it->s_slot, it->q,
                it->head, it->stride, it->group, it->V, it->scale, it->scores);
}
static void fast_softmax_part(const item_view *it) {
    fast_softmax(it->scores, it->V, it->group, it->nk, it->pos, it->first, it->window, it->totals);
}
static void fast_weigh_part(const item_view *it, int64_t j0, int64_t j1, float *own) {
    fast_weigh(it->values, it->blocks, it->first, j0, j1, it->D, it->bs, it->s_block, it->s_slot,
               (const uint32_t *)it->scores, it->nk, it->V, own + it->outputs);
}

/* An item on the fast path (paged_attention_bf16's, in the same scratch: the sums where the
 * queries' floats would be); 0 (nothing done) where the head size does not fit. */
static int fast_item(const item_view *it, uint16_t *out, float *share, int64_t per_thread, int64_t split) {
    if (it->D % 32) return 0;
    split_keys(it, split, share, per_thread, fast_scores_part, fast_softmax_part, fast_weigh_part);
    const int64_t D = it->D;
    for (int64_t v = 0; v < it->V; v++) {
        uint16_t *dst = out + it->head + (v / it->group) * it->stride + (v % it->group) * D;
        const float *src = share + it->outputs + v * D;
        for (int64_t d0 = 0; d0 < D; d0 += 32)
            for (int64_t lane = 0; lane < 4; lane++)
                for (int64_t t = 0; t < 8; t++)
                    store_bf16(dst, d0 + 8 * lane + t, src[d0 + (t < 4 ? 0 : 16) + 4 * lane + t % 4] / it->totals[v]);
    }
    return 1;
}

#else
#define fast_item(...) 0
#endif
#define no_fast_item(...) 0

/* T: the queries' and outputs' type (the model's), C: the cache's; WIDEN and CWIDEN read
 * them as float32, CSCALE a cache row's scale. */
#define DEFINE_PAGED_ATTENTION(NAME, T, WIDEN, STORE, ROUND, C, CWIDEN, CSCALE, FAST)                  \
    static inline const C *NAME##_row(const C *cache, const int32_t *blocks, int64_t p,           \
                                      int64_t bs, int64_t s_block, int64_t s_slot) {              \
        return cache + blocks[p / bs] * s_block + (p % bs) * s_slot;                              \
    }                                                                                             \
                                                                                                  \
    /* Widen `count` (<= 4) rows from position first + j into `rows`: four rows of P >= D     \
     * floats, zero past D and in the rows past `count` (so the vector loops need no tails);  \
     * and ask for the 4 rows PREFETCH_AHEAD positions later: rows sit in scattered blocks,   \
     * so the hardware prefetcher loses the stream at each block boundary. */                 \
    static inline void NAME##_widen(const C *base, const int32_t *blocks, int64_t first,         \
                                    int64_t j, int64_t count, int64_t nk, int64_t D, int64_t P,  \
                                    int64_t bs, int64_t s_block, int64_t s_slot, float *rows) {  \
        for (int64_t i = 0; j + PREFETCH_AHEAD + 4 <= nk && i < 4; i++) {                         \
            const char *ahead = (const char *)NAME##_row(base, blocks, first + j + PREFETCH_AHEAD + i, \
                                                         bs, s_block, s_slot);                   \
            for (int64_t b = 0; b < D * (int64_t)sizeof(C); b += 64) __builtin_prefetch(ahead + b); \
        }                                                                                         \
        for (int64_t i = 0; i < count; i++) {                                                     \
            const C *row = NAME##_row(base, blocks, first + j + i, bs, s_block, s_slot);          \
            const float scale = CSCALE(row, D);                                                   \
            for (int64_t d = 0; d < D; d++) rows[i * P + d] = CWIDEN(row, d) * scale;             \
            for (int64_t d = D; d < P; d++) rows[i * P + d] = 0.0f;                               \
        }                                                                                         \
        if (count < 4) memset(rows + count * P, 0, (4 - count) * P * sizeof(float));              \
    }                                                                                             \
                                                                                                  \
    /* The tile's query vectors as float32 (P apart, zero past D) into q32. */                 \
    static inline void NAME##_queries(const T *q, int64_t head, int64_t stride, int64_t V,          \
                                      int64_t group, int64_t D, int64_t P, float *q32) {            \
        for (int64_t v = 0; v < V; v++) {                                                         \
            const T *x = q + head + (v / group) * stride + (v % group) * D;                       \
            for (int64_t d = 0; d < P; d++) q32[v * P + d] = d < D ? WIDEN(x, d) : 0.0f;          \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* Scores of keys [j0, j1) of the item (j0 a multiple of 4) into its scores, its rows     \
     * widened in own's; after the softmax, the weighted sum of their values into own's        \
     * outputs: split_keys' parts. */                                                         \
    static void NAME##_scores(const item_view *it, int64_t j0, int64_t j1, float *own) {         \
        float *rows = own + it->rows;                                                             \
        for (int64_t j = j0; j < j1; j += 4) {                                                    \
            const int64_t count = j1 - j < 4 ? j1 - j : 4;                                        \
            NAME##_widen(it->keys, it->blocks, it->first, j, count, it->nk, it->D, it->P, it->bs,     \
                         it->s_block, it->s_slot, rows);                                          \
            score_four(it->q, it->V, rows, it->P, count, it->scale, it->scores + j, it->nk);          \
        }                                                                                         \
    }                                                                                             \
    static void NAME##_softmax(const item_view *it) {                                             \
        softmax_visible(it->scores, it->V, it->group, it->nk, it->pos, it->first, it->window, ROUND); \
    }                                                                                             \
    static void NAME##_weigh(const item_view *it, int64_t j0, int64_t j1, float *own) {          \
        float *rows = own + it->rows, *o32 = own + it->outputs;                                   \
        memset(o32, 0, it->V * it->P * sizeof(float));                                            \
        for (int64_t j = j0; j < j1; j += 4) {                                                    \
            const int64_t count = j1 - j < 4 ? j1 - j : 4;                                        \
            NAME##_widen(it->values, it->blocks, it->first, j, count, it->nk, it->D, it->P, it->bs,   \
                         it->s_block, it->s_slot, rows);                                          \
            weigh_four(it->scores + j, it->nk, it->V, rows, it->P, count, o32);                   \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    /* Item (tile i, KV head h) in `share` (and split > 1: the shares after it; split_keys). */ \
    static void NAME##_item(const T *q, T *out, const C *cache, int64_t s_block, int64_t s_kv,    \
                            int64_t s_slot, int64_t s_head, const int32_t *table, int64_t s_row,  \
                            const int64_t *tile, int64_t h, int64_t num_heads, int64_t group,     \
                            int64_t D, int64_t P, int64_t block_size, int64_t window, float scale, \
                            float *share, int64_t per_thread, int64_t max_span, int64_t split) {  \
        item_view it = view_item(q, cache, sizeof(C), s_block, s_kv, s_slot, s_head, table, s_row, tile, h, \
                                 num_heads, group, D, P, block_size, window, scale, share, max_span); \
        if (FAST(&it, out, share, per_thread, split)) return;                                     \
        float *q32 = it.totals; /* where the fast path keeps its sums */                          \
        NAME##_queries(q, it.head, it.stride, it.V, group, D, P, q32);                            \
        it.q = q32;                                                                               \
        split_keys(&it, split, share, per_thread, NAME##_scores, NAME##_softmax, NAME##_weigh);    \
        const float *o32 = share + it.outputs;                                                    \
        for (int64_t v = 0; v < it.V; v++) {                                                      \
            T *o = out + it.head + (v / group) * it.stride + (v % group) * D;                     \
            for (int64_t d = 0; d < D; d++) STORE(o, d, o32[v * P + d]);                          \
        }                                                                                         \
    }                                                                                             \
                                                                                                  \
    int NAME(const T *q, T *out, const C *cache, int64_t s_block, int64_t s_kv,                   \
             int64_t s_slot, int64_t s_head, const int32_t *table, int64_t s_row, int64_t table_rows, \
             const int64_t *tiles, int64_t n_tiles, int64_t max_tile, int64_t num_tokens,          \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t block_size,      \
             int64_t window, float scale, float *scratch, int64_t max_span, int64_t threads) {    \
        if (num_kv_heads <= 0 || num_heads % num_kv_heads || max_tile < 1 || threads < 1) return 1; \
        for (int64_t i = 0; i < n_tiles; i++) {                                                   \
            const int64_t *tile = tiles + 4 * i;                                                  \
            if (tile[1] < 1 || tile[1] > max_tile || tile[0] < 0 || tile[0] + tile[1] > num_tokens \
                || tile[2] < 0 || tile[2] >= table_rows || tile[3] < 0                            \
                || (tile[3] + tile[1] - 1) / block_size >= s_row                                  \
                || tile[3] + tile[1] - first_seen(tile[3], window) > max_span)                    \
                return 1;                                                                         \
        }                                                                                         \
        const int64_t group = num_heads / num_kv_heads, D = head_size, P = (D + 15) / 16 * 16;    \
        const int64_t per_thread = max_tile * group * (max_span + 2 * P) + 4 * P;                 \
        if (n_tiles * num_kv_heads < threads) {                                                   \
            for (int64_t i = 0; i < n_tiles; i++)                                                 \
                for (int64_t h = 0; h < num_kv_heads; h++)                                        \
                    NAME##_item(q, out, cache, s_block, s_kv, s_slot, s_head, table, s_row, tiles + 4 * i, h, \
                                num_heads, group, D, P, block_size, window, scale, scratch, per_thread, \
                                max_span, threads);                                               \
            return 0;                                                                             \
        }                                                                                         \
        _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(threads)")         \
        for (int64_t i = 0; i < n_tiles; i++)                                                     \
            for (int64_t h = 0; h < num_kv_heads; h++)                                            \
                NAME##_item(q, out, cache, s_block, s_kv, s_slot, s_head, table, s_row, tiles + 4 * i, h, \
                            num_heads, group, D, P, block_size, window, scale,                    \
                            scratch + omp_get_thread_num() * per_thread, per_thread, max_span, 1); \
        return 0;                                                                                 \
    }

#define BF16 uint16_t, load_bf16, store_bf16, round_bf16
#define F32 float, load_f32, store_f32, round_f32
#define PAGED_ATTENTION(NAME, MODEL, C, CWIDEN, CSCALE, FAST) \
    DEFINE_PAGED_ATTENTION(NAME, MODEL, C, CWIDEN, CSCALE, FAST)
PAGED_ATTENTION(paged_attention_bf16, BF16, uint16_t, load_bf16, unscaled, fast_item)
PAGED_ATTENTION(paged_attention_f32, F32, float, load_f32, unscaled, no_fast_item)
PAGED_ATTENTION(paged_attention_bf16_fp8, BF16, uint8_t, load_fp8, unscaled, no_fast_item)
PAGED_ATTENTION(paged_attention_f32_fp8, F32, uint8_t, load_fp8, unscaled, no_fast_item)
PAGED_ATTENTION(paged_attention_bf16_i8, BF16, int8_t, load_i8, row_scale, no_fast_item)
PAGED_ATTENTION(paged_attention_f32_i8, F32, int8_t, load_i8, row_scale, no_fast_item)

/* --kv-cache-dtype int8: write `tokens` new tokens' K and V rows into the cache, each row
 * (token, KV head) as round(x / s) in int8 and then s = max |x| / 127 (1 for a zero row) as
 * float32, where its block and offset say; the arithmetic of torch_backend.quantize_rows
 * (a division, not a multiply by 1 / s), so both paths write the same bytes. key and value
 * are (tokens, kv_heads, D), heads contiguous, a token `s_key` (`s_value`) elements from the
 * next. */
#define DEFINE_WRITE_I8(NAME, T, WIDEN)                                                           \
    int NAME(const T *key, const T *value, int64_t s_key, int64_t s_value, int8_t *cache, int64_t s_block, \
             int64_t s_kv, int64_t s_slot, int64_t s_head, const int64_t *blocks,                 \
             const int64_t *offsets, int64_t tokens, int64_t kv_heads, int64_t D) {              \
        if (tokens < 0 || kv_heads <= 0 || D <= 0) return 1;                                      \
        for (int64_t t = 0; t < tokens; t++)                                                      \
            for (int64_t kv = 0; kv < 2; kv++)                                                    \
                for (int64_t h = 0; h < kv_heads; h++) {                                          \
                    const T *x = kv ? value + t * s_value + h * D : key + t * s_key + h * D;      \
                    int8_t *row = cache + blocks[t] * s_block + kv * s_kv + offsets[t] * s_slot + h * s_head; \
                    float amax = 0.0f;                                                            \
                    for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(WIDEN(x, d)));       \
                    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;                           \
                    for (int64_t d = 0; d < D; d++) {                                             \
                        const float r = nearbyintf(WIDEN(x, d) / s);                              \
                        row[d] = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));     \
                    }                                                                             \
                    memcpy(row + D, &s, sizeof s);                                                \
                }                                                                                 \
        return 0;                                                                                 \
    }
DEFINE_WRITE_I8(write_kv_i8_bf16, uint16_t, load_bf16)
DEFINE_WRITE_I8(write_kv_i8_f32, float, load_f32)

/* A cache in the model's dtype: copy `tokens` new tokens' K and V rows (row_bytes each,
 * heads `row_bytes` apart) where their blocks and offsets say; strides in bytes. */
int write_kv_rows(const char *key, const char *value, int64_t s_key, int64_t s_value, char *cache, int64_t s_block,
                  int64_t s_kv, int64_t s_slot, int64_t s_head, const int64_t *blocks, const int64_t *offsets,
                  int64_t tokens, int64_t kv_heads, int64_t row_bytes) {
    if (tokens < 0 || kv_heads <= 0 || row_bytes <= 0) return 1;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t kv = 0; kv < 2; kv++)
            for (int64_t h = 0; h < kv_heads; h++)
                memcpy(cache + blocks[t] * s_block + kv * s_kv + offsets[t] * s_slot + h * s_head,
                       (kv ? value + t * s_value : key + t * s_key) + h * row_bytes, (size_t)row_bytes);
    return 0;
}
