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
// How: the activations are transposed once into xt (K, MP), MP = M rounded up to the vector
// width, so that the M rows of one k are MV contiguous vectors. Each task owns NR weight
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
// Register tiles (weight rows x row vectors), at most 32 zmm: NR * MV accumulators, MV x
// vectors and a broadcast.
constexpr int kMaxMV = 4;
template <int MV> struct Tile;
template <> struct Tile<1> { static constexpr int NR = 16; };
template <> struct Tile<2> { static constexpr int NR = 12; };
template <> struct Tile<3> { static constexpr int NR = 8; };
template <> struct Tile<4> { static constexpr int NR = 6; };
#else
// 16 ymm (AVX2): NR * MV <= 12.
constexpr int kMaxMV = 2;
template <int MV> struct Tile;
template <> struct Tile<1> { static constexpr int NR = 8; };
template <> struct Tile<2> { static constexpr int NR = 5; };
#endif

// acc[r][v] += w[r][k] * xt[k][v] over all k, for R weight rows starting at w (row stride K)
// and MV vectors of rows starting at xt (k stride MP); writes the R x (MV * W) tile to out.
template <int MV, int R, typename T>
inline void tile(const float* xt, int64_t MP, const T* w, int64_t K, float* out) {
  vec acc[R][MV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) acc[r][v] = vzero();
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
    for (int64_t kk = k; kk < k + 16; ++kk) {
      vec xv[MV];
      for (int v = 0; v < MV; ++v) xv[v] = vload(xt + kk * MP + v * W);
      for (int r = 0; r < R; ++r) {
        const vec wb = vset1(widen(w[r * K + kk]));
        for (int v = 0; v < MV; ++v) acc[r][v] = vfma(wb, xv[v], acc[r][v]);
      }
    }
  }
  for (; k < K; ++k) {
    vec xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = vload(xt + k * MP + v * W);
    for (int r = 0; r < R; ++r) {
      const vec wb = vset1(widen(w[r * K + k]));
      for (int v = 0; v < MV; ++v) acc[r][v] = vfma(wb, xv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < MV; ++v) vstore(out + r * MV * W + v * W, acc[r][v]);
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
template <int MV, typename T>
void run_rows(const float* xt, int64_t M, int64_t MP, const T* w, const T* b, T* y, int64_t N, int64_t K,
              int64_t n_begin, int64_t n_end) {
  constexpr int NR = Tile<MV>::NR;
  constexpr int64_t MB = MV * W;  // rows of x per register tile
  float out[NR * MB];
  int64_t n = n_begin;
  for (; n + NR <= n_end; n += NR)
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      tile<MV, NR>(xt + m0, MP, w + n * K, K, out);
      put(out, MB, NR, m0, std::min(MB, M - m0), n, b, y, N);
    }
  for (; n < n_end; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      tile<MV, 1>(xt + m0, MP, w + n * K, K, out);
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

// xt[k][m] = x[m][k] in fp32, rows M .. MP zero. fp32 inputs transpose in kTB x kTB register
// blocks (a scalar loop here took ~40 us for 48 x 1536, on the step's critical path), the
// edges and other dtypes element by element.
template <typename T>
void transpose_in(const T* x, int64_t M, int64_t K, int64_t MP, float* xt) {
  int64_t m_done = 0, k_done = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (std::is_same_v<T, float>) {
    m_done = M / kTB * kTB;
    k_done = K / kTB * kTB;
    for (int64_t m0 = 0; m0 < m_done; m0 += kTB)
      for (int64_t k0 = 0; k0 < k_done; k0 += kTB)
#if defined(__AVX512F__)
        transpose16(x + m0 * K + k0, K, xt + k0 * MP + m0, MP);
#else
        transpose8(x + m0 * K + k0, K, xt + k0 * MP + m0, MP);
#endif
  }
#endif
  // the rest: rows m_done .. M for every k, and columns k_done .. K for the blocked rows
  for (int64_t k = 0; k < K; ++k) {
    float* o = xt + k * MP;
    for (int64_t m = (k < k_done ? m_done : 0); m < M; ++m) o[m] = widen(x[m * K + k]);
    for (int64_t m = M; m < MP; ++m) o[m] = 0.f;
  }
}

template <int MV, typename T>
void small(const T* x, int64_t M, int64_t MP, const T* w, const T* b, T* y, int64_t N, int64_t K) {
  constexpr int NR = Tile<MV>::NR;
  const int64_t tiles = (N + NR - 1) / NR;
  // Contiguous weight-row ranges per thread: each weight element is streamed by one thread.
  // Each thread transposes x into its own buffer: one shared copy, made by one thread, cost
  // the others a cross-core read of all of it (at 48 x 1536, more than their share of the
  // GEMM for the narrow projections) and left them idle while it was made.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    // Reused across calls: a fresh 100-300 KiB allocation came back as new pages to fault in.
    // Aligned to 64 bytes, so that no vector of xt straddles two cache lines.
    thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(K * MP + 16)) scratch.resize(K * MP + 16);
    const uintptr_t base = reinterpret_cast<uintptr_t>(scratch.data());
    float* xt = reinterpret_cast<float*>((base + 63) & ~static_cast<uintptr_t>(63));
    transpose_in(x, M, K, MP, xt);
    run_rows<MV>(xt, M, MP, w, b, y, N, K, begin * NR, std::min(N, end * NR));
  });
}

template <typename T>
void dispatch(const T* x, int64_t M, int64_t MP, const T* w, const T* b, T* y, int64_t N, int64_t K) {
  // Fewest vectors per register tile that cover M in one block; wider inputs loop over
  // blocks of the widest tile.
  const int64_t mv = std::min<int64_t>(kMaxMV, (M + W - 1) / W);
  switch (mv) {
    case 1: small<1>(x, M, MP, w, b, y, N, K); break;
    case 2: small<2>(x, M, MP, w, b, y, N, K); break;
#if defined(__AVX512F__)
    case 3: small<3>(x, M, MP, w, b, y, N, K); break;
    case 4: small<4>(x, M, MP, w, b, y, N, K); break;
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
  const int64_t mb = std::min<int64_t>(kMaxMV, (M + W - 1) / W) * W;
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
