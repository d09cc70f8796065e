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

#include "verl/checks.h"

#if defined(__CUDACC__)
#define VERL_HD __host__ __device__ __forceinline__
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

inline void fill_local_counts(AggParams& p, double local_tokens, double local_seqs) {
  if (p.tokens < 0.0) p.tokens = local_tokens;
  if (p.seqs < 0.0) p.seqs = local_seqs;
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
  return std::exp(x);
#endif
}

template <typename T>
struct ValGrad {
  T value, grad;  // grad = d value / d logprob
};

// KL per token with d = logprob - ref_logprob (k3 uses the reference's convention, dr = ref - logp).
template <typename T>
VERL_HD ValGrad<T> kl_token(T logp, T ref, Kl kind) {
  const T d = logp - ref;
  switch (kind) {
    case Kl::K1:
      return {d, T(1)};
    case Kl::Abs:
      return {d < T(0) ? -d : d, d > T(0) ? T(1) : (d < T(0) ? T(-1) : T(0))};
    case Kl::K2:
      return {T(0.5) * d * d, d};
    case Kl::K1Plus:
      return {d, d};
    default: {  // K3 and K3Plus
      const T dr = ref - logp;
      const T dc = clampv(dr, T(-20), T(20));
      const T e = expv(dc);
      const T raw = e - dc - T(1);
      const T val = clampv(raw, T(-10), T(10));
      if (kind == Kl::K3Plus) return {val, d};
      // d/dlogp of exp(dr) - dr - 1 is 1 - exp(dr); zero where either clamp is active.
      const bool live = dr >= T(-20) && dr <= T(20) && raw <= T(10);
      return {val, live ? T(1) - e : T(0)};
    }
  }
}

struct PgParams {
  Pg type = Pg::Vanilla;
  double clip_low = 0.2, clip_high = 0.2, clip_c = 3.0;
};

template <typename T>
struct PgToken {
  T loss, grad;        // grad = d loss / d logprob
  bool clipped, lower;  // pg_clipfrac and pg_clipfrac_lower indicators
};

// One token of the PPO-family losses. `log_ratio` is logp - old_logp (per token) or, for GSPO, the
// stop-gradient sequence log-ratio; either way d ratio / d logp = ratio when the clamp is not active.
template <typename T>
VERL_HD PgToken<T> pg_token(T log_ratio, T adv, const PgParams& p) {
  const T lr = clampv(log_ratio, T(-20), T(20));
  const bool live = log_ratio >= T(-20) && log_ratio <= T(20);
  const T ratio = expv(lr);
  const T dratio = live ? ratio : T(0);
  const T pg1 = -adv * ratio;
  if (p.type == Pg::Reinforce) return {pg1, -adv * dratio, false, false};
  const T lo = T(1) - T(p.clip_low), hi = T(1) + T(p.clip_high);
  const T rc = clampv(ratio, lo, hi);
  const T pg2 = -adv * rc;
  const bool clipped = pg2 > pg1;
  // max(pg1, pg2): on a tie the ratio is inside the clip range and both branches have the same gradient.
  const T clip1 = clipped ? pg2 : pg1;
  const T clip1_grad = clipped ? T(0) : -adv * dratio;
  if (p.type == Pg::Gspo || !(adv < T(0))) return {clip1, clip1_grad, clipped, false};
  const T pg3 = -adv * T(p.clip_c);
  const bool lower = clip1 > pg3;  // dual clip: the loss of a negative advantage is bounded by -adv * c
  return {lower ? pg3 : clip1, lower ? T(0) : clip1_grad, clipped, lower};
}

template <typename T>
struct VfToken {
  T loss, grad;  // loss = 0.5 * max(l1, l2); grad = d loss / d values
  bool clipped;
};

template <typename T>
VERL_HD VfToken<T> vf_token(T v, T old, T ret, T clip) {
  const T lo = old - clip, hi = old + clip;
  const T vc = clampv(v, lo, hi);
  const T e1 = v - ret, e2 = vc - ret;
  const T l1 = e1 * e1, l2 = e2 * e2;
  const bool clipped = l2 > l1;
  if (!clipped) return {T(0.5) * l1, e1, false};
  const bool inside = v >= lo && v <= hi;
  return {T(0.5) * l2, inside ? e2 : T(0), true};
}

}  // namespace rl
}  // namespace verl
