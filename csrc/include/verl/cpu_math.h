// Scalar math for the CPU kernels that must vectorise (libm's expf is a call per element).
#pragma once

#include <cstdint>
#include <cstring>

namespace verl {

// exp for float without a libm call, so that loops calling it vectorise: Cody-Waite range reduction
// x = k ln2 + r and a degree-6 polynomial for exp(r) (Cephes expf coefficients), about 1 ulp (relative
// error ~1e-7). Valid for x in [-87, ~88]: callers clamp first (the RL kernels to +-20, log-prob to -87,
// where exp(d) * d stays finite for -inf logits).
static inline __attribute__((always_inline)) float exp_poly(float x) {
  // Round to nearest by adding and subtracting 1.5 * 2^23 (branch-free; exact for |x log2 e| < 2^22).
  const float kf = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - kf * 0.693359375f) + kf * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(kf) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace verl
