// Fused element-wise ops of the Llama-family decoder for CPU (vLLM's csrc/cpu/layernorm,
// pos_encoding and activation kernels play the same part on its CPU backend).
//
// Why: at decode a layer's element-wise work is a few thousand floats, so each ATen op
// costs its dispatch (a few microseconds), not its arithmetic. RMSNorm was 5 ops, the
// rotary embedding of q and k 12, SiLU-and-mul 3; one op each here. On SmolLM2-135M
// that is ~600 dispatches fewer per decode step (see benchmarks/README.md).
//
// Numerics follow the PyTorch reference in kvmesh/models (llama.py, rope.py) step by
// step, including its roundings to the model dtype (bf16 / fp16) between steps, so the
// only differences are float summation order (RMSNorm's sum of squares) and FMA
// contraction.
//
//   rms_norm(x, w, eps)            = w * to_dtype(x * rsqrt(mean(x^2) + eps))   (math in fp32)
//   add_rms_norm(h, a, w, eps)     = (h + a, rms_norm(h + a, w, eps))
//   rope_qkv(qkv, cos, sin, H, KVH) = (rope(q), rope(k), v) from the fused QKV projection
//                                    (T, (H + 2 KVH) D); rotate-half convention (HF Llama)
//   silu_and_mul(gu)               = silu(gu[:, :I]) * gu[:, I:]
//   argmax_rows(x)                 = x.argmax(-1) for float32 (B, V) logits: the first index of
//                                    the row's max, or of its first NaN (torch's semantics);
//                                    rows in parallel. torch's took 1.8-3.3 ms for 48 x 49152
//                                    on 2 threads (greedy sampling of a decode batch), this
//                                    a max pass and a find pass per row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "kernels.h"
#include "vec_math.h"

namespace {

// Rows per task: decode (a handful of rows) stays on the calling thread.
constexpr int64_t kGrain = 16;

template <typename T>
inline T rnd(float v) { return static_cast<T>(v); }

template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i)
    out[i] = rnd<T>(static_cast<float>(w[i]) * static_cast<float>(rnd<T>(static_cast<float>(x[i]) * r)));
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "rms_norm: x (T, n), weight (n,)");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and weight dtypes differ");
}

// One head: out = x * cos + rotate_half(x) * sin, each product rounded to T as the
// reference's separate ops do.
template <typename T>
inline void rope_head(const T* x, const T* c, const T* s, T* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -static_cast<float>(x[d + half]) : static_cast<float>(x[d - half]);
    const float a = static_cast<float>(rnd<T>(static_cast<float>(x[d]) * static_cast<float>(c[d])));
    const float b = static_cast<float>(rnd<T>(rot * static_cast<float>(s[d])));
    out[d] = rnd<T>(a + b);
  }
}

}  // namespace

namespace kvmesh_cpu {

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_norm(x_in, w_in);
  auto x = x_in.contiguous();
  auto w = w_in.contiguous();
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = x.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h_in, const at::Tensor& a_in,
                                                const at::Tensor& w_in, double eps) {
  check_norm(h_in, w_in);
  TORCH_CHECK(a_in.sizes() == h_in.sizes() && a_in.scalar_type() == h_in.scalar_type(),
              "add_rms_norm: residual and update must have the same shape and dtype");
  auto h = h_in.contiguous();
  auto a = a_in.contiguous();
  auto w = w_in.contiguous();
  auto sum = at::empty_like(h);
  auto out = at::empty_like(h);
  const int64_t rows = h.size(0), n = h.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h.scalar_type(), "add_rms_norm", [&] {
    const scalar_t *hp = h.data_ptr<scalar_t>(), *ap = a.data_ptr<scalar_t>(), *wp = w.data_ptr<scalar_t>();
    scalar_t *sp = sum.data_ptr<scalar_t>(), *op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        for (int64_t i = 0; i < n; ++i)
          sp[r * n + i] = rnd<scalar_t>(static_cast<float>(hp[r * n + i]) + static_cast<float>(ap[r * n + i]));
        rms_row(sp + r * n, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return {sum, out};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_qkv(const at::Tensor& qkv_in, const at::Tensor& cos_in,
                                                        const at::Tensor& sin_in, int64_t H, int64_t KVH) {
  TORCH_CHECK(qkv_in.dim() == 2, "rope_qkv: qkv must be (T, (H + 2 KVH) * D)");
  const int64_t T = qkv_in.size(0), W = qkv_in.size(1);
  TORCH_CHECK(H > 0 && KVH > 0 && W % (H + 2 * KVH) == 0, "rope_qkv: width is not (H + 2 KVH) * D");
  const int64_t D = W / (H + 2 * KVH);
  TORCH_CHECK(D % 2 == 0, "rope_qkv: head_dim must be even");
  auto qkv = qkv_in.contiguous();
  auto cos = cos_in.reshape({T, D}).contiguous();
  auto sin = sin_in.reshape({T, D}).contiguous();
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_qkv: cos / sin must be in the activation dtype");
  auto q = at::empty({T, H, D}, qkv.options());
  auto k = at::empty({T, KVH, D}, qkv.options());
  auto v = at::empty({T, KVH, D}, qkv.options());  // a copy: outputs never alias the input
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_qkv", [&] {
    const scalar_t *xp = qkv.data_ptr<scalar_t>(), *cp = cos.data_ptr<scalar_t>(), *sp = sin.data_ptr<scalar_t>();
    scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    at::parallel_for(0, T, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t* row = xp + t * W;
        for (int64_t h = 0; h < H; ++h) rope_head(row + h * D, cp + t * D, sp + t * D, qp + (t * H + h) * D, D);
        for (int64_t h = 0; h < KVH; ++h)
          rope_head(row + (H + h) * D, cp + t * D, sp + t * D, kp + (t * KVH + h) * D, D);
        std::copy(row + (H + KVH) * D, row + W, vp + t * KVH * D);
      }
    });
  });
  return {q, k, v};
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % 2 == 0, "silu_and_mul: x must be (T, 2 I)");
  auto x = x_in.contiguous();
  const int64_t T = x.size(0), I = x.size(1) / 2;
  auto out = at::empty({T, I}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T, kGrain, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const scalar_t *g = xp + t * 2 * I, *u = g + I;
        scalar_t* o = op + t * I;
        _Pragma("omp simd")  // (a #pragma cannot sit inside the dispatch macro's argument)
        for (int64_t i = 0; i < I; ++i) {
          const float gv = static_cast<float>(g[i]);
          const float act = static_cast<float>(rnd<scalar_t>(gv / (1.f + kvmesh_vec::exp_approx(-gv))));
          o[i] = rnd<scalar_t>(act * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}

// The first index of the max of row[0 .. V), or of its first NaN.
static inline int64_t argmax_row(const float* row, int64_t V) {
  float m = row[0];
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(row[0]);
  __mmask16 un = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    vm = _mm512_max_ps(vm, v);
    un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  m = _mm512_reduce_max_ps(vm);
  nan = un != 0;
#endif
  for (; i < V; ++i) {
    m = std::max(m, row[i]);
    nan |= row[i] != row[i];
  }
  int64_t idx = 0;
#if defined(__AVX512F__)
  if (!nan) {
    const __m512 vt = _mm512_set1_ps(m);
    for (; idx + 16 <= V; idx += 16) {
      const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + idx), vt, _CMP_EQ_OQ);
      if (eq) return idx + __builtin_ctz(eq);
    }
  }
#endif
  if (nan) {
    while (row[idx] == row[idx]) ++idx;
  } else {
    while (row[idx] != m) ++idx;
  }
  return idx;
}

at::Tensor argmax_rows(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) > 0 && x_in.scalar_type() == at::kFloat,
              "argmax_rows: float32 (B, V) with V > 0");
  auto x = x_in.contiguous();
  const int64_t B = x.size(0), V = x.size(1);
  auto out = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = xp + r * V;
      op[r] = argmax_row(row, V);
    }
  });
  return out;
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor residual, Tensor update, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("rms_norm", &kvmesh_cpu::rms_norm);
  m.impl("add_rms_norm", &kvmesh_cpu::add_rms_norm);
  m.impl("rope_qkv", &kvmesh_cpu::rope_qkv);
  m.impl("silu_and_mul", &kvmesh_cpu::silu_and_mul);
  m.impl("argmax_rows", &kvmesh_cpu::argmax_rows);
}
