/* Linear layers with int8 weights and int8 activations (W8A8, activations quantized at
 * run time), for `--quantization int8` on CPU.
 *
 * Both sides are first rotated by a Hadamard matrix H (orthogonal once divided by
 * sqrt(block), applied to blocks of `block` inputs): x W^T = (x H)(W H)^T / block. A few
 * input channels of a real model carry most of an activation row's magnitude; one int8
 * scale per row then leaves the other channels a handful of levels (Gemma 3 270M fell to
 * 92 % top-1 agreement with transformers' bfloat16 over 512 tokens of English). The
 * rotation spreads every channel over its block: 97.5 % over 2,048 tokens (our bfloat16:
 * 98.9 %).
 *
 * Weights are rotated and quantized once, per output channel (pd/models/quantized.py):
 * wq[n][k] = round((W H)[n][k] / ws[n]), ws[n] = max_k |(W H)[n][k]| / 127 / sqrt(block).
 * Each call rotates its input rows and quantizes them the same way, per row:
 * xq[m][k] = round((x H)[m][k] / s[m]), s[m] = max_k |(x H)[m][k]| / 127, xs[m] = s[m] /
 * sqrt(block). The products are summed exactly, in int32, and scaled back:
 * y[m][n] = (sum_k xq[m][k] wq[n][k]) xs[m] ws[n] (+ bias[n]), rounded once to the output
 * dtype.
 *
 * Why activations too: a decode step's matmuls have few rows, and on these CPUs they run
 * at the rate the multiply instructions allow, not the rate memory does. int8 weights
 * widened to bfloat16 would save bytes and spend them again in conversions; the VNNI
 * instruction (vpdpbusd) multiplies 64 byte pairs at a time, twice the pairs of the
 * bfloat16 dot (vdpbf16ps) the bfloat16 path uses, from half the bytes.
 *
 * vpdpbusd multiplies unsigned bytes by signed ones, so the packed weights are stored
 * offset by 128 (unsigned) and the activations stay signed:
 * sum_k (wq + 128) xq = sum_k wq xq + 128 sum_k xq, and the second term, one number per
 * row, is subtracted before scaling.
 *
 * Packed layout (`pack_int8_weight` below): output channels in tiles of 32, inputs in
 * groups of 4; tile t is K4 = ceil(K / 4) groups of 128 bytes, byte [g][c][j] =
 * wq[32 t + c][4 g + j] + 128 (zero weights pad past N and K). The 128 bytes of a group
 * are two vpdpbusd operands (16 channels x 4 inputs each), and a tile is one stream.
 *
 * Without AVX-512 VNNI, on AVX2 the same sums are taken 16 byte pairs at a time by
 * vpmaddwd (bytes widened to int16, products summed in pairs into int32: exact, |w| <=
 * 255 and |x| <= 127), else by a plain loop; every path gives the same int32 sums.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 32      /* output channels per packed tile: two 16-lane vectors */
#define GROUP 4      /* inputs per vpdpbusd lane */
#define MAX_ROWS 12  /* rows of one register tile (12 rows x 2 vectors = 24 accumulators) */
#define PARALLEL_MIN_ROWS 64

/* v = v H in place, H the unnormalized Sylvester-Hadamard matrix of order `block` (a power
 * of two dividing n) applied to each block of v: butterflies (a, b) -> (a + b, a - b) over
 * pairs h apart, h = 1, 2, 4, ... (pd/models/quantized.py `hadamard` adds in this order). */
static void hadamard(float *v, int64_t n, int64_t block) {
    int64_t h = 1;
#ifdef __AVX512F__
    if (block >= 16) { /* pairs 1..8 apart lie in one 16-float vector: a permute and a masked add */
        for (int64_t i = 0; i < n; i += 16) {
            __m512 x = _mm512_loadu_ps(v + i);
            for (int level = 1; level < 16; level *= 2) {
                const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
                const __m512 partner = _mm512_permutexvar_ps(_mm512_xor_si512(lanes, _mm512_set1_epi32(level)), x);
                const __mmask16 high = _mm512_test_epi32_mask(lanes, _mm512_set1_epi32(level));
                x = _mm512_mask_sub_ps(_mm512_add_ps(x, partner), high, partner, x);
            }
            _mm512_storeu_ps(v + i, x);
        }
        h = 16;
    }
#endif
    for (int64_t b0 = 0; b0 < n; b0 += block)
        for (int64_t hh = h; hh < block; hh *= 2)
            for (int64_t i = b0; i < b0 + block; i += 2 * hh)
                for (int64_t j = i; j < i + hh; j++) {
                    const float a = v[j], c = v[j + hh];
                    v[j] = a + c;
                    v[j + hh] = a - c;
                }
}

/* acc[row][c] = sum_k (wq[c][k] + 128) xq[row][k] for `rows` rows of xq (each `k4` groups)
 * and the 32 channels of the packed tile w. */
#ifdef __AVX512VNNI__
static inline __attribute__((always_inline)) void tile_sums(const int32_t *xq, int64_t k4, const uint8_t *w,
                                                            int rows, int32_t *acc) {
    __m512i a0[MAX_ROWS], a1[MAX_ROWS];
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        a0[r] = _mm512_setzero_si512();
        a1[r] = _mm512_setzero_si512();
    }
    for (int64_t g = 0; g < k4; g++) {
        const __m512i w0 = _mm512_loadu_si512(w + g * 2 * 64);
        const __m512i w1 = _mm512_loadu_si512(w + g * 2 * 64 + 64);
#pragma GCC unroll 12
        for (int r = 0; r < rows; r++) {
            const __m512i xb = _mm512_set1_epi32(xq[r * k4 + g]);
            a0[r] = _mm512_dpbusd_epi32(a0[r], w0, xb);
            a1[r] = _mm512_dpbusd_epi32(a1[r], w1, xb);
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_si512(acc + r * TILE, a0[r]);
        _mm512_storeu_si512(acc + r * TILE + 16, a1[r]);
    }
}

/* One specialization per row count, so that the accumulators stay in registers. */
#define TILE_CASE(R) \
    case R:          \
        tile_sums(xq, k4, w, R, acc); break;

static void tile(const int32_t *xq, int64_t k4, const uint8_t *w, int rows, int32_t *acc) {
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
        default: break;
    }
}
#elif defined(__AVX2__)
/* One row at a time (AVX2 has 16 vector registers): a group's 128 bytes are 8 runs of 16
 * (4 channels x 4 inputs), each widened to int16 and multiplied by the row's 4 inputs
 * repeated; vpmaddwd leaves each channel's sum in two adjacent int32 lanes, added at the end. */
static void tile(const int32_t *xq, int64_t k4, const uint8_t *w, int rows, int32_t *acc) {
    for (int r = 0; r < rows; r++) {
        __m256i a[8];
        for (int q = 0; q < 8; q++) a[q] = _mm256_setzero_si256();
        for (int64_t g = 0; g < k4; g++) {
            const __m256i x = _mm256_cvtepi8_epi16(_mm_set1_epi32(xq[r * k4 + g]));
            const uint8_t *wg = w + g * TILE * GROUP;
            for (int q = 0; q < 8; q++) {
                const __m256i wq = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wg + 16 * q)));
                a[q] = _mm256_add_epi32(a[q], _mm256_madd_epi16(wq, x));
            }
        }
        int32_t pairs[8 * 8] __attribute__((aligned(32)));
        for (int q = 0; q < 8; q++) _mm256_store_si256((__m256i *)(pairs + 8 * q), a[q]);
        for (int c = 0; c < TILE; c++) acc[r * TILE + c] = pairs[2 * c] + pairs[2 * c + 1];
    }
}
#else
static void tile(const int32_t *xq, int64_t k4, const uint8_t *w, int rows, int32_t *acc) {
    for (int r = 0; r < rows; r++) {
        const int8_t *x = (const int8_t *)(xq + r * k4);
        for (int c = 0; c < TILE; c++) {
            int32_t total = 0;
            for (int64_t g = 0; g < k4; g++)
                for (int j = 0; j < GROUP; j++) total += (int32_t)w[g * 2 * 64 + c * GROUP + j] * x[g * GROUP + j];
            acc[r * TILE + c] = total;
        }
    }
}
#endif

/* Pack wq (n rows of k int8, row stride `stride`) into `out`, the layout above:
 * ceil(n / 32) * ceil(k / 4) * 128 bytes. */
int pack_int8_weight(const int8_t *wq, int64_t n, int64_t k, int64_t stride, uint8_t *out) {
    if (n <= 0 || k <= 0) return 1;
    const int64_t k4 = (k + GROUP - 1) / GROUP, tiles = (n + TILE - 1) / TILE;
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t g = 0; g < k4; g++)
            for (int c = 0; c < TILE; c++)
                for (int j = 0; j < GROUP; j++) {
                    const int64_t row = t * TILE + c, col = g * GROUP + j;
                    const int32_t v = row < n && col < k ? wq[row * stride + col] : 0;
                    out[(t * k4 + g) * TILE * GROUP + c * GROUP + j] = (uint8_t)(v + 128);
                }
    return 0;
}

/* y[c] = (acc[c] - offset) scale wscale[c] (+ bias[c]) for c < width (<= 32), stored
 * with STORE (float32) or to bfloat16. */
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
static inline void scale_row(const int32_t *acc, int32_t offset, float scale, const float *wscale,
                             const float *bias, int64_t width, float *yf, uint16_t *yb) {
    for (int64_t c0 = 0; c0 < width; c0 += 16) {
        const __mmask16 mask = width - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (width - c0)) - 1);
        __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc + c0), _mm512_set1_epi32(offset)));
        y = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_set1_ps(scale)), _mm512_maskz_loadu_ps(mask, wscale + c0));
        if (bias) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(mask, bias + c0));
        if (yf) _mm512_mask_storeu_ps(yf + c0, mask, y);
        else _mm256_mask_storeu_epi16(yb + c0, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
}
#else
static inline void scale_row(const int32_t *acc, int32_t offset, float scale, const float *wscale,
                             const float *bias, int64_t width, float *yf, uint16_t *yb) {
    for (int64_t c = 0; c < width; c++) {
        float y = (float)(acc[c] - offset) * scale * wscale[c];
        if (bias) y += bias[c];
        if (yf) yf[c] = y;
        else store_bf16(yb, c, y);
    }
}
#endif

#define DEFINE_INT8_LINEAR(NAME, T, LOAD, OUT_F32, OUT_BF16)                                                   \
    /* out[m][n] for m < rows, n < n_out: x (rows x k, row stride x_stride), rotated by H in  \
     * blocks of `block` and times `norm` (1 / sqrt(block)), times the packed weight (rotated \
     * alike), scaled by wscale (n_out floats), plus bias (n_out floats, or NULL). */         \
    int int8_linear_##NAME(const T *x, int64_t x_stride, int64_t rows, int64_t k, const uint8_t *w,   \
                           int64_t n_out, const float *wscale, const float *bias, int64_t block, float norm, \
                           T *out, int64_t out_stride, int64_t threads) {                                   \
        if (rows < 0 || k <= 0 || n_out <= 0 || block <= 0 || k % block || (block & (block - 1))) return 1; \
        if (rows == 0) return 0;                                                                    \
        const int64_t k4 = (k + GROUP - 1) / GROUP, padded = k4 * GROUP;                           \
        const int64_t tiles = (n_out + TILE - 1) / TILE, tile_bytes = k4 * TILE * GROUP;           \
        int8_t *xq = aligned_alloc(64, (size_t)((rows * padded + 63) / 64 * 64));                  \
        float *xs = malloc((size_t)rows * sizeof(float));                                           \
        int32_t *xsum = malloc((size_t)rows * sizeof(int32_t));                                     \
        float *rotated = malloc((size_t)(rows * k) * sizeof(float));                                \
        if (!xq || !xs || !xsum || !rotated) {                                                      \
            free(xq); free(xs); free(xsum); free(rotated);                                          \
            return 2;                                                                               \
        }                                                                                           \
        _Pragma("omp parallel for num_threads(threads) if (rows >= PARALLEL_MIN_ROWS)")             \
        for (int64_t m = 0; m < rows; m++) { /* xq = round(x H / xs), xs = max|x H| / 127 */       \
            float *v = rotated + m * k;                                                             \
            for (int64_t i = 0; i < k; i++) v[i] = LOAD(x + m * x_stride, i);                       \
            hadamard(v, k, block);                                                                  \
            int8_t *q = xq + m * padded;                                                            \
            float amax = 0.0f;                                                                      \
            for (int64_t i = 0; i < k; i++) amax = fmaxf(amax, fabsf(v[i]));                        \
            const float scale = amax > 0.0f ? amax / 127.0f : 1.0f, inv = 1.0f / scale;             \
            int32_t total = 0;                                                                      \
            for (int64_t i = 0; i < k; i++) {                                                       \
                const float r = nearbyintf(v[i] * inv);                                             \
                const int32_t c = (int32_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));     \
                q[i] = (int8_t)c;                                                                   \
                total += c;                                                                         \
            }                                                                                       \
            for (int64_t i = k; i < padded; i++) q[i] = 0;                                          \
            xs[m] = scale * norm;                                                                   \
            xsum[m] = total;                                                                        \
        }                                                                                           \
        free(rotated);                                                                              \
        const int64_t chunks = (rows + MAX_ROWS - 1) / MAX_ROWS;                                   \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(threads)")               \
        for (int64_t t = 0; t < tiles; t++) {                                                       \
            for (int64_t ch = 0; ch < chunks; ch++) {                                               \
                int32_t acc[MAX_ROWS * TILE] __attribute__((aligned(64)));                          \
                const int64_t m0 = ch * MAX_ROWS, n0 = t * TILE;                                    \
                const int r = (int)(rows - m0 < MAX_ROWS ? rows - m0 : MAX_ROWS);                  \
                const int64_t width = n_out - n0 < TILE ? n_out - n0 : TILE;                        \
                tile((const int32_t *)(xq + m0 * padded), k4, w + t * tile_bytes, r, acc);          \
                for (int i = 0; i < r; i++)                                                         \
                    scale_row(acc + i * TILE, 128 * xsum[m0 + i], xs[m0 + i], wscale + n0,          \
                              bias ? bias + n0 : NULL, width, OUT_F32(out + (m0 + i) * out_stride + n0), \
                              OUT_BF16(out + (m0 + i) * out_stride + n0));                          \
            }                                                                                       \
        }                                                                                           \
        free(xq); free(xs); free(xsum);                                                             \
        return 0;                                                                                   \
    }

#define AS_NULL(p) NULL
#define AS_SELF(p) (p)
DEFINE_INT8_LINEAR(bf16, uint16_t, load_bf16, AS_NULL, AS_SELF)
DEFINE_INT8_LINEAR(f32, float, load_f32, AS_SELF, AS_NULL)
