/* Linear layers computed from a GGUF file's quantized blocks (`--quantization gguf`, CPU).
 *
 * Every block type served here is, per block of BS inputs of one output channel,
 *     w[i] = a * u[i] + c          (u an unsigned byte, a and c float32),
 * exactly as gguf's dequantizer computes it (pd/models/gguf_linear.py unpacks each type):
 *   Q8_0: BS 32, u = q + 128, a = d, c = -128 d (q int8, d the block's float16 scale);
 *   Q5_0: BS 32, u = q + 112, a = d, c = -128 d (q the 5-bit value 0..31, w = d (q - 16));
 *   Q6_K: BS 16, u = q + 96,  a = d sc, c = -128 a (q 0..63, w = d sc (q - 32));
 *   Q4_K: BS 32, u = q,       a = d sc, c = -dmin m (q 0..15).
 * The first three are "symmetric" (c = -128 a), Q4_K is not. The K-quants' sc and m are small
 * integers per block (int8; Q4_K's 0..63), d and dmin float16 per 256 inputs (a super-block).
 *
 * Activations are quantized per row as llama.cpp quantizes them for the weight's type
 * (below): xq = round(x / dx), one dx per 32 inputs (Q8_0, Q5_0) or per 256 (Q4_K, Q6_K).
 * Then per weight block
 *     sum_i w[i] x[i] ~= dx (a S + c sx),  S = sum_i u[i] xq[i],  sx = sum_i xq[i],
 * S summed exactly in int32 (vpdpbusd multiplies unsigned bytes by signed ones: why u is
 * unsigned). Q8_0 and Q5_0 sum the blocks' terms in float32. The K-quants, as llama.cpp
 * does, sum sc S (and Q4_K's m sx) exactly in int32 over a super-block, whose dx holds for
 * all of it, and scale those sums once by d dx (and -dmin dx). Against a float32 matmul of
 * the dequantized weight with the dequantized activations the only difference is float32
 * rounding and summation order (tests/pd/models/test_gguf_linear.py).
 *
 * Packed layout (`pack` in gguf_linear.py): output channels in tiles of 32; a tile is one
 * stream of its K / BS blocks. A block's values, as BS / 4 groups of 128 bytes (byte
 * [g][c][j] = v[32 t + c][BS b + 4 g + j]), are stored in the type's own bits: Q8_0 the
 * bytes as they are (v = u); the others the value of `bits` bits (v = q: u less 128 - z for
 * the symmetric ones, z = 2^(bits - 1): 16 for Q5_0, 32 for Q6_K), as nibbles, groups 2p and
 * 2p + 1 sharing the 128 bytes of pair p (low and high nibble), then for each bit above the
 * fourth a plane of 256 bits per pair (bit h * 128 + i of pair p: byte i of group 2p + h).
 * Then the 32 channels' scales, as `scales` says: 2 a as float16 (Q8_0 and Q5_0, whose a is
 * the file's float16 d: exact); 0 sc as int8 (Q6_K); 1 sc then m as int8 (Q4_K). A K-quant's
 * super-block (256 / BS blocks) is followed by its 32 channels' d as float32 (Q4_K: then
 * -dmin). So 1.0625 bytes a weight for Q8_0, 0.6875 for Q5_0, 0.59 for Q4_K, 0.83 for Q6_K
 * (the file's: 1.0625, 0.6875, 0.5625, 0.82). Channels past N are zero (values and scales),
 * and their outputs are not written.
 *
 * With AVX-512 VNNI a register tile of up to ROWS rows x 32 channels keeps, per row, two
 * int32 accumulators for the block and two float32 ones for the whole row (K-quants: two
 * int32 ones for the super-block too); without it a plain C loop computes the same int32
 * sums (PD_PLAIN forces it, for the tests).
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512VNNI__) && !defined(PD_PLAIN)
#include <immintrin.h>
#define VNNI 1
#endif

#define TILE 32     /* output channels per packed tile */
#define XBLOCK 32   /* inputs per activation scale */
/* Where the rows are more than one register tile's, a tile's stream is read once per ROWS
 * rows: pass p of P asks for the next tile's blocks p, p + P, ... into L2, so that the next
 * tile's bytes come in evenly while this one is computed. (Asking 16 KB ahead in the first
 * pass alone took the lm_head at 8 rows 1.2x the time, at 6-24 rows 1.05-1.13x.) At 4 rows
 * or fewer the hardware's prefetch alone is faster (1 row: the lm_head 1.07-1.22x the time
 * with it). Measured. */
#define ROWS 4      /* rows of one register tile */
#define KBLOCK 256  /* inputs per K-quant super-block, and per Q8_K scale (their activation rows) */
#define PARALLEL_MIN_ROWS 16  /* rows below which one thread quantizes them */

/* Activation rows quantized: xq (rows x k int8), dx (rows x k / 32), sx (rows x k / 16, sums
 * of xq over 16 inputs; a 32-input block takes two). */
typedef struct {
    int8_t *xq;
    float *dx;
    int32_t *sx;
    int64_t k;
    int64_t passes; /* passes over a tile that ask for the next one's blocks (its rows' chunks), 0: none */
} Quantized;

static inline int32_t block_sum(const Quantized *q, int64_t row, int64_t first, int64_t bs) {
    const int32_t *s = q->sx + row * (q->k / 16) + first / 16;
    return bs == 16 ? s[0] : s[0] + s[1];
}

/* Per row and weight block, what the block's activation sum sx contributes, worked out once
 * per call rather than per tile: a symmetric type's int32 sums start from -z sx; Q4_K's
 * minimums take sx itself (times m). (In the tile loop each took two loads, an add, a
 * multiply and a broadcast from a general register per row and block: 8-13 % of a hot 4-row
 * tile.) */
typedef union {
    int32_t start; /* symmetric: -z sx */
    int32_t sx;    /* Q4_K: sx */
} BlockTerm;

static void block_terms(const Quantized *q, int64_t rows, int64_t bs, int asym, int32_t zero, BlockTerm *out) {
    const int64_t nb = q->k / bs;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < nb; b++) {
            const int32_t sx = block_sum(q, m, b * bs, bs);
            if (asym)
                out[m * nb + b].sx = sx;
            else
                out[m * nb + b].start = -zero * sx;
        }
}

/* Bytes of one block's values in the packed layout, of its scales, of the scales after each
 * super-block (none for Q8_0 and Q5_0, whose super-block is one block), blocks a super-block,
 * a tile's bytes over k inputs, and the symmetric types' zero z. */
static inline int64_t value_bytes(int64_t bs, int64_t bits) {
    return bits == 8 ? bs * TILE : bs * TILE / 2 + (bits - 4) * bs * TILE / 8;
}
static inline int64_t scale_bytes(int64_t scales) { return scales == 0 ? TILE : TILE * 2; }
static inline int64_t super_bytes(int64_t scales) { return scales == 2 ? 0 : scales == 1 ? 2 * TILE * 4 : TILE * 4; }
static inline int64_t blocks_per_super(int64_t bs, int64_t scales) { return scales == 2 ? 1 : KBLOCK / bs; }
static inline int64_t tile_bytes(int64_t k, int64_t bs, int64_t bits, int64_t scales) {
    return k / bs * (value_bytes(bs, bits) + scale_bytes(scales)) + k / KBLOCK * super_bytes(scales);
}
static inline int32_t zero_of(int64_t bits) { return 1 << (bits - 1); }

#ifdef VNNI
/* Groups g and g + 1 of a block (bits < 8: pair p = g / 2) as four registers of bytes:
 * w[0], w[1] group g's channels 0-15 and 16-31, w[2], w[3] group g + 1's. */
static inline __attribute__((always_inline)) void load_pair(const uint8_t *wb, int64_t g, int64_t bs, int bits,
                                                            __m512i w[4]) {
    if (bits == 8) {
        for (int i = 0; i < 4; i++) w[i] = _mm512_loadu_si512(wb + g * 128 + i * 64);
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i n0 = _mm512_loadu_si512(wb + g * 64), n1 = _mm512_loadu_si512(wb + g * 64 + 64);
    w[0] = _mm512_and_si512(n0, low), w[1] = _mm512_and_si512(n1, low);
    w[2] = _mm512_and_si512(_mm512_srli_epi16(n0, 4), low), w[3] = _mm512_and_si512(_mm512_srli_epi16(n1, 4), low);
    for (int plane = 0; plane < bits - 4; plane++) {
        const uint8_t *bitsp = wb + bs * TILE / 2 + plane * bs * TILE / 8 + (g / 2) * 32;
        const __m512i add = _mm512_set1_epi8((char)(16 << plane));
        for (int i = 0; i < 4; i++) {
            __mmask64 m;
            memcpy(&m, bitsp + i * 8, sizeof m);
            w[i] = _mm512_mask_add_epi8(w[i], m, w[i], add);
        }
    }
}

/* acc += the products of w's unsigned bytes with the four signed bytes at x, broadcast: the
 * broadcast folded into vpdpbusd's memory operand ({1to16}), where a broadcast of its own took
 * a vector instruction per row and group (GCC does not fold one reused by two products): a hot
 * 4-row Q5_0 tile 0.93x the time. */
#define DOT_BROADCAST(acc, w, x) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(x)))

/* Block b's int32 sums s0, s1 (channels 0-15, 16-31) for rows m0 .. m0 + rows, its values at
 * wb; reads q, m0, rows, nb, bs, bits, asym and term where it is used. A symmetric type's
 * start at -z sx, so they end at sum (v - z) xq. (A macro: passed to an inline function, the
 * register arrays were kept in memory, 1.07x the time of a hot Q6_K tile.) */
#define BLOCK_SUMS(s0, s1, b, wb)                                                                     \
    do {                                                                                              \
        const int32_t *x4[ROWS];                                                                      \
        for (int r = 0; r < rows; r++) {                                                              \
            s0[r] = s1[r] = asym ? _mm512_setzero_si512() : _mm512_set1_epi32(term[r * nb + (b)].start); \
            x4[r] = (const int32_t *)(q->xq + (m0 + r) * q->k + (b) * bs);                            \
        }                                                                                             \
        if (bits == 8) { /* bytes: one group at a time */                                             \
            for (int64_t g = 0; g < bs / 4; g++) {                                                    \
                const __m512i w0 = _mm512_loadu_si512((wb) + g * 128), w1 = _mm512_loadu_si512((wb) + g * 128 + 64); \
                for (int r = 0; r < rows; r++) {                                                      \
                    DOT_BROADCAST(s0[r], w0, x4[r] + g);                                              \
                    DOT_BROADCAST(s1[r], w1, x4[r] + g);                                              \
                }                                                                                     \
            }                                                                                         \
        } else for (int64_t g = 0; g < bs / 4; g += 2) {                                              \
            __m512i wv[4];                                                                            \
            load_pair((wb), g, bs, bits, wv);                                                         \
            for (int r = 0; r < rows; r++) {                                                          \
                DOT_BROADCAST(s0[r], wv[0], x4[r] + g);                                               \
                DOT_BROADCAST(s1[r], wv[1], x4[r] + g);                                               \
                DOT_BROADCAST(s0[r], wv[2], x4[r] + g + 1);                                           \
                DOT_BROADCAST(s1[r], wv[3], x4[r] + g + 1);                                           \
            }                                                                                         \
        }                                                                                             \
    } while (0)

/* f0[r], f1[r] += s0[r], s1[r] (int32) times a0, a1 (per channel) times row r's dx for
 * block b, for every row; reads q, m0, rows and bs where it is used (a macro, as BLOCK_SUMS). */
#define ADD_SCALED(f0, f1, s0, s1, a0, a1, b)                                                        \
    for (int r = 0; r < rows; r++) {                                                              \
        const __m512 dx_ = _mm512_set1_ps(q->dx[(m0 + r) * (q->k / XBLOCK) + (b) * bs / XBLOCK]);  \
        f0[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[r]), _mm512_mul_ps(a0, dx_), f0[r]);       \
        f1[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[r]), _mm512_mul_ps(a1, dx_), f1[r]);       \
    }

/* out[r][c] for r < rows, c < 32 (float32): one tile's stream of nb blocks of Q8_0 or Q5_0
 * against rows m0.. of q (term: their block terms, row stride nb): per block and row
 * f += S a dx, in float32. */
static inline __attribute__((always_inline)) void tile_rows(const Quantized *q, int64_t m0, int rows,
                                                            const uint8_t *w, int64_t nb, int64_t bs, int bits,
                                                            const BlockTerm *term, float *out) {
    __m512 f0[ROWS], f1[ROWS];
    for (int r = 0; r < rows; r++) f0[r] = f1[r] = _mm512_setzero_ps();
    const int asym = 0;
    const int64_t values = value_bytes(bs, bits), block_bytes = values + scale_bytes(2);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * block_bytes;
        if (q->passes && b % q->passes == m0 / ROWS) /* this pass's share of the next tile's blocks */
            for (int64_t l = 0; l < block_bytes; l += 64) __builtin_prefetch(wb + nb * block_bytes + l, 0, 1);
        __m512i s0[ROWS], s1[ROWS];
        BLOCK_SUMS(s0, s1, b, wb);
        const __m512 a0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + values)));
        const __m512 a1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(wb + values + 32)));
        ADD_SCALED(f0, f1, s0, s1, a0, a1, b);
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(out + r * TILE, f0[r]);
        _mm512_storeu_ps(out + r * TILE + 16, f1[r]);
    }
}

/* The same for a K-quant (Q6_K scales 0, Q4_K 1; as stored or unpacked to bytes): each
 * block adds sc S to int32 sums t, exactly; its super-block's end adds t d dx to f (Q4_K
 * also u (-dmin) dx, u the super-block's m sx summed, exactly) and starts t again, as
 * llama.cpp sums them. Against a float32 a per block scaled per block and row (C harness,
 * hot, 640 x 2,048): Q6_K 0.93x the time at 4 rows on one thread, 0.86x at 512 rows on two;
 * Q4_K 1.03x and 0.96x. */
static inline __attribute__((always_inline)) void tile_rows_k(const Quantized *q, int64_t m0, int rows,
                                                              const uint8_t *w, int64_t nb, int64_t bs, int scales,
                                                              int bits, const BlockTerm *term, float *out) {
    __m512 f0[ROWS], f1[ROWS];
    __m512i t0[ROWS], t1[ROWS];
    for (int r = 0; r < rows; r++) f0[r] = f1[r] = _mm512_setzero_ps(), t0[r] = t1[r] = _mm512_setzero_si512();
    const int asym = scales == 1;
    const int64_t per = KBLOCK / bs, super = super_bytes(scales);
    const int64_t values = value_bytes(bs, bits), block_bytes = values + scale_bytes(scales);
    const int64_t stride = tile_bytes(nb * bs, bs, bits, scales); /* to the next tile's same block */
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + b * block_bytes + b / per * super;
        const int last = b % per == per - 1; /* of its super-block: its scales follow */
        if (q->passes && b % q->passes == m0 / ROWS) /* this pass's share of the next tile's blocks */
            for (int64_t l = 0; l < block_bytes + (last ? super : 0); l += 64) __builtin_prefetch(wb + stride + l, 0, 1);
        __m512i s0[ROWS], s1[ROWS];
        BLOCK_SUMS(s0, s1, b, wb);
        const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + values)));
        const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(wb + values + 16)));
        for (int r = 0; r < rows; r++) {
            t0[r] = _mm512_add_epi32(t0[r], _mm512_mullo_epi32(s0[r], sc0));
            t1[r] = _mm512_add_epi32(t1[r], _mm512_mullo_epi32(s1[r], sc1));
        }
        if (!last)
            continue;
        const float *d = (const float *)(wb + block_bytes);
        const __m512 d0 = _mm512_loadu_ps(d), d1 = _mm512_loadu_ps(d + 16);
        ADD_SCALED(f0, f1, t0, t1, d0, d1, b);
        for (int r = 0; r < rows; r++) t0[r] = t1[r] = _mm512_setzero_si512();
        if (!asym)
            continue;
        for (int r = 0; r < rows; r++) s0[r] = s1[r] = _mm512_setzero_si512(); /* here: u */
        for (int64_t j = 0; j < per; j++) {
            const uint8_t *m = wb - (per - 1 - j) * block_bytes + values + TILE;
            const __m512i m0v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)m));
            const __m512i m1v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(m + 16)));
            for (int r = 0; r < rows; r++) {
                const __m512i sx = _mm512_set1_epi32(term[r * nb + b - (per - 1) + j].sx);
                s0[r] = _mm512_add_epi32(s0[r], _mm512_mullo_epi32(m0v, sx));
                s1[r] = _mm512_add_epi32(s1[r], _mm512_mullo_epi32(m1v, sx));
            }
        }
        const __m512 n0 = _mm512_loadu_ps(d + 32), n1 = _mm512_loadu_ps(d + 48);
        ADD_SCALED(f0, f1, s0, s1, n0, n1, b);
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(out + r * TILE, f0[r]);
        _mm512_storeu_ps(out + r * TILE + 16, f1[r]);
    }
}

#define ROWS_CASE(R, CALL) \
    case R:                \
        CALL; break;
#define BY_ROWS(CALL_R)                                                                                    \
    switch (rows) { ROWS_CASE(1, CALL_R(1)) ROWS_CASE(2, CALL_R(2)) ROWS_CASE(3, CALL_R(3)) ROWS_CASE(4, CALL_R(4)) default: break; }
#define Q8_0_TILE(R) tile_rows(q, m0, R, w, nb, bs, 8, term, out)
#define Q5_0_TILE(R) tile_rows(q, m0, R, w, nb, bs, 5, term, out)
#define Q4_K_TILE(R) tile_rows_k(q, m0, R, w, nb, bs, 1, 4, term, out)
#define Q6_K_TILE(R) tile_rows_k(q, m0, R, w, nb, bs, 0, 6, term, out)
#define Q4_K_BYTES_TILE(R) tile_rows_k(q, m0, R, w, nb, bs, 1, 8, term, out)
#define Q6_K_BYTES_TILE(R) tile_rows_k(q, m0, R, w, nb, bs, 0, 8, term, out)

/* The register tile, with its rows, bits and (K-quants) scale format made constants: Q8_0,
 * Q5_0, Q4_K, Q6_K, and the K-quants unpacked to bytes. */
static void tile(const Quantized *q, int64_t m0, int rows, const uint8_t *w, int64_t nb, int64_t bs, int scales,
                 int bits, const BlockTerm *term, float *out) {
    if (scales == 2 && bits == 8) BY_ROWS(Q8_0_TILE)
    else if (scales == 2 && bits == 5) BY_ROWS(Q5_0_TILE)
    else if (scales == 1 && bits == 4) BY_ROWS(Q4_K_TILE)
    else if (scales == 0 && bits == 6) BY_ROWS(Q6_K_TILE)
    else if (scales == 1 && bits == 8) BY_ROWS(Q4_K_BYTES_TILE)
    else if (scales == 0 && bits == 8) BY_ROWS(Q6_K_BYTES_TILE)
}

/* A tile's nb blocks of `bits` bits rewritten as bytes (the 8-bit layout, scales copied),
 * for many rows to read without unpacking each block again per ROWS rows (the plain path
 * reads the packed values at any row count). */
#define UNPACKS 1
static void unpack_tile(const uint8_t *w, int64_t nb, int64_t bs, int bits, int scales, uint8_t *dst) {
    const int64_t values = value_bytes(bs, bits), sb = scale_bytes(scales);
    const int64_t per = blocks_per_super(bs, scales), super = super_bytes(scales);
    for (int64_t b = 0; b < nb; b++) {
        for (int64_t g = 0; g < bs / 4; g += 2) {
            __m512i wv[4];
            load_pair(w, g, bs, bits, wv);
            for (int i = 0; i < 4; i++) _mm512_storeu_si512(dst + g * 128 + i * 64, wv[i]);
        }
        const int64_t scale_span = sb + (b % per == per - 1 ? super : 0); /* a super-block's scales follow its last */
        memcpy(dst + bs * TILE, w + values, (size_t)scale_span);
        w += values + scale_span, dst += bs * TILE + scale_span;
    }
}
#else
#define UNPACKS 0
#define unpack_tile(...) ((void)0) /* not called: UNPACKS is 0 */
/* Value i = 4 g + j (within the block) of channel c, from the packed layout. */
static inline int32_t packed_value(const uint8_t *wb, int64_t bs, int bits, int64_t c, int64_t i) {
    const int64_t g = i / 4, j = i % 4, at = c * 4 + j;
    if (bits == 8) return wb[g * 128 + at];
    const uint8_t byte = wb[(g / 2) * 128 + at];
    int32_t v = (g % 2) ? byte >> 4 : byte & 0x0F;
    for (int plane = 0; plane < bits - 4; plane++) {
        const int64_t bit = (g % 2) * 128 + at;
        const uint8_t *bitsp = wb + bs * TILE / 2 + plane * bs * TILE / 8 + (g / 2) * 32;
        v += ((bitsp[bit / 8] >> (bit % 8)) & 1) << (4 + plane);
    }
    return v;
}

/* A float16's value (the scales of `scales` 2). */
static inline float half_to_float(uint16_t h) {
    const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float f;
    if (exponent == 0) {
        f = (float)mantissa * 0x1p-24f;
    } else {
        const uint32_t bits = (exponent == 31 ? 0xffu << 23 : (exponent + 112) << 23) | (mantissa << 13);
        memcpy(&f, &bits, sizeof f);
    }
    return (h & 0x8000) ? -f : f;
}

static void tile(const Quantized *q, int64_t m0, int rows, const uint8_t *w, int64_t nb, int64_t bs, int scales,
                 int bits, const BlockTerm *term, float *out) {
    const int asym = scales == 1, kquant = scales != 2;
    const int64_t values = value_bytes(bs, bits), block_bytes = values + scale_bytes(scales);
    const int64_t per = blocks_per_super(bs, scales), super = super_bytes(scales);
    for (int r = 0; r < rows; r++) {
        const int64_t m = m0 + r;
        float acc[TILE] = {0};
        int32_t t[TILE] = {0}, u[TILE] = {0}; /* K-quants: sc S and m sx over the super-block so far */
        const uint8_t *wb = w;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *x = q->xq + m * q->k + b * bs, *sc = (const int8_t *)(wb + values);
            const float dx = q->dx[m * (q->k / XBLOCK) + b * bs / XBLOCK];
            const BlockTerm term_b = term[r * nb + b];
            for (int c = 0; c < TILE; c++) {
                int32_t s = asym ? 0 : term_b.start;
                for (int64_t i = 0; i < bs; i++) s += packed_value(wb, bs, bits, c, i) * x[i];
                if (!kquant) {
                    acc[c] += (float)s * (half_to_float(((const uint16_t *)(wb + values))[c]) * dx);
                    continue;
                }
                t[c] += sc[c] * s;
                if (asym) u[c] += sc[TILE + c] * term_b.sx;
            }
            const int last = b % per == per - 1;
            if (kquant && last) {
                const float *d = (const float *)(wb + block_bytes);
                for (int c = 0; c < TILE; c++) {
                    acc[c] += (float)t[c] * (d[c] * dx) + (asym ? (float)u[c] * (d[TILE + c] * dx) : 0.0f);
                    t[c] = u[c] = 0;
                }
            }
            wb += block_bytes + (last ? super : 0);
        }
        for (int c = 0; c < TILE; c++) out[r * TILE + c] = acc[c];
    }
}
#endif

/* The activations quantized as llama.cpp quantizes them for the weight's type, so that a
 * GGUF computes as llama.cpp computes it (ggml's vec_dot_type):
 *   legacy weights (Q8_0, Q5_0; scales 2) take Q8_0 rows: per 32 inputs d = max |x| / 127,
 *     xq = round(x 127 / max |x|), and the products are scaled by d rounded to float16;
 *   K-quant weights (Q4_K, Q6_K; scales 0 and 1) take Q8_K rows: per 256 inputs, with m the
 *     input of largest |x| (the first), xq = min(127, round(x (-127 / m))), d = 1 / (-127 / m).
 * Rounding is to nearest, ties to even, as ggml's. dx holds d per 32 inputs either way (a
 * Q8_K block's eight times; 0 for zeros), sx the sums of xq over 16. */
enum { LEGACY_ROWS = 0, K_ROWS = 1 };
static inline int scheme_of(int64_t scales) { return scales == 2 ? LEGACY_ROWS : K_ROWS; }

static inline void quantized_block(const float *v, int64_t n, float iscale, float d, int8_t *out, float *dx,
                                   int32_t *sx) {
    for (int64_t i = 0; i < n; i += 16) sx[i / 16] = 0;
    for (int64_t i = 0; i < n; i++) {
        const float r = nearbyintf(v[i] * iscale);
        const int32_t c = (int32_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
        out[i] = (int8_t)c;
        sx[i / 16] += c;
    }
    for (int64_t b = 0; b < n / XBLOCK; b++) dx[b] = d;
}

/* One block of n inputs (32 or 256) from src: the scalar steps above. */
#define DEFINE_QUANTIZE_BLOCK(NAME, T, LOAD)                                                        \
    static inline void quantize_block_##NAME(const T *src, int64_t n, int scheme, int8_t *xq, float *dx, \
                                             int32_t *sx) {                                         \
        float v[KBLOCK], amax = 0.0f, signed_max = 0.0f;                                            \
        for (int64_t i = 0; i < n; i++) {                                                           \
            v[i] = LOAD(src, i);                                                                    \
            if (fabsf(v[i]) > amax) amax = fabsf(v[i]), signed_max = v[i];                          \
        }                                                                                           \
        float iscale = 0.0f, d = 0.0f;                                                              \
        if (amax > 0.0f && scheme == K_ROWS) iscale = -127.0f / signed_max, d = 1.0f / iscale;      \
        if (amax > 0.0f && scheme == LEGACY_ROWS) iscale = 127.0f / amax, d = (float)(_Float16)(amax / 127.0f); \
        quantized_block(v, n, iscale, d, xq, dx, sx);                                               \
    }

#ifdef VNNI
/* The same steps on 16 lanes at a time (bitwise the scalar ones: a maximum, products and
 * rounding to nearest even are exact per lane; the first input of largest |x| is found by
 * its lane). */
static inline __m512 load16_bf16(const uint16_t *x, int64_t i) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16));
}
static inline __m512 load16_f32(const float *x, int64_t i) { return _mm512_loadu_ps(x + i); }

/* round(v iscale) clamped to +-127 into out (16 bytes); their sum. */
static inline int32_t quantize16(__m512 v, float iscale, int8_t *out) {
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(iscale)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    const __m512i c = _mm512_cvtps_epi32(r);
    _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(c));
    return _mm512_reduce_add_epi32(c);
}

#define DEFINE_QUANTIZE_BLOCK16(NAME, T)                                                            \
    static inline void quantize_block16_##NAME(const T *src, int64_t n, int scheme, int8_t *xq, float *dx, \
                                               int32_t *sx) {                                       \
        __m512 v[KBLOCK / 16], top = _mm512_setzero_ps();                                           \
        const int64_t lanes = n / 16;                                                               \
        for (int64_t i = 0; i < lanes; i++) {                                                       \
            v[i] = load16_##NAME(src, 16 * i);                                                      \
            top = _mm512_max_ps(top, _mm512_abs_ps(v[i]));                                          \
        }                                                                                           \
        const float amax = _mm512_reduce_max_ps(top);                                               \
        float iscale = 0.0f, d = 0.0f;                                                              \
        if (amax > 0.0f && scheme == K_ROWS) {                                                      \
            float signed_max = 0.0f;                                                                \
            for (int64_t i = 0; i < lanes; i++) {                                                   \
                const __mmask16 at = _mm512_cmpeq_ps_mask(_mm512_abs_ps(v[i]), _mm512_set1_ps(amax)); \
                if (at) {                                                                           \
                    float lane[16];                                                                 \
                    _mm512_storeu_ps(lane, v[i]);                                                   \
                    signed_max = lane[__builtin_ctz(at)];                                           \
                    break;                                                                          \
                }                                                                                   \
            }                                                                                       \
            iscale = -127.0f / signed_max, d = 1.0f / iscale;                                       \
        }                                                                                           \
        if (amax > 0.0f && scheme == LEGACY_ROWS) iscale = 127.0f / amax, d = (float)(_Float16)(amax / 127.0f); \
        for (int64_t i = 0; i < lanes; i++) sx[i] = quantize16(v[i], iscale, xq + 16 * i);         \
        for (int64_t b = 0; b < n / XBLOCK; b++) dx[b] = d;                                         \
    }
DEFINE_QUANTIZE_BLOCK16(bf16, uint16_t)
DEFINE_QUANTIZE_BLOCK16(f32, float)
#define QUANTIZE_BLOCK(NAME) quantize_block16_##NAME
#else
#define QUANTIZE_BLOCK(NAME) quantize_block_##NAME
#endif
DEFINE_QUANTIZE_BLOCK(bf16, uint16_t, load_bf16)
DEFINE_QUANTIZE_BLOCK(f32, float, load_f32)

#define DEFINE_QUANTIZE(NAME, T)                                                                    \
    static void quantize_##NAME(const T *x, int64_t x_stride, int64_t rows, Quantized *q, int scheme, \
                                int64_t threads) {                                                  \
        const int64_t n = scheme == K_ROWS ? KBLOCK : XBLOCK;                                       \
        _Pragma("omp parallel for num_threads(threads) if (rows >= PARALLEL_MIN_ROWS)")             \
        for (int64_t m = 0; m < rows; m++)                                                          \
            for (int64_t b = 0; b < q->k / n; b++)                                                  \
                QUANTIZE_BLOCK(NAME)(x + m * x_stride + b * n, n, scheme, q->xq + m * q->k + b * n, \
                                     q->dx + m * (q->k / XBLOCK) + b * n / XBLOCK, q->sx + m * (q->k / 16) + b * n / 16); \
    }
DEFINE_QUANTIZE(bf16, uint16_t)
DEFINE_QUANTIZE(f32, float)

/* The activation quantization alone, for the reference path's tests: xq, dx as above, for
 * a weight whose scales are in format `scales`. */
int gguf_quantize_rows(const float *x, int64_t rows, int64_t k, int64_t scales, int8_t *xq, float *dx) {
    if (rows < 0 || k <= 0 || k % (scheme_of(scales) == K_ROWS ? KBLOCK : XBLOCK)) return 1;
    int32_t *sx = malloc((size_t)(rows * (k / 16) + 1) * sizeof(int32_t));
    if (!sx) return 2;
    Quantized q = {xq, dx, sx, k, 0};
    quantize_f32(x, k, rows, &q, scheme_of(scales), 1);
    free(sx);
    return 0;
}

static int alloc_quantized(Quantized *q, int64_t rows) {
    q->xq = aligned_alloc(64, (size_t)((rows * q->k + 63) / 64 * 64));
    q->dx = malloc((size_t)(rows * (q->k / XBLOCK)) * sizeof(float));
    q->sx = malloc((size_t)(rows * (q->k / 16)) * sizeof(int32_t));
    return !q->xq || !q->dx || !q->sx;
}
static void free_quantized(Quantized *q) { free(q->xq), free(q->dx), free(q->sx); }

/* y[0..width) = acc, width <= 32, as float32 or rounded to bfloat16. */
static inline void store_row_f32(float *y, const float *acc, int64_t width) { memcpy(y, acc, (size_t)width * 4); }

#if defined(VNNI) && defined(__AVX512BF16__)
static inline void store_row_bf16(uint16_t *y, const float *acc, int64_t width) {
    for (int64_t c0 = 0; c0 < width; c0 += 16) {
        const __mmask16 mask = width - c0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (width - c0)) - 1);
        _mm256_mask_storeu_epi16(y + c0, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + c0)));
    }
}
#else
static inline void store_row_bf16(uint16_t *y, const float *acc, int64_t width) {
    for (int64_t c = 0; c < width; c++) store_bf16(y, c, acc[c]);
}
#endif

#define MAX_SEGMENTS 8
/* The segment of tile t (tile_start: each segment's first tile, then the total). */
static inline int64_t segment_of(int64_t t, const int64_t *tile_start) {
    int64_t s = 0;
    while (t >= tile_start[s + 1]) s++;
    return s;
}

/* Several weights against the same rows in one call (a fused q/k/v or gate/up: one segment
 * per GGUF tensor): the rows are quantized once, and every segment's tiles share one
 * OpenMP loop. Segment s writes out[m][first[s] + n] for n < n_out[s] (row stride
 * out_stride), from its packed weight w[s] (blocks of bs[s] inputs of bits[s] bits, scales in
 * format scales[s]). x is rows x k, row stride x_stride. */
#define DEFINE_GGUF_LINEAR(NAME, T, STORE)                                                               \
    /* Rows m0 .. m0 + ROWS (fewer at the end) of one tile (w, as `bits` bits) into out's       \
     * columns col .. col + width. */                                                            \
    static void chunk_##NAME(const Quantized *q, int64_t m0, int64_t rows, const uint8_t *w, int64_t bs, \
                             int scales, int bits, const BlockTerm *term, T *out, int64_t out_stride,     \
                             int64_t col, int64_t width) {                                               \
        float acc[ROWS * TILE] __attribute__((aligned(64)));                                             \
        const int r = (int)(rows - m0 < ROWS ? rows - m0 : ROWS);                                       \
        tile(q, m0, r, w, q->k / bs, bs, scales, bits, term + m0 * (q->k / bs), acc);                    \
        for (int i = 0; i < r; i++) STORE(out + (m0 + i) * out_stride + col, acc + i * TILE, width);     \
    }                                                                                                    \
                                                                                                         \
    int gguf_segments_##NAME(const T *x, int64_t x_stride, int64_t rows, int64_t k, int64_t n_seg,       \
                             const uint8_t *const *w, const int64_t *n_out, const int64_t *bs,            \
                             const int64_t *scales, const int64_t *bits, const int64_t *first, T *out,    \
                             int64_t out_stride, int64_t threads) {                                      \
        if (rows < 0 || k <= 0 || k % XBLOCK || n_seg < 1 || n_seg > MAX_SEGMENTS) return 1;             \
        int64_t tile_start[MAX_SEGMENTS + 1] = {0};                                                      \
        for (int64_t s = 0; s < n_seg; s++) {                                                            \
            if (n_out[s] <= 0 || (bs[s] != 16 && bs[s] != 32)) return 1;                                  \
            if ((bits[s] != 8 && !(bits[s] >= 4 && bits[s] <= 6)) || scales[s] < 0 || scales[s] > 2) return 1; \
            tile_start[s + 1] = tile_start[s] + (n_out[s] + TILE - 1) / TILE;                             \
        }                                                                                                \
        int needed[2] = {0, 0};                                                                          \
        for (int64_t s = 0; s < n_seg; s++) needed[scheme_of(scales[s])] = 1;                            \
        if (needed[K_ROWS] && k % KBLOCK) return 1;                                                      \
        if (rows == 0) return 0;                                                                         \
        const int64_t passes = rows > ROWS ? (rows + ROWS - 1) / ROWS : 0;                              \
        Quantized qs[2] = {{NULL, NULL, NULL, k, passes}, {NULL, NULL, NULL, k, passes}};                \
        for (int scheme = 0; scheme < 2; scheme++) {                                                     \
            if (!needed[scheme]) continue;                                                               \
            if (alloc_quantized(&qs[scheme], rows)) {                                                    \
                free_quantized(qs), free_quantized(qs + 1);                                              \
                return 2;                                                                                \
            }                                                                                            \
            quantize_##NAME(x, x_stride, rows, &qs[scheme], scheme, threads);                            \
        }                                                                                                \
        int64_t term_at[MAX_SEGMENTS + 1] = {0}; /* segment s's block terms: terms + term_at[s] */        \
        for (int64_t s = 0; s < n_seg; s++) term_at[s + 1] = term_at[s] + rows * (k / bs[s]);            \
        BlockTerm *terms = malloc((size_t)term_at[n_seg] * sizeof *terms);                               \
        if (!terms) {                                                                                    \
            free_quantized(qs), free_quantized(qs + 1);                                                  \
            return 2;                                                                                    \
        }                                                                                                \
        for (int64_t s = 0; s < n_seg; s++)                                                              \
            block_terms(&qs[scheme_of(scales[s])], rows, bs[s], scales[s] == 1, zero_of(bits[s]), terms + term_at[s]); \
        const int64_t tiles = tile_start[n_seg], chunks = (rows + ROWS - 1) / ROWS;                      \
        if (chunks > 8) { /* past 32 rows (measured): each thread unpacks a tile's blocks to bytes, once */ \
            int64_t most = 0;                                                                            \
            for (int64_t s = 0; s < n_seg; s++)                                                          \
                most = tile_bytes(k, bs[s], 8, scales[s]) > most ? tile_bytes(k, bs[s], 8, scales[s]) : most; \
            Quantized from_bytes[2] = {qs[0], qs[1]}; /* an unpacked tile's: no next tile after its copy */  \
            from_bytes[0].passes = from_bytes[1].passes = 0;                                             \
            _Pragma("omp parallel num_threads(threads)")                                                 \
            {                                                                                            \
                uint8_t *bytes = UNPACKS ? aligned_alloc(64, (size_t)((most + 63) / 64 * 64)) : NULL;    \
                _Pragma("omp for schedule(static)")                                                      \
                for (int64_t t = 0; t < tiles; t++) {                                                    \
                    const int64_t s = segment_of(t, tile_start), local = t - tile_start[s];              \
                    const int64_t width = n_out[s] - local * TILE < TILE ? n_out[s] - local * TILE : TILE; \
                    const uint8_t *src = w[s] + local * tile_bytes(k, bs[s], bits[s], scales[s]);        \
                    const int unpacked = bits[s] != 8 && bytes;                                          \
                    if (unpacked) unpack_tile(src, k / bs[s], bs[s], (int)bits[s], (int)scales[s], bytes); \
                    for (int64_t ch = 0; ch < chunks; ch++)                                              \
                        chunk_##NAME((unpacked ? from_bytes : qs) + scheme_of(scales[s]), ch * ROWS, rows,   \
                                     unpacked ? bytes : src, bs[s],                                      \
                                     (int)scales[s],                                                     \
                                     unpacked ? 8 : (int)bits[s], terms + term_at[s], out, out_stride,    \
                                     first[s] + local * TILE, width);                                     \
                }                                                                                        \
                free(bytes);                                                                             \
            }                                                                                            \
        } else {                                                                                         \
            _Pragma("omp parallel for collapse(2) schedule(static) num_threads(threads) if (tiles * chunks > 1)") \
            for (int64_t t = 0; t < tiles; t++)                                                          \
                for (int64_t ch = 0; ch < chunks; ch++) {                                                \
                    const int64_t s = segment_of(t, tile_start), local = t - tile_start[s];              \
                    const int64_t width = n_out[s] - local * TILE < TILE ? n_out[s] - local * TILE : TILE; \
                    chunk_##NAME(&qs[scheme_of(scales[s])], ch * ROWS, rows,                              \
                                 w[s] + local * tile_bytes(k, bs[s], bits[s], scales[s]),                 \
                                 bs[s], (int)scales[s], (int)bits[s], terms + term_at[s], out, out_stride, \
                                 first[s] + local * TILE, width);                                         \
                }                                                                                        \
        }                                                                                                \
        free(terms), free_quantized(qs), free_quantized(qs + 1);                                         \
        return 0;                                                                                        \
    }                                                                                                    \
                                                                                                         \
    /* One weight: out[m][n] for n < n_out. */                                                           \
    int gguf_linear_##NAME(const T *x, int64_t x_stride, int64_t rows, int64_t k, const uint8_t *w,      \
                           int64_t n_out, int64_t bs, int64_t scales, int64_t bits, T *out,              \
                           int64_t out_stride, int64_t threads) {                                        \
        const int64_t first = 0;                                                                         \
        return gguf_segments_##NAME(x, x_stride, rows, k, 1, &w, &n_out, &bs, &scales, &bits, &first, out, \
                                    out_stride, threads);                                                \
    }
DEFINE_GGUF_LINEAR(bf16, uint16_t, store_row_bf16)
DEFINE_GGUF_LINEAR(f32, float, store_row_f32)
