/* Weight-only int8 / int4 GEMM for skinny inputs (decode) on x86-64 with AVX2 + FMA + F16C.
 *
 * Why a kernel of our own: PyTorch 2.13's CPU ops for this (`_weight_int8pack_mm`,
 * `_weight_int4pack_mm_for_cpu`) measured 3-10x SLOWER than the float32 matmul at
 * batch 1 on an AVX2-only EPYC (see benchmarks/README.md), and a dequantize-then-
 * matmul reads more bytes than float32 does. Decode is memory-bound: these loops read
 * each weight byte once, convert in registers and FMA against the few input rows.
 *
 * Threads: OpenMP over output rows. The library links libgomp.so.1, which resolves to
 * the copy torch already loaded, so it shares torch's thread pool and thread count.
 *
 * Layouts (row-major over the output dim N, as in kvmesh/quant/primitives.py):
 *   int8: w (N, K) int8, s (N,) float32:            y = x @ (w * s)^T
 *   int4: w (N, K/2) uint8, column 2j in the low nibble, 2j+1 in the high one;
 *         s, z (N, K/G) float16 bits:               w[n, k] = (q - z[n, g]) * s[n, g]
 *         xe / xo: the even / odd columns of x, (M, K/2); xs: per-group sums of x, (M, K/G).
 *   Because sum_k x_k (q_k - z) s = s * (sum_k x_k q_k - z * sum_k x_k), the inner loop
 *   only converts nibbles and FMAs; the zero point costs one scalar term per group.
 */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* K % 16 == 0. */
void kvm_int8_gemm(const float* x, int64_t M, int64_t K, const int8_t* w, const float* s,
                   int64_t N, float* y) {
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* wr = w + n * K;
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {  /* 4 input rows share each converted weight vector */
            const float *x0 = x + m * K, *x1 = x0 + K, *x2 = x1 + K, *x3 = x2 + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                __m256 wv = load_i8(wr + k);
                a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0 + k), a0);
                a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x1 + k), a1);
                a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x2 + k), a2);
                a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x3 + k), a3);
            }
            y[(m + 0) * N + n] = hsum(a0) * s[n];
            y[(m + 1) * N + n] = hsum(a1) * s[n];
            y[(m + 2) * N + n] = hsum(a2) * s[n];
            y[(m + 3) * N + n] = hsum(a3) * s[n];
        }
        for (; m < M; m++) {  /* two accumulators hide the FMA latency */
            const float* xr = x + m * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0;
            for (int64_t k = 0; k < K; k += 16) {
                a0 = _mm256_fmadd_ps(load_i8(wr + k), _mm256_loadu_ps(xr + k), a0);
                a1 = _mm256_fmadd_ps(load_i8(wr + k + 8), _mm256_loadu_ps(xr + k + 8), a1);
            }
            y[m * N + n] = hsum(_mm256_add_ps(a0, a1)) * s[n];
        }
    }
}

/* G % 16 == 0, K % G == 0. */
void kvm_int4_gemm(const float* xe, const float* xo, const float* xs, int64_t M, int64_t K,
                   const uint8_t* w, const uint16_t* s, const uint16_t* z, int64_t N, int64_t G,
                   float* y) {
    const int64_t ng = K / G, hg = G / 2, K2 = K / 2;
    const __m128i mask = _mm_set1_epi8(0x0F);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* wr = w + n * K2;
        const uint16_t *sr = s + n * ng, *zr = z + n * ng;
        for (int64_t m = 0; m < M; m++) {
            const float *xem = xe + m * K2, *xom = xo + m * K2, *xsm = xs + m * ng;
            __m256 tot = _mm256_setzero_ps();
            float corr = 0.0f;
            for (int64_t g = 0; g < ng; g++) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0;
                for (int64_t j = g * hg; j < (g + 1) * hg; j += 8) {
                    __m128i b = _mm_loadl_epi64((const __m128i*)(wr + j));
                    __m128i lo = _mm_and_si128(b, mask);
                    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
                    a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), _mm256_loadu_ps(xem + j), a0);
                    a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), _mm256_loadu_ps(xom + j), a1);
                }
                float sg = _cvtsh_ss(sr[g]);
                tot = _mm256_fmadd_ps(_mm256_set1_ps(sg), _mm256_add_ps(a0, a1), tot);
                corr += sg * _cvtsh_ss(zr[g]) * xsm[g];
            }
            y[m * N + n] = hsum(tot) - corr;
        }
    }
}
