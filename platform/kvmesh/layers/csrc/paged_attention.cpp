// Paged decode attention for CPU: one query token per sequence, keys and values read
// in place from the paged cache through the block table (no gather copy), exact
// context lengths (no padding), fp32 accumulation, parallel over (sequence, kv head).
//
//   out[b, h, :] = softmax(scale * q[b, h, :] . K[b, t, h/G, :] for t < len[b]) @ V[b, :, h/G, :]
//
// Shapes: q, out (B, H, D); k_cache, v_cache (num_blocks, block_size, KVH, D) contiguous;
// block_tables (B, max_blocks) int64; context_lens (B,) int64. G = H / KVH query heads
// share a KV head and are computed together so each K/V row is loaded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename scalar_t>
void decode_kernel(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                   const at::Tensor& tables, const at::Tensor& lens, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), KVH = kc.size(2), G = H / KVH;
  const int64_t max_blocks = tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = kc.data_ptr<scalar_t>();
  const scalar_t* vp = vc.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D), qf(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t len = lp[b];
      scores.assign(G * len, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qp[(b * H + h * G + g) * D + d]) * fscale;
      // scores[g, t] = q_g . k_t
      for (int64_t t = 0; t < len; ++t) {
        const int64_t blk = tp[b * max_blocks + t / bs];
        const scalar_t* krow = kp + ((blk * bs + t % bs) * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(krow[d]);
          scores[g * len + t] = s;
        }
      }
      // softmax over t, per query head
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        float mx = sg[0];  // len >= 1 always
        for (int64_t t = 1; t < len; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      // acc[g, :] = sum_t p[g, t] * v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t blk = tp[b * max_blocks + t / bs];
        const scalar_t* vrow = vp + ((blk * bs + t % bs) * KVH + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * len + t];
          float* __restrict__ ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(vrow[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) op[(b * H + h * G + g) * D + d] = static_cast<scalar_t>(acc[g * D + d]);
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention", [&] {
    decode_kernel<scalar_t>(out, qc, k_cache, v_cache, tables, lens, scale);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(kvmesh, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
