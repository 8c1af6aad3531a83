// Paged decode attention for CPU: one query token per sequence, keys and values read
// in place from the paged cache through the block table (no gather copy, no padding).
//
//   out[b, h, :] = softmax(scale * q[b, h, :] . K[b, t, h/G, :] for lo[b] <= t < len[b]) @ V[b, :, h/G, :]
//
// lo[b] = max(0, len[b] - window) for a sliding-window layer (window > 0), else 0: the
// tokens before a window are never read (their blocks may have been freed and reused, see
// engine/kv_cache_manager.py), and a long context costs window-sized work.
//
// Shapes: q, out (B, H, D); k_cache, v_cache (num_blocks, block_size, KVH, D) contiguous,
// float32 / bfloat16 / float16 (the model's dtype), or int8 with k_scale, v_scale
// (num_blocks, block_size, KVH) float32 beside them (an 8-bit KV cache, layers/kv_cache.py:
// row = scale * int8 row); block_tables (B, max_blocks) int64; context_lens (B,) int64.
// G = H / KVH query heads share a KV head.
//
// How it is fast (decode attention is bound by reading the cache once per step):
// - a task is (sequence, KV head, partition of the context): the G query heads that share
//   a KV head are computed together, so each K/V row is loaded once for all of them;
// - one pass over the context in chunks of CHUNK tokens with an online softmax (running
//   max m, sum l, rescaled accumulator), so K and V rows of a chunk are read back to back
//   and no score buffer grows with the context; the next chunk's rows are prefetched
//   (blocks are scattered, the hardware prefetcher stops at each one), spread over the
//   chunk's work rather than asked for at once;
// - for head sizes of 2 / 4 / 8 / 16 whole vectors, a register-blocked variant scores W keys
//   at a time with one transposed reduction (no horizontal sum per key) and adds each value
//   row into all G heads' accumulators held in registers (`attend_fixed`);
// - the ISA is chosen when the kernel is built on the machine (-march=native): AVX-512
//   (16 lanes), AVX2 + FMA (8 lanes), or portable scalar code; bf16 / fp16 rows widen to
//   fp32 in registers, accumulation is fp32; exp is a vectorised polynomial (Cephes expf,
//   ~1 ulp), not a libm call per score;
// - tasks are scheduled dynamically, longest first; when there are too few (batch-1
//   decode: one task per KV head) contexts are split into partitions that are merged by
//   their log-sum-exp afterwards (flash-decoding), so every core has work;
// - sequences whose tables start with the same blocks (a shared system prompt, hit in the
//   prefix cache) attend those blocks in one task for all of them (cascade attention, see
//   `shared_groups`): the prefix is read once per step, not once per sequence;
// - an int8 cache is read at a quarter of fp32's bytes (plus a scale per row): per chunk and
//   KV head its rows are widened into an fp32 tile in L1 (`attend_q8`), which the G query
//   heads of that KV head then read, so each int8 row is converted once, not G times, and no
//   fp32 copy of the cache exists beyond that tile; the scales multiply whole vectors of
//   scores and probabilities, and scores are reduced W at a time (`vsums`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vec_math.h"

namespace {

using namespace kvmesh_vec;

// exp of softmax scores minus their max (<= 0): vectorised polynomial, see vec_math.h.
inline float exp_nonpos(float x) { return kvmesh_vec::exp_approx(x); }

constexpr int64_t CHUNK = 32;  // tokens per online-softmax update

// Running softmax state of one task: G heads x (max, sum, accumulator of D floats).
struct Partial {
  float* m;
  float* l;
  float* acc;
};

// Software prefetch of `nbytes` from `p` into L2 / L3 (prefetcht2; no-op without SSE):
// on a cold cache the chunk-ahead rows measured T2 > T1 > T0 (5-10% apart).
inline void prefetch_bytes(const void* p, int64_t nbytes) {
#if defined(__SSE__)
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < nbytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T2);
#else
  (void)p;
  (void)nbytes;
#endif
}

// Empty running state of H heads: max -inf, sum 0, accumulator 0.
inline void reset_state(Partial st, int64_t H, int64_t D) {
  std::fill(st.m, st.m + H, -INFINITY);
  std::fill(st.l, st.l + H, 0.f);
  std::fill(st.acc, st.acc + H * D, 0.f);
}

// Offset (in elements) of token t's cache row (all KV heads) through the block table.
inline int64_t row_offset(const int64_t* table, int64_t bs, int64_t row_stride, int64_t t) {
  return (table[t / bs] * bs + t % bs) * row_stride;
}

// Points krows / vrows at the cache rows of tokens [t0, t0 + n) through the block table,
// and prefetches the rows of the following chunk (up to t_end): blocks sit anywhere in the
// cache and the hardware prefetcher stops at every block (and page) boundary, so the next
// chunk's loads are requested while this one is computed instead of waiting on DRAM one
// block at a time.
template <typename scalar_t>
inline void chunk_rows(const scalar_t* kp, const scalar_t* vp, const int64_t* table, int64_t bs, int64_t row_stride,
                       int64_t t0, int64_t n, int64_t t_end, const scalar_t** krows, const scalar_t** vrows) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t off = row_offset(table, bs, row_stride, t0 + j);
    krows[j] = kp + off;
    vrows[j] = vp + off;
  }
  const int64_t n_next = std::min(CHUNK, t_end - t0 - n);
  const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t j = 0; j < n_next; ++j) {
    const int64_t off = row_offset(table, bs, row_stride, t0 + n + j);
    prefetch_bytes(kp + off, row_bytes);
    prefetch_bytes(vp + off, row_bytes);
  }
}

// One head's chunk of n scores `sg`, exponentiated in place against the running max `m`
// raised to the chunk's max, which is returned; `sum` gets the chunk's sum of exponentials.
// Whole vectors with explicit intrinsics (vexp), the n % W rest scalar: the `omp simd` form
// of this loop ran at half the AVX-512 width (decode attention, 48 sequences of 100-500
// tokens, 30 layers: 45.4 -> 41.4 ms).
inline float exp_chunk(float* sg, int64_t n, float m, float& sum) {
  const int64_t nw = n / W * W;
  float mx = vmax_row(sg, nw, m);
  for (int64_t j = nw; j < n; ++j) mx = std::max(mx, sg[j]);
  float s = vexp_row(sg, nw, mx);
  for (int64_t j = nw; j < n; ++j) {
    sg[j] = exp_nonpos(sg[j] - mx);
    s += sg[j];
  }
  sum = s;
  return mx;
}

// Attend all H query heads `qs` (pre-scaled fp32, H x D) of one sequence over its context
// tokens [t_begin, t_end); query head x reads KV head x / G. Leaves the unnormalised result
// in `st`. Whole cache rows (every KV head of a token, contiguous) are read at once: a
// task per KV head would touch 1/KVH of every row and waste most of each DRAM burst.
template <typename scalar_t>
void attend(const float* qs, const scalar_t* kp, const scalar_t* vp, const float*, const float*,
            const int64_t* table, int64_t bs, int64_t KVH, int64_t D, int64_t G, int64_t t_begin, int64_t t_end,
            Partial st, float* scores, float*) {
  const int64_t H = KVH * G;
  const int64_t nv = D / W;  // full vectors per row; D % W handled by the scalar tail below
  const int64_t tail = nv * W;
  const int64_t row_stride = KVH * D;
  reset_state(st, H, D);
  const scalar_t* krows[CHUNK];
  const scalar_t* vrows[CHUNK];
  for (int64_t t0 = t_begin; t0 < t_end; t0 += CHUNK) {
    const int64_t n = std::min(CHUNK, t_end - t0);
    chunk_rows(kp, vp, table, bs, row_stride, t0, n, t_end, krows, vrows);
    // scores[g, j] = q_g . k_j
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t g = 0; g < H; ++g) {
        const scalar_t* k = krows[j] + (g / G) * D;
        const float* q = qs + g * D;
        vec a0 = vzero(), a1 = vzero();
        int64_t i = 0;
        for (; i + 1 < nv; i += 2) {
          a0 = vfma(vload(q + i * W), vload(k + i * W), a0);
          a1 = vfma(vload(q + (i + 1) * W), vload(k + (i + 1) * W), a1);
        }
        if (i < nv) a0 = vfma(vload(q + i * W), vload(k + i * W), a0);
        float s = vsum(a0) + vsum(a1);
        for (int64_t d = tail; d < D; ++d) s += q[d] * static_cast<float>(k[d]);
        scores[g * CHUNK + j] = s;
      }
    }
    // online softmax: rescale the running state to the new max, exponentiate the chunk
    for (int64_t g = 0; g < H; ++g) {
      float sum;
      const float mx = exp_chunk(scores + g * CHUNK, n, st.m[g], sum);
      if (mx != st.m[g]) {
        const float alpha = exp_nonpos(st.m[g] - mx);  // 0 on the first chunk (m = -inf)
        st.l[g] *= alpha;
        float* ag = st.acc + g * D;
        for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
        st.m[g] = mx;
      }
      st.l[g] += sum;
    }
    // acc[g, :] += p[g, j] * v_j
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t g = 0; g < H; ++g) {
        const scalar_t* v = vrows[j] + (g / G) * D;
        const vec p = vset1(scores[g * CHUNK + j]);
        float* ag = st.acc + g * D;
        for (int64_t i = 0; i < nv; ++i) vstore(ag + i * W, vfma(p, vload(v + i * W), vload(ag + i * W)));
        const float ps = scores[g * CHUNK + j];
        for (int64_t d = tail; d < D; ++d) ag[d] += ps * static_cast<float>(v[d]);
      }
    }
  }
}

// Online-softmax update of one head for a chunk of n scores `sg` (replaced by their
// exponentials against the new running max): the running max m and sum l move on, and the
// accumulator `ag` (D floats) is rescaled to the new max; the caller then adds P V.
inline void online_update(float* sg, int64_t n, float& m, float& l, float* ag, int64_t D) {
  float sum;
  const float mx = exp_chunk(sg, n, m, sum);
  if (mx != m) {
    const float alpha = exp_nonpos(m - mx);  // 0 on the first chunk (m = -inf)
    l *= alpha;
    const vec va = vset1(alpha);
    int64_t d = 0;
    for (; d + W <= D; d += W) vstore(ag + d, vmul(va, vload(ag + d)));
    for (; d < D; ++d) ag[d] *= alpha;
    m = mx;
  }
  l += sum;
}

// Scores and online-softmax update of one query head `q` (pre-scaled, D floats) over a chunk
// of n keys of an int8 cache, widened (not scaled) into fp32 rows of stride D in `kt`, their
// scales in ks; `sg` gets the chunk's probabilities times the values' scales vs, ready for
// P V over the widened values (the running sum l takes the probabilities themselves):
//   score_j = ks_j (q . kt_j)          p_j v_j = (p_j vs_j) vt_j
// Scores are computed W keys at a time and reduced together (vsums): one horizontal sum per
// key was a third of a head's work once the cache's bytes were cut to a quarter. NV > 0:
// D = NV * W, the query in registers; NV == 0: any D, a scalar tail. The accumulator `ag` is
// rescaled to the new running max here; the caller adds P V.
template <int NV>
inline void scores_q8(const float* q, const float* kt, const float* ks, const float* vs, int64_t D, int64_t n,
                      float& m, float& l, float* ag, float* sg) {
  const int64_t nv = D / W, tail = nv * W;
  const int64_t nw = W > 1 ? n / W * W : 0;  // keys scored W at a time
  vec qr[NV > 0 ? NV : 1];
  if constexpr (NV > 0)
    for (int i = 0; i < NV; ++i) qr[i] = vload(q + i * W);
  auto dot = [&](const float* k) {  // q . k as a vector of partial sums (the D % W tail apart)
    vec a0;
    if constexpr (NV > 0) {
      a0 = vmul(qr[0], vload(k));
      vec a1 = NV > 1 ? vmul(qr[1], vload(k + W)) : vzero();
      for (int i = 2; i < NV; i += 2) {
        a0 = vfma(qr[i], vload(k + i * W), a0);
        if (i + 1 < NV) a1 = vfma(qr[i + 1], vload(k + (i + 1) * W), a1);
      }
      a0 = vadd(a0, a1);
    } else {
      a0 = vzero();
      for (int64_t i = 0; i < nv; ++i) a0 = vfma(vload(q + i * W), vload(k + i * W), a0);
    }
    return a0;
  };
  auto rest = [&](const float* k) {  // the D % W tail columns
    float e = 0.f;
    for (int64_t d = tail; d < D; ++d) e += q[d] * k[d];
    return e;
  };
  for (int64_t j0 = 0; j0 < nw; j0 += W) {
    vec acc[W];
    for (int64_t t = 0; t < W; ++t) acc[t] = dot(kt + (j0 + t) * D);
    vec sc = vsums(acc);
    if (NV == 0 && tail < D) {
      float extra[W];
      for (int64_t t = 0; t < W; ++t) extra[t] = rest(kt + (j0 + t) * D);
      sc = vadd(sc, vload(extra));
    }
    vstore(sg + j0, vmul(sc, vload(ks + j0)));
  }
  for (int64_t j = nw; j < n; ++j) sg[j] = (vsum(dot(kt + j * D)) + rest(kt + j * D)) * ks[j];
  online_update(sg, n, m, l, ag, D);
  for (int64_t j = 0; j < nw; j += W) vstore(sg + j, vmul(vload(sg + j), vload(vs + j)));
  for (int64_t j = nw; j < n; ++j) sg[j] *= vs[j];
}

// ag += sum_j sg[j] vt_j for one head over n widened value rows (row stride D) of a tile.
template <int NV>
inline void pv_tile_q8(const float* vt, const float* sg, int64_t D, int64_t n, float* ag) {
  if constexpr (NV > 0) {
    vec acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = vload(ag + i * W);
    for (int64_t j = 0; j < n; ++j) {
      const float* v = vt + j * D;
      const vec p = vset1(sg[j]);
      for (int i = 0; i < NV; ++i) acc[i] = vfma(p, vload(v + i * W), acc[i]);
    }
    for (int i = 0; i < NV; ++i) vstore(ag + i * W, acc[i]);
  } else {
    const int64_t nv = D / W, tail = nv * W;
    for (int64_t j = 0; j < n; ++j) {
      const float* v = vt + j * D;
      const vec p = vset1(sg[j]);
      for (int64_t i = 0; i < nv; ++i) vstore(ag + i * W, vfma(p, vload(v + i * W), vload(ag + i * W)));
      for (int64_t d = tail; d < D; ++d) ag[d] += sg[j] * v[d];
    }
  }
}

// P V for HB heads at once straight from the value rows `vrows` (n of them, D = NV * W; int8
// or the float cache's dtype): each row loaded (widened) once into registers and added into
// the HB heads' accumulators, also held in registers; head h's probabilities are
// sg[h * CHUNK ..], its accumulator ag[h * D ..]. (A tile of widened values would cost a store
// and HB loads per vector: on CPUs that split 512-bit stores, the tile's L1 traffic was the
// int8 kernel's bound. For a float cache, one value row per head would be read G times.)
template <int NV, int HB, typename T>
inline void pv_regs(const T* const* vrows, const float* sg, int64_t n, float* ag, int64_t D) {
  vec acc[HB][NV];
  for (int h = 0; h < HB; ++h)
    for (int i = 0; i < NV; ++i) acc[h][i] = vload(ag + h * D + i * W);
  for (int64_t j = 0; j < n; ++j) {
    vec v[NV];
    for (int i = 0; i < NV; ++i) v[i] = vload(vrows[j] + i * W);
    for (int h = 0; h < HB; ++h) {
      const vec p = vset1(sg[h * CHUNK + j]);
      for (int i = 0; i < NV; ++i) acc[h][i] = vfma(p, v[i], acc[h][i]);
    }
  }
  for (int h = 0; h < HB; ++h)
    for (int i = 0; i < NV; ++i) vstore(ag + h * D + i * W, acc[h][i]);
}

// Accumulator registers the register-held P V may use (of 32 zmm / 16 ymm), and so how many
// heads it takes at once for a head of NV vectors; 1: the widened-value tile instead.
constexpr int kAccRegs = W >= 16 ? 16 : 8;
template <int NV>
constexpr int kHeadsPerPass = NV > 0 ? kAccRegs / NV : 0;

// pv_regs over heads [0, nh) in passes of up to HB (the last pass with the rest).
template <int NV, int HB, typename T>
inline void pv_heads(const T* const* vrows, const float* sg, int64_t n, float* ag, int64_t D, int64_t nh) {
  int64_t h = 0;
  for (; h + HB <= nh; h += HB) pv_regs<NV, HB>(vrows, sg + h * CHUNK, n, ag + h * D, D);
  if constexpr (HB > 1) {
    if (h < nh) pv_heads<NV, HB - 1>(vrows, sg + h * CHUNK, n, ag + h * D, D, nh - h);
  }
}

// Scores of one query head `q` (pre-scaled, D = NV * W floats) against n key rows `krows`
// (the float cache's dtype, each pointing at this KV head's D values): W keys at a time, their
// W partial-sum vectors reduced together (vsums, ~3 instructions a key; one horizontal sum
// per key is ~8, and was the larger part of the kernel's work), the n % W rest one by one.
// The query stays in registers where they hold it beside the W accumulators.
template <int NV, typename scalar_t>
inline void scores_rows(const float* q, const scalar_t* const* krows, int64_t n, float* sg) {
  constexpr bool kQInRegs = NV + W <= (W >= 16 ? 24 : 12);  // of 32 zmm / 16 ymm: room left for the K loads
  vec qr[kQInRegs ? NV : 1];
  if constexpr (kQInRegs)
    for (int i = 0; i < NV; ++i) qr[i] = vload(q + i * W);
  auto qv = [&](int i) __attribute__((always_inline)) {
    if constexpr (kQInRegs) return qr[i];
    else return vload(q + i * W);
  };
  auto dot = [&](const scalar_t* k) __attribute__((always_inline)) {
    vec a0 = vmul(qv(0), vload(k));
    vec a1 = NV > 1 ? vmul(qv(1), vload(k + W)) : vzero();
    for (int i = 2; i < NV; i += 2) {
      a0 = vfma(qv(i), vload(k + i * W), a0);
      if (i + 1 < NV) a1 = vfma(qv(i + 1), vload(k + (i + 1) * W), a1);
    }
    return vadd(a0, a1);
  };
  const int64_t nw = W > 1 ? n / W * W : 0;
  for (int64_t j0 = 0; j0 < nw; j0 += W) {
    vec acc[W];
    for (int64_t t = 0; t < W; ++t) acc[t] = dot(krows[j0 + t]);
    vstore(sg + j0, vsums(acc));
  }
  for (int64_t j = nw; j < n; ++j) sg[j] = vsum(dot(krows[j]));
}

// `attend` for rows of exactly NV vectors (D = NV * W: head sizes 32 / 64 / 128 / 256),
// the common case. Same arithmetic, reordered per chunk and KV head: the G query heads
// sharing the KV head score the chunk's keys W at a time (`scores_rows`), then P V adds
// each value row once into all G heads' accumulators held in registers (`pv_heads`), so
// the head's slice of a value row is loaded once, not G times; the next chunk's rows are
// prefetched a slice at a time between the heads (below). SmolLM2-135M's heads, 30 layers'
// caches out of cache (huge pages, blocks scattered), 32 sequences of 300 tokens, 2 threads,
// Zen 4: 28-31 -> 23 ms a step (14-16 -> 19 GB/s; a burst of prefetches per chunk and one
// horizontal sum per key had it at half the 29 GB/s the cores read sequentially).
template <typename scalar_t, int NV>
void attend_fixed(const float* qs, const scalar_t* kp, const scalar_t* vp, const float*, const float*,
                  const int64_t* table, int64_t bs, int64_t KVH, int64_t D, int64_t G, int64_t t_begin,
                  int64_t t_end, Partial st, float* scores, float*) {
  constexpr int HB = kHeadsPerPass<NV> > 0 ? kHeadsPerPass<NV> : 1;
  const int64_t row_stride = KVH * D;
  reset_state(st, KVH * G, D);
  const int64_t head_bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  int64_t offs[CHUNK], next[CHUNK];  // this chunk's and the next one's row offsets
  const scalar_t* hk[CHUNK];
  const scalar_t* hv[CHUNK];
  for (int64_t t0 = t_begin; t0 < t_end; t0 += CHUNK) {
    const int64_t n = std::min(CHUNK, t_end - t0);
    const int64_t n_next = std::min(CHUNK, t_end - t0 - n);
    for (int64_t j = 0; j < n; ++j) offs[j] = row_offset(table, bs, row_stride, t0 + j);
    for (int64_t j = 0; j < n_next; ++j) next[j] = row_offset(table, bs, row_stride, t0 + n + j);
    for (int64_t kh = 0; kh < KVH; ++kh) {
      for (int64_t j = 0; j < n; ++j) {
        hk[j] = kp + offs[j] + kh * D;
        hv[j] = vp + offs[j] + kh * D;
      }
      for (int64_t g = kh * G; g < (kh + 1) * G; ++g) {
        // This KV head's slice of the next chunk's rows, a G-th of it before each query head:
        // requests spread over the chunk's work keep DRAM busy while it computes (the whole
        // next chunk asked for at once, as `chunk_rows` does, stalls on the full miss queue
        // and then leaves DRAM idle while it computes).
        const int64_t gi = g - kh * G;
        for (int64_t j = gi * n_next / G; j < (gi + 1) * n_next / G; ++j) {
          prefetch_bytes(kp + next[j] + kh * D, head_bytes);
          prefetch_bytes(vp + next[j] + kh * D, head_bytes);
        }
        float* sg = scores + g * CHUNK;
        scores_rows<NV>(qs + g * D, hk, n, sg);
        online_update(sg, n, st.m[g], st.l[g], st.acc + g * D, D);
      }
      pv_heads<NV, HB>(hv, scores + kh * G * CHUNK, n, st.acc + kh * G * D, D, G);
    }
  }
}

// dst[0 .. D) = src[0 .. D) widened to floats (an int8 cache row).
inline void widen_row(const int8_t* src, float* dst, int64_t D) {
  int64_t d = 0;
  for (; d + W <= D; d += W) vstore(dst + d, vload(src + d));
  for (; d < D; ++d) dst[d] = static_cast<float>(src[d]);
}

// `attend` over an int8 cache with per-(token, KV head) scales `ksc` / `vsc`. Per chunk the
// rows' slots are resolved (and the next chunk's rows and scales prefetched, as
// `chunk_rows` does); then per KV head the chunk's K rows of that head are widened into
// `tile` (CHUNK x D floats, L1-sized) with the K and V scales beside, the G query heads
// sharing it score the tile (`scores_q8`), and P V adds the int8 value rows for several heads
// at once (`pv_heads`; a widened tile where the registers hold too few heads). Query
// head x reads KV head x / G, as in `attend`.
template <int NV>
void attend_q8(const float* qs, const int8_t* kp, const int8_t* vp, const float* ksc, const float* vsc,
               const int64_t* table, int64_t bs, int64_t KVH, int64_t D, int64_t G, int64_t t_begin, int64_t t_end,
               Partial st, float* scores, float* tile) {
  constexpr int HB = kHeadsPerPass<NV>;
  const int64_t H = KVH * G;
  const int64_t row_stride = KVH * D;
  reset_state(st, H, D);
  float* kt = tile;
  float* vt = tile + CHUNK * D;
  float* ks = tile + 2 * CHUNK * D;
  float* vs = ks + CHUNK;
  int64_t slots[CHUNK];
  const int8_t* vrows[CHUNK];
  for (int64_t t0 = t_begin; t0 < t_end; t0 += CHUNK) {
    const int64_t n = std::min(CHUNK, t_end - t0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = t0 + j;
      slots[j] = table[t / bs] * bs + t % bs;
    }
    const int64_t n_next = std::min(CHUNK, t_end - t0 - n);
    for (int64_t j = 0; j < n_next; ++j) {
      const int64_t t = t0 + n + j;
      const int64_t slot = table[t / bs] * bs + t % bs;
      prefetch_bytes(kp + slot * row_stride, row_stride);
      prefetch_bytes(vp + slot * row_stride, row_stride);
      prefetch_bytes(ksc + slot * KVH, KVH * static_cast<int64_t>(sizeof(float)));
      prefetch_bytes(vsc + slot * KVH, KVH * static_cast<int64_t>(sizeof(float)));
    }
    for (int64_t kh = 0; kh < KVH; ++kh) {
      for (int64_t j = 0; j < n; ++j) {
        const int64_t si = slots[j] * KVH + kh;
        widen_row(kp + slots[j] * row_stride + kh * D, kt + j * D, D);
        vrows[j] = vp + slots[j] * row_stride + kh * D;
        ks[j] = ksc[si];
        vs[j] = vsc[si];
      }
      for (int64_t g = kh * G; g < (kh + 1) * G; ++g)
        scores_q8<NV>(qs + g * D, kt, ks, vs, D, n, st.m[g], st.l[g], st.acc + g * D, scores + g * CHUNK);
      if constexpr (HB >= 2) {
        pv_heads<NV, HB>(vrows, scores + kh * G * CHUNK, n, st.acc + kh * G * D, D, G);
      } else {
        for (int64_t j = 0; j < n; ++j) widen_row(vrows[j], vt + j * D, D);
        for (int64_t g = kh * G; g < (kh + 1) * G; ++g)
          pv_tile_q8<NV>(vt, scores + g * CHUNK, D, n, st.acc + g * D);
      }
    }
  }
}

template <typename scalar_t>
using AttendFn = void (*)(const float*, const scalar_t*, const scalar_t*, const float*, const float*,
                          const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, Partial, float*,
                          float*);

// The register-blocked `attend_fixed` when the head size is a supported multiple of the
// vector width, else the general `attend`; for an int8 cache `attend_q8` likewise.
template <typename scalar_t>
AttendFn<scalar_t> pick_attend(int64_t D) {
  if (W > 1 && D % W == 0) {
    switch (D / W) {
      case 2: return attend_fixed<scalar_t, 2>;
      case 4: return attend_fixed<scalar_t, 4>;
      case 8: return attend_fixed<scalar_t, 8>;
      case 16: return attend_fixed<scalar_t, 16>;
      default: break;
    }
  }
  return attend<scalar_t>;
}

template <>
AttendFn<int8_t> pick_attend<int8_t>(int64_t D) {
  if (W > 1 && D % W == 0) {
    switch (D / W) {
      case 2: return attend_q8<2>;
      case 4: return attend_q8<4>;
      case 8: return attend_q8<8>;
      case 16: return attend_q8<16>;
      default: break;
    }
  }
  return attend_q8<0>;
}

// Sequences whose block tables begin with the same block ids share that prefix's K/V: a
// prefix-cache hit hands out the same physical blocks, and shared blocks are full and never
// written again. Cascade attention reads such a prefix once per step for all its sharers:
// one task attends the n sharers' queries (n x H rows) over the shared tokens, each sharer
// attends its own tokens alone, and the two partial softmaxes merge by log-sum-exp like the
// partitions below. Decode attention streams the cache at copy bandwidth, so reading a
// 512-token system prompt once for 3 sharers instead of 3 times cuts its bytes ~3x.
struct Group {
  int64_t first, n;   // members: order[first .. first + n)
  int64_t shared;     // leading tokens every member has in the same blocks (whole blocks)
};

// Blocks shared between full-block runs of two table rows: leading equal ids, counting only
// blocks both sequences attend completely (a row's tail past its length is padding).
inline int64_t common_blocks(const int64_t* a, const int64_t* b, int64_t nfull) {
  int64_t i = 0;
  while (i < nfull && a[i] == b[i]) ++i;
  return i;
}

// Groups of >= 2 sequences sharing >= kMinSharedBlocks leading blocks: rows sorted
// lexicographically over their full blocks, then maximal runs whose adjacent common
// prefixes all reach the minimum (the run's shared prefix is the least of them).
constexpr int64_t kMinSharedBlocks = 4;

std::vector<Group> shared_groups(const int64_t* tp, const int64_t* lp, int64_t B, int64_t max_blocks, int64_t bs,
                                 std::vector<int64_t>& order) {
  order.resize(B);
  std::iota(order.begin(), order.end(), 0);
  std::vector<Group> groups;
  if (B < 2) return groups;
  auto nfull = [&](int64_t b) { return std::min(lp[b] / bs, max_blocks); };
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    const int64_t n = std::min(nfull(x), nfull(y));
    const int64_t c = common_blocks(tp + x * max_blocks, tp + y * max_blocks, n);
    if (c < n) return tp[x * max_blocks + c] < tp[y * max_blocks + c];
    return nfull(x) < nfull(y) || (nfull(x) == nfull(y) && x < y);
  });
  for (int64_t i = 0; i < B;) {
    int64_t j = i + 1, shared = nfull(order[i]);
    while (j < B) {
      const int64_t a = order[j - 1], b = order[j];
      const int64_t c = common_blocks(tp + a * max_blocks, tp + b * max_blocks, std::min(nfull(a), nfull(b)));
      if (c < kMinSharedBlocks) break;
      shared = std::min(shared, c);
      ++j;
    }
    if (j - i >= 2) groups.push_back({i, j - i, shared * bs});
    i = j;
  }
  return groups;
}

// scalar_t: the queries' and outputs' dtype; cache_t: the cache's (scalar_t, or int8_t with
// scales ksc / vsc; null for a float cache).
template <typename scalar_t, typename cache_t>
void decode_kernel(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                   const float* ksc, const float* vsc, const at::Tensor& tables, const at::Tensor& lens, double scale,
                   int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = kc.size(1), KVH = kc.size(2), G = H / KVH;
  const int64_t max_blocks = tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = kc.data_ptr<cache_t>();
  const cache_t* vp = vc.data_ptr<cache_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t threads = at::get_num_threads();

  // Partition contexts only when sequences alone cannot keep every thread busy (small
  // batches); a partition is at least kMinPart tokens so the merge stays cheap.
  constexpr int64_t kMinPart = 128;
  // First token each sequence attends; partitions are laid over [lo, len).
  std::vector<int64_t> lo(B, 0);
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (window > 0) lo[b] = std::max<int64_t>(0, lp[b] - window);
    max_len = std::max(max_len, lp[b] - lo[b]);
  }
  int64_t parts = 1;
  if (B < 4 * threads) parts = std::max<int64_t>(1, std::min((4 * threads + B - 1) / B, max_len / kMinPart));
  const int64_t part_len = (max_len + parts - 1) / parts;

  // Cascade over shared prefixes only for full attention: a window skips the prefix anyway.
  std::vector<int64_t> order;
  const std::vector<Group> groups =
      window > 0 ? std::vector<Group>() : shared_groups(tp, lp, B, max_blocks, bs, order);
  if (window > 0) {
    order.resize(B);
    std::iota(order.begin(), order.end(), 0);
  }
  std::vector<int64_t> own_from(B, 0);  // first token a sequence attends on its own
  int64_t max_group = 1;
  for (const Group& gr : groups) {
    max_group = std::max(max_group, gr.n);
    for (int64_t m = 0; m < gr.n; ++m) own_from[order[gr.first + m]] = gr.shared;
  }

  // Tasks: (sequence, partition) over the tokens it attends alone, and (group, partition)
  // over a group's shared tokens; longest work first so dynamic scheduling balances them.
  // Partition p covers tokens lo + [p * part_len, (p + 1) * part_len), clipped to the task's range.
  struct Task {
    int64_t b, group, p, begin, end;  // group -1: a sequence's own tokens
  };
  std::vector<Task> tasks;
  tasks.reserve((B + groups.size()) * parts);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t begin = std::max(own_from[b], lo[b] + p * part_len);
      const int64_t end = std::min(lp[b], lo[b] + (p + 1) * part_len);
      if (begin < end) tasks.push_back({b, -1, p, begin, end});
    }
  for (int64_t gi = 0; gi < static_cast<int64_t>(groups.size()); ++gi)
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t begin = p * part_len, end = std::min(groups[gi].shared, (p + 1) * part_len);
      if (begin < end) tasks.push_back({order[groups[gi].first], gi, p, begin, end});
    }
  auto work = [&](const Task& t) { return (t.end - t.begin) * (t.group < 0 ? 1 : groups[t.group].n); };
  std::stable_sort(tasks.begin(), tasks.end(), [&](const Task& x, const Task& y) { return work(x) > work(y); });

  // State of each (sequence, slot): H heads x {m, l, acc[D]}; l = 0 marks "no tokens".
  // Slots 0 .. parts-1 hold its own partitions, parts .. 2 parts-1 its group's (only when
  // there are groups: a batch without shared prefixes zeroes and merges no extra slots).
  const int64_t slot = H * (2 + D), slots = groups.empty() ? parts : 2 * parts;
  std::vector<float> state(B * slots * slot, 0.f);
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  const AttendFn<cache_t> attend_fn = pick_attend<cache_t>(D);
  const int64_t tile_size = std::is_same_v<cache_t, int8_t> ? 2 * CHUNK * (D + 1) : 0;

#pragma omp parallel num_threads(std::min(threads, ntasks))
  {
    const int64_t rows_max = max_group * H;
    std::vector<float> qs(rows_max * D), scores(rows_max * CHUNK), gstate(rows_max * (2 + D)), tile(tile_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < ntasks; ++i) {
      const Task& tk = tasks[i];
      if (tk.group < 0) {
        const scalar_t* qrow = qp + tk.b * H * D;
        for (int64_t x = 0; x < H * D; ++x) qs[x] = static_cast<float>(qrow[x]) * fscale;
        float* s = state.data() + (tk.b * slots + tk.p) * slot;
        attend_fn(qs.data(), kp, vp, ksc, vsc, tp + tk.b * max_blocks, bs, KVH, D, G, tk.begin, tk.end,
                  Partial{s, s + H, s + 2 * H}, scores.data(), tile.data());
        continue;
      }
      // The group's queries as one sequence of n x H heads, ordered (KV head, member, head
      // within the KV head), so query row r reads KV head r / (n G), as `attend` expects.
      const Group& gr = groups[tk.group];
      const int64_t n = gr.n, R = n * H;
      for (int64_t k = 0; k < KVH; ++k)
        for (int64_t m = 0; m < n; ++m)
          for (int64_t g = 0; g < G; ++g) {
            const scalar_t* src = qp + (order[gr.first + m] * H + k * G + g) * D;
            float* dst = qs.data() + ((k * n + m) * G + g) * D;
            for (int64_t x = 0; x < D; ++x) dst[x] = static_cast<float>(src[x]) * fscale;
          }
      float* gm = gstate.data();
      attend_fn(qs.data(), kp, vp, ksc, vsc, tp + tk.b * max_blocks, bs, KVH, D, n * G, tk.begin, tk.end,
                Partial{gm, gm + R, gm + 2 * R}, scores.data(), tile.data());
      for (int64_t k = 0; k < KVH; ++k)
        for (int64_t m = 0; m < n; ++m)
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = (k * n + m) * G + g, h = k * G + g;
            float* s = state.data() + (order[gr.first + m] * slots + parts + tk.p) * slot;
            s[h] = gm[r];
            s[H + h] = gm[R + r];
            std::memcpy(s + 2 * H + h * D, gm + 2 * R + r * D, D * sizeof(float));
          }
    }
  }

  // Merge the slots of each sequence by log-sum-exp and normalise.
  at::parallel_for(0, B, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t b = begin; b < end; ++b) {
      const float* base = state.data() + b * slots * slot;
      for (int64_t g = 0; g < H; ++g) {
        float m = -INFINITY;
        for (int64_t p = 0; p < slots; ++p)
          if (base[p * slot + H + g] > 0.f) m = std::max(m, base[p * slot + g]);
        float l = 0.f;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t p = 0; p < slots; ++p) {
          const float* s = base + p * slot;
          if (!(s[H + g] > 0.f)) continue;
          const float w = exp_nonpos(s[g] - m);
          l += w * s[H + g];
          const float* a = s + 2 * H + g * D;
          for (int64_t d = 0; d < D; ++d) acc[d] += w * a[d];
        }
        const float inv = 1.f / l;
        scalar_t* o = op + (b * H + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[d] * inv);
      }
    }
  });
}

}  // namespace

namespace kvmesh_cpu {

void check_kv_scales(const at::Tensor& k_cache, const at::Tensor& v_cache, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, const at::Tensor& q) {
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "give both k_scale and v_scale, or neither");
  if (!k_scale.has_value()) {
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
                "q and the KV cache must share a dtype (or the cache is int8 with k_scale / v_scale)");
    return;
  }
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar,
              "k_scale / v_scale go with an int8 KV cache");
  for (const at::Tensor* s : {&*k_scale, &*v_scale})
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 3 &&
                    s->size(0) == k_cache.size(0) && s->size(1) == k_cache.size(1) && s->size(2) == k_cache.size(2),
                "KV scales must be contiguous float32 (num_blocks, block_size, kv_heads)");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "q must be float32, bfloat16 or float16");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  int64_t window, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: full attention)");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q and the KV cache must share a head size");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  check_kv_scales(k_cache, v_cache, k_scale, v_scale, q);
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  auto qc = q.contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  for (int64_t b = 0; b < lens.size(0); ++b)
    TORCH_CHECK(lens.data_ptr<int64_t>()[b] >= 1, "every sequence needs at least one context token");
  auto out = at::empty_like(qc);
  if (k_scale.has_value()) {
    const float* ks = k_scale->data_ptr<float>();
    const float* vs = v_scale->data_ptr<float>();
    switch (q.scalar_type()) {
      case at::kFloat: decode_kernel<float, int8_t>(out, qc, k_cache, v_cache, ks, vs, tables, lens, scale, window); break;
      case at::kBFloat16:
        decode_kernel<at::BFloat16, int8_t>(out, qc, k_cache, v_cache, ks, vs, tables, lens, scale, window);
        break;
      default: decode_kernel<at::Half, int8_t>(out, qc, k_cache, v_cache, ks, vs, tables, lens, scale, window); break;
    }
    return out;
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_kernel<float, float>(out, qc, k_cache, v_cache, nullptr, nullptr, tables, lens, scale, window);
      break;
    case at::kBFloat16:
      decode_kernel<at::BFloat16, at::BFloat16>(out, qc, k_cache, v_cache, nullptr, nullptr, tables, lens, scale,
                                                window);
      break;
    case at::kHalf:
      decode_kernel<at::Half, at::Half>(out, qc, k_cache, v_cache, nullptr, nullptr, tables, lens, scale, window);
      break;
    default: TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace kvmesh_cpu

TORCH_LIBRARY(kvmesh, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, int window=0, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("paged_decode_attention", &kvmesh_cpu::paged_decode_attention); }
