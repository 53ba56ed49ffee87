/* The CPU's arithmetic peaks, for reading a decode step's figures against them
 * (`python -m benchmarks.peaks`): `iterations` rounds of 12 independent 512-bit multiply-adds
 * on each of `threads` threads (12 chains hide each instruction's latency), of one kind:
 *   0 vpdpbusd   (int8 x uint8 -> int32, 64 multiply-adds an instruction; the GGUF kernels')
 *   1 vdpbf16ps  (bfloat16 pairs -> float32, 32; oneDNN's bfloat16 matmuls)
 *   2 vfmadd     (float32, 16; the attention kernel's)
 * Returns 0, or 1 where this CPU (or compiler) lacks the kind. `sink` takes a sum of the
 * results so that nothing is optimized away. */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Memory bandwidth: `rounds` passes over `bytes` bytes at `source` (a multiple of 256 *
 * `threads`), each of `threads` threads taking its own contiguous share of them (as a
 * linear layer's rows are shared):
 *   kind 0 read: every 8-byte word folded into 32 accumulators (the compiler makes them
 *          four 512-bit loads a round; nothing is written back);
 *   kind 1 copy: memcpy of the share to `target` (bytes read + bytes written is the figure).
 * Returns 1 for an unknown kind. `sink` takes what was read, so no load is optimized away. */
int bandwidth(int64_t kind, const void *source, void *target, int64_t bytes, int64_t rounds, int64_t threads,
              double *sink) {
    if (kind < 0 || kind > 1) return 1;
    uint64_t folded = 0;
#pragma omp parallel num_threads(threads) reduction(^ : folded)
    {
        int64_t share = bytes / threads, start = share * omp_get_thread_num();
        const uint64_t *words = (const uint64_t *)((const char *)source + start);
        int64_t count = share / 8;
        for (int64_t r = 0; r < rounds; r++) {
            if (kind == 1) {
                memcpy((char *)target + start, (const char *)source + start, (size_t)share);
                folded ^= ((const uint64_t *)((char *)target + start))[r % count];
                continue;
            }
#ifdef __AVX512F__
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;  /* four loads a round */
            for (int64_t i = 0; i < count; i += 32) {
                a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(words + i));
                a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(words + i + 8));
                a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(words + i + 16));
                a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(words + i + 24));
            }
            uint64_t lanes[8];
            _mm512_storeu_si512(lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
            for (int c = 0; c < 8; c++) folded ^= lanes[c];
#else
            uint64_t acc[32] = {0};
            for (int64_t i = 0; i < count; i += 32)
                for (int c = 0; c < 32; c++) acc[c] ^= words[i + c];
            for (int c = 0; c < 32; c++) folded ^= acc[c];
#endif
        }
    }
    *sink = (double)folded;
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define CHAINS 12

#define ROUNDS(TYPE, ZERO, OP, REDUCE)                                                    \
    do {                                                                                  \
        TYPE acc[CHAINS];                                                                 \
        for (int c = 0; c < CHAINS; c++) acc[c] = ZERO;                                   \
        for (int64_t n = 0; n < iterations; n++) {                                        \
            for (int c = 0; c < CHAINS; c++) acc[c] = OP;                                 \
            __asm__ volatile("" : "+v"(a), "+v"(b)); /* operands not provably constant */ \
        }                                                                                 \
        for (int c = 0; c < CHAINS; c++) total += (double)REDUCE(acc[c]);                 \
    } while (0)

int peak(int64_t kind, int64_t iterations, int64_t threads, double *sink) {
    if (kind < 0 || kind > 2) return 1;
    double sum = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : sum)
    {
        double total = 0.0;
        if (kind == 0) {
            __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(1);
            ROUNDS(__m512i, _mm512_setzero_si512(), _mm512_dpbusd_epi32(acc[c], a, b), _mm512_reduce_add_epi32);
        } else if (kind == 1) {
            __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
            ROUNDS(__m512, _mm512_setzero_ps(), _mm512_dpbf16_ps(acc[c], a, b), _mm512_reduce_add_ps);
        } else {
            __m512 a = _mm512_set1_ps(0.5f), b = _mm512_set1_ps(1e-3f);
            ROUNDS(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(acc[c], a, b), _mm512_reduce_add_ps);
        }
        sum += total;
    }
    *sink = sum;
    return 0;
}
#else
int peak(int64_t kind, int64_t iterations, int64_t threads, double *sink) {
    (void)kind, (void)iterations, (void)threads, (void)sink;
    return 1;
}
#endif
