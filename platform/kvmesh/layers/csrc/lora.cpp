// The batched multi-LoRA delta (SGMV: segmented gather matrix-vector) on CPU, in place:
//
//   for each segment i with slot s = slots[i] >= 0 (s < 0: base model, skipped), each row
//   t in [starts[i], starts[i] + lens[i]) and each shard l (columns off[l] .. off[l + 1]):
//     h[t, l, :]             = x[t, :] @ a[l, s]^T                          shrink: (K) -> (R)
//     y[t, off[l]:off[l+1]] += h[t, l, :] @ b[s, :, off[l]:off[l+1]]        expand: (R) -> (N_l)
//
// Layouts: x (T, K), y (T, N), a (L, S, R, K), b (S, R, N). B is stored transposed (rank-major)
// so that the expand streams contiguous rows of N: each output vector is R broadcast-FMAs of
// one vector of b, where the (N, R) layout would need R-long dot products and a horizontal sum
// per output (R = 8..64 is at most 4 AVX-512 vectors). The shards of a fused projection
// (q / k / v, gate / up) share one b; the LoRA scale (alpha / r) is folded into b; ranks are
// zero-padded to R. Segments must not overlap; rows outside every segment are untouched.
//
// Numerics: fp32 or bf16 tensors (one dtype for x, y, a, b); products and sums in fp32, h kept
// in fp32, y rounded once (bf16: to nearest even) after its delta is added.
//
// Work: the shrink is split into tasks of (segment, <= kRowBlock rows, shard, <= kRankChunk
// ranks), the expand into (segment, <= kRowBlock rows, kColsPerTask columns of one shard);
// each phase is one at::parallel_for over its tasks. A decode step (1 row per sequence) thus
// spreads over segments x tiles rather than over the few rows. The ISA is the build's
// (-march=native on the machine that runs it, see layers/native.py): vec_math.h's vectors.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "kernels.h"
#include "vec_math.h"

namespace {

using namespace kvmesh_vec;

constexpr int64_t kRowBlock = 16;
constexpr int64_t kRankChunk = 16;
constexpr int64_t kColsPerTask = 256;
// Output vectors per expand step: M x kNV accumulators fit the register file (32 zmm, 16 ymm).
constexpr int kNV = W >= 16 ? 4 : 2;

// One unit of work: rows [row, row + rows) under `slot`; shrink: ranks [lo, hi) of shard l;
// expand: columns [lo, hi) of shard l.
struct Task {
  int64_t row, rows, slot, l, lo, hi;
};

inline void store(float* p, vec v) { vstore(p, v); }
inline void store(at::BFloat16* p, vec v) {
  float tmp[W];
  vstore(tmp, v);
  for (int64_t j = 0; j < W; ++j) p[j] = static_cast<at::BFloat16>(tmp[j]);
}

// h[m * ldh + r] = dot(x[m * ldx, :K], a[r * K, :K]) for M rows and RR rank rows.
template <int M, int RR, typename T>
inline void shrink_tile(const T* x, int64_t ldx, const T* a, int64_t K, float* h, int64_t ldh) {
  vec acc[M][RR];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) acc[m][r] = vzero();
  const int64_t kv = K / W * W;
  for (int64_t k = 0; k < kv; k += W) {
    vec ar[RR];
    for (int r = 0; r < RR; ++r) ar[r] = vload(a + r * K + k);
    for (int m = 0; m < M; ++m) {
      const vec xv = vload(x + m * ldx + k);
      for (int r = 0; r < RR; ++r) acc[m][r] = vfma(xv, ar[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < RR; ++r) {
      float s = vsum(acc[m][r]);
      for (int64_t k = kv; k < K; ++k) s += static_cast<float>(x[m * ldx + k]) * static_cast<float>(a[r * K + k]);
      h[m * ldh + r] = s;
    }
}

template <int M, typename T>
void shrink_rows(const T* x, int64_t ldx, const T* a, int64_t K, int64_t ranks, float* h, int64_t ldh) {
  int64_t r = 0;
  for (; r + 4 <= ranks; r += 4) shrink_tile<M, 4>(x, ldx, a + r * K, K, h + r, ldh);
  for (; r < ranks; ++r) shrink_tile<M, 1>(x, ldx, a + r * K, K, h + r, ldh);
}

// y[m * ldy + n] += sum_r h[m * ldh + r] * b[r * ldb + n] for M rows and n in [0, cols).
template <int M, typename T>
void expand_rows(const float* h, int64_t ldh, int64_t R, const T* b, int64_t ldb, T* y, int64_t ldy,
                 int64_t cols) {
  int64_t n = 0;
  for (; n + kNV * W <= cols; n += kNV * W) {
    vec acc[M][kNV];
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < kNV; ++v) acc[m][v] = vload(y + m * ldy + n + v * W);
    for (int64_t r = 0; r < R; ++r) {
      vec bv[kNV];
      for (int v = 0; v < kNV; ++v) bv[v] = vload(b + r * ldb + n + v * W);
      for (int m = 0; m < M; ++m) {
        const vec hb = vset1(h[m * ldh + r]);
        for (int v = 0; v < kNV; ++v) acc[m][v] = vfma(hb, bv[v], acc[m][v]);
      }
    }
    for (int m = 0; m < M; ++m)
      for (int v = 0; v < kNV; ++v) store(y + m * ldy + n + v * W, acc[m][v]);
  }
  for (; n + W <= cols; n += W) {
    vec acc[M];
    for (int m = 0; m < M; ++m) acc[m] = vload(y + m * ldy + n);
    for (int64_t r = 0; r < R; ++r) {
      const vec bv = vload(b + r * ldb + n);
      for (int m = 0; m < M; ++m) acc[m] = vfma(vset1(h[m * ldh + r]), bv, acc[m]);
    }
    for (int m = 0; m < M; ++m) store(y + m * ldy + n, acc[m]);
  }
  for (; n < cols; ++n)
    for (int m = 0; m < M; ++m) {
      float s = static_cast<float>(y[m * ldy + n]);
      for (int64_t r = 0; r < R; ++r) s += h[m * ldh + r] * static_cast<float>(b[r * ldb + n]);
      y[m * ldy + n] = static_cast<T>(s);
    }
}

// The shrink and expand of one task's rows, 4 at a time, the tail by its size.
template <typename T>
void shrink_task(const Task& t, const T* x, int64_t ldx, const T* a, int64_t K, float* h, int64_t ldh) {
  const int64_t ranks = t.hi - t.lo;
  int64_t m = 0;
  for (; m + 4 <= t.rows; m += 4) shrink_rows<4>(x + m * ldx, ldx, a, K, ranks, h + m * ldh, ldh);
  switch (t.rows - m) {
    case 3: shrink_rows<3>(x + m * ldx, ldx, a, K, ranks, h + m * ldh, ldh); break;
    case 2: shrink_rows<2>(x + m * ldx, ldx, a, K, ranks, h + m * ldh, ldh); break;
    case 1: shrink_rows<1>(x + m * ldx, ldx, a, K, ranks, h + m * ldh, ldh); break;
    default: break;
  }
}

template <typename T>
void expand_task(const Task& t, const float* h, int64_t ldh, int64_t R, const T* b, int64_t ldb, T* y,
                 int64_t ldy) {
  const int64_t cols = t.hi - t.lo;
  int64_t m = 0;
  for (; m + 4 <= t.rows; m += 4) expand_rows<4>(h + m * ldh, ldh, R, b, ldb, y + m * ldy, ldy, cols);
  switch (t.rows - m) {
    case 3: expand_rows<3>(h + m * ldh, ldh, R, b, ldb, y + m * ldy, ldy, cols); break;
    case 2: expand_rows<2>(h + m * ldh, ldh, R, b, ldb, y + m * ldy, ldy, cols); break;
    case 1: expand_rows<1>(h + m * ldh, ldh, R, b, ldb, y + m * ldy, ldy, cols); break;
    default: break;
  }
}

template <typename T>
void sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
          const std::vector<Task>& shrink_tasks, const std::vector<Task>& expand_tasks) {
  const int64_t T_ = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t L = a.size(0), S = a.size(1), R = a.size(2);
  const int64_t ldx = x.stride(0), ldy = y.stride(0), ldh = L * R;
  const T* xp = x.data_ptr<T>();
  const T* ap = a.data_ptr<T>();
  const T* bp = b.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  std::vector<float> hbuf(static_cast<size_t>(T_ * ldh));
  float* hp = hbuf.data();
  at::parallel_for(0, static_cast<int64_t>(shrink_tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = shrink_tasks[i];
      shrink_task(t, xp + t.row * ldx, ldx, ap + ((t.l * S + t.slot) * R + t.lo) * K, K,
                  hp + t.row * ldh + t.l * R + t.lo, ldh);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(expand_tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = expand_tasks[i];
      expand_task(t, hp + t.row * ldh + t.l * R, ldh, R, bp + t.slot * R * N + t.lo, N, yp + t.row * ldy + t.lo,
                  ldy);
    }
  });
}

}  // namespace

namespace kvmesh_cpu {

void lora_sgmv(const at::Tensor& y, const at::Tensor& x_in, const at::Tensor& a_in, const at::Tensor& b_in,
               const at::Tensor& seg_starts, const at::Tensor& seg_lens, const at::Tensor& seg_slots,
               at::IntArrayRef shard_offsets) {
  TORCH_CHECK(x_in.dim() == 2 && y.dim() == 2 && x_in.size(0) == y.size(0), "lora_sgmv: x (T, K) and y (T, N)");
  TORCH_CHECK(a_in.dim() == 4 && a_in.size(3) == x_in.size(1), "lora_sgmv: a (L, S, R, K)");
  TORCH_CHECK(b_in.dim() == 3 && b_in.size(0) == a_in.size(1) && b_in.size(1) == a_in.size(2) &&
                  b_in.size(2) == y.size(1),
              "lora_sgmv: b (S, R, N) with a's S and R and y's N");
  const at::ScalarType dtype = y.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "lora_sgmv: float32 or bfloat16, not ", dtype);
  TORCH_CHECK(x_in.scalar_type() == dtype && a_in.scalar_type() == dtype && b_in.scalar_type() == dtype,
              "lora_sgmv: x, y, a and b must share one dtype");
  TORCH_CHECK(y.device().is_cpu() && y.stride(1) == 1, "lora_sgmv: y must be a CPU tensor with unit column stride");
  const int64_t T_ = y.size(0), N = y.size(1), L = a_in.size(0), S = a_in.size(1), R = a_in.size(2);
  TORCH_CHECK(static_cast<int64_t>(shard_offsets.size()) == L + 1 && shard_offsets[0] == 0 &&
                  shard_offsets[L] == N,
              "lora_sgmv: shard_offsets must be L + 1 column offsets from 0 to N");
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(shard_offsets[l] <= shard_offsets[l + 1], "lora_sgmv: shard_offsets must be non-decreasing");
  const int64_t G = seg_starts.numel();
  TORCH_CHECK(seg_lens.numel() == G && seg_slots.numel() == G, "lora_sgmv: one start, length and slot per segment");
  const at::Tensor starts = seg_starts.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor lens = seg_lens.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor slots = seg_slots.to(at::kCPU, at::kLong).contiguous();
  const int64_t *sp = starts.data_ptr<int64_t>(), *np = lens.data_ptr<int64_t>(), *lp = slots.data_ptr<int64_t>();

  std::vector<Task> shrink_tasks, expand_tasks;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t start = sp[g], len = np[g], slot = lp[g];
    TORCH_CHECK(len >= 0 && start >= 0 && start + len <= T_, "lora_sgmv: segment ", g, " (start ", start,
                ", length ", len, ") outside the ", T_, " rows");
    TORCH_CHECK(slot < S, "lora_sgmv: segment ", g, ": slot ", slot, " >= the ", S, " adapter slots");
    if (slot < 0 || len == 0 || R == 0) continue;
    for (int64_t row = start; row < start + len; row += kRowBlock) {
      const int64_t rows = std::min(kRowBlock, start + len - row);
      for (int64_t l = 0; l < L; ++l) {
        for (int64_t r = 0; r < R; r += kRankChunk)
          shrink_tasks.push_back({row, rows, slot, l, r, std::min(R, r + kRankChunk)});
        for (int64_t n = shard_offsets[l]; n < shard_offsets[l + 1]; n += kColsPerTask)
          expand_tasks.push_back({row, rows, slot, l, n, std::min(shard_offsets[l + 1], n + kColsPerTask)});
      }
    }
  }
  if (shrink_tasks.empty()) return;
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  if (dtype == at::kFloat)
    sgmv<float>(y, x, a, b, shrink_tasks, expand_tasks);
  else
    sgmv<at::BFloat16>(y, x, a, b, shrink_tasks, expand_tasks);
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("lora_sgmv(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor seg_starts, Tensor seg_lens, "
        "Tensor seg_slots, int[] shard_offsets) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("lora_sgmv", &kvmesh_cpu::lora_sgmv); }
