// Branch-free float math that the compiler vectorises inside `#pragma omp simd` loops (a
// libm call per element does not vectorise: it cost softmax and SiLU most of their time).
#pragma once

#include <ATen/ATen.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace kvmesh_vec {

// -- float vectors of W lanes for the ISA the kernels are built for (-march=native) ----------

#if defined(__AVX512F__)
using vec = __m512;
constexpr int64_t W = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vec vload(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 int8 values (an 8-bit KV cache row) widened to floats.
inline vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline float vmaxall(vec v) { return _mm512_reduce_max_ps(v); }
inline vec vclamp(vec x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset1(lo)), vset1(hi)); }
inline vec vfloor(vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// 2^k for integral k in [-127, 128] held as floats: the exponent field built directly.
inline vec vpow2i(vec k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23));
}
// The W horizontal sums of W vectors as one vector: r[i] = sum of v[i]'s lanes, by a
// transpose-and-add tree (45 instructions for 16 sums; vsum is ~8 for one).
inline vec vsums(const vec* v) {
  __m512 s[8], t[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit chunk: [a0+a2, b0+b2, a1+a3, b1+b3]
    s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per chunk: the chunk's sums of v[4i .. 4i + 3]
    const __m512d a = _mm512_castps_pd(s[2 * i]), b = _mm512_castps_pd(s[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88), _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, 0x88), _mm512_shuffle_f32x4(y01, y23, 0xDD));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using vec = __m256;
constexpr int64_t W = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vec vload(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float vsum(vec v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline float vmaxall(vec v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}
inline vec vclamp(vec x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vset1(lo)), vset1(hi)); }
inline vec vfloor(vec x) { return _mm256_floor_ps(x); }
inline vec vpow2i(vec k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
}
inline vec vsums(const vec* v) {
  __m256 s[4], t[2];
  for (int i = 0; i < 4; ++i)
    s[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(s[2 * i]), b = _mm256_castps_pd(s[2 * i + 1]);
    t[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
}
#else
using vec = float;
constexpr int64_t W = 1;
inline vec vzero() { return 0.f; }
inline vec vset1(float x) { return x; }
template <typename T>
inline vec vload(const T* p) { return static_cast<float>(*p); }
inline void vstore(float* p, vec v) { *p = v; }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline vec vmul(vec a, vec b) { return a * b; }
inline vec vadd(vec a, vec b) { return a + b; }
inline float vsum(vec v) { return v; }
inline vec vmax(vec a, vec b) { return a > b ? a : b; }
inline float vmaxall(vec v) { return v; }
inline vec vclamp(vec x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
inline vec vfloor(vec x) { return __builtin_floorf(x); }
inline vec vpow2i(vec k) {
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline vec vsums(const vec* v) { return v[0]; }
#endif


// exp(x) for x in [-87, 88] (clamped outside): Cephes expf, range-reduced by powers of two,
// relative error ~2 ulp.
inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float k = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  // Cody-Waite reduction r = x - k ln2 in two steps; explicit FMAs so that -fassociative-math
  // cannot fold the two constants back into one (and lose the low bits of ln2).
  const float r = __builtin_fmaf(k, 2.12194440e-4f, __builtin_fmaf(-k, 0.693359375f, x));
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp_approx on a whole vector (the same polynomial and reduction, explicit intrinsics): gcc
// vectorised the scalar form in `omp simd` loops only at half the AVX-512 width, with the
// clamps and the exponent trick as separate passes.
inline vec vexp(vec x) {
  x = vclamp(x, -87.0f, 88.0f);
  const vec k = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
  const vec r = vfma(k, vset1(2.12194440e-4f), vfma(k, vset1(-0.693359375f), x));
  vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, vadd(r, vset1(1.0f)));
  return vmul(p, vpow2i(k));
}

// The softmax pieces of a row of n = whole vectors of scores (n % W == 0), shared by the
// attention kernels: the running max raised to the row's, and the row exponentiated in
// place against a max (returns the sum of the exponentials).
inline float vmax_row(const float* s, int64_t n, float m) {
  vec vm = vset1(m);
  for (int64_t j = 0; j < n; j += W) vm = vmax(vm, vload(s + j));
  return vmaxall(vm);
}

inline float vexp_row(float* s, int64_t n, float mx) {
  const vec neg_mx = vset1(-mx);
  vec vs = vzero();
  for (int64_t j = 0; j < n; j += W) {
    const vec e = vexp(vadd(vload(s + j), neg_mx));
    vstore(s + j, e);
    vs = vadd(vs, e);
  }
  return vsum(vs);
}

}  // namespace kvmesh_vec
