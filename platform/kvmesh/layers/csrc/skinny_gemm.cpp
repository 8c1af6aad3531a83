// GEMM for decode-sized inputs on CPU: y (M, N) = x (M, K) @ w (N, K)^T + b, M <= 8.
//
// Why: at batch 1-8 a linear layer is a matrix-vector product bound by reading the weight
// once from DRAM. oneDNN's packed GEMM streams SmolLM2's weights at 17-25 GB/s there
// (1.8x the bandwidth floor per decode step); this kernel reads the plain row-major weight
// (the model's parameter, no packed copy) as R sequential row streams per thread, keeps
// the M inputs in L1 as fp32, and accumulates M x R dot products in vector registers, so
// the loop is one load per weight vector and nothing else.
//
// fp32 or bf16 / fp16 weights (widened in registers); accumulation in fp32; output in the
// weight's dtype. Rows are split across threads in blocks of 8 tiles of R rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "kernels.h"
#include "vec_math.h"

namespace {

using namespace kvmesh_vec;

// Dot products of M fp32 rows `xs` (M x K) with weight rows n .. n + R of `w`.
// kPrefetch note: each row stream prefetches the same k two tiles of R rows ahead (R rows are
// contiguous, so 2 * R * K elements on) into L2 / L3 (prefetcht2). Earlier it prefetched 512
// elements ahead along its own row (2 KiB: on an AMD EPYC, T2 streams at 31 GB/s over all of
// SmolLM2's weights from DRAM, where 1 KiB with NTA gave 24 and T0 / T1 26-30), but at
// K = 576 that lands in the tile's next row, which is being read anyway. On an Intel Xeon,
// 2 threads, all of SmolLM2's linears + lm_head: 1 row 25.2-26.1 -> 23.5-25.3 ms, 3 rows
// 28.9-29.5 -> 25.3-25.7 ms; one tile ahead did as well at 1 row, four tiles worse.
template <int M, int R, typename T>
inline void dot_rows(const float* xs, const T* w, int64_t K, float* out /* M x R */) {
  vec acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = vzero();
  const int64_t kv = K / W * W;
  for (int64_t k = 0; k < kv; k += W) {
    for (int r = 0; r < R; ++r) __builtin_prefetch(w + r * K + k + 2 * R * K, 0, 1);  // see the kPrefetch note
    vec wr[R];
    for (int r = 0; r < R; ++r) wr[r] = vload(w + r * K + k);
    for (int m = 0; m < M; ++m) {
      const vec xv = vload(xs + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = vfma(xv, wr[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = vsum(acc[m][r]);
      for (int64_t k = kv; k < K; ++k) s += xs[m * K + k] * static_cast<float>(w[r * K + k]);
      out[m * R + r] = s;
    }
}

// Weight rows per tile for M input rows. Up to 4 rows: 8, as measured (the table in
// layers/linear.py). 5-8 rows: the M x R accumulators, R weight vectors and an input vector
// within the register file (32 zmm; 16 ymm on AVX2). R changes the order rows are streamed
// in, not the bits: each output is one vector accumulator over k, then its horizontal sum.
template <int M>
constexpr int kTileRows = M <= 4 ? 8 : W >= 16 ? (M == 5 ? 5 : M == 6 ? 4 : 3) : (M <= 6 ? 2 : 1);

template <int M, typename T>
void skinny(const float* xs, const T* w, const T* b, T* y, int64_t N, int64_t K) {
  constexpr int R = kTileRows<M>;
  constexpr int64_t kRowsPerTask = 8 * R;  // 8 tiles: 64 rows (>= 16 KiB of weight) up to 4 inputs
  at::parallel_for(0, (N + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    float out[M * R];
    for (int64_t n = begin * kRowsPerTask, stop = std::min(N, end * kRowsPerTask); n < stop;) {
      const int64_t rows = stop - n >= R ? R : 1;
      if (rows == R)
        dot_rows<M, R>(xs, w + n * K, K, out);
      else
        dot_rows<M, 1>(xs, w + n * K, K, out);
      for (int m = 0; m < M; ++m)
        for (int64_t r = 0; r < rows; ++r) {
          const float bias = b ? static_cast<float>(b[n + r]) : 0.f;
          y[m * N + n + r] = static_cast<T>(out[m * rows + r] + bias);
        }
      n += rows;
    }
  });
}

template <typename T>
void dispatch_m(int64_t M, const float* xs, const T* w, const T* b, T* y, int64_t N, int64_t K) {
  switch (M) {
    case 1: skinny<1>(xs, w, b, y, N, K); break;
    case 2: skinny<2>(xs, w, b, y, N, K); break;
    case 3: skinny<3>(xs, w, b, y, N, K); break;
    case 4: skinny<4>(xs, w, b, y, N, K); break;
    case 5: skinny<5>(xs, w, b, y, N, K); break;
    case 6: skinny<6>(xs, w, b, y, N, K); break;
    case 7: skinny<7>(xs, w, b, y, N, K); break;
    case 8: skinny<8>(xs, w, b, y, N, K); break;
    default: TORCH_CHECK(false, "skinny_linear: at most ", kvmesh_cpu::kSkinnyMaxRows, " rows, got ", M);
  }
}

}  // namespace

namespace kvmesh_cpu {

at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& w_in, const std::optional<at::Tensor>& b_in) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "skinny_linear: x (M, K) and weight (N, K)");
  TORCH_CHECK(x_in.scalar_type() == w_in.scalar_type(), "skinny_linear: x and weight dtypes differ");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = w_in.size(0);
  auto w = w_in.contiguous();
  auto xs = x_in.to(at::kFloat).contiguous();
  auto y = at::empty({M, N}, x_in.options());
  at::Tensor b;
  if (b_in.has_value() && b_in->defined()) {
    b = b_in->contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == N && b.scalar_type() == w.scalar_type(), "skinny_linear: bias (N,)");
  }
  switch (w.scalar_type()) {
    case at::kFloat:
      dispatch_m<float>(M, xs.data_ptr<float>(), w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                        y.data_ptr<float>(), N, K);
      break;
    case at::kBFloat16:
      dispatch_m<at::BFloat16>(M, xs.data_ptr<float>(), w.data_ptr<at::BFloat16>(),
                               b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(), N, K);
      break;
    case at::kHalf:
      dispatch_m<at::Half>(M, xs.data_ptr<float>(), w.data_ptr<at::Half>(),
                           b.defined() ? b.data_ptr<at::Half>() : nullptr, y.data_ptr<at::Half>(), N, K);
      break;
    default:
      TORCH_CHECK(false, "skinny_linear supports float32, bfloat16 and float16, not ", w.scalar_type());
  }
  return y;
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) { m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("skinny_linear", &kvmesh_cpu::skinny_linear); }
