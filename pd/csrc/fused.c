/* Fused elementwise ops of the decoder layers on CPU: RMS norm (with the residual add),
 * q/k norm + RoPE, and the gated MLP's act(gate) * up. Each is one pass over its rows
 * where torch takes 5-10 ops (and as many temporaries); on a decode step those ops are
 * mostly dispatch overhead, on a prefill mostly memory traffic.
 *
 * Numerics follow the torch code they replace (pd/models/layers.py), rounding where it
 * rounds: in 16-bit models every op's result is rounded to bfloat16 (round to nearest
 * even) before the next op reads it, and arithmetic is float32. The float32 variants
 * round nowhere. Sums and exp() differ from torch's in the last float32 bits, so a
 * bfloat16 output may differ by one unit in rare elements.
 *
 * Rows are spread over `threads` OpenMP threads (torch's, loaded into torch's process)
 * when there are enough of them to pay for waking the threads.
 */
#include <math.h>
#include <omp.h>

#include "common.h"

#define PARALLEL_MIN_ELEMENTS 65536
#define MAX_HEAD_SIZE 1024

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

/* silu(x) = x / (1 + e^-x); gelu_tanh(x) = x (1 + tanh(u)) / 2, u = sqrt(2 / pi) (x +
 * 0.044715 x^3), in torch's order of operations. tanh from 1 - 2 / (e^2|u| + 1), within
 * an ulp or two of torch's, so 1 + tanh(u) rounds alike even where tanh(u) is near -1. */
static inline float silu(float x) { return x / (1.0f + exp_f32(-x)); }

static inline float gelu_tanh(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * (x * x * x));
    float a = u < 0.0f ? -u : u;
    float t = 1.0f - 2.0f / (exp_f32(2.0f * a) + 1.0f);
    t = u < 0.0f ? -t : t;
    return 0.5f * x * (1.0f + t);
}

#define DEFINE_FUSED(NAME, T, LOAD, STORE, ROUND)                                                 \
    /* 1 / sqrt(mean(x^2) + eps) over n elements, summed in float32. */                           \
    static inline float inv_rms_##NAME(const T *x, int64_t n, float eps) {                        \
        float squares = 0.0f;                                                                     \
        for (int64_t i = 0; i < n; i++) {                                                         \
            const float v = LOAD(x, i);                                                           \
            squares += v * v;                                                                     \
        }                                                                                         \
        return 1.0f / sqrtf(squares / (float)n + eps);                                            \
    }                                                                                             \
                                                                                                  \
    /* out[r] = x[r] / rms(x[r]) * weight (+ residual[r]): the norm rounded, then the add.    \
     * weight float32 (a Gemma norm passes 1 + its stored delta). */                          \
    int rms_norm_##NAME(const T *x, int64_t x_stride, const T *residual, int64_t residual_stride, \
                        T *out, int64_t out_stride, const float *weight, int64_t rows, int64_t cols, \
                        float eps, int64_t threads) {                                             \
        if (cols <= 0) return 1;                                                                  \
        _Pragma("omp parallel for num_threads(threads) if (rows * cols >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const T *xr = x + r * x_stride;                                                       \
            T *o = out + r * out_stride;                                                          \
            const float inv_rms = inv_rms_##NAME(xr, cols, eps);                                  \
            if (residual) {                                                                       \
                const T *res = residual + r * residual_stride;                                    \
                for (int64_t c = 0; c < cols; c++)                                                \
                    STORE(o, c, LOAD(res, c) + ROUND(LOAD(xr, c) * inv_rms * weight[c]));        \
            } else {                                                                              \
                for (int64_t c = 0; c < cols; c++) STORE(o, c, LOAD(xr, c) * inv_rms * weight[c]); \
            }                                                                                     \
        }                                                                                         \
        return 0;                                                                                 \
    }                                                                                             \
                                                                                                  \
    /* Per token: q heads then k heads from one row of the fused qkv projection (q at    \
     * column 0, k after the q_heads * D columns), each RMS-normed over the head (when its    \
     * weight is given) and rotated (neox rotate-half over the first `rot` dims: x cos +       \
     * swap_halves(x) sin, with sin_table holding [-sin, sin]; tables float32 (positions,      \
     * rot), rounded to T as torch rounds them), into q_out (tokens, q_heads * D) and k_out   \
     * (tokens, k_heads * D). */                                                              \
    int qk_norm_rope_##NAME(const T *qkv, int64_t qkv_stride, int64_t tokens, int64_t q_heads,   \
                            int64_t k_heads, int64_t D, const float *q_weight,                   \
                            const float *k_weight, float eps, const int64_t *positions,          \
                            const float *cos_table, const float *sin_table, int64_t rot,         \
                            int64_t table_rows, T *q_out, T *k_out, int64_t threads) {            \
        if (D <= 0 || D > MAX_HEAD_SIZE || rot < 0 || rot > D || rot % 2) return 1;               \
        for (int64_t t = 0; t < tokens; t++)                                                      \
            if (positions[t] < 0 || positions[t] >= table_rows) return 1;                         \
        int64_t heads = q_heads + k_heads, half = rot / 2;                                        \
        _Pragma("omp parallel for num_threads(threads) if (tokens * heads * D >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t i = 0; i < tokens * heads; i++) {                                            \
            int64_t t = i / heads, h = i % heads, is_k = h >= q_heads;                            \
            const T *x = qkv + t * qkv_stride + h * D;                                            \
            const float *w = is_k ? k_weight : q_weight;                                          \
            T *o = is_k ? k_out + t * k_heads * D + (h - q_heads) * D : q_out + t * q_heads * D + h * D; \
            float v[MAX_HEAD_SIZE];                                                               \
            if (w) {                                                                              \
                const float inv_rms = inv_rms_##NAME(x, D, eps);                                  \
                for (int64_t d = 0; d < D; d++) v[d] = ROUND(LOAD(x, d) * inv_rms * w[d]);        \
            } else {                                                                              \
                for (int64_t d = 0; d < D; d++) v[d] = LOAD(x, d);                                \
            }                                                                                     \
            const float *c = cos_table + positions[t] * rot, *s = sin_table + positions[t] * rot;  \
            for (int64_t d = 0; d < half; d++)                                                    \
                STORE(o, d, ROUND(v[d] * ROUND(c[d])) + ROUND(v[d + half] * ROUND(s[d])));         \
            for (int64_t d = half; d < rot; d++)                                                  \
                STORE(o, d, ROUND(v[d] * ROUND(c[d])) + ROUND(v[d - half] * ROUND(s[d])));         \
            for (int64_t d = rot; d < D; d++) STORE(o, d, v[d]);                                  \
        }                                                                                         \
        return 0;                                                                                 \
    }                                                                                             \
                                                                                                  \
    /* out[r] = act(gate) * up, gate = x[r][:inter], up = x[r][inter:2 inter]; the           \
     * activation rounded before the product. */                                             \
    int act_mul_##NAME(const T *x, int64_t x_stride, T *out, int64_t out_stride, int64_t rows,   \
                       int64_t inter, int64_t act, int64_t threads) {                             \
        if (act != ACT_SILU && act != ACT_GELU_TANH) return 1;                                    \
        _Pragma("omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++) {                                                      \
            const T *gate = x + r * x_stride, *up = gate + inter;                                 \
            T *o = out + r * out_stride;                                                          \
            if (act == ACT_SILU)                                                                  \
                for (int64_t c = 0; c < inter; c++) STORE(o, c, ROUND(silu(LOAD(gate, c))) * LOAD(up, c)); \
            else                                                                                  \
                for (int64_t c = 0; c < inter; c++)                                               \
                    STORE(o, c, ROUND(gelu_tanh(LOAD(gate, c))) * LOAD(up, c));                   \
        }                                                                                         \
        return 0;                                                                                 \
    }

DEFINE_FUSED(bf16, uint16_t, load_bf16, store_bf16, round_bf16)
DEFINE_FUSED(f32, float, load_f32, store_f32, round_f32)

/* The sampler's greedy choice: each row's index of its first largest value, as torch's
 * max(dim=-1).indices gives it (a NaN counts as the largest: the first NaN's index). One
 * pass for the maximum, 16 lanes at a time, then one for its first position. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __m512 first_max_load16_bf16(const uint16_t *x, int64_t i) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16));
}
static inline __m512 first_max_load16_f32(const float *x, int64_t i) { return _mm512_loadu_ps(x + i); }
#define DEFINE_FIRST_MAX(NAME, T, LOAD)                                                           \
    static int64_t first_max_row_##NAME(const T *x, int64_t n) {                                  \
        const int64_t whole = n / 16 * 16;                                                        \
        __m512 top = _mm512_set1_ps(-INFINITY);                                                   \
        __mmask16 nan = 0;                                                                        \
        for (int64_t i = 0; i < whole; i += 16) {                                                 \
            const __m512 v = first_max_load16_##NAME(x, i);                                       \
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);                                        \
            top = _mm512_max_ps(top, v);                                                          \
        }                                                                                         \
        float best = _mm512_reduce_max_ps(top);                                                   \
        for (int64_t i = whole; i < n; i++) {                                                     \
            const float v = LOAD(x, i);                                                           \
            if (v != v) nan = 1;                                                                  \
            best = v > best ? v : best;                                                           \
        }                                                                                         \
        if (nan) {                                                                                \
            for (int64_t i = 0; i < n; i++)                                                       \
                if (LOAD(x, i) != LOAD(x, i)) return i;                                           \
        }                                                                                         \
        const __m512 b = _mm512_set1_ps(best);                                                    \
        for (int64_t i = 0; i < whole; i += 16) {                                                 \
            const __mmask16 at = _mm512_cmp_ps_mask(first_max_load16_##NAME(x, i), b, _CMP_EQ_OQ); \
            if (at) return i + __builtin_ctz(at);                                                 \
        }                                                                                         \
        for (int64_t i = whole; i < n; i++)                                                       \
            if (LOAD(x, i) == best) return i;                                                     \
        return 0; /* n == 0 only */                                                               \
    }
#else
#define DEFINE_FIRST_MAX(NAME, T, LOAD)                                                           \
    static int64_t first_max_row_##NAME(const T *x, int64_t n) {                                  \
        int64_t at = 0;                                                                           \
        float best = n ? LOAD(x, 0) : 0.0f;                                                       \
        for (int64_t i = 1; i < n && best == best; i++) {                                         \
            const float v = LOAD(x, i);                                                           \
            if (v > best || v != v) best = v, at = i;                                             \
        }                                                                                         \
        return at;                                                                                \
    }
#endif
#define DEFINE_FIRST_MAX_ROWS(NAME, T, LOAD)                                                      \
    DEFINE_FIRST_MAX(NAME, T, LOAD)                                                               \
    int first_max_##NAME(const T *x, int64_t stride, int64_t rows, int64_t n, int64_t *out, int64_t threads) { \
        if (rows < 0 || n <= 0) return 1;                                                         \
        _Pragma("omp parallel for num_threads(threads) if (rows > 1 && rows * n >= PARALLEL_MIN_ELEMENTS)") \
        for (int64_t r = 0; r < rows; r++) out[r] = first_max_row_##NAME(x + r * stride, n);     \
        return 0;                                                                                 \
    }
DEFINE_FIRST_MAX_ROWS(bf16, uint16_t, load_bf16)
DEFINE_FIRST_MAX_ROWS(f32, float, load_f32)
