// The decoder stack of a Llama-family model for one decode step, in one call: the CPU
// counterpart of replaying a captured CUDA graph.
//
// Why: at batch 1 a decode step of SmolLM2-135M is ~17-19 ms of weight streaming and
// ~4-5 ms of everything else, almost all of it per-op overhead: 30 layers x ~12 ops, each
// a Python call into a module, a dispatcher round trip and its argument checks. This op
// runs the same kernels, in the same order, with the same arguments, from C++: the
// outputs equal the layer-by-layer path bit for bit (tests/layers/test_decode_stack.py),
// and the per-op cost drops to a function call and a tensor allocation.
//
// Per layer (weights 6 per layer, biases 4 per layer, absent biases as None):
//   x = rms_norm(h, in_norm)                         weights[6l + 0]
//   q, k, v = rope_qkv(x @ qkv.T + b_qkv)             weights[6l + 1], biases[4l + 0]
//   K[slot], V[slot] = k, v                           k_caches[l], v_caches[l]
//   a = paged_decode_attention(q, K, V) @ o.T + b_o   weights[6l + 2], biases[4l + 1]
//   h, x = add_rms_norm(h, a, post_norm)              weights[6l + 3]
//   h = h + silu_and_mul(x @ gate_up.T + b_gu) @ down.T + b_down
//                                                     weights[6l + 4, 6l + 5], biases[4l + 2, 4l + 3]
// Returns h after the last layer (before the final norm), like LlamaForCausalLM.forward.
// Linear layers run the skinny GEMM, so the batch is at most 4 tokens, one per sequence.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <optional>

#include "kernels.h"

namespace {

// Writes this step's k / v (T, KVH, D) into their cache slots, as the layer-by-layer
// path's index_copy_ does: a row copy per token.
void write_kv(const at::Tensor& cache, const at::Tensor& rows, const int64_t* slots, int64_t T) {
  const int64_t n_slots = cache.size(0) * cache.size(1);
  const int64_t row_bytes = rows.size(1) * rows.size(2) * rows.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < n_slots, "decode_stack: slot ", slots[t], " outside the KV cache");
    std::memcpy(dst + slots[t] * row_bytes, src + t * row_bytes, row_bytes);
  }
}

}  // namespace

namespace kvmesh_cpu {

at::Tensor decode_stack(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin,
                        at::TensorList weights, const c10::List<std::optional<at::Tensor>>& biases,
                        at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_heads,
                        int64_t num_kv_heads, double eps, double scale) {
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L && static_cast<int64_t>(weights.size()) == 6 * L &&
                  static_cast<int64_t>(biases.size()) == 4 * L,
              "decode_stack: per layer 6 weights, 4 biases, one K and one V cache");
  TORCH_CHECK(h_in.dim() == 2 && h_in.size(0) >= 1 && h_in.size(0) <= 4, "decode_stack: hidden (T <= 4, hidden)");
  const int64_t T = h_in.size(0);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T && block_tables.size(0) == T &&
                  context_lens.numel() == T,
              "decode_stack: one slot, block-table row and context length per token (int64)");
  auto slots_t = slot_mapping.contiguous();
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  auto bias = [&](int64_t i) -> std::optional<at::Tensor> { return biases.get(i); };

  at::Tensor h = h_in.contiguous();
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = weights.data() + 6 * l;
    const at::Tensor &kc = k_caches[l], &vc = v_caches[l];
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes() &&
                    kc.scalar_type() == h.scalar_type(),
                "decode_stack: layer ", l, ": K and V caches must be contiguous, alike and in the model dtype");
    at::Tensor x = rms_norm(h, w[0], eps);
    auto [q, k, v] = rope_qkv(skinny_linear(x, w[1], bias(4 * l + 0)), cos, sin, num_heads, num_kv_heads);
    write_kv(kc, k, slots, T);
    write_kv(vc, v, slots, T);
    at::Tensor o = paged_decode_attention(q, kc, vc, block_tables, context_lens, scale);
    at::Tensor a = skinny_linear(o.view({T, -1}), w[2], bias(4 * l + 1));
    std::tie(h, x) = add_rms_norm(h, a, w[3], eps);
    h = h.add(skinny_linear(silu_and_mul(skinny_linear(x, w[4], bias(4 * l + 2))), w[5], bias(4 * l + 3)));
  }
  return h;
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("decode_stack(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, Tensor?[] biases, "
        "Tensor[] k_caches, Tensor[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
        "int num_heads, int num_kv_heads, float eps, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("decode_stack", &kvmesh_cpu::decode_stack); }
