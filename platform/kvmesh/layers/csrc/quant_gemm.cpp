/* Weight-only int8 / int4 GEMM for skinny inputs (decode) on x86-64 with AVX2 + FMA + F16C.
 *
 * Why a kernel of our own: PyTorch 2.13's CPU ops for this (`_weight_int8pack_mm`,
 * `_weight_int4pack_mm_for_cpu`) measured 3-10x SLOWER than the float32 matmul at
 * batch 1 on an AVX2-only EPYC (see benchmarks/README.md), and a dequantize-then-
 * matmul reads more bytes than float32 does. Decode is memory-bound once the inner loop
 * is cheap: these loops read each weight byte once, convert it in registers and FMA it
 * against up to 4 input rows at a time (a tile shares each converted weight vector).
 * Activations stay float32: results equal dequantize-then-matmul up to summation order.
 *
 * Threads: OpenMP over output rows (each thread streams one contiguous block of rows), in
 * torch's OpenMP pool (this file is part of the one native build, layers/native.py).
 *
 * CPUs without AVX2 / FMA / F16C get no quantized kernel (`has_quant_gemm()` is false and
 * the Python side dequantizes then multiplies); decode_stack never sends them one.
 *
 * Layouts (row-major over the output dim N, as in kvmesh/quant/primitives.py):
 *   int8: w (N, K) int8, s (N, K/G) float32 (G == K: per channel):  w[n,k] = q * s[n, k/G]
 *   int4: w (N, K/2) uint8, column 2j in the low nibble of byte j, 2j+1 in the high one;
 *         s, o (N, K/G) float16 bits, and per group g, with q in [0, 15]:
 *           mode 0 (zero points: kvmesh int4, GPTQ, AWQ, GGUF Q4_0): w = (q - o) * s
 *           mode 1 (mins: GGUF Q4_1):                                w = q * s + o
 *   Both are w = q * s + b (b = -o * s, or o), so
 *     sum_k x_k w_k = sum_k x_k (q_k s_g) + sum_g b_g * (sum of x over group g):
 *   the inner loop only converts nibbles and FMAs them against x, each group's sum is
 *   scaled once, and the offsets cost one vectorized dot product per output row.
 *   The even / odd columns of x (and its group sums) are split once per call into a
 *   scratch buffer, so the nibbles of 16 bytes meet 16 contiguous floats each.
 *
 * AVX-512 (where the CPU has AVX-512 F / BW: the build is -march=native, layers/native.py): the same
 * layouts, 16 lanes. An int4 group of 32 weights is then one 16-byte load that widens into a
 * single register (low nibbles = 16 even columns, high = 16 odd ones); the nibbles are scaled
 * before the FMA (2 multiplies a group, shared by the rows) instead of scaling a per-group
 * partial sum, so the accumulators run across groups, two sets of them (even / odd groups)
 * to hide the FMA latency. The AVX2 loops are unchanged.
 *
 * Measured, batch-1 Q4_1 decode of SmolLM2-135M, 2 threads, Intel Xeon (AVX-512), weights out
 * of cache: the decoder's GEMMs 13.1 ms a step (5 GB/s) -> 7.1-7.3 with the row prefetch below
 * and these loops (the prefetch did most of it); its int8 (Q8_0) lm_head 3.9 -> 2.6 ms; the
 * whole step 15.4 -> 11.4 ms (65 -> 88 tok/s).
 */
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

namespace kvmesh_cpu {
namespace {

#define MT_MAX 4
#define INLINE static inline __attribute__((always_inline))

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE __m256 load_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* ---------------------------------------------------------------- int8 */

/* Output row n for MT input rows: y[r] = sum_g s[g] * (x_r . q_g). */
INLINE void int8_tile(const int MT, const float* x, int64_t K, const int8_t* wr, const float* sr,
                      int64_t G, float* out) {
    __m256 tot[MT_MAX];
    for (int r = 0; r < MT; r++) tot[r] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        __m256 a0[MT_MAX], a1[MT_MAX];  /* two accumulators per row hide the FMA latency */
        for (int r = 0; r < MT; r++) a0[r] = a1[r] = _mm256_setzero_ps();
        for (int64_t k = g0; k < g0 + G; k += 16) {
            const __m256 w0 = load_i8(wr + k), w1 = load_i8(wr + k + 8);
            for (int r = 0; r < MT; r++) {
                a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K + k), a0[r]);
                a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K + k + 8), a1[r]);
            }
        }
        const __m256 vs = _mm256_broadcast_ss(sr + g0 / G);
        for (int r = 0; r < MT; r++) tot[r] = _mm256_fmadd_ps(vs, _mm256_add_ps(a0[r], a1[r]), tot[r]);
    }
    for (int r = 0; r < MT; r++) out[r] = hsum(tot[r]);
}

/* ---------------------------------------------------------------- int4 */

/* Output row n for MT input rows: sum_g s_g * sum_{k in g} x_k q_k, x split into even (xe) /
 * odd (xo) columns, (M, K/2) each. Each 8 weight bytes zero-extend straight from memory
 * into 32-bit lanes (vpmovzxbd), where the low nibble is `& 15` and the high one `>> 4`;
 * the nibbles convert to float and FMA against x unscaled, and each group's sum is scaled
 * once: 4 FMAs per 32 weights instead of 4 multiplies + 4 FMAs. */
INLINE void int4_tile(const int MT, const float* xe, const float* xo, int64_t K2, const uint8_t* wr,
                      const float* sf, int64_t ng, int64_t hg, float* out) {
    const __m256i mask = _mm256_set1_epi32(0x0F);
    __m256 tot[MT_MAX];
    for (int r = 0; r < MT; r++) tot[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m256 a0[MT_MAX], a1[MT_MAX];
        for (int r = 0; r < MT; r++) a0[r] = a1[r] = _mm256_setzero_ps();
        for (int64_t j = g * hg; j < (g + 1) * hg; j += 16) {
            const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(wr + j)));
            const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(wr + j + 8)));
            const __m256 w0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, mask));   /* xe[j .. j+7]    */
            const __m256 w1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask));   /* xe[j+8 .. j+15] */
            const __m256 w2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));     /* xo[j .. j+7]    */
            const __m256 w3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));     /* xo[j+8 .. j+15] */
            for (int r = 0; r < MT; r++) {
                const float *e = xe + r * K2 + j, *o = xo + r * K2 + j;
                a0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(e), a0[r]);
                a1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(e + 8), a1[r]);
                a0[r] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(o), a0[r]);
                a1[r] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(o + 8), a1[r]);
            }
        }
        const __m256 vs = _mm256_broadcast_ss(sf + g);
        for (int r = 0; r < MT; r++) tot[r] = _mm256_fmadd_ps(vs, _mm256_add_ps(a0[r], a1[r]), tot[r]);
    }
    for (int r = 0; r < MT; r++) out[r] = hsum(tot[r]);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVM_AVX512 1
/* int8, 16 lanes: per group, two accumulators per row over 32 weights an iteration (G % 32
 * == 0) or one (G % 16 == 0), scaled once per group as in int8_tile. */
INLINE void int8_tile512(const int MT, const float* x, int64_t K, const int8_t* wr, const float* sr,
                         int64_t G, float* out) {
    __m512 tot[MT_MAX];
    for (int r = 0; r < MT; r++) tot[r] = _mm512_setzero_ps();
    for (int64_t g0 = 0; g0 < K; g0 += G) {
        __m512 a0[MT_MAX], a1[MT_MAX];
        for (int r = 0; r < MT; r++) a0[r] = a1[r] = _mm512_setzero_ps();
        int64_t k = g0;
        for (; k + 32 <= g0 + G; k += 32) {
            const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + k))));
            const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + k + 16))));
            for (int r = 0; r < MT; r++) {
                a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * K + k), a0[r]);
                a1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + r * K + k + 16), a1[r]);
            }
        }
        if (k < g0 + G) {  /* G % 32 == 16 */
            const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(wr + k))));
            for (int r = 0; r < MT; r++) a0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * K + k), a0[r]);
        }
        const __m512 vs = _mm512_set1_ps(sr[g0 / G]);
        for (int r = 0; r < MT; r++) tot[r] = _mm512_fmadd_ps(vs, _mm512_add_ps(a0[r], a1[r]), tot[r]);
    }
    for (int r = 0; r < MT; r++) out[r] = _mm512_reduce_add_ps(tot[r]);
}

/* One int4 group g (hg bytes, a multiple of 16) into the accumulators ae / ao of MT rows. */
INLINE void int4_group512(const int MT, const float* xe, const float* xo, int64_t K2, const uint8_t* wr,
                          float scale, int64_t j0, int64_t hg, __m512* ae, __m512* ao) {
    const __m512i mask = _mm512_set1_epi32(0x0F);
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t j = j0; j < j0 + hg; j += 16) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(wr + j)));
        const __m512 we = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, mask)), vs);  /* xe[j .. j+15] */
        const __m512 wo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), vs);    /* xo[j .. j+15] */
        for (int r = 0; r < MT; r++) {
            ae[r] = _mm512_fmadd_ps(we, _mm512_loadu_ps(xe + r * K2 + j), ae[r]);
            ao[r] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(xo + r * K2 + j), ao[r]);
        }
    }
}

/* sum_k x_k (q_k s_g) for MT rows: groups alternate between two accumulator sets. */
INLINE void int4_tile512(const int MT, const float* xe, const float* xo, int64_t K2, const uint8_t* wr,
                         const float* sf, int64_t ng, int64_t hg, float* out) {
    __m512 e0[MT_MAX], o0[MT_MAX], e1[MT_MAX], o1[MT_MAX];
    for (int r = 0; r < MT; r++) e0[r] = o0[r] = e1[r] = o1[r] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 2 <= ng; g += 2) {
        int4_group512(MT, xe, xo, K2, wr, sf[g], g * hg, hg, e0, o0);
        int4_group512(MT, xe, xo, K2, wr, sf[g + 1], (g + 1) * hg, hg, e1, o1);
    }
    if (g < ng) int4_group512(MT, xe, xo, K2, wr, sf[g], g * hg, hg, e0, o0);
    for (int r = 0; r < MT; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(e0[r], o0[r]), _mm512_add_ps(e1[r], o1[r])));
}
#define INT8_TILE int8_tile512
#define INT4_TILE int4_tile512
#else
#define INT8_TILE int8_tile
#define INT4_TILE int4_tile
#endif

/* float scales sf and offsets bf (b = -o * s, or o) of one output row. */
static void int4_row_params(const uint16_t* sr, const uint16_t* orow, int32_t mode, int64_t ng, float* sf,
                            float* bf) {
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) {
        const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sr + g)));
        const __m256 o8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(orow + g)));
        _mm256_storeu_ps(sf + g, s8);
        _mm256_storeu_ps(bf + g, mode ? o8 : _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(o8, s8)));
    }
    for (; g < ng; g++) {
        sf[g] = _cvtsh_ss(sr[g]);
        bf[g] = mode ? _cvtsh_ss(orow[g]) : -_cvtsh_ss(orow[g]) * sf[g];
    }
}

INLINE float dot(const float* a, const float* b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float t = hsum(acc);
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* kPrefetch: rows of a decoder weight are short (K = 576: 288 bytes, with 36 + 36 bytes of
 * scales and offsets in two other arrays), too short for the hardware prefetcher to run ahead
 * of, so each row fetches row n + INT4_PREFETCH_ROWS into L2 (prefetcht1) while it is
 * computed (int8 rows likewise, INT8_PREFETCH_ROWS ahead). 4, 8, 12, 16 or 24 rows ahead
 * measured the same (7.1-7.5 ms for the decoder's int4 GEMMs), 32 worse. */
#ifndef INT8_PREFETCH_ROWS
#define INT8_PREFETCH_ROWS 8
#endif
#ifndef INT4_PREFETCH_ROWS
#define INT4_PREFETCH_ROWS 8
#endif
INLINE void prefetch_row(const uint8_t* w, const uint16_t* s, const uint16_t* o, int64_t K2, int64_t ng,
                         int64_t n, int64_t N) {
    if (n >= N) return;
    const char* wr = (const char*)(w + n * K2);
    for (int64_t b = 0; b < K2; b += 64) _mm_prefetch(wr + b, _MM_HINT_T1);
    for (int64_t b = 0; b < ng * 2; b += 64) {
        _mm_prefetch((const char*)(s + n * ng) + b, _MM_HINT_T1);
        _mm_prefetch((const char*)(o + n * ng) + b, _MM_HINT_T1);
    }
}

}  // namespace

/* K % 16 == 0, G % 16 == 0, K % G == 0. */
void int8_gemm(const float* x, int64_t M, int64_t K, const int8_t* w, const float* s, int64_t G,
                   int64_t N, float* y) {
    const int64_t ng = K / G;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* wr = w + n * K;
        const float* sr = s + n * ng;
        if (n + INT8_PREFETCH_ROWS < N) {  /* see kPrefetch above */
            const char* ahead = (const char*)(w + (n + INT8_PREFETCH_ROWS) * K);
            for (int64_t b = 0; b < K; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
            const char* sa = (const char*)(s + (n + INT8_PREFETCH_ROWS) * ng);
            for (int64_t b = 0; b < ng * 4; b += 64) _mm_prefetch(sa + b, _MM_HINT_T1);
        }
        float out[MT_MAX];
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) {
            INT8_TILE(4, x + m * K, K, wr, sr, G, out);
            for (int r = 0; r < 4; r++) y[(m + r) * N + n] = out[r];
        }
        const int64_t rest = M - m;
        if (rest == 0) continue;
        if (rest == 1) INT8_TILE(1, x + m * K, K, wr, sr, G, out);
        else if (rest == 2) INT8_TILE(2, x + m * K, K, wr, sr, G, out);
        else INT8_TILE(3, x + m * K, K, wr, sr, G, out);
        for (int r = 0; r < rest; r++) y[(m + r) * N + n] = out[r];
    }
}

/* G % 32 == 0, K % G == 0. Returns 0, or -1 when the scratch buffer cannot be allocated. */
int int4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, const uint16_t* s,
                  const uint16_t* o, int32_t mode, int64_t G, int64_t N, float* y) {
    const int64_t ng = K / G, hg = G / 2, K2 = K / 2;
    if (M == 0 || N == 0) return 0;
    float* scratch = (float*)malloc(sizeof(float) * (size_t)(M * K + M * ng));
    if (scratch == nullptr) return -1;
    float *xe = scratch, *xo = scratch + M * K2, *xs = scratch + M * K;
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * K;
        for (int64_t j = 0; j < K2; j++) {
            xe[m * K2 + j] = xr[2 * j];
            xo[m * K2 + j] = xr[2 * j + 1];
        }
        for (int64_t g = 0; g < ng; g++) {
            float t = 0.0f;
            for (int64_t k = g * G; k < (g + 1) * G; k++) t += xr[k];
            xs[m * ng + g] = t;
        }
    }
    #pragma omp parallel
    {
        float sf[ng], bf[ng];  /* this row's float scales and offsets */
        #pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t* wr = w + n * K2;
            prefetch_row(w, s, o, K2, ng, n + INT4_PREFETCH_ROWS, N);
            int4_row_params(s + n * ng, o + n * ng, mode, ng, sf, bf);
            float out[MT_MAX];
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) {
                INT4_TILE(4, xe + m * K2, xo + m * K2, K2, wr, sf, ng, hg, out);
                for (int r = 0; r < 4; r++) y[(m + r) * N + n] = out[r] + dot(bf, xs + (m + r) * ng, ng);
            }
            const int64_t rest = M - m;
            if (rest == 0) continue;
            if (rest == 1) INT4_TILE(1, xe + m * K2, xo + m * K2, K2, wr, sf, ng, hg, out);
            else if (rest == 2) INT4_TILE(2, xe + m * K2, xo + m * K2, K2, wr, sf, ng, hg, out);
            else INT4_TILE(3, xe + m * K2, xo + m * K2, K2, wr, sf, ng, hg, out);
            for (int r = 0; r < rest; r++) y[(m + r) * N + n] = out[r] + dot(bf, xs + (m + r) * ng, ng);
        }
    }
    free(scratch);
    return 0;
}

bool has_quant_gemm() { return true; }

}  // namespace kvmesh_cpu

#else  // no AVX2 / FMA / F16C: no quantized kernel (callers check has_quant_gemm first)

namespace kvmesh_cpu {
void int8_gemm(const float*, int64_t, int64_t, const int8_t*, const float*, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "kvmesh: the int8 CPU kernel needs AVX2, FMA and F16C");
}
int int4_gemm(const float*, int64_t, int64_t, const uint8_t*, const uint16_t*, const uint16_t*, int32_t, int64_t,
              int64_t, float*) {
  TORCH_CHECK(false, "kvmesh: the int4 CPU kernel needs AVX2, FMA and F16C");
}
bool has_quant_gemm() { return false; }
}  // namespace kvmesh_cpu

#endif

namespace kvmesh_cpu {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && qweight.dim() == 2 &&
                  qweight.scalar_type() == at::kChar && qweight.size(1) == x.size(1) && qweight.is_contiguous() &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == qweight.size(0),
              "int8_linear: x float32 (M, K), qweight int8 (N, K), scales float32 (N,) or (N, K / G)");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  const int64_t G = scales.dim() == 1 ? K : K / scales.size(1);
  TORCH_CHECK(K % 16 == 0 && G % 16 == 0 && K % G == 0, "int8_linear: K and the group size must be multiples of 16");
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  int8_gemm(xc.data_ptr<float>(), M, K, qweight.data_ptr<int8_t>(), scales.data_ptr<float>(), G, N,
            y.data_ptr<float>());
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& offsets, bool mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && qweight.dim() == 2 &&
                  qweight.scalar_type() == at::kByte && qweight.size(1) * 2 == x.size(1) && qweight.is_contiguous() &&
                  scales.scalar_type() == at::kHalf && offsets.scalar_type() == at::kHalf && scales.dim() == 2 &&
                  scales.sizes() == offsets.sizes() && scales.size(0) == qweight.size(0) && scales.is_contiguous() &&
                  offsets.is_contiguous(),
              "int4_linear: x float32 (M, K), packed qweight uint8 (N, K / 2), float16 scales and offsets (N, K / G)");
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  TORCH_CHECK(K % scales.size(1) == 0 && (K / scales.size(1)) % 32 == 0,
              "int4_linear: the group size must be a multiple of 32");
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  const int rc = int4_gemm(xc.data_ptr<float>(), M, K, qweight.data_ptr<uint8_t>(),
                           static_cast<const uint16_t*>(scales.data_ptr()), static_cast<const uint16_t*>(offsets.data_ptr()),
                           mins ? 1 : 0, K / scales.size(1), N, y.data_ptr<float>());
  TORCH_CHECK(rc == 0, "int4_linear: out of memory for the activation scratch buffer");
  return y;
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, bool mins) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("int8_linear", &kvmesh_cpu::int8_linear);
  m.impl("int4_linear", &kvmesh_cpu::int4_linear);
}
