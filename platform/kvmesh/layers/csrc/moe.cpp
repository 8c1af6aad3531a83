// The grouped expert computation of a mixture-of-experts layer on CPU, as one op:
//
//   out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]
//
// The T k (token, expert) pairs are sorted by expert (stable), the rows gathered once, each
// active expert runs its two GEMMs on its contiguous rows (the skinny kernel up to
// `skinny_rows`, the small-batch one up to `small_rows`, else ATen's linear), and the
// weighted outputs are scattered back with one index_add (each token's contributions summed
// in ascending expert id, as transformers' loop does). Same arithmetic as layers/moe.py's
// `grouped_experts`; what it saves is the interpreter: a decode step of a few dozen tokens
// activates most experts with a few rows each, and four Python-dispatched ops per expert
// cost more than the expert's GEMMs (Qwen3-MoE-shaped layer, 32 experts, 32 tokens: see
// benchmarks/results/moe_layer.md).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "kernels.h"

namespace kvmesh_cpu {

namespace {

at::Tensor expert_gemm(const at::Tensor& x, const at::Tensor& w, int64_t skinny_rows, int64_t small_rows) {
  const int64_t m = x.size(0);
  if (m <= skinny_rows) return skinny_linear(x, w, std::nullopt);
  if (m <= small_rows) return small_linear(x, w, std::nullopt);
  return at::linear(x, w);
}

}  // namespace

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                       const at::Tensor& w2, int64_t skinny_rows, int64_t small_rows) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "moe_experts: x (T, H), weights and ids (T, k)");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) && w13.size(2) == x.size(1) &&
                  w2.size(1) == x.size(1) && w13.size(1) == 2 * w2.size(2),
              "moe_experts: w13 (E, 2I, H), w2 (E, H, I)");
  TORCH_CHECK(ids.scalar_type() == at::kLong, "moe_experts: int64 expert ids");
  const int64_t k = ids.size(1), num_experts = w13.size(0);
  const at::Tensor flat = ids.reshape(-1);
  const at::Tensor order = std::get<1>(at::sort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false));
  const at::Tensor counts = at::bincount(flat, {}, num_experts);
  const at::Tensor tokens = at::floor_divide(order, k);
  const at::Tensor xs = x.index_select(0, tokens).contiguous();
  at::Tensor ys = at::empty_like(xs);
  const int64_t* count = counts.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t n = count[e];
    if (n == 0) continue;
    at::Tensor rows = xs.narrow(0, start, n);
    at::Tensor h = silu_and_mul(expert_gemm(rows, w13[e], skinny_rows, small_rows));
    ys.narrow(0, start, n).copy_(expert_gemm(h, w2[e], skinny_rows, small_rows));
    start += n;
  }
  ys.mul_(weights.reshape(-1).index_select(0, order).unsqueeze(1));
  return at::zeros_like(x).index_add_(0, tokens, ys);
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("moe_experts(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor w2, int skinny_rows, "
        "int small_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("moe_experts", &kvmesh_cpu::moe_experts); }
