// Branch-free float math that the compiler vectorises inside `#pragma omp simd` loops (a
// libm call per element does not vectorise: it cost softmax and SiLU most of their time).
#pragma once

#include <cstdint>
#include <cstring>

namespace kvmesh_vec {

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

}  // namespace kvmesh_vec
