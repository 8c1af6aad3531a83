// Paged prefill attention for CPU: every prefill chunk of a step in one call, queries
// against keys and values read in place from the paged cache (the chunk's own K/V are
// written there first), causal, GQA-aware.
//
//   out[q_start + i, h, :] = softmax(scale * q[q_start + i, h, :] . K[t, h / G, :]
//                                    for lo_i <= t <= start_pos + i) @ V[:, h / G, :]
//
// lo_i = max(0, start_pos + i - window + 1) for a sliding-window layer (window > 0), else 0.
// Keys before the window of the chunk's first query are never read (their blocks may have
// been freed and reused: engine/kv_cache_manager.py) nor packed, and key tiles wholly before
// a query tile's window are skipped, so a long context costs window-sized work.
//
// Shapes: q, out (T, H, D) (only the spans' rows of out are written); k_cache, v_cache
// (num_blocks, block_size, KVH, D) contiguous, float32 / bfloat16 / float16 (q's dtype), or
// int8 with k_scale, v_scale (num_blocks, block_size, KVH) float32 (layers/kv_cache.py); block_tables
// (S, max_blocks) int64; spans (S, 3) int64 rows (q_start, q_len, start_pos): sequence s's
// queries are rows [q_start, q_start + q_len) of q at positions [start_pos, start_pos +
// q_len), and it attends its ctx = start_pos + q_len first cached tokens.
//
// Why: the reference (layers/attention.py) runs torch's SDPA once per sequence, with K/V
// repeated per query head for GQA and, for a chunk behind a cached prefix, the context
// gathered out of the cache and an additive mask; on SmolLM2-135M (head 64, 9 query / 3 KV
// heads) that ran at ~80 GFLOP/s on two cores, plus the copies.
//
// How (flash attention, one pass with an online softmax):
// - a task is (sequence, KV head, tile of MQ query positions); its rows are the MQ x G query
//   heads that share the KV head, ordered (position, head), so each K / V element it loads
//   serves all G heads;
// - K is packed once per call, transposed per key tile: (D, NK) fp32 blocks, one after the
//   other per (sequence, KV head), zero-padded past the context, so that scores are an
//   outer-product register tile (per d, QK_C vectors of keys times QK_R broadcast query
//   elements) over a contiguous 16 KiB block (one (D, ctx) matrix per head put the rows of
//   a tile 1-4 KiB apart, onto a few L1 sets);
// - V rows are read in place through the block table; P V is a register tile of PV_R rows x
//   PV_C vectors of the head dimension, per key one broadcast of p and PV_C loads of v;
// - per key tile of NK: scores, the running max / sum update (exp is the vectorised
//   polynomial of vec_math.h), the accumulator rescaled, P V added; masked keys (after the
//   query's position) get probability exactly 0, and tiles past a task's last position are
//   never visited;
// - tasks run dynamically scheduled, most keys first (a causal tile near the end of a long
//   sequence costs more than one at its start).
// Numerics: fp32 throughout (bf16 / fp16 widened on load), outputs rounded to the dtype.
// An int8 cache: K rows are dequantized (times their scale) as they are packed, V rows widened
// on load in the P V tile, each key's V scale folded into its column of probabilities first
// (p v = (p s) q: one multiply per score instead of one per value).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec_math.h"

namespace {

using namespace kvmesh_vec;

constexpr int64_t NK = 64;  // keys per online-softmax tile
constexpr int64_t MQ = 32;  // query positions per task

#if defined(__AVX512F__)
constexpr int QK_R = 6, QK_C = 2;  // 12 accumulators, 2 key vectors, a broadcast (of 32 zmm)
constexpr int PV_R = 6, PV_C = 4;  // 24 accumulators, 4 value vectors, a broadcast
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int QK_R = 4, QK_C = 2;  // 8 + 2 + 1 of 16 ymm
constexpr int PV_R = 3, PV_C = 4;  // 12 + 4 (the broadcast is folded into the FMA's memory operand)
#else
constexpr int QK_R = 1, QK_C = 1;
constexpr int PV_R = 1, PV_C = 1;
#endif
// Rows of a task's buffers are padded to a multiple of both tiles.
constexpr int64_t RPAD = QK_R * PV_R / std::gcd(QK_R, PV_R);
static_assert(NK % (QK_C * W) == 0, "a key tile is whole QK register tiles");

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// s[i][c] = q[i] . kt[:, c] for QK_R query rows (row stride D) and QK_C * W keys: kt is the
// packed (D, NK) transposed key tile at its column n0; s has row stride NK.
inline void qk_tile(const float* q, int64_t D, const float* kt, float* s) {
  vec acc[QK_R][QK_C];
  for (int i = 0; i < QK_R; ++i)
    for (int c = 0; c < QK_C; ++c) acc[i][c] = vzero();
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; ++d) {
    vec kv[QK_C];
    for (int c = 0; c < QK_C; ++c) kv[c] = vload(kt + d * NK + c * W);
    for (int i = 0; i < QK_R; ++i) {
      const vec qb = vset1(q[i * D + d]);
      for (int c = 0; c < QK_C; ++c) acc[i][c] = vfma(qb, kv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < QK_R; ++i)
    for (int c = 0; c < QK_C; ++c) vstore(s + i * NK + c * W, acc[i][c]);
}

// o[i][:C W] += sum_n p[i][n] v_n[:C W] for PV_R rows (o row stride D, p row stride NK) and
// n < nk keys whose value rows (at this column block) are vrows[n] + col.
template <int C, typename scalar_t>
inline void pv_tile(const float* p, int64_t nk, const scalar_t* const* vrows, int64_t col, float* o, int64_t D) {
  vec acc[PV_R][C];
  for (int i = 0; i < PV_R; ++i)
    for (int c = 0; c < C; ++c) acc[i][c] = vload(o + i * D + c * W);
#pragma GCC unroll 2
  for (int64_t n = 0; n < nk; ++n) {
    const scalar_t* v = vrows[n] + col;
    vec vv[C];
    for (int c = 0; c < C; ++c) vv[c] = vload(v + c * W);
    for (int i = 0; i < PV_R; ++i) {
      const vec pb = vset1(p[i * NK + n]);
      for (int c = 0; c < C; ++c) acc[i][c] = vfma(pb, vv[c], acc[i][c]);
    }
  }
  for (int i = 0; i < PV_R; ++i)
    for (int c = 0; c < C; ++c) vstore(o + i * D + c * W, acc[i][c]);
}

// The column blocks of one PV row tile: whole PV_C-vector blocks, then whole vectors, then
// scalar columns (D % W).
template <typename scalar_t>
inline void pv_rows(const float* p, int64_t nk, const scalar_t* const* vrows, float* o, int64_t D) {
  int64_t col = 0;
  for (; col + PV_C * W <= D; col += PV_C * W) pv_tile<PV_C>(p, nk, vrows, col, o + col, D);
  for (; col + W <= D; col += W) pv_tile<1>(p, nk, vrows, col, o + col, D);
  for (; col < D; ++col)
    for (int i = 0; i < PV_R; ++i) {
      float acc = o[i * D + col];
      for (int64_t n = 0; n < nk; ++n) acc += p[i * NK + n] * static_cast<float>(vrows[n][col]);
      o[i * D + col] = acc;
    }
}

// One sequence's span and where its packed K starts.
struct Seq {
  int64_t q_start, q_len, start_pos, ctx;
  int64_t kbase;      // first key packed: the window start of the first query (0 without a window)
  int64_t ld;         // ctx - kbase rounded up to whole key tiles
  int64_t kt_offset;  // into the packed buffer, for KV head 0
};

struct Task {
  int64_t s, h, i0;  // sequence, KV head, first query of the tile (relative to q_start)
  int64_t cost;
};

// scalar_t: q's and out's dtype; cache_t: the cache's (scalar_t, or int8_t with scales ksc /
// vsc, null for a float cache).
template <typename scalar_t, typename cache_t>
void prefill_kernel(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                    const float* ksc, const float* vsc, const at::Tensor& tables, const at::Tensor& spans,
                    double scale, int64_t window) {
  constexpr bool kQuant = std::is_same_v<cache_t, int8_t>;
  const int64_t H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), KVH = kc.size(2), G = H / KVH;
  const int64_t S = spans.size(0), max_blocks = tables.size(1);
  const int64_t row_stride = KVH * D;  // cache elements per token
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = kc.data_ptr<cache_t>();
  const cache_t* vp = vc.data_ptr<cache_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = spans.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  std::vector<Seq> seqs(S);
  int64_t kt_size = 0;
  for (int64_t s = 0; s < S; ++s) {
    Seq& x = seqs[s];
    x.q_start = sp[3 * s];
    x.q_len = sp[3 * s + 1];
    x.start_pos = sp[3 * s + 2];
    x.ctx = x.start_pos + x.q_len;
    x.kbase = window > 0 ? std::max<int64_t>(0, x.start_pos - window + 1) : 0;
    x.ld = round_up(x.ctx - x.kbase, NK);
    x.kt_offset = kt_size;
    kt_size += KVH * D * x.ld;
  }
  auto kt_buf = at::empty({kt_size}, at::kFloat);
  float* kt = kt_buf.data_ptr<float>();

  // Pack K per (sequence, KV head) as transposed key tiles: kt[tile][d][j] = K[kbase + tile NK + j][h][d],
  // zero beyond ctx.
  struct Piece {
    int64_t s, h, t0;
  };
  std::vector<Piece> pieces;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t t0 = 0; t0 < seqs[s].ld; t0 += NK) pieces.push_back({s, h, t0});
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Piece& pc = pieces[i];
      const Seq& x = seqs[pc.s];
      float* dst = kt + x.kt_offset + pc.h * D * x.ld + pc.t0 * D;
      const int64_t* table = tp + pc.s * max_blocks;
      const int64_t n = std::min(NK, x.ctx - x.kbase - pc.t0);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t t = x.kbase + pc.t0 + j;
        const int64_t slot = table[t / bs] * bs + t % bs;
        const cache_t* src = kp + slot * row_stride + pc.h * D;
        if constexpr (kQuant) {
          const float ks = ksc[slot * KVH + pc.h];
          for (int64_t d = 0; d < D; ++d) dst[d * NK + j] = static_cast<float>(src[d]) * ks;
        } else {
          for (int64_t d = 0; d < D; ++d) dst[d * NK + j] = static_cast<float>(src[d]);
        }
      }
      for (int64_t d = 0; d < D; ++d)
        for (int64_t j = n; j < NK; ++j) dst[d * NK + j] = 0.f;
    }
  });

  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t h = 0; h < KVH; ++h)
      for (int64_t i0 = 0; i0 < seqs[s].q_len; i0 += MQ) {
        const int64_t mq = std::min(MQ, seqs[s].q_len - i0), pos0 = seqs[s].start_pos + i0;
        const int64_t first = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
        tasks.push_back({s, h, i0, mq * (pos0 + mq - first)});
      }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const int64_t rows_max = round_up(MQ * G, RPAD);
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntasks));

#pragma omp parallel num_threads(threads)
  {
    std::vector<float> qbuf(rows_max * D), obuf(rows_max * D), sbuf(rows_max * NK), m(rows_max), l(rows_max);
    const cache_t* vrows[NK];
    float vscale[NK];
#pragma omp for schedule(dynamic, 1)
    for (int64_t ti = 0; ti < ntasks; ++ti) {
      const Task& tk = tasks[ti];
      const Seq& x = seqs[tk.s];
      const int64_t* table = tp + tk.s * max_blocks;
      const int64_t mq = std::min(MQ, x.q_len - tk.i0);
      const int64_t R = mq * G, RP = round_up(R, RPAD);
      const int64_t pos0 = x.start_pos + tk.i0;  // position of the tile's first query
      const int64_t kend = pos0 + mq;            // keys [kfirst, kend) are visible to some row
      const int64_t kfirst = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
      const float* ktp = kt + x.kt_offset + tk.h * D * x.ld;

      for (int64_t i = 0; i < mq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const scalar_t* src = qp + ((x.q_start + tk.i0 + i) * H + tk.h * G + g) * D;
          float* dst = qbuf.data() + (i * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
        }
      std::fill(qbuf.begin() + R * D, qbuf.begin() + RP * D, 0.f);
      std::fill(obuf.begin(), obuf.begin() + RP * D, 0.f);
      std::fill(m.begin(), m.begin() + RP, -INFINITY);
      std::fill(l.begin(), l.begin() + RP, 0.f);

      // Key tiles are aligned to kbase (the packed layout); start at the one holding kfirst.
      for (int64_t k0 = x.kbase + (kfirst - x.kbase) / NK * NK; k0 < kend; k0 += NK) {
        const int64_t nk = std::min(NK, kend - k0);
        const int64_t nkc = round_up(nk, QK_C * W);  // the packed K is zero up to the tile's end
        for (int64_t n = 0; n < nk; ++n) {
          const int64_t t = k0 + n;
          const int64_t slot = table[t / bs] * bs + t % bs;
          vrows[n] = vp + slot * row_stride + tk.h * D;
          if constexpr (kQuant) vscale[n] = vsc[slot * KVH + tk.h];
        }
        for (int64_t r0 = 0; r0 < RP; r0 += QK_R)
          for (int64_t n0 = 0; n0 < nkc; n0 += QK_C * W)
            qk_tile(qbuf.data() + r0 * D, D, ktp + (k0 - x.kbase) * D + n0, sbuf.data() + r0 * NK + n0);
        // Online softmax per row: row r is query position p = pos0 + r / G and sees keys
        // (p - window, p]: tile columns [n_lo, nv).
        for (int64_t r = 0; r < RP; ++r) {
          float* s = sbuf.data() + r * NK;
          const int64_t p = pos0 + r / G;
          const int64_t nv = r < R ? std::clamp<int64_t>(p - k0 + 1, 0, nk) : 0;
          const int64_t n_lo = window > 0 ? std::clamp<int64_t>(p - window + 1 - k0, 0, nk) : 0;
          if (nv <= n_lo) {
            std::fill(s, s + nk, 0.f);
            continue;
          }
          // Whole vectors over the valid keys; the lanes before n_lo and past nv in the last
          // one are masked to -inf for the max and to exactly 0 after the exponential.
          const int64_t nvw = round_up(nv, W);
          for (int64_t j = 0; j < n_lo; ++j) s[j] = -INFINITY;
          for (int64_t j = nv; j < nvw; ++j) s[j] = -INFINITY;
          const float mx = vmax_row(s, nvw, m[r]);
          const float sum = vexp_row(s, nvw, mx);  // the masked lanes add ~1e-38 each to a sum >= 1: nothing
          std::fill(s + nv, s + nk, 0.f);
          std::fill(s, s + n_lo, 0.f);
          if (m[r] != -INFINITY) {
            const float alpha = exp_approx(m[r] - mx);
            if (alpha != 1.f) {
              float* o = obuf.data() + r * D;
              const vec va = vset1(alpha);
              int64_t d = 0;
              for (; d + W <= D; d += W) vstore(o + d, vmul(vload(o + d), va));
              for (; d < D; ++d) o[d] *= alpha;
            }
            l[r] = l[r] * alpha + sum;
          } else {
            l[r] = sum;
          }
          m[r] = mx;
        }
        if constexpr (kQuant) {  // (the sums l above are of the unscaled probabilities)
          for (int64_t r = 0; r < RP; ++r) {
            float* s = sbuf.data() + r * NK;
            for (int64_t n = 0; n < nk; ++n) s[n] *= vscale[n];
          }
        }
        for (int64_t r0 = 0; r0 < RP; r0 += PV_R)
          pv_rows(sbuf.data() + r0 * NK, nk, vrows, obuf.data() + r0 * D, D);
      }

      for (int64_t i = 0; i < mq; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * G + g;
          const float inv = 1.f / l[r];
          const float* o = obuf.data() + r * D;
          scalar_t* dst = op + ((x.q_start + tk.i0 + i) * H + tk.h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(o[d] * inv);
        }
    }
  }
}

}  // namespace

namespace kvmesh_cpu {

void paged_prefill_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& spans,
                             double scale, int64_t window, const std::optional<at::Tensor>& k_scale,
                             const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: full attention)");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous(), "out must be a contiguous tensor shaped like q");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the KV cache must share a head size");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "q, out and the KV cache must share a dtype");
  check_kv_scales(k_cache, v_cache, k_scale, v_scale, q);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && spans.scalar_type() == at::kLong, "int64 tables");
  TORCH_CHECK(spans.dim() == 2 && spans.size(1) == 3 && block_tables.dim() == 2 &&
                  block_tables.size(0) == spans.size(0),
              "spans (S, 3) and block_tables (S, max_blocks)");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto sp = spans.contiguous();
  const int64_t* s = sp.data_ptr<int64_t>();
  const int64_t bs = k_cache.size(1);
  for (int64_t i = 0; i < sp.size(0); ++i) {
    TORCH_CHECK(s[3 * i] >= 0 && s[3 * i + 1] >= 1 && s[3 * i + 2] >= 0 && s[3 * i] + s[3 * i + 1] <= q.size(0),
                "span ", i, " is outside q");
    TORCH_CHECK((s[3 * i + 1] + s[3 * i + 2] + bs - 1) / bs <= tables.size(1), "span ", i,
                "'s context needs more blocks than its table has");
  }
  if (k_scale.has_value()) {
    const float* ks = k_scale->data_ptr<float>();
    const float* vs = v_scale->data_ptr<float>();
    switch (q.scalar_type()) {
      case at::kFloat: prefill_kernel<float, int8_t>(out, qc, k_cache, v_cache, ks, vs, tables, sp, scale, window); break;
      case at::kBFloat16:
        prefill_kernel<at::BFloat16, int8_t>(out, qc, k_cache, v_cache, ks, vs, tables, sp, scale, window);
        break;
      default: prefill_kernel<at::Half, int8_t>(out, qc, k_cache, v_cache, ks, vs, tables, sp, scale, window); break;
    }
    return;
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      prefill_kernel<float, float>(out, qc, k_cache, v_cache, nullptr, nullptr, tables, sp, scale, window);
      break;
    case at::kBFloat16:
      prefill_kernel<at::BFloat16, at::BFloat16>(out, qc, k_cache, v_cache, nullptr, nullptr, tables, sp, scale,
                                                 window);
      break;
    case at::kHalf:
      prefill_kernel<at::Half, at::Half>(out, qc, k_cache, v_cache, nullptr, nullptr, tables, sp, scale, window);
      break;
    default:
      TORCH_CHECK(false, "paged_prefill_attention supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor spans, float scale, int window=0, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("paged_prefill_attention", &kvmesh_cpu::paged_prefill_attention); }
