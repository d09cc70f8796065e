// Scalar math for the CPU kernels that must vectorise (libm's expf is a call per element).
#pragma once

#include <cstdint>
#include <cstring>

// One build serves any x86-64 CPU: a function marked VERL_SIMD_CLONES is compiled twice, for AVX2+FMA
// (x86-64-v3) and for baseline x86-64, and the loader picks the clone the CPU can run. Only code inlined into
// such a function is compiled for the clone's ISA.
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(_M_X64))
#define VERL_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VERL_SIMD_CLONES
#endif

// VERL_X86: 1 where the x86 intrinsics (immintrin.h) are available to kernels that pick an AVX2 path at run time.
#if !defined(__CUDACC__) && (defined(__x86_64__) || defined(_M_X64))
#include <immintrin.h>
#define VERL_X86 1
#else
#define VERL_X86 0
#endif

namespace verl {

#if VERL_X86
// Whether this CPU runs AVX2 and FMA (asked once per process): the kernels with an AVX2 path and a baseline one.
inline bool cpu_has_avx2_fma() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}
#endif

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

#if !defined(__CUDACC__)  // CPU kernels only; nvcc's front end need not parse GCC vector builtins
// Eight floats at a time, written with the GCC/Clang vector extension rather than at::vec: at::vec only
// emits AVX2 in a translation unit compiled with -mavx2 and ATen's CPU_CAPABILITY macros (a per-file build
// flag), whereas these types follow the target of the function they are inlined into, so one portable build
// gets AVX2+FMA code inside a target_clones("arch=x86-64-v3") clone and SSE pairs in the default clone.
// The helpers take and give vf8 by reference only: a vf8 passed or returned by value is a different ABI
// in AVX and non-AVX code, which GCC warns about (-Wpsabi) even for inlined calls.
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));

// x = exp(x) lane by lane: exp_poly's reduction and coefficients; same valid range, callers clamp first.
static inline __attribute__((always_inline)) void exp_poly_inplace(vf8& x) {
  const vf8 kf = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vf8 r = (x - kf * 0.693359375f) + kf * 2.12194440e-4f;
  vf8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi8 bits = (__builtin_convertvector(kf, vi8) + 127) << 23;
  x = p * __builtin_bit_cast(vf8, bits);
}

static inline __attribute__((always_inline)) void load_vf8(vf8& v, const float* p) {
  std::memcpy(&v, p, sizeof(v));  // unaligned load
}

static inline __attribute__((always_inline)) void store_vf8(float* p, const vf8& v) { std::memcpy(p, &v, sizeof(v)); }

static inline __attribute__((always_inline)) float hsum(const vf8& v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

static inline __attribute__((always_inline)) float hmax(const vf8& v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
#endif  // !defined(__CUDACC__)

}  // namespace verl
