// The CPU kernels as C++ functions, so that fused ops (decode_stack.cpp) call them
// directly instead of through the dispatcher. Each is also registered as a torch op
// (torch.ops.kvmesh.<name>) in the file that defines it; see that file for the contract.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace kvmesh_cpu {

// skinny_gemm.cpp: y = x @ w.T + b for x (M <= kSkinnyMaxRows, K).
constexpr int64_t kSkinnyMaxRows = 8;
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);

// small_gemm.cpp: y = x @ w.T + b for x (a few dozen rows, K).
at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);

// paged_attention.cpp: one query token per sequence against its paged K/V (its last
// `window` tokens when window > 0); an int8 cache comes with its float32 scales.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window = 0, const std::optional<at::Tensor>& k_scale = std::nullopt,
                                  const std::optional<at::Tensor>& v_scale = std::nullopt);
// The cache's dtype against q's and the scales' presence, shapes and dtype (TORCH_CHECK).
void check_kv_scales(const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, const at::Tensor& q);

// kv_quant.cpp: a step's K / V rows quantized into an int8 cache and its per-(token, KV
// head) scales, at their slots (a negative slot is skipped).
void quantize_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& slot_mapping);

// fused_ops.cpp: the decoder's element-wise ops.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& a, const at::Tensor& w,
                                                double eps);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                                        const at::Tensor& sin, int64_t num_heads,
                                                        int64_t num_kv_heads);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor argmax_rows(const at::Tensor& x);

// quant_gemm.cpp: weight-only int8 / int4 GEMMs for a few rows (AVX2 + FMA + F16C; on other
// CPUs has_quant_gemm() is false and the two raise). Raw-pointer forms (see the file for the
// layouts); int4_gemm returns -1 when its scratch buffer cannot be allocated.
bool has_quant_gemm();
void int8_gemm(const float* x, int64_t M, int64_t K, const int8_t* w, const float* s, int64_t G, int64_t N,
               float* y);
int int4_gemm(const float* x, int64_t M, int64_t K, const uint8_t* w, const uint16_t* s, const uint16_t* o,
              int32_t mode, int64_t G, int64_t N, float* y);

// shm_allreduce.cpp: x summed in place over the tensor-parallel ranks sharing `segment`
// (float32 / bfloat16; every rank gets the same bits).
at::Tensor& shm_all_reduce_(at::Tensor& x, const at::Tensor& segment, int64_t rank, double timeout_s);

// lora.cpp: y[rows of each segment, shard l's columns] += (x @ a[l, slot]^T) @ b[slot] in place
// (the batched multi-LoRA delta; see the file for the layouts).
void lora_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& seg_starts, const at::Tensor& seg_lens, const at::Tensor& seg_slots,
               at::IntArrayRef shard_offsets);

}  // namespace kvmesh_cpu
