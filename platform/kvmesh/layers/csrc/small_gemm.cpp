// GEMM for decode batches on CPU: y (M, N) = x (M, K) @ w (N, K)^T + b, for a few to a few
// dozen rows (a continuous batch of decodes).
//
// Why: at M = 8..64 a linear layer of a small model is neither bound by its FLOPs nor by
// reading its weight, and oneDNN's packed GEMM pays for both one after the other. All of
// SmolLM2-135M's decoder linears, 2 threads, Intel Xeon (AVX-512), weights out of cache:
// at 48 rows oneDNN runs at ~140-160 GFLOP/s (65-72 ms) against ~190 with the same weights
// in cache and ~300 on prefill-sized inputs; this kernel at ~170-200 (51-60 ms). See
// layers/ops.py for the row range where it is used and the ratios measured.
//
// How: the activations are transposed once into xt (K, MP), MP = M rounded up to a register
// tile of rows (AVX-512: whole 16-lane vectors plus at most one 8-lane half), so that the M
// rows of one k are MV contiguous vectors. Each task owns NR weight
// rows at a time: per k it loads the MV vectors of xt (from L1 / L2) and broadcasts the NR
// weights w[n][k] (NR sequential row streams of the plain row-major weight, prefetched
// ahead), accumulating an NR x MV register tile of outputs. Every weight element is read
// once per call (from DRAM) and used M times from a register; there is no packed copy of the
// weight. Inputs wider than one register tile of rows loop over row blocks inside the task,
// re-reading the NR weight rows from L1.
//
// Numerics: fp32 accumulation in k order, one accumulator per output (a plain matmul with a
// different summation order from oneDNN's). fp32 weights, or bf16 / fp16 weights widened in
// registers (x then in fp32).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec_math.h"

namespace {

using namespace kvmesh_vec;

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }
inline float widen(at::Half v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
// Register tiles (weight rows x row vectors), at most 32 zmm: NR * (MV + H) accumulators,
// MV + H x vectors and a broadcast. H = 1 adds a half-width (8-lane ymm) vector of rows, so a
// tile covers rows in steps of 8, not 16: on AMD Zen 4, which runs a 512-bit FMA as two
// 256-bit halves, 40 rows cost 2.5 vectors of FMAs rather than 3 (at 48 rows these linears are
// FMA-bound there). On Intel's two 512-bit FMA ports a ymm FMA costs what a zmm one does, and
// the half vector is a wash.
constexpr int kMaxMV = 4;
constexpr bool kHalf = true;
template <int MV, int H> struct Tile;
template <> struct Tile<1, 0> { static constexpr int NR = 16; };
template <> struct Tile<1, 1> { static constexpr int NR = 12; };
template <> struct Tile<2, 0> { static constexpr int NR = 12; };
template <> struct Tile<2, 1> { static constexpr int NR = 8; };
template <> struct Tile<3, 0> { static constexpr int NR = 8; };
template <> struct Tile<3, 1> { static constexpr int NR = 6; };
template <> struct Tile<4, 0> { static constexpr int NR = 6; };
using hvec = __m256;
inline hvec hzero() { return _mm256_setzero_ps(); }
inline hvec hload(const float* p) { return _mm256_loadu_ps(p); }
inline void hstore(float* p, hvec v) { _mm256_storeu_ps(p, v); }
inline hvec hlow(vec v) { return _mm512_castps512_ps256(v); }
inline hvec hfma(hvec a, hvec b, hvec c) { return _mm256_fmadd_ps(a, b, c); }
#else
// 16 ymm (AVX2): NR * MV <= 12; no half vectors.
constexpr int kMaxMV = 2;
constexpr bool kHalf = false;
template <int MV, int H> struct Tile;
template <> struct Tile<1, 0> { static constexpr int NR = 8; };
template <> struct Tile<2, 0> { static constexpr int NR = 5; };
using hvec = vec;  // (never used: H is 0)
inline hvec hzero() { return vzero(); }
inline hvec hload(const float* p) { return vload(p); }
inline void hstore(float* p, hvec v) { vstore(p, v); }
inline hvec hlow(vec v) { return v; }
inline hvec hfma(hvec a, hvec b, hvec c) { return vfma(a, b, c); }
#endif
constexpr int64_t kHW = W / 2;  // lanes of a half vector

// acc[r][v] += w[r][k] * xt[k][v] over all k, for R weight rows starting at w (row stride K)
// and MV vectors (plus H half vectors) of rows starting at xt (k stride ld); writes the
// R x (MV * W + H * W / 2) tile to out.
template <int MV, int H, int R, typename T>
inline void tile(const float* xt, int64_t ld, const T* w, int64_t K, float* out) {
  constexpr int64_t MB = MV * W + H * kHW;
  vec acc[R][MV > 0 ? MV : 1];
  hvec hacc[R];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < MV; ++v) acc[r][v] = vzero();
    if constexpr (H) hacc[r] = hzero();
  }
  // One k: MV (+ H) vectors of x against R broadcast weights.
  auto step = [&](int64_t kk) __attribute__((always_inline)) {
    vec xv[MV > 0 ? MV : 1];
    for (int v = 0; v < MV; ++v) xv[v] = vload(xt + kk * ld + v * W);
    hvec xh;
    if constexpr (H) xh = hload(xt + kk * ld + MV * W);
    for (int r = 0; r < R; ++r) {
      const vec wb = vset1(widen(w[r * K + kk]));
      for (int v = 0; v < MV; ++v) acc[r][v] = vfma(wb, xv[v], acc[r][v]);
      if constexpr (H) hacc[r] = hfma(hlow(wb), xh, hacc[r]);
    }
  };
  // kPrefetch: the same k of the weight tile two tiles ahead (R rows are contiguous, so that is
  // 2 * R * K elements on), into L2, once per 16 k (a 64-byte line). A row's own stream is too
  // short (K = 576: 2.3 KiB) for the hardware prefetcher to run ahead of, and prefetching
  // 512 elements along the row (csrc/skinny_gemm.cpp's distance) only touched the tile's
  // next row: all decoder linears, 48 rows, 72-79 -> 55-61 ms; one or four tiles ahead were
  // no better, nor an extra prefetch into L1.
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    for (int r = 0; r < R; ++r) __builtin_prefetch(w + r * K + k + 2 * R * K, 0, 1);
#pragma GCC unroll 4
    for (int64_t kk = k; kk < k + 16; ++kk) step(kk);
  }
  for (; k < K; ++k) step(k);
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < MV; ++v) vstore(out + r * MB + v * W, acc[r][v]);
    if constexpr (H) hstore(out + r * MB + MV * W, hacc[r]);
  }
}

// Rows [m0, m0 + rows) of y for weight rows [n, n + R): scatter the tile (R x rows) into y.
template <typename T>
inline void put(const float* out, int64_t stride, int64_t R, int64_t m0, int64_t rows, int64_t n, const T* b,
                T* y, int64_t N) {
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t r = 0; r < R; ++r) {
      const float bias = b ? widen(b[n + r]) : 0.f;
      y[(m0 + m) * N + n + r] = static_cast<T>(out[r * stride + m] + bias);
    }
}

// One task: weight rows [n_begin, n_end), every row block of x.
template <int MV, int H, typename T>
void run_rows(const float* xt, int64_t M, int64_t ld, const T* w, const T* b, T* y, int64_t N, int64_t K,
              int64_t n_begin, int64_t n_end) {
  constexpr int NR = Tile<MV, H>::NR;
  constexpr int64_t MB = MV * W + H * kHW;  // rows of x per register tile
  float out[NR * MB];
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR)
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      tile<MV, H, NR>(xt + m0, ld, w + n * K, K, out);
      put(out, MB, NR, m0, std::min(MB, M - m0), n, b, y, N);
    }
  for (; n < n_end; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      tile<MV, H, 1>(xt + m0, ld, w + n * K, K, out);
      put(out, MB, 1, m0, std::min(MB, M - m0), n, b, y, N);
    }
}

#if defined(__AVX512F__)
// 16 x 16 block transpose: rows r[0..15] (16 floats each, stride ld) -> out rows (stride ldo).
inline void transpose16(const float* in, int64_t ld, float* out, int64_t ldo) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * ld);
  for (int i = 0; i < 16; i += 2) {  // interleave pairs of rows: 32-bit elements
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 64-bit pairs across row pairs
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes across row quads
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + i * ldo, r[i]);  // r[i]: input column i
}
constexpr int64_t kTB = 16;
#elif defined(__AVX2__)
// 8 x 8 block transpose.
inline void transpose8(const float* in, int64_t ld, float* out, int64_t ldo) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * ld);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + i * ldo, t[i]);  // t[i]: input column i
}
constexpr int64_t kTB = 8;
#else
constexpr int64_t kTB = 0;
#endif

// xt[k][m] = x[m][k] in fp32 (k stride ld), rows M .. MP zero. fp32 inputs transpose in
// kTB x kTB register blocks (a scalar loop here took ~40 us for 48 x 1536, on the step's
// critical path), the edges and other dtypes element by element.
template <typename T>
void transpose_in(const T* x, int64_t M, int64_t K, int64_t MP, int64_t ld, float* xt) {
  int64_t m_done = 0, k_done = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    m_done = M / kTB * kTB;
    k_done = K / kTB * kTB;
    for (int64_t m0 = 0; m0 < m_done; m0 += kTB)
      for (int64_t k0 = 0; k0 < k_done; k0 += kTB)
#if defined(__AVX512F__)
        transpose16(x + m0 * K + k0, K, xt + k0 * ld + m0, ld);
#else
        transpose8(x + m0 * K + k0, K, xt + k0 * ld + m0, ld);
#endif
  }
#endif
  // the rest: rows m_done .. M for every k, and columns k_done .. K for the blocked rows
  for (int64_t k = 0; k < K; ++k) {
    float* o = xt + k * ld;
    for (int64_t m = (k < k_done ? m_done : 0); m < M; ++m) o[m] = widen(x[m * K + k]);
    for (int64_t m = M; m < MP; ++m) o[m] = 0.f;
  }
}

// MP: M rounded up to a whole register tile of rows; ld: MP rounded up to whole vectors (so
// every k's row of xt starts on a 64-byte line).
template <int MV, int H, typename T>
void small(const T* x, int64_t M, int64_t MP, const T* w, const T* b, T* y, int64_t N, int64_t K) {
  constexpr int NR = Tile<MV, H>::NR;
  const int64_t ld = (MP + W - 1) / W * W;
  const int64_t tiles = (N + NR - 1) / NR;
  // Contiguous weight-row ranges per thread: each weight element is streamed by one thread.
  // Each thread transposes x into its own buffer: one shared copy, made by one thread, cost
  // the others a cross-core read of all of it (at 48 x 1536, more than their share of the
  // GEMM for the narrow projections) and left them idle while it was made.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // Reused across calls: a fresh 100-300 KiB allocation came back as new pages to fault in.
    // Aligned to 64 bytes, so that no vector of xt straddles two cache lines.
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(K * ld + 16)) scratch.resize(K * ld + 16);
    const uintptr_t base = reinterpret_cast<uintptr_t>(scratch.data());
    float* xt = reinterpret_cast<float*>((base + 63) & ~static_cast<uintptr_t>(63));
    transpose_in(x, M, K, MP, ld, xt);
    run_rows<MV, H>(xt, M, ld, w, b, y, N, K, begin * NR, std::min(N, end * NR));
  });
}

// The register tile for M rows: the fewest (half) vectors that cover M in one block; wider
// inputs loop over blocks of the widest tile. Returns (MV, H) as MV * 2 + H.
inline int tile_shape(int64_t M) {
  if (M > kMaxMV * W) return kMaxMV * 2;
  if (kHalf) {
    const int64_t halves = (M + kHW - 1) / kHW;
    return static_cast<int>(halves);  // (halves / 2) vectors and (halves % 2) half vectors
  }
  return static_cast<int>((M + W - 1) / W) * 2;
}

inline int64_t tile_rows(int shape) { return shape / 2 * W + shape % 2 * kHW; }

template <typename T>
void dispatch(const T* x, int64_t M, int64_t MP, const T* w, const T* b, T* y, int64_t N, int64_t K) {
  switch (tile_shape(M)) {
    case 2: small<1, 0>(x, M, MP, w, b, y, N, K); break;
    case 4: small<2, 0>(x, M, MP, w, b, y, N, K); break;
#if defined(__AVX512F__)
    case 3: small<1, 1>(x, M, MP, w, b, y, N, K); break;
    case 5: small<2, 1>(x, M, MP, w, b, y, N, K); break;
    case 6: small<3, 0>(x, M, MP, w, b, y, N, K); break;
    case 7: small<3, 1>(x, M, MP, w, b, y, N, K); break;
    case 8: small<4, 0>(x, M, MP, w, b, y, N, K); break;
#endif
    default: TORCH_CHECK(false, "small_linear: bad tile");
  }
}

}  // namespace

namespace kvmesh_cpu {

at::Tensor small_linear(const at::Tensor& x_in, const at::Tensor& w_in, const std::optional<at::Tensor>& b_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "small_linear: x (M, K) and weight (N, K)");
  TORCH_CHECK(x_in.scalar_type() == w_in.scalar_type(), "small_linear: x and weight dtypes differ");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  // A few rows are bound by the weight stream, and the skinny GEMM's R row streams of whole
  // vectors keep it fuller than the NR broadcast streams here. All of SmolLM2's decoder
  // linears, 2 threads, weights out of cache, Zen 4: AVX-512, 8 rows 21.8-25.2 -> 16.4-17.4 ms
  // (lm_head 5.4-5.9 -> 3.8 ms; from 10 rows on this kernel is as fast or faster); the AVX2
  // build, 6 rows 18.3-18.8 -> 15.0-16.9 ms, but at 8 rows its one-row tiles take 31 ms to 19.
  constexpr int64_t kSkinnyRows = kvmesh_vec::W >= 16 ? kSkinnyMaxRows : 6;
  if (M > 0 && M <= kSkinnyRows) return skinny_linear(x_in, w_in, b_in);
  auto w = w_in.contiguous();
  auto y = at::empty({M, N}, x_in.options());
  if (M == 0) return y;
  at::Tensor b;
  if (b_in.has_value() && b_in->defined()) {
    b = b_in->contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N && b.scalar_type() == w.scalar_type(), "small_linear: bias (N,)");
  }
  // x is transposed (inside each task) into xt (K, MP): fp32, rows padded with zeros to a whole
  // register tile of rows.
  const int64_t mb = tile_rows(tile_shape(M));
  const int64_t MP = (M + mb - 1) / mb * mb;
  auto x = x_in.contiguous();
  switch (w.scalar_type()) {
    case at::kFloat:
      dispatch<float>(x.data_ptr<float>(), M, MP, w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                      y.data_ptr<float>(), N, K);
      break;
    case at::kBFloat16:
      dispatch<at::BFloat16>(x.data_ptr<at::BFloat16>(), M, MP, w.data_ptr<at::BFloat16>(),
                             b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), N, K);
      break;
    case at::kHalf:
      dispatch<at::Half>(x.data_ptr<at::Half>(), M, MP, w.data_ptr<at::Half>(),
                         b.defined() ? b.data_ptr<at::Half>() : nullptr, y.data_ptr<at::Half>(), N, K);
      break;
    default:
      TORCH_CHECK(false, "small_linear supports float32, bfloat16 and float16, not ", w.scalar_type());
  }
  return y;
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) { m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("small_linear", &kvmesh_cpu::small_linear); }
