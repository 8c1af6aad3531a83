// The decoder stack of a Llama-family model for one decode step, in one call: the CPU
// counterpart of replaying a captured CUDA graph.
//
// Why: at batch 1 a decode step of SmolLM2-135M is ~17-19 ms of weight streaming and
// ~4-5 ms of everything else, almost all of it per-op overhead: 30 layers x ~12 ops, each
// a Python call into a module, a dispatcher round trip and its argument checks. This op
// runs the same kernels, in the same order, with the same arguments, from C++: the
// outputs equal the layer-by-layer path bit for bit (tests/worker/test_decode_stack.py),
// and the per-op cost drops to a function call and a tensor allocation.
//
// Per layer l (norms 2 per layer; linears 4 per layer, in the order qkv, o, gate_up, down):
//   x = rms_norm(h, norms[2l])
//   q, k, v = rope_qkv(linear(x, qkv))
//   K[slot], V[slot] = k, v                            k_caches[l], v_caches[l]
//     (an int8 cache: quantized, its scales into k_scales[l], v_scales[l]; kv_quant.cpp)
//   a = linear(paged_decode_attention(q, K, V, windows[l]), o)   (windows empty: all 0, full attention)
//   h, x = add_rms_norm(h, a, norms[2l + 1])
//   h = h + linear(silu_and_mul(linear(x, gate_up)), down)
// Returns h after the last layer (before the final norm), like LlamaForCausalLM.forward.
//
// Tensor parallel (`tp_shm` the group's shared-memory segment, with this rank's index in it,
// or `tp_group` the name of its process group; neither without TP): qkv and gate_up are
// this rank's column shards (num_heads, num_kv_heads and the intermediate size are its own),
// o and down its row shards, whose partial outputs are summed over the group before their
// bias is added, as layers/linear.py's row-parallel Linear does:
//   a = all_reduce(o_shard(attn)) + o_bias,  m = all_reduce(down_shard(...)) + down_bias
// The sum runs shm_allreduce.cpp on the segment, or the dispatcher's
// _c10d_functional::all_reduce_ on the group torch resolves by that name (worker/groups.py
// registers it; so this file needs no c10d header): either way the collective the layer
// loop's TPGroup.all_reduce runs, in the same order.
//
// A linear is one of (linear_kinds; its tensors are taken from linear_tensors in turn):
//   0 dense     [weight (N, K)]: the skinny GEMM (skinny_gemm.cpp), bias added in-kernel
//   1 int8      [qweight, scales]            } kvmesh's weight-only quantized GEMM
//   2 int4      [qweight, scales, zeros]     } (quant_gemm.cpp, in this same build);
//   3 int4 mins [qweight, scales, mins]      } bias added after
// exactly as the Python modules (layers/linear.py Linear, quant/modules.py QuantLinear) run
// them for a few rows (up to `skinny_rows`, layers/linear.py SKINNY_KERNEL_ROWS, at most 4).
// Steps of more rows (up to 64: layers/linear.py SMALL_GEMM_ROWS) take the small-batch GEMM
// (small_gemm.cpp) instead, as `Linear` does for them; they need every linear dense and
// float32.
// Activations, norms, biases, dense weights and the KV cache share one dtype: float32 or
// bfloat16 (quantized layers: float32 only), or the caches are int8 with their scales (an
// 8-bit KV cache, layers/kv_cache.py; k_scales / v_scales empty: a float cache).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "gil.h"
#include "kernels.h"

namespace {

// The tensor-parallel sum of a row-parallel shard's output, in place: over the group's
// shared-memory segment (shm_allreduce.cpp) where it has one, else over the process group
// registered as `group` (torch.distributed's functional all_reduce_, then its wait).
struct Reducer {
  std::string group;
  std::optional<at::Tensor> shm;
  int64_t rank;
  double timeout_s;

  void operator()(at::Tensor& y) const {
    if (shm.has_value()) {
      kvmesh_cpu::shm_all_reduce_(y, *shm, rank, timeout_s);
      return;
    }
    static const auto reduce =
        c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_reduce_", "");
    static const auto wait = c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
    kvmesh_cpu::GilRelease released;
    torch::jit::Stack stack{y, std::string("sum"), group};
    reduce.callBoxed(&stack);
    stack = {y};
    wait.callBoxed(&stack);
  }
};

enum Kind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2, kInt4Mins = 3 };

// One linear layer of the stack: its kind, tensors and bias.
struct StackLinear {
  int64_t kind;
  const at::Tensor* t;
  std::optional<at::Tensor> bias;
  int64_t skinny_rows;  // dense layers: the skinny GEMM up to this many rows, the small-batch one above

  at::Tensor operator()(const at::Tensor& x) const { return run(x, bias); }

  // A row-parallel shard: its partial product summed over the group, then the bias.
  at::Tensor reduced(const at::Tensor& x, const Reducer& all_reduce) const {
    at::Tensor y = run(x, std::nullopt);
    all_reduce(y);
    return bias.has_value() ? y.add(*bias) : y;
  }

  // The GEMM plus `b` (the bias, or none for a shard whose sum gets it).
  at::Tensor run(const at::Tensor& x, const std::optional<at::Tensor>& b) const {
    if (kind == kDense)
      return x.size(0) <= skinny_rows ? kvmesh_cpu::skinny_linear(x, t[0], b) : kvmesh_cpu::small_linear(x, t[0], b);
    const int64_t M = x.size(0), K = x.size(1), N = t[0].size(0);
    auto y = at::empty({M, N}, x.options());
    if (kind == kInt8) {
      const int64_t G = t[1].dim() == 1 ? K : K / t[1].size(1);
      kvmesh_cpu::int8_gemm(x.data_ptr<float>(), M, K, t[0].data_ptr<int8_t>(), t[1].data_ptr<float>(), G, N,
                            y.data_ptr<float>());
    } else {
      const int64_t G = K / t[1].size(1);
      const int rc = kvmesh_cpu::int4_gemm(
          x.data_ptr<float>(), M, K, t[0].data_ptr<uint8_t>(), static_cast<const uint16_t*>(t[1].data_ptr()),
          static_cast<const uint16_t*>(t[2].data_ptr()), kind == kInt4Mins ? 1 : 0, G, N, y.data_ptr<float>());
      TORCH_CHECK(rc == 0, "decode_stack: the int4 kernel could not allocate its scratch buffer");
    }
    return b.has_value() ? y.add(*b) : y;
  }
};

// Checks each linear's tensors against its kind and the layer shapes it must have:
// in_features K, out_features N.
void check_linear(const StackLinear& lin, int64_t K, int64_t N, int64_t index, at::ScalarType dtype) {
  const at::Tensor* t = lin.t;
  const int64_t count = lin.kind == kDense ? 1 : lin.kind == kInt8 ? 2 : 3;
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(t[i].is_contiguous() && t[i].device().is_cpu(), "decode_stack: linear ", index,
                ": tensors must be contiguous CPU tensors");
  TORCH_CHECK(t[0].dim() == 2 && t[0].size(0) == N, "decode_stack: linear ", index, " must have ", N, " outputs");
  if (lin.bias.has_value())
    TORCH_CHECK(lin.bias->dim() == 1 && lin.bias->size(0) == N && lin.bias->scalar_type() == dtype,
                "decode_stack: linear ", index, ": bias must be (", N, ",) in the hidden dtype");
  TORCH_CHECK(lin.kind == kDense || dtype == at::kFloat, "decode_stack: linear ", index,
              ": the quantized kernels take float32 activations only");
  TORCH_CHECK(lin.kind == kDense || kvmesh_cpu::has_quant_gemm(), "decode_stack: linear ", index,
              ": this build has no quantized kernel (it needs AVX2, FMA and F16C)");
  switch (lin.kind) {
    case kDense:
      TORCH_CHECK(t[0].scalar_type() == dtype && t[0].size(1) == K, "decode_stack: linear ", index,
                  ": dense weight must be (", N, ", ", K, ") in the hidden dtype");
      break;
    case kInt8:
      TORCH_CHECK(t[0].scalar_type() == at::kChar && t[0].size(1) == K &&
                      t[1].scalar_type() == at::kFloat && t[1].size(0) == N && K % 16 == 0 &&
                      (t[1].dim() == 1 || (t[1].dim() == 2 && K % t[1].size(1) == 0 && (K / t[1].size(1)) % 16 == 0)),
                  "decode_stack: linear ", index, ": int8 needs qweight int8 (N, K), float32 scales "
                  "per row or per group of a multiple of 16");
      break;
    case kInt4:
    case kInt4Mins:
      TORCH_CHECK(t[0].scalar_type() == at::kByte && t[0].size(1) * 2 == K &&
                      t[1].scalar_type() == at::kHalf && t[2].scalar_type() == at::kHalf && t[1].dim() == 2 &&
                      t[1].sizes() == t[2].sizes() && t[1].size(0) == N && K % t[1].size(1) == 0 &&
                      (K / t[1].size(1)) % 32 == 0,
                  "decode_stack: linear ", index, ": int4 needs packed qweight uint8 (N, K / 2), "
                  "float16 scales and offsets (N, K / G) with G a multiple of 32");
      break;
    default:
      break;  // (kinds are checked when unpacked)
  }
}

// Writes this step's k / v (T, KVH, D) into their cache slots, as the layer-by-layer
// path's index_copy_ does: a row copy per token (slots checked by the caller).
void write_kv(const at::Tensor& cache, const at::Tensor& rows, const int64_t* slots, int64_t T) {
  const int64_t row_bytes = rows.size(1) * rows.size(2) * rows.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());
  for (int64_t t = 0; t < T; ++t) std::memcpy(dst + slots[t] * row_bytes, src + t * row_bytes, row_bytes);
}

}  // namespace

namespace kvmesh_cpu {

at::Tensor decode_stack(const at::Tensor& h_in, const at::Tensor& cos, const at::Tensor& sin, at::TensorList norms,
                        at::TensorList linear_tensors, at::IntArrayRef linear_kinds,
                        const c10::List<std::optional<at::Tensor>>& biases, at::TensorList k_caches,
                        at::TensorList v_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads, double eps,
                        double scale, int64_t skinny_rows, at::TensorList k_scales, at::TensorList v_scales,
                        at::IntArrayRef windows, c10::string_view tp_group, const std::optional<at::Tensor>& tp_shm,
                        int64_t tp_rank, double tp_timeout_s) {
  const bool tp = !tp_group.empty() || tp_shm.has_value();
  const Reducer all_reduce{std::string(tp_group), tp_shm, tp_rank, tp_timeout_s};
  const int64_t L = static_cast<int64_t>(k_caches.size());
  const bool quant_kv = !k_scales.empty();
  TORCH_CHECK(static_cast<int64_t>(k_scales.size()) == (quant_kv ? L : 0) && v_scales.size() == k_scales.size(),
              "decode_stack: k_scales / v_scales must be empty (a float KV cache) or one per layer each");
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L && static_cast<int64_t>(norms.size()) == 2 * L &&
                  static_cast<int64_t>(linear_kinds.size()) == 4 * L &&
                  static_cast<int64_t>(biases.size()) == 4 * L,
              "decode_stack: per layer 2 norms, 4 linears (kind and bias each), one K and one V cache");
  TORCH_CHECK(h_in.dim() == 2 && h_in.size(0) >= 1 && h_in.size(0) <= 64 &&
                  (h_in.scalar_type() == at::kFloat || h_in.scalar_type() == at::kBFloat16),
              "decode_stack: hidden must be float32 or bfloat16 (T <= 64, hidden)");
  TORCH_CHECK(skinny_rows >= 0 && skinny_rows <= 4, "decode_stack: skinny_rows must be 0..4");
  TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == L,
              "decode_stack: windows must be empty or one per layer (0: full attention)");
  for (const int64_t w : windows) TORCH_CHECK(w >= 0, "decode_stack: a window must be >= 0");
  const int64_t T = h_in.size(0), hidden = h_in.size(1);
  const at::ScalarType dtype = h_in.scalar_type();
  const bool small = T > skinny_rows;  // every linear on the small-batch GEMM
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T && block_tables.size(0) == T &&
                  context_lens.numel() == T,
              "decode_stack: one slot, block-table row and context length per token (int64)");
  TORCH_CHECK(k_caches.size() > 0 && k_caches[0].dim() == 4 && k_caches[0].size(2) == num_kv_heads,
              "decode_stack: K / V caches (blocks, block_size, num_kv_heads, head_dim)");
  const int64_t D = k_caches[0].size(3), q_width = num_heads * D, qkv_width = (num_heads + 2 * num_kv_heads) * D;

  // Unpack and check every linear once, before any work.
  std::vector<StackLinear> linears;
  linears.reserve(4 * L);
  size_t next = 0;
  for (int64_t i = 0; i < 4 * L; ++i) {
    const int64_t kind = linear_kinds[i];
    TORCH_CHECK(kind >= kDense && kind <= kInt4Mins, "decode_stack: linear ", i, ": unknown kind ", kind);
    const size_t count = kind == kDense ? 1 : kind == kInt8 ? 2 : 3;
    TORCH_CHECK(next + count <= linear_tensors.size(), "decode_stack: too few linear tensors for their kinds");
    TORCH_CHECK(!small || (kind == kDense && dtype == at::kFloat), "decode_stack: steps of more than ",
                skinny_rows, " rows need every linear dense and float32 (linear ", i, ")");
    linears.push_back({kind, linear_tensors.data() + next, biases.get(i), skinny_rows});
    next += count;
  }
  TORCH_CHECK(next == linear_tensors.size(), "decode_stack: more linear tensors than their kinds take");
  const int64_t inter = linears[2].t[0].size(0) / 2;
  for (int64_t l = 0; l < L; ++l) {
    check_linear(linears[4 * l + 0], hidden, qkv_width, 4 * l + 0, dtype);
    check_linear(linears[4 * l + 1], q_width, hidden, 4 * l + 1, dtype);
    check_linear(linears[4 * l + 2], hidden, 2 * inter, 4 * l + 2, dtype);
    check_linear(linears[4 * l + 3], inter, hidden, 4 * l + 3, dtype);
    const at::Tensor &kc = k_caches[l], &vc = v_caches[l];
    TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes() && kc.sizes() == k_caches[0].sizes(),
                "decode_stack: layer ", l, ": K and V caches must be contiguous, of one shape");
    if (quant_kv)
      check_kv_scales(kc, vc, k_scales[l], v_scales[l], h_in);
    else
      TORCH_CHECK(kc.scalar_type() == dtype && vc.scalar_type() == dtype, "decode_stack: layer ", l,
                  ": K and V caches must be in the hidden dtype (or int8 with k_scales / v_scales)");
    for (int64_t i = 0; i < 2; ++i)
      TORCH_CHECK(norms[2 * l + i].scalar_type() == dtype && norms[2 * l + i].numel() == hidden,
                  "decode_stack: layer ", l, ": norm weights must be (hidden,) in the hidden dtype");
  }
  auto slots_t = slot_mapping.contiguous();
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < k_caches[0].size(0) * k_caches[0].size(1), "decode_stack: slot ",
                slots[t], " outside the KV cache");

  at::Tensor h = h_in.contiguous();
  for (int64_t l = 0; l < L; ++l) {
    const StackLinear* lin = linears.data() + 4 * l;
    const at::Tensor &kc = k_caches[l], &vc = v_caches[l];
    at::Tensor x = rms_norm(h, norms[2 * l], eps);
    auto [q, k, v] = rope_qkv(lin[0](x), cos, sin, num_heads, num_kv_heads);
    const int64_t window = windows.empty() ? 0 : windows[l];
    at::Tensor o;
    if (quant_kv) {
      quantize_kv_cache(k, v, kc, vc, k_scales[l], v_scales[l], slots_t);
      o = paged_decode_attention(q, kc, vc, block_tables, context_lens, scale, window, k_scales[l], v_scales[l]);
    } else {
      write_kv(kc, k, slots, T);
      write_kv(vc, v, slots, T);
      o = paged_decode_attention(q, kc, vc, block_tables, context_lens, scale, window);
    }
    at::Tensor attn = o.view({T, q_width});
    at::Tensor a = tp ? lin[1].reduced(attn, all_reduce) : lin[1](attn);
    std::tie(h, x) = add_rms_norm(h, a, norms[2 * l + 1], eps);
    at::Tensor act = silu_and_mul(lin[2](x));
    h = h.add(tp ? lin[3].reduced(act, all_reduce) : lin[3](act));
  }
  return h;
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("decode_stack(Tensor hidden, Tensor cos, Tensor sin, Tensor[] norms, Tensor[] linear_tensors, "
        "int[] linear_kinds, Tensor?[] biases, Tensor[] k_caches, Tensor[] v_caches, "
        "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, int num_heads, int num_kv_heads, "
        "float eps, float scale, int skinny_rows, Tensor[] k_scales, Tensor[] v_scales, int[] windows=[], "
        "str tp_group=\"\", Tensor? tp_shm=None, int tp_rank=0, float tp_timeout_s=300.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("decode_stack", &kvmesh_cpu::decode_stack); }
