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
