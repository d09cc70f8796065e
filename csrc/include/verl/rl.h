// Shared by the CPU (csrc/cpu/rl.cpp) and CUDA (csrc/cuda/rl.cu) RL kernels: the mode names, the
// aggregation weights and the per-token math. Keeping the per-token formulas in one place (host + device)
// is what makes the two backends agree bit-for-bit in structure and differ only in scheduling.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>

#include "verl/checks.h"
#include "verl/cpu_math.h"

#if defined(__CUDACC__)
#define VERL_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// always_inline: the CPU token loops are compiled once per ISA (target_clones in csrc/cpu/rl.cpp), and only
// inlined per-token math is compiled for the clone's ISA.
#define VERL_HD inline __attribute__((always_inline))
#else
#define VERL_HD inline
#endif

namespace verl {
namespace rl {

// ------------------------------------------------------------------------------------------ mode names

// Loss aggregation. Every mode is loss = sum_b w_b * sum_t m_bt * l_bt with a per-row weight w_b, which
// is what lets forward save w (B numbers) and backward be a single elementwise pass.
enum class Agg : int { TokenMean = 0, SeqMeanTokenSum = 1, SeqMeanTokenMean = 2, SeqMeanTokenSumNorm = 3 };
constexpr const char* kAggNames = "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm";

inline Agg parse_agg(std::string_view s, const char* op) {
  if (s == "token-mean") return Agg::TokenMean;
  if (s == "seq-mean-token-sum") return Agg::SeqMeanTokenSum;
  if (s == "seq-mean-token-mean") return Agg::SeqMeanTokenMean;
  if (s == "seq-mean-token-sum-norm") return Agg::SeqMeanTokenSumNorm;
  TORCH_CHECK(false, op, ": unknown aggregation `mode` '", std::string(s), "'; known modes: ", kAggNames);
}

// KL estimators of KL(pi || ref) from per-token log-probs. The "+" kinds are straight-through: the value of
// k1 / k3 with the gradient of k2 (an unbiased gradient of the KL in expectation).
enum class Kl : int { K1 = 0, Abs = 1, K2 = 2, K3 = 3, K1Plus = 4, K3Plus = 5 };
constexpr const char* kKlNames = "kl (k1), abs, mse (k2), low_var_kl (k3), k1+ (kl+), k3+ (low_var_kl+)";

inline Kl parse_kl(std::string_view s, const char* op) {
  if (s == "kl" || s == "k1") return Kl::K1;
  if (s == "abs") return Kl::Abs;
  if (s == "mse" || s == "k2") return Kl::K2;
  if (s == "low_var_kl" || s == "k3") return Kl::K3;
  if (s == "k1+" || s == "kl+") return Kl::K1Plus;
  if (s == "k3+" || s == "low_var_kl+") return Kl::K3Plus;
  TORCH_CHECK(false, op, ": unknown KL `kind` '", std::string(s), "'; known kinds: ", kKlNames);
}

enum class Pg : int { Vanilla = 0, Gspo = 1, Reinforce = 2 };
constexpr const char* kPgNames = "vanilla, gspo, reinforce";

inline Pg parse_pg(std::string_view s, const char* op) {
  if (s == "vanilla") return Pg::Vanilla;
  if (s == "gspo") return Pg::Gspo;
  if (s == "reinforce") return Pg::Reinforce;
  TORCH_CHECK(false, op, ": unknown policy `loss_type` '", std::string(s), "'; known types: ", kPgNames);
}

enum class Outcome : int { Grpo = 0, Rloo = 1, Remax = 2, ReinforcePPBaseline = 3 };
constexpr const char* kOutcomeNames = "grpo, rloo, remax, reinforce_plus_plus_baseline";

inline Outcome parse_outcome(std::string_view s, const char* op) {
  if (s == "grpo") return Outcome::Grpo;
  if (s == "rloo") return Outcome::Rloo;
  if (s == "remax") return Outcome::Remax;
  if (s == "reinforce_plus_plus_baseline") return Outcome::ReinforcePPBaseline;
  TORCH_CHECK(false, op, ": unknown outcome `estimator` '", std::string(s), "'; known estimators: ", kOutcomeNames);
}

// ------------------------------------------------------------------------------------------ aggregation

// The normalisers of one aggregation, fixed before the per-row weights are computed. With
// global_tokens / global_seqs (counts over every data-parallel rank and micro-batch of the step) and
// dp_size, each rank's loss is its partial sum / global count * dp_size, so averaging gradients across
// ranks (as DDP does) and summing micro-batches gives exactly the full-batch loss and gradient.
struct AggParams {
  Agg mode = Agg::TokenMean;
  double tokens = 0.0;  // token normaliser (global or local count)
  double seqs = 0.0;    // sequence normaliser: rows with at least one valid token
  double dp = 1.0;
  double norm_len = 1.0;  // seq-mean-token-sum-norm: the constant length each sequence sum is divided by
};

VERL_HD double row_weight(const AggParams& p, double count) {
  if (count <= 0.0) return 0.0;
  switch (p.mode) {
    case Agg::TokenMean:
      return p.tokens > 0.0 ? p.dp / p.tokens : 0.0;
    case Agg::SeqMeanTokenSum:
      return p.seqs > 0.0 ? p.dp / p.seqs : 0.0;
    case Agg::SeqMeanTokenMean:
      return p.seqs > 0.0 ? p.dp / (p.seqs * count) : 0.0;
    default:
      return p.seqs > 0.0 ? p.dp / (p.seqs * p.norm_len) : 0.0;
  }
}

// Validates the aggregation arguments shared by every loss op; local counts fill what is not given.
inline AggParams make_agg(std::string_view mode, std::optional<double> global_tokens,
                          std::optional<double> global_seqs, int64_t dp_size, std::optional<double> norm_len,
                          int64_t T, const char* op) {
  AggParams p;
  p.mode = parse_agg(mode, op);
  TORCH_CHECK(dp_size >= 1, op, ": `dp_size` must be >= 1, got ", dp_size);
  TORCH_CHECK(!global_tokens || (*global_tokens >= 0.0 && std::isfinite(*global_tokens)), op,
              ": `global_tokens` must be a finite count >= 0, got ", global_tokens.value_or(0.0));
  TORCH_CHECK(!global_seqs || (*global_seqs >= 0.0 && std::isfinite(*global_seqs)), op,
              ": `global_seqs` must be a finite count >= 0, got ", global_seqs.value_or(0.0));
  TORCH_CHECK(!norm_len || (*norm_len > 0.0 && std::isfinite(*norm_len)), op,
              ": `norm_len` must be > 0 (it divides each sequence's token sum), got ", norm_len.value_or(0.0));
  p.dp = static_cast<double>(dp_size);
  p.norm_len = norm_len ? *norm_len : static_cast<double>(T > 0 ? T : 1);
  p.tokens = global_tokens ? *global_tokens : -1.0;  // < 0: fill from the local counts
  p.seqs = global_seqs ? *global_seqs : -1.0;
  return p;
}

VERL_HD void fill_local_counts(AggParams& p, double local_tokens, double local_seqs) {
  if (p.tokens < 0.0) p.tokens = local_tokens;
  if (p.seqs < 0.0) p.seqs = local_seqs;
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

// ------------------------------------------------------------------------------------------ per-token math

template <typename T>
VERL_HD T clampv(T x, T lo, T hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}


template <typename T>
VERL_HD T expv(T x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  if constexpr (sizeof(T) == sizeof(float)) return exp_poly(x);
  else return std::exp(x);
#endif
}

template <typename T>
struct ValGrad {
  T value, grad;  // grad = d value / d logprob
};

// KL per token with d = logprob - ref_logprob (k3 uses the reference's convention, dr = ref - logp). The kind
// is a template parameter (and every choice a select) so that CPU token loops vectorise.
template <Kl kKind, typename T>
VERL_HD ValGrad<T> kl_token_t(T logp, T ref) {
  const T d = logp - ref;
  if constexpr (kKind == Kl::K1) {
    return {d, T(1)};
  } else if constexpr (kKind == Kl::Abs) {
    return {d < T(0) ? -d : d, d > T(0) ? T(1) : (d < T(0) ? T(-1) : T(0))};
  } else if constexpr (kKind == Kl::K2) {
    return {T(0.5) * d * d, d};
  } else if constexpr (kKind == Kl::K1Plus) {
    return {d, d};
  } else {  // K3 and K3Plus
    const T dr = ref - logp;
    const T dc = clampv(dr, T(-20), T(20));
    const T e = expv(dc);
    const T raw = e - dc - T(1);
    const T val = clampv(raw, T(-10), T(10));
    if constexpr (kKind == Kl::K3Plus) {
      return {val, d};
    } else {
      // d/dlogp of exp(dr) - dr - 1 is 1 - exp(dr); zero where either clamp is active (0/1 arithmetic so
      // that the CPU loops vectorise).
      const T live = (dc == dr ? T(1) : T(0)) * (raw <= T(10) ? T(1) : T(0));
      return {val, live * (T(1) - e)};
    }
  }
}

template <typename F>
VERL_HD auto kl_switch(Kl kind, const F& f) {
  switch (kind) {
    case Kl::K1:
      return f(std::integral_constant<Kl, Kl::K1>{});
    case Kl::Abs:
      return f(std::integral_constant<Kl, Kl::Abs>{});
    case Kl::K2:
      return f(std::integral_constant<Kl, Kl::K2>{});
    case Kl::K1Plus:
      return f(std::integral_constant<Kl, Kl::K1Plus>{});
    case Kl::K3Plus:
      return f(std::integral_constant<Kl, Kl::K3Plus>{});
    default:
      return f(std::integral_constant<Kl, Kl::K3>{});
  }
}

template <typename T>
VERL_HD ValGrad<T> kl_token(T logp, T ref, Kl kind) {
  return kl_switch(kind, [&](auto k) { return kl_token_t<decltype(k)::value, T>(logp, ref); });
}

struct PgParams {
  Pg type = Pg::Vanilla;
  double clip_low = 0.2, clip_high = 0.2, clip_c = 3.0;
};

template <typename T>
struct PgToken {
  T loss, grad;     // grad = d loss / d logprob
  T clipped, lower;  // pg_clipfrac and pg_clipfrac_lower indicators, 0 or 1 (numbers, not bools: they vectorise)
};

// One token of the PPO-family losses. `log_ratio` is logp - old_logp (per token) or, for GSPO, the
// stop-gradient sequence log-ratio; either way d ratio / d logp = ratio when the clamp is not active.
//
// With r the ratio, max(-A r, -A clip(r, lo, hi)) and the dual clip min(., -A c) for A < 0 reduce to one clamp:
//   loss = -A * clamp(r, lo_eff, hi_eff),  lo_eff = A < 0 ? lo : 0,  hi_eff = A < 0 ? c : hi
// (GSPO: c = inf, no dual clip; r > 0 so the lower bound 0 is inert). The gradient flows where r is inside
// [lo_eff, hi_eff] (a tie at a bound is the unclipped branch, whose gradient equals the clipped one's limit).
// Everything is min/max and 0/1 arithmetic, with no data-dependent branch, so CPU token loops vectorise.
template <Pg kType, typename T>
VERL_HD PgToken<T> pg_token_t(T log_ratio, T adv, const PgParams& p) {
  const T lr = clampv(log_ratio, T(-20), T(20));
  const T ratio = expv(lr);
  const T live = lr == log_ratio ? T(1) : T(0);
  if constexpr (kType == Pg::Reinforce) {
    return {-adv * ratio, -adv * ratio * live, T(0), T(0)};
  } else {
    const T lo = T(1) - T(p.clip_low), hi = T(1) + T(p.clip_high);
    // A finite stand-in for c = inf keeps neg * (c - hi) free of 0 * inf.
    const T c = kType == Pg::Gspo ? T(1e30) : (p.clip_c < 1e30 ? T(p.clip_c) : T(1e30));
    const T neg = adv < T(0) ? T(1) : T(0), pos = adv > T(0) ? T(1) : T(0);
    const T lo_eff = neg * lo, hi_eff = hi + neg * (c - hi);
    const T q = clampv(ratio, lo_eff, hi_eff);
    const T inside = (ratio >= lo_eff ? T(1) : T(0)) * (ratio <= hi_eff ? T(1) : T(0));
    const T clipped = pos * (ratio > hi ? T(1) : T(0)) + neg * (ratio < lo ? T(1) : T(0));
    const T lower = kType == Pg::Gspo ? T(0) : neg * ((ratio < lo ? lo : ratio) > c ? T(1) : T(0));
    return {-adv * q, -adv * ratio * inside * live, clipped, lower};
  }
}

template <typename T>
VERL_HD PgToken<T> pg_token(T log_ratio, T adv, const PgParams& p) {
  switch (p.type) {
    case Pg::Gspo:
      return pg_token_t<Pg::Gspo>(log_ratio, adv, p);
    case Pg::Reinforce:
      return pg_token_t<Pg::Reinforce>(log_ratio, adv, p);
    default:
      return pg_token_t<Pg::Vanilla>(log_ratio, adv, p);
  }
}

template <typename T>
struct VfToken {
  T loss, grad;  // loss = 0.5 * max(l1, l2); grad = d loss / d values
  T clipped;     // vf_clipfrac indicator, 0 or 1
};

template <typename T>
VERL_HD VfToken<T> vf_token(T v, T old, T ret, T clip) {
  const T lo = old - clip, hi = old + clip;
  const T vc = clampv(v, lo, hi);
  const T e1 = v - ret, e2 = vc - ret;
  const T l1 = e1 * e1, l2 = e2 * e2;
  const bool clipped = l2 > l1;
  const bool inside = (v >= lo) & (v <= hi);
  return {T(0.5) * (clipped ? l2 : l1), clipped ? (inside ? e2 : T(0)) : e1, clipped ? T(1) : T(0)};
}

// ------------------------------------------------------------------------------------------ argument checks
// Shared by the CPU and CUDA host code so both backends reject the same inputs with the same messages.


inline void check_bt(const at::Tensor& t, const char* op, const char* name) {
  check_floating(t, op, name);
  TORCH_CHECK(t.dim() == 2, op, ": `", name, "` must be 2-D [B, T] (sequences x response tokens), got shape ",
              t.sizes());
  TORCH_CHECK(t.size(0) > 0 && t.size(1) > 0, op, ": `", name, "` is empty (shape ", t.sizes(),
              "); an empty batch has nothing to compute: skip the step, or check that the rollout produced tokens");
}

// `t` must match `ref` in shape, device and dtype (no silent broadcasting or casting of loss inputs).
inline void check_like(const at::Tensor& ref, const at::Tensor& t, const char* op, const char* ref_name, const char* name) {
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

inline void check_row_weight(const at::Tensor& w, int64_t B, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kDouble && w.dim() == 1 && w.size(0) == B, op,
              ": `row_weight` must be the float64 [B] output of the forward op (B=", B, "), got ", w.scalar_type(),
              " ", w.sizes());
}

inline PgParams make_pg(c10::string_view loss_type, double clip_low, double clip_high, double clip_c, const char* op) {
  PgParams p;
  p.type = parse_pg(loss_type, op);
  TORCH_CHECK(clip_low >= 0.0 && clip_low < 1.0, op, ": `clip_low` must be in [0, 1) (ratio lower bound 1 - clip_low), got ",
              clip_low);
  TORCH_CHECK(clip_high >= 0.0, op, ": `clip_high` must be >= 0, got ", clip_high);
  TORCH_CHECK(clip_c > 1.0, op, ": `clip_c` (dual-clip constant) must be > 1, got ", clip_c,
              "; pass inf to turn dual clip off");
  p.clip_low = clip_low;
  p.clip_high = clip_high;
  p.clip_c = clip_c;
  return p;
}

inline void check_pg_inputs(const at::Tensor& logprob, const at::Tensor& old_logprob, const at::Tensor& advantages,
                     const at::Tensor& mask, const char* op) {
  check_bt(logprob, op, "logprob");
  check_like(logprob, old_logprob, op, "logprob", "old_logprob");
  check_like(logprob, advantages, op, "logprob", "advantages");
  check_mask_of(logprob, mask, op, "logprob");
}

// Checks the kl_loss arguments (the forward's and the backward's); returns the parsed KL kind.
inline Kl check_kl_inputs(const at::Tensor& logprob, const at::Tensor& ref_logprob, const at::Tensor& mask,
                          c10::string_view kind, const char* op) {
  const Kl k = parse_kl(kind, op);
  check_bt(logprob, op, "logprob");
  check_like(logprob, ref_logprob, op, "logprob", "ref_logprob");
  check_mask_of(logprob, mask, op, "logprob");
  return k;
}

inline void check_vf_inputs(const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
                     const at::Tensor& mask, double clip, const char* op) {
  check_bt(values, op, "values");
  check_like(values, old_values, op, "values", "old_values");
  check_like(values, returns, op, "values", "returns");
  check_mask_of(values, mask, op, "values");
  TORCH_CHECK(clip >= 0.0, op, ": `clip` (value clip range) must be >= 0, got ", clip, "; pass inf for no clipping");
}

// Checks the outcome_advantage arguments; returns the baseline as contiguous float64 (undefined if none).
inline at::Tensor check_outcome_inputs(const at::Tensor& rewards, const at::Tensor& mask, const at::Tensor& index,
                                       Outcome est, c10::string_view estimator, double eps,
                                       const std::optional<at::Tensor>& baseline, const char* op) {
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
  at::Tensor base;
  if (baseline) {
    check_floating(*baseline, op, "baseline");
    check_same_device(rewards, *baseline, op, "rewards", "baseline");
    TORCH_CHECK(baseline->dim() == 1 && baseline->size(0) == B, op, ": `baseline` must have shape [B]=[", B,
                "], got ", baseline->sizes());
    base = baseline->to(at::kDouble).contiguous();
  }
  return base;
}

}  // namespace rl
}  // namespace verl
