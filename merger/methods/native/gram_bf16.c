/* a · aᵀ of a bf16 matrix with fp32 accumulation by AVX512-BF16's dot product (vdpbf16ps): each bf16
   product is exact in fp32, so this is the fp32 Gram of the same values, at twice the fp32 rate.
   Built and loaded by merger/methods/native.py; see there for why and the figures. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 8          /* rows of a tile: broadcast pairs */
#define NR 3          /* 16-column vectors of a tile: 24 accumulators */
#define NC (16 * NR)  /* columns of a packed panel */
#define CHUNK 64      /* pairs summed in fresh accumulators before they join the running sums: rounding
                         stays below OpenBLAS's fp32 ?syrk (3.8e-7 against 1.1e-6 of the largest entry at
                         768 × 3072; one running sum: 5e-6) */

/* pack[g][p][j]: the pair p (columns 2p, 2p + 1) of row g·NC + j as one 32-bit word, 0 past the ends */
static void pack_rows(const uint16_t *a, long n, long k, long s_row, long s_col, uint32_t *pack, long np, long kp) {
    memset(pack, 0, (size_t)np * kp * 4);
    if (s_col == 1) {  /* each row contiguous: its pairs are words; transpose in blocks that stay in L1 */
        for (long g = 0; g < np / NC; g++)
            for (long p0 = 0; p0 < kp; p0 += 64) {
                long p1 = p0 + 64 < k / 2 ? p0 + 64 : k / 2;
                for (long j = 0; j < NC && g * NC + j < n; j++) {
                    const uint16_t *row = a + (g * NC + j) * s_row;
                    uint32_t *dst = pack + g * NC * kp + j;
                    for (long p = p0; p < p1; p++) {
                        uint32_t w;
                        memcpy(&w, row + 2 * p, 4);
                        dst[p * NC] = w;
                    }
                }
            }
        if (k & 1)
            for (long i = 0; i < n; i++)
                pack[(i / NC) * NC * kp + (kp - 1) * NC + i % NC] = a[i * s_row + k - 1];
        return;
    }
    /* each column contiguous (s_row == 1): the pair p of 16 rows interleaves two runs of 16 */
    for (long g = 0; g < np / NC; g++)
        for (long p = 0; p < kp; p++)
            for (long c = 0; c < NR; c++) {
                long i = g * NC + 16 * c;
                if (i >= n) break;
                __mmask16 rows = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
                __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rows, a + 2 * p * s_col + i));
                __m512i hi = 2 * p + 1 < k
                    ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(rows, a + (2 * p + 1) * s_col + i))
                    : _mm512_setzero_si512();
                _mm512_store_si512(pack + g * NC * kp + p * NC + 16 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
}

/* The lower triangle (j ≤ i) of c [n, n] (fp32, row stride ldc) = a · aᵀ, a [n, k] bf16 with
   a[i, t] at a[i·s_row + t·s_col], s_col == 1 or s_row == 1; the rest of c untouched (k = 0: all of it). 0, or 1: out of memory,
   2: a layout it does not read. */
int gram_bf16(const uint16_t *a, long n, long k, long s_row, long s_col, float *c, long ldc) {
    if (n <= 0 || k <= 0) return 0;  /* nothing to add: c as it was */
    if (s_col != 1 && s_row != 1) return 2;
    long kp = (k + 1) / 2, np = (n + NC - 1) / NC * NC;
    uint32_t *pack = aligned_alloc(64, (size_t)np * kp * 4);
    if (!pack) return 1;
    pack_rows(a, n, k, s_row, s_col, pack, np, kp);
    for (long g = 0; g < np / NC; g++) {
        const uint32_t *panel = pack + g * NC * kp;
        long j0 = g * NC;
        for (long i0 = j0; i0 < n; i0 += MR) {  /* the tiles on and below the diagonal */
            const uint32_t *rows = pack + (i0 / NC) * NC * kp + i0 % NC;
            __m512 acc[MR][NR], sum[MR][NR];
            for (int r = 0; r < MR; r++)
                for (int v = 0; v < NR; v++) sum[r][v] = _mm512_setzero_ps();
            for (long q = 0; q < kp; q += CHUNK) {
                long qe = q + CHUNK < kp ? q + CHUNK : kp;
                for (int r = 0; r < MR; r++)
                    for (int v = 0; v < NR; v++) acc[r][v] = _mm512_setzero_ps();
                for (long p = q; p < qe; p++) {
                    __m512bh b[NR];
                    for (int v = 0; v < NR; v++) b[v] = (__m512bh)_mm512_load_si512(panel + p * NC + 16 * v);
                    for (int r = 0; r < MR; r++) {
                        __m512bh x = (__m512bh)_mm512_set1_epi32((int)rows[p * NC + r]);
                        for (int v = 0; v < NR; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], x, b[v]);
                    }
                }
                for (int r = 0; r < MR; r++)
                    for (int v = 0; v < NR; v++) sum[r][v] = _mm512_add_ps(sum[r][v], acc[r][v]);
            }
            for (int r = 0; r < MR && i0 + r < n; r++) {
                long i = i0 + r;
                for (int v = 0; v < NR; v++) {
                    long j = j0 + 16 * v, valid = i - j + 1 < n - j ? i - j + 1 : n - j;
                    if (valid <= 0) break;
                    _mm512_mask_storeu_ps(c + i * ldc + j, valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1), sum[r][v]);
                }
            }
        }
    }
    free(pack);
    return 0;
}
