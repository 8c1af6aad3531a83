// Writes a step's K / V rows into an int8 paged cache (layers/kv_cache.py has the scheme):
//
//   for each token t with slot s = slot_mapping[t] >= 0 and KV head h:
//     a = max |x|, x = k[t, h, :]          (likewise v)
//     k_scale[s, h] = a / 127
//     k_cache[s, h, :] = clamp(nearbyint(x * (127 / a)), -127, 127)    (0 when a == 0)
//
// The same float32 operations, in the same order, as the PyTorch reference
// (kv_cache.quantize_rows), so both write the same bits: a cache written by one backend reads
// the same under every other. Rounding is to nearest, ties to even (torch.round's).
//
// Shapes: k, v (T, KVH, D) float32 / bfloat16 / float16 (rows may be strided; each row's D
// values contiguous); k_cache, v_cache (num_blocks, block_size, KVH, D) int8 contiguous;
// k_scale, v_scale (num_blocks, block_size, KVH) float32 contiguous; slot_mapping (T,) int64,
// a negative slot skips its token (a padded row).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"

namespace {

template <typename scalar_t>
void quantize_rows(const at::Tensor& x, int8_t* cache, float* scales, const int64_t* slots, int64_t T, int64_t KVH,
                   int64_t D) {
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    for (int64_t h = 0; h < KVH; ++h) {
      const scalar_t* row = xp + t * st + h * sh;
      float a = 0.f;
      for (int64_t d = 0; d < D; ++d) a = std::max(a, std::fabs(static_cast<float>(row[d])));
      const float inv = a > 0.f ? 127.f / a : 0.f;
      int8_t* dst = cache + (slot * KVH + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float r = std::nearbyint(static_cast<float>(row[d]) * inv);
        dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
      }
      scales[slot * KVH + h] = a / 127.f;
    }
  }
}

void check_side(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scale, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "quantize_kv_cache: ", name, " must be (T, KVH, D) with contiguous rows");
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.scalar_type() == at::kChar,
              "quantize_kv_cache: the ", name, " cache must be a contiguous int8 (blocks, block_size, KVH, D) tensor");
  TORCH_CHECK(cache.size(2) == x.size(1) && cache.size(3) == x.size(2), "quantize_kv_cache: ", name,
              " rows and the cache disagree on KV heads or head size");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 3 &&
                  scale.size(0) == cache.size(0) && scale.size(1) == cache.size(1) && scale.size(2) == cache.size(2),
              "quantize_kv_cache: ", name, " scales must be contiguous float32 (blocks, block_size, KVH)");
}

}  // namespace

namespace kvmesh_cpu {

void quantize_kv_cache(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& slot_mapping) {
  check_side(k, k_cache, k_scale, "k");
  check_side(v, v_cache, v_scale, "v");
  TORCH_CHECK(k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "quantize_kv_cache: k and v differ");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "quantize_kv_cache: K and V caches differ in shape");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == k.size(0),
              "quantize_kv_cache: one int64 slot per token");
  auto slots_t = slot_mapping.contiguous();
  const int64_t* slots = slots_t.data_ptr<int64_t>();
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] < num_slots, "quantize_kv_cache: slot ", slots[t], " outside the KV cache");
  auto run = [&](const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scale) {
    int8_t* cp = cache.data_ptr<int8_t>();
    float* sp = scale.data_ptr<float>();
    switch (x.scalar_type()) {
      case at::kFloat: quantize_rows<float>(x, cp, sp, slots, T, KVH, D); break;
      case at::kBFloat16: quantize_rows<at::BFloat16>(x, cp, sp, slots, T, KVH, D); break;
      case at::kHalf: quantize_rows<at::Half>(x, cp, sp, slots, T, KVH, D); break;
      default: TORCH_CHECK(false, "quantize_kv_cache supports float32, bfloat16 and float16 rows, not ", x.scalar_type());
    }
  };
  run(k, k_cache, k_scale);
  run(v, v_cache, v_scale);
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("quantize_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, "
        "Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("quantize_kv_cache", &kvmesh_cpu::quantize_kv_cache); }
