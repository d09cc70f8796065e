// CPU helpers of the RL kernel policies (csrc/cpu/rl_advantage.cpp, csrc/cpu/rl_loss.cpp): the ISA clones,
// the row / chunk work split, and chunk-wise bfloat16 / half <-> float conversion.
//
// Work is split over rows (sequences) with at::parallel_for: every RL op is a per-row pass followed by O(B)
// work, so one row stays in cache while its running sums are formed, and each [B, T] input is read once.
// Token loops run over kChunk tokens at a time in the compute type (float, or double for float64 inputs);
// 16-bit inputs are converted chunk by chunk through buffers that stay in L1.
//
// The token loops are small non-inlined functions compiled twice with target_clones, for AVX2+FMA and for
// baseline x86-64, so one build serves any x86-64 CPU at full vector width where it has AVX2. Everything here
// has internal linkage (an unnamed namespace): each kernel file gets its own clones.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "verl/cpu_math.h"  // VERL_SIMD_CLONES

#if defined(__GNUC__)
// Token lambdas and loop templates are forced inline into the cloned chunk functions: only inlined code is
// compiled for the clone's ISA.
#define VERL_INLINE inline __attribute__((always_inline))
#define VERL_INLINE_LAMBDA __attribute__((always_inline))
#else
#define VERL_INLINE inline
#define VERL_INLINE_LAMBDA
#endif

namespace verl {
namespace {

constexpr int64_t kGrain = 32768;
constexpr int64_t kChunk = 512;  // tokens per chunk of a token loop: 2 KiB of float per input, stays in L1

int64_t row_grain(int64_t T) { return std::max<int64_t>(1, kGrain / std::max<int64_t>(T, 1)); }

// Compute type of the token loops: double for float64 inputs, float otherwise.
template <typename scalar_t>
using comp_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// The unsigned integer with a float type's bit pattern.
template <typename scalar_t>
using bits_t = std::conditional_t<sizeof(scalar_t) == 2, uint16_t,
                                  std::conditional_t<sizeof(scalar_t) == 4, uint32_t, uint64_t>>;

typedef uint32_t u32_alias __attribute__((may_alias));

// bfloat16 <-> float through bit patterns (vectorises; c10's scalar conversions do not).
VERL_SIMD_CLONES void load_chunk(const c10::BFloat16* x, float* out, int64_t n) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  u32_alias* o = reinterpret_cast<u32_alias*>(out);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) o[j] = static_cast<uint32_t>(u[j]) << 16;
}

// Round to nearest even, NaN -> quiet NaN: the same results as c10::BFloat16(float).
VERL_SIMD_CLONES void store_chunk(const float* in, c10::BFloat16* x, int64_t n) {
  const u32_alias* u = reinterpret_cast<const u32_alias*>(in);
  uint16_t* o = reinterpret_cast<uint16_t*>(x);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t b = u[j];
    const uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    o[j] = in[j] != in[j] ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(r);
  }
}

void load_chunk(const c10::Half* x, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<float>(x[j]);
}

void store_chunk(const float* in, c10::Half* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] = static_cast<c10::Half>(in[j]);
}

// out[j] = m[j] ? v : 0 on bit patterns of any float type (0 bits = +0.0).
template <typename U>
VERL_INLINE void select_fill_impl(const bool* m, int64_t n, U v, U* out) {
  const uint8_t* m8 = reinterpret_cast<const uint8_t*>(m);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<U>(v & static_cast<U>(U(0) - static_cast<U>(m8[j] != 0)));
}
VERL_SIMD_CLONES void select_fill(const bool* m, int64_t n, uint16_t v, uint16_t* out) { select_fill_impl(m, n, v, out); }
VERL_SIMD_CLONES void select_fill(const bool* m, int64_t n, uint32_t v, uint32_t* out) { select_fill_impl(m, n, v, out); }
VERL_SIMD_CLONES void select_fill(const bool* m, int64_t n, uint64_t v, uint64_t* out) { select_fill_impl(m, n, v, out); }

// out[b, t] = m[b, t] ? value(b) : 0 over [B, T]: one value per row, rounded once to scalar_t and written as
// bit patterns.
template <typename scalar_t, typename F>
void fill_rows(const bool* mp, int64_t B, int64_t T, scalar_t* out, const F& value) {
  bits_t<scalar_t>* o = reinterpret_cast<bits_t<scalar_t>*>(out);
  at::parallel_for(0, B, row_grain(T), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const scalar_t v = static_cast<scalar_t>(value(b));
      bits_t<scalar_t> bits;
      std::memcpy(&bits, &v, sizeof(bits));
      select_fill(mp + b * T, T, bits, o + b * T);
    }
  });
}

}  // namespace
}  // namespace verl
