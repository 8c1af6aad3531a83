// The CPU kernels as C++ functions, so that fused ops (decode_stack.cpp) call them
// directly instead of through the dispatcher. Each is also registered as a torch op
// (torch.ops.kvmesh.<name>) in the file that defines it; see that file for the contract.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace kvmesh_cpu {

// skinny_gemm.cpp: y = x @ w.T + b for x (M <= 4, K).
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);

// small_gemm.cpp: y = x @ w.T + b for x (a few dozen rows, K).
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);

// paged_attention.cpp: one query token per sequence against its paged K/V.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);

// fused_ops.cpp: the decoder's element-wise ops.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& a, const at::Tensor& w,
                                                double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t num_heads,
                                                        int64_t num_kv_heads);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor argmax_rows(const at::Tensor& x);

}  // namespace kvmesh_cpu
