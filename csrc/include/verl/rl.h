// What the two RL kernel families share: verl/rl_advantage.h (GAE, outcome advantages) and verl/rl_loss.h
// (per-token KL, the aggregated policy / value / KL losses).
//
// Each family has the shape of verl/logprob.h: its ops are written once, as drivers templated on a per-device
// kernel policy K. A driver checks the arguments (same checks, same messages on every device), allocates the
// outputs and dispatches on the dtype; K runs the kernels: the CPU policies in csrc/cpu/rl_*.cpp, the CUDA
// ones in csrc/cuda/rl_*.cu. K::Guard, constructed from the inputs' device before any allocation, makes that
// device current for the kernel launches (c10::cuda::CUDAGuard; NoGuard on CPU).
//
// Per-token math lives in the family headers as host + device functions (VERL_HD), so the two backends share
// the formulas and differ only in scheduling.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

#include "verl/checks.h"

#if defined(__CUDACC__)
#define VERL_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// always_inline: the CPU token loops are compiled once per ISA (target_clones in csrc/cpu/rl_*.cpp), and only
// inlined per-token math is compiled for the clone's ISA.
#define VERL_HD inline __attribute__((always_inline))
#else
#define VERL_HD inline
#endif

namespace verl {
namespace rl {

// Enum values by name: the ops take modes, estimators and kinds as strings (schema `str`).
template <typename E>
struct Named {
  std::string_view name;
  E value;
};

// The value spelled `s` in `table`, else an error naming the argument and every known spelling, e.g.
// "kl_loss: unknown KL `kind` 'k4'; known kinds: kl (k1), ...".
template <typename E, size_t N>
E parse_named(std::string_view s, const Named<E> (&table)[N], const char* op, const char* what, const char* plural,
              const char* known) {
  for (const Named<E>& n : table) {
    if (n.name == s) return n.value;
  }
  TORCH_CHECK(false, op, ": unknown ", what, " '", std::string(s), "'; known ", plural, ": ", known);
}

struct NoGuard {
  explicit NoGuard(const at::Device&) {}
};

// Calls f(std::true_type) or f(std::false_type): a runtime flag becomes a template parameter once, outside
// the kernels (FlashAttention's BOOL_SWITCH), instead of a branch per element or a copied kernel.
template <typename F>
decltype(auto) bool_switch(bool flag, const F& f) {
  if (flag) return f(std::true_type{});
  return f(std::false_type{});
}

// ------------------------------------------------------------------------------------------ argument checks

inline void check_bt(const at::Tensor& t, const char* op, const char* name) {
  check_floating(t, op, name);
  TORCH_CHECK(t.dim() == 2, op, ": `", name, "` must be 2-D [B, T] (sequences x response tokens), got shape ",
              t.sizes());
  TORCH_CHECK(t.size(0) > 0 && t.size(1) > 0, op, ": `", name, "` is empty (shape ", t.sizes(),
              "); an empty batch has nothing to compute: skip the step, or check that the rollout produced tokens");
}

// `t` must match `ref` in shape, device and dtype (no silent broadcasting or casting of loss inputs).
inline void check_like(const at::Tensor& ref, const at::Tensor& t, const char* op, const char* ref_name,
                       const char* name) {
  check_same_device(ref, t, op, ref_name, name);
  check_same_shape(ref, t, op, ref_name, name);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": `", name, "` must have the dtype of `", ref_name, "` (",
              ref.scalar_type(), "), got ", t.scalar_type(), "; cast it with .to(", ref_name, ".dtype)");
}

inline void check_mask_of(const at::Tensor& ref, const at::Tensor& mask, const char* op, const char* ref_name) {
  check_same_device(ref, mask, op, ref_name, "mask");
  check_same_shape(ref, mask, op, ref_name, "mask");
  TORCH_CHECK(!at::isComplexType(mask.scalar_type()), op,
              ": `mask` must be bool or a real dtype (nonzero = valid), got ", mask.scalar_type());
}

}  // namespace rl
}  // namespace verl
