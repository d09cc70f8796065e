// Device-agnostic drivers of the advantage ops: gae and outcome_advantage (schemas in csrc/ops.cpp; CPU
// kernels in csrc/cpu/rl_advantage.cpp, CUDA kernels in csrc/cuda/rl_advantage.cu; see verl/rl.h for the
// driver / policy split). A kernel policy K supplies, for each dtype scalar_t:
//   K::gae<scalar_t>(const GaeArgs&)          the reverse scan over each row's valid tokens writing advantages,
//                                             returns and the non-finite count; with whiten_eps, also the
//                                             masked whitening of the advantages (statistics from the scan)
//   K::outcome<scalar_t>(const OutcomeArgs&)  each row's score (sum of its valid rewards, minus the baseline),
//                                             group statistics, and the advantage broadcast over valid tokens
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>

#include "verl/checks.h"
#include "verl/rl.h"

namespace verl {
namespace rl {

using at::Tensor;

enum class Outcome : int { Grpo = 0, Rloo = 1, Remax = 2, ReinforcePPBaseline = 3 };

inline Outcome parse_outcome(std::string_view s, const char* op) {
  static constexpr Named<Outcome> kNames[] = {{"grpo", Outcome::Grpo},
                                              {"rloo", Outcome::Rloo},
                                              {"remax", Outcome::Remax},
                                              {"reinforce_plus_plus_baseline", Outcome::ReinforcePPBaseline}};
  return parse_named(s, kNames, op, "outcome `estimator`", "estimators",
                     "grpo, rloo, remax, reinforce_plus_plus_baseline");
}

// One sequence's outcome advantage from its score s and its group's (sum, count, centered sum of squares).
// A singleton group has no baseline but its own score: grpo, rloo and the reinforce++ baseline give 0 there.
VERL_HD double group_advantage(Outcome est, double s, double sum, double cnt, double sq, double eps,
                               bool norm_by_std) {
  if (est == Outcome::Remax) return s;  // the greedy baseline was already subtracted from s
  if (cnt < 2.0) return 0.0;
  const double mean = sum / cnt;
  if (est == Outcome::Rloo) return s - (sum - s) / (cnt - 1.0);
  if (est == Outcome::Grpo && norm_by_std) return (s - mean) / (::sqrt(sq / (cnt - 1.0)) + eps);
  return s - mean;
}

// ------------------------------------------------------------------------------------------ GAE

struct GaeArgs {
  Tensor r, v, m;         // rewards, values (undefined: a zero critic), mask as bool; all contiguous [B, T]
  double gamma = 1.0, lam = 1.0;
  std::optional<double> whiten_eps;  // whiten the advantages over the mask (masked_whiten, eps in the sqrt)
  Tensor adv, ret, bad;   // outputs: [B, T] x2 in the rewards' dtype, int64 0-d count (zero-filled)
};

template <class K>
std::tuple<Tensor, Tensor, Tensor> gae(const Tensor& rewards, const std::optional<Tensor>& values,
                                       const Tensor& mask, double gamma, double lam,
                                       std::optional<double> whiten_eps) {
  const char* op = "gae";
  check_bt(rewards, op, "rewards");
  if (values) check_like(rewards, *values, op, "rewards", "values");
  check_mask_of(rewards, mask, op, "rewards");
  TORCH_CHECK(gamma >= 0.0 && gamma <= 1.0, op, ": `gamma` must be in [0, 1], got ", gamma);
  TORCH_CHECK(lam >= 0.0 && lam <= 1.0, op, ": `lam` must be in [0, 1], got ", lam);
  TORCH_CHECK(!whiten_eps || *whiten_eps >= 0.0, op, ": `whiten_eps` must be >= 0 (or None: no whitening), got ",
              whiten_eps.value_or(0.0));
  typename K::Guard guard(rewards.device());
  GaeArgs a;
  a.r = rewards.contiguous();
  a.v = values ? values->contiguous() : Tensor();
  a.m = mask_as_bool(mask);
  a.gamma = gamma;
  a.lam = lam;
  a.whiten_eps = whiten_eps;
  a.adv = at::empty(rewards.sizes(), rewards.options());
  a.ret = at::empty(rewards.sizes(), rewards.options());
  a.bad = at::zeros({}, rewards.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "verl_gae",
                                  [&] { K::template gae<scalar_t>(a); });
  return {a.adv, a.ret, a.bad};
}

// ------------------------------------------------------------------------------------------ outcome advantages

struct OutcomeArgs {
  Tensor r, m;      // rewards, mask as bool; contiguous [B, T]
  Tensor index;     // [B] integer prompt ids (any integer dtype, any values)
  Tensor base;      // [B] float64 baseline (remax), else undefined
  Outcome est = Outcome::Grpo;
  double eps = 0.0;
  bool norm_by_std = true;
  Tensor adv, bad;  // outputs: [B, T] in the rewards' dtype, int64 0-d count (zero-filled)
};

// Checks the outcome_advantage arguments; returns the baseline as contiguous float64 (undefined if none).
inline Tensor check_outcome_inputs(const Tensor& rewards, const Tensor& mask, const Tensor& index, Outcome est,
                                   c10::string_view estimator, double eps, const std::optional<Tensor>& baseline,
                                   const char* op) {
  check_bt(rewards, op, "rewards");
  check_mask_of(rewards, mask, op, "rewards");
  const int64_t B = rewards.size(0);
  check_same_device(rewards, index, op, "rewards", "index");
  TORCH_CHECK(!at::isFloatingType(index.scalar_type()) && !at::isComplexType(index.scalar_type()) &&
                  index.scalar_type() != at::kBool,
              op, ": `index` (the prompt id of each sequence) must be an integer tensor, got ", index.scalar_type());
  TORCH_CHECK(index.dim() == 1 && index.size(0) == B, op, ": `index` must be 1-D with one prompt id per sequence (B=",
              B, "), got shape ", index.sizes());
  TORCH_CHECK(eps >= 0.0, op, ": `eps` must be >= 0, got ", eps);
  TORCH_CHECK(est != Outcome::Remax || baseline.has_value(), op,
              ": estimator 'remax' needs `baseline` [B] (the reward of each prompt's greedy response)");
  TORCH_CHECK(est == Outcome::Remax || !baseline.has_value(), op,
              ": `baseline` is only used by estimator 'remax'; pass None for '", std::string(estimator), "'");
  Tensor base;
  if (baseline) {
    check_floating(*baseline, op, "baseline");
    check_same_device(rewards, *baseline, op, "rewards", "baseline");
    TORCH_CHECK(baseline->dim() == 1 && baseline->size(0) == B, op, ": `baseline` must have shape [B]=[", B,
                "], got ", baseline->sizes());
    base = baseline->to(at::kDouble).contiguous();
  }
  return base;
}

template <class K>
std::tuple<Tensor, Tensor> outcome_advantage(const Tensor& rewards, const Tensor& mask, const Tensor& index,
                                             c10::string_view estimator, double eps, bool norm_by_std,
                                             const std::optional<Tensor>& baseline) {
  const char* op = "outcome_advantage";
  const Outcome est = parse_outcome(estimator, op);
  const Tensor base = check_outcome_inputs(rewards, mask, index, est, estimator, eps, baseline, op);
  typename K::Guard guard(rewards.device());
  OutcomeArgs a;
  a.r = rewards.contiguous();
  a.m = mask_as_bool(mask);
  a.index = index;
  a.base = base;
  a.est = est;
  a.eps = eps;
  a.norm_by_std = norm_by_std;
  a.adv = at::empty(rewards.sizes(), rewards.options());
  a.bad = at::zeros({}, rewards.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "verl_outcome_advantage",
                                  [&] { K::template outcome<scalar_t>(a); });
  return {a.adv, a.bad};
}

// Registers the advantage ops of kernel policy K (in a TORCH_LIBRARY_IMPL block of its dispatch key).
template <class K>
void register_advantage_ops(torch::Library& m) {
  m.impl("gae", &gae<K>);
  m.impl("outcome_advantage", &outcome_advantage<K>);
}

}  // namespace rl
}  // namespace verl
