// GEMM for decode batches on CPU: y (M, N) = x (M, K) @ w (N, K)^T + b, for a few to a few
// dozen rows (a continuous batch of decodes).
//
// Why: at M = 12..64 a linear layer of a small model is neither bound by its FLOPs nor by
// reading its weight, and oneDNN's packed GEMM pays for both one after the other. All of
// SmolLM2-135M's decoder linears, 2 threads, Intel Xeon (AVX-512), weights out of cache:
// at 48 rows oneDNN runs at ~145-160 GFLOP/s (65-72 ms) against ~190 with the same weights
// in cache and ~300 on prefill-sized inputs; this kernel at ~175-185 (55-58 ms). See
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

template <int MV, typename T>
void small(const float* xt, int64_t M, int64_t MP, const T* w, const T* b, T* y, int64_t N, int64_t K) {
  constexpr int NR = Tile<MV>::NR;
  const int64_t tiles = (N + NR - 1) / NR;
  // Contiguous weight-row ranges per thread: each weight element is streamed by one thread.
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    run_rows<MV>(xt, M, MP, w, b, y, N, K, begin * NR, std::min(N, end * NR));
  });
}

template <typename T>
void dispatch(const float* xt, int64_t M, int64_t MP, const T* w, const T* b, T* y, int64_t N, int64_t K) {
  // Fewest vectors per register tile that cover M in one block; wider inputs loop over
  // blocks of the widest tile.
  const int64_t mv = std::min<int64_t>(kMaxMV, (M + W - 1) / W);
  switch (mv) {
    case 1: small<1>(xt, M, MP, w, b, y, N, K); break;
    case 2: small<2>(xt, M, MP, w, b, y, N, K); break;
#if defined(__AVX512F__)
    case 3: small<3>(xt, M, MP, w, b, y, N, K); break;
    case 4: small<4>(xt, M, MP, w, b, y, N, K); break;
#endif
    default: TORCH_CHECK(false, "small_linear: bad tile");
  }
}

// xt[k][m] = x[m][k] in fp32, rows M .. MP zero: 16 k at a time, so that each row of x is read
// in whole cache lines and each line of xt is written while it is in L1.
template <typename T>
void transpose_in(const T* x, int64_t M, int64_t K, int64_t MP, float* xt) {
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t kn = std::min<int64_t>(16, K - k0);
    for (int64_t m = 0; m < M; ++m) {
      const T* row = x + m * K + k0;
      for (int64_t j = 0; j < kn; ++j) xt[(k0 + j) * MP + m] = widen(row[j]);
    }
    for (int64_t j = 0; j < kn; ++j)
      for (int64_t m = M; m < MP; ++m) xt[(k0 + j) * MP + m] = 0.f;
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
  // xt (K, MP): x transposed, in fp32, rows padded with zeros to a whole vector tile.
  const int64_t mb = std::min<int64_t>(kMaxMV, (M + W - 1) / W) * W;
  const int64_t MP = (M + mb - 1) / mb * mb;
  auto xt = at::empty({K, MP}, x_in.options().dtype(at::kFloat));
  float* xp = xt.data_ptr<float>();
  switch (x_in.scalar_type()) {
    case at::kFloat: transpose_in(x_in.contiguous().data_ptr<float>(), M, K, MP, xp); break;
    case at::kBFloat16: transpose_in(x_in.contiguous().data_ptr<at::BFloat16>(), M, K, MP, xp); break;
    case at::kHalf: transpose_in(x_in.contiguous().data_ptr<at::Half>(), M, K, MP, xp); break;
    default: TORCH_CHECK(false, "small_linear supports float32, bfloat16 and float16, not ", x_in.scalar_type());
  }
  switch (w.scalar_type()) {
    case at::kFloat:
      dispatch<float>(xp, M, MP, w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                      y.data_ptr<float>(), N, K);
      break;
    case at::kBFloat16:
      dispatch<at::BFloat16>(xp, M, MP, w.data_ptr<at::BFloat16>(), b.defined() ? b.data_ptr<at::BFloat16>() : nullptr,
                             y.data_ptr<at::BFloat16>(), N, K);
      break;
    case at::kHalf:
      dispatch<at::Half>(xp, M, MP, w.data_ptr<at::Half>(), b.defined() ? b.data_ptr<at::Half>() : nullptr,
                         y.data_ptr<at::Half>(), N, K);
      break;
    default:
      TORCH_CHECK(false, "small_linear supports float32, bfloat16 and float16, not ", w.scalar_type());
  }
  return y;
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) { m.def("small_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("small_linear", &kvmesh_cpu::small_linear); }
