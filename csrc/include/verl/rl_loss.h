// Device-agnostic drivers of the RL loss ops: kl_penalty (per token) and the losses aggregated over a mask,
// agg_loss, kl_loss, policy_loss and value_loss (schemas in csrc/ops.cpp; CPU kernels in csrc/cpu/rl_loss.cpp,
// CUDA kernels in csrc/cuda/rl_loss.cu; see verl/rl.h for the driver / policy split), with the per-token math
// both backends share. A kernel policy K supplies, for each dtype scalar_t:
//   K::kl_penalty<scalar_t>(const KlArgs&)           the per-token estimator (or, given grad, its backward)
//   K::loss<scalar_t>(const LossArgs&, const L&)      for L in {SumLoss, KlLoss, PgLoss, VfLoss}: one pass over
//                                                    the rows giving the loss, its statistics and, with_grad,
//                                                    d loss / d input
//   K::agg_loss_backward<scalar_t>(const AggBackwardArgs&)   grad * row_weight_b where valid, else 0
//
// Gradients. Every aggregation is loss = sum_b w_b sum_t m_bt l_bt, with row weights w_b that depend on the
// mask alone, so they are known before the token pass. With `with_grad`, the loss ops write
// d loss / d x = m_bt w_b d l_bt / d x in the same pass that reads x for the loss (forward and backward read the
// inputs once), and the backward op loss_grad_scale multiplies that saved tensor by the incoming scalar.
// agg_loss's gradient, m_bt w_b, reads no input: it saves the row weights and agg_loss_backward writes it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include "verl/checks.h"
#include "verl/cpu_math.h"
#include "verl/rl.h"

namespace verl {
namespace rl {

using at::Tensor;

// ------------------------------------------------------------------------------------------ aggregation

// Loss aggregation. Every mode is loss = sum_b w_b * sum_t m_bt * l_bt with a per-row weight w_b.
// token-sum has no normaliser: w_b = dp, so DP gradient averaging leaves the sum over every rank's tokens.
enum class Agg : int {
  TokenMean = 0, SeqMeanTokenSum = 1, SeqMeanTokenMean = 2, SeqMeanTokenSumNorm = 3, TokenSum = 4
};

inline Agg parse_agg(std::string_view s, const char* op) {
  static constexpr Named<Agg> kNames[] = {{"token-mean", Agg::TokenMean},
                                          {"seq-mean-token-sum", Agg::SeqMeanTokenSum},
                                          {"seq-mean-token-mean", Agg::SeqMeanTokenMean},
                                          {"seq-mean-token-sum-norm", Agg::SeqMeanTokenSumNorm},
                                          {"token-sum", Agg::TokenSum}};
  return parse_named(s, kNames, op, "aggregation `mode`", "modes",
                     "token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm, token-sum");
}

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
    case Agg::TokenSum:
      return p.dp;
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

// KL estimators of KL(pi || ref) from per-token log-probs. The "+" kinds are straight-through: the value of
// k1 / k3 with the gradient of k2 (an unbiased gradient of the KL in expectation).
enum class Kl : int { K1 = 0, Abs = 1, K2 = 2, K3 = 3, K1Plus = 4, K3Plus = 5 };

inline Kl parse_kl(std::string_view s, const char* op) {
  static constexpr Named<Kl> kNames[] = {
      {"kl", Kl::K1},         {"k1", Kl::K1},         {"abs", Kl::Abs},          {"mse", Kl::K2},
      {"k2", Kl::K2},         {"low_var_kl", Kl::K3}, {"k3", Kl::K3},            {"k1+", Kl::K1Plus},
      {"kl+", Kl::K1Plus},    {"k3+", Kl::K3Plus},    {"low_var_kl+", Kl::K3Plus}};
  return parse_named(s, kNames, op, "KL `kind`", "kinds",
                     "kl (k1), abs, mse (k2), low_var_kl (k3), k1+ (kl+), k3+ (low_var_kl+)");
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

// f(std::integral_constant<Kl, kind>): the kind as a template parameter, chosen once per call site.
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

enum class Pg : int { Vanilla = 0, Gspo = 1, Reinforce = 2 };

inline Pg parse_pg(std::string_view s, const char* op) {
  static constexpr Named<Pg> kNames[] = {{"vanilla", Pg::Vanilla}, {"gspo", Pg::Gspo}, {"reinforce", Pg::Reinforce}};
  return parse_named(s, kNames, op, "policy `loss_type`", "types", "vanilla, gspo, reinforce");
}

template <typename F>
VERL_HD auto pg_switch(Pg type, const F& f) {
  switch (type) {
    case Pg::Gspo:
      return f(std::integral_constant<Pg, Pg::Gspo>{});
    case Pg::Reinforce:
      return f(std::integral_constant<Pg, Pg::Reinforce>{});
    default:
      return f(std::integral_constant<Pg, Pg::Vanilla>{});
  }
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

// ------------------------------------------------------------------------------------------ the four losses

// One token of a loss op: its loss, d loss / d (the differentiable input), and up to three statistics.
template <typename T>
struct TokOut {
  T loss, grad, s0, s1, s2;
};

// What each loss op reads per token (kIn [B, T] inputs, the first one differentiable), how many token-mean
// statistics it reports (kStats), its parameters, and its token: a pure function of that token's inputs.

struct SumLoss {  // agg_loss: the per-token loss given, as is
  static constexpr int kIn = 1, kStats = 0;
  template <typename T>
  VERL_HD static TokOut<T> token(T x) {
    return {x, T(1), T(0), T(0), T(0)};
  }
};

struct KlLoss {  // kl_loss: in = (logprob, ref_logprob)
  static constexpr int kIn = 2, kStats = 0;
  Kl kind = Kl::K3;
  template <Kl kKind, typename T>
  VERL_HD static TokOut<T> token(T lp, T ref) {
    const ValGrad<T> k = kl_token_t<kKind, T>(lp, ref);
    return {k.value, k.grad, T(0), T(0), T(0)};
  }
};

// policy_loss: in = (logprob, old_logprob, advantages); statistics (pg_clipfrac, pg_clipfrac_lower, ppo_kl).
// seq_lr: GSPO's per-row sequence log-ratio (ignored by the other types).
struct PgLoss {
  static constexpr int kIn = 3, kStats = 3;
  PgParams p;
  template <Pg kType, typename T>
  VERL_HD static TokOut<T> token(T lp, T olp, T adv, T seq_lr, const PgParams& params) {
    const T d = lp - olp;
    const PgToken<T> k = pg_token_t<kType, T>(kType == Pg::Gspo ? seq_lr : d, adv, params);
    // ppo_kl = mean(old - logp), with the same +-20 clamp as the ratio.
    return {k.loss, k.grad, k.clipped, k.lower, -clampv(d, T(-20), T(20))};
  }
};

struct VfLoss {  // value_loss: in = (values, old_values, returns); statistic vf_clipfrac
  static constexpr int kIn = 3, kStats = 1;
  double clip = 0.5;
  template <typename T>
  VERL_HD static TokOut<T> token(T v, T ov, T ret, T clip_t) {
    const VfToken<T> k = vf_token<T>(v, ov, ret, clip_t);
    return {k.loss, k.grad, k.clipped, T(0), T(0)};
  }
};

// ------------------------------------------------------------------------------------------ argument checks

inline PgParams make_pg(c10::string_view loss_type, double clip_low, double clip_high, double clip_c,
                        const char* op) {
  PgParams p;
  p.type = parse_pg(loss_type, op);
  TORCH_CHECK(clip_low >= 0.0 && clip_low < 1.0, op,
              ": `clip_low` must be in [0, 1) (ratio lower bound 1 - clip_low), got ", clip_low);
  TORCH_CHECK(clip_high >= 0.0, op, ": `clip_high` must be >= 0, got ", clip_high);
  TORCH_CHECK(clip_c > 1.0, op, ": `clip_c` (dual-clip constant) must be > 1, got ", clip_c,
              "; pass inf to turn dual clip off");
  p.clip_low = clip_low;
  p.clip_high = clip_high;
  p.clip_c = clip_c;
  return p;
}

inline void check_row_weight(const Tensor& w, int64_t B, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kDouble && w.dim() == 1 && w.size(0) == B, op,
              ": `row_weight` must be the float64 [B] output of the forward op (B=", B, "), got ", w.scalar_type(),
              " ", w.sizes());
}

inline void check_scalar_grad(const Tensor& grad, const char* op) {
  TORCH_CHECK(grad.numel() == 1, op, ": `grad` must be the gradient of the scalar loss, got shape ", grad.sizes());
}

// ------------------------------------------------------------------------------------------ drivers

struct KlArgs {
  Tensor a, b;  // logprob, ref_logprob: contiguous, one shape
  Tensor grad;  // backward: the incoming gradient (contiguous, the inputs' dtype); forward: undefined
  Kl kind = Kl::K3;
  Tensor out;   // the estimate (forward) or d / d logprob (backward), shaped like the inputs
};

// Per-token KL (forward), or its backward given `grad` (d out / d logprob; d / d ref is its negation).
template <class K>
Tensor kl_penalty_common(const Tensor* grad, const Tensor& logprob, const Tensor& ref_logprob,
                         c10::string_view kind, const char* op) {
  KlArgs a;
  a.kind = parse_kl(kind, op);
  check_floating(logprob, op, "logprob");
  check_like(logprob, ref_logprob, op, "logprob", "ref_logprob");
  if (grad) {
    check_same_shape(logprob, *grad, op, "logprob", "grad");
    check_same_device(logprob, *grad, op, "logprob", "grad");
  }
  typename K::Guard guard(logprob.device());
  a.a = logprob.contiguous();
  a.b = ref_logprob.contiguous();
  if (grad) a.grad = grad->to(logprob.scalar_type()).contiguous();
  a.out = at::empty(logprob.sizes(), logprob.options());
  if (a.out.numel() == 0) return a.out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_kl_penalty",
                                  [&] { K::template kl_penalty<scalar_t>(a); });
  return a.out;
}

template <class K>
Tensor kl_penalty(const Tensor& logprob, const Tensor& ref_logprob, c10::string_view kind) {
  return kl_penalty_common<K>(nullptr, logprob, ref_logprob, kind, "kl_penalty");
}

template <class K>
Tensor kl_penalty_backward(const Tensor& grad, const Tensor& logprob, const Tensor& ref_logprob,
                           c10::string_view kind) {
  return kl_penalty_common<K>(&grad, logprob, ref_logprob, kind, "kl_penalty_backward");
}

struct LossArgs {
  std::array<Tensor, 3> in;     // the loss's kIn contiguous [B, T] inputs; in[0] is the differentiable one
  Tensor m;                     // the mask as contiguous bool
  AggParams agg;
  bool with_grad = false;
  Tensor loss;                  // output: 0-d, the inputs' dtype
  std::array<Tensor, 3> stats;  // outputs: the loss's kStats 0-d float32 token means over the valid tokens
  Tensor row_weight;            // output (agg_loss only): [B] float64 w_b, what agg_loss_backward reads
  Tensor grad;                  // output: [B, T] d loss / d in[0] with_grad, else an empty [0]
};

// The body of every loss op, after its own argument checks: contiguous inputs, outputs, one dtype dispatch.
template <class K, class L>
LossArgs run_loss(const L& loss, std::initializer_list<Tensor> inputs, const Tensor& mask, const AggParams& agg,
                  bool with_grad, bool row_weight) {
  const Tensor& like = *inputs.begin();
  typename K::Guard guard(like.device());
  LossArgs a;
  int k = 0;
  for (const Tensor& x : inputs) a.in[k++] = x.contiguous();
  a.m = mask_as_bool(mask);
  a.agg = agg;
  a.with_grad = with_grad;
  a.loss = at::empty({}, like.options());
  for (int s = 0; s < L::kStats; ++s) a.stats[s] = at::empty({}, like.options().dtype(at::kFloat));
  if (row_weight) a.row_weight = at::empty({like.size(0)}, like.options().dtype(at::kDouble));
  a.grad = with_grad ? at::empty(like.sizes(), like.options()) : at::empty({0}, like.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, like.scalar_type(), "verl_rl_loss",
                                  [&] { K::template loss<scalar_t>(a, loss); });
  return a;
}

template <class K>
std::tuple<Tensor, Tensor> agg_loss(const Tensor& loss, const Tensor& mask, c10::string_view mode,
                                    std::optional<double> global_tokens, std::optional<double> global_seqs,
                                    int64_t dp_size, std::optional<double> norm_len) {
  const char* op = "agg_loss";
  check_bt(loss, op, "loss");
  check_mask_of(loss, mask, op, "loss");
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, loss.size(1), op);
  const LossArgs a = run_loss<K>(SumLoss{}, {loss}, mask, p, /*with_grad=*/false, /*row_weight=*/true);
  return {a.loss, a.row_weight};
}

struct AggBackwardArgs {
  Tensor grad;        // 0-d or one-element incoming gradient
  Tensor m;           // [B, T] mask as contiguous bool
  Tensor row_weight;  // [B] float64
  Tensor out;         // [B, T] in grad's dtype
};

template <class K>
Tensor agg_loss_backward(const Tensor& grad, const Tensor& mask, const Tensor& row_weight) {
  const char* op = "agg_loss_backward";
  check_floating(grad, op, "grad");
  TORCH_CHECK(mask.dim() == 2, op, ": `mask` must be 2-D [B, T], got ", mask.sizes());
  check_row_weight(row_weight, mask.size(0), op);
  check_scalar_grad(grad, op);
  typename K::Guard guard(mask.device());
  AggBackwardArgs a{grad, mask_as_bool(mask), row_weight, at::empty(mask.sizes(), mask.options().dtype(grad.dtype()))};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "verl_agg_loss_backward",
                                  [&] { K::template agg_loss_backward<scalar_t>(a); });
  return a.out;
}

template <class K>
std::tuple<Tensor, Tensor> kl_loss(const Tensor& logprob, const Tensor& ref_logprob, const Tensor& mask,
                                   c10::string_view kind, c10::string_view mode, std::optional<double> global_tokens,
                                   std::optional<double> global_seqs, int64_t dp_size, std::optional<double> norm_len,
                                   bool with_grad) {
  const char* op = "kl_loss";
  KlLoss loss;
  loss.kind = parse_kl(kind, op);
  check_bt(logprob, op, "logprob");
  check_like(logprob, ref_logprob, op, "logprob", "ref_logprob");
  check_mask_of(logprob, mask, op, "logprob");
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, logprob.size(1), op);
  const LossArgs a = run_loss<K>(loss, {logprob, ref_logprob}, mask, p, with_grad, /*row_weight=*/false);
  return {a.loss, a.grad};
}

template <class K>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> policy_loss(
    const Tensor& logprob, const Tensor& old_logprob, const Tensor& advantages, const Tensor& mask,
    c10::string_view loss_type, double clip_low, double clip_high, double clip_c, c10::string_view mode,
    std::optional<double> global_tokens, std::optional<double> global_seqs, int64_t dp_size,
    std::optional<double> norm_len, bool with_grad) {
  const char* op = "policy_loss";
  PgLoss loss;
  loss.p = make_pg(loss_type, clip_low, clip_high, clip_c, op);
  check_bt(logprob, op, "logprob");
  check_like(logprob, old_logprob, op, "logprob", "old_logprob");
  check_like(logprob, advantages, op, "logprob", "advantages");
  check_mask_of(logprob, mask, op, "logprob");
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, logprob.size(1), op);
  const LossArgs a = run_loss<K>(loss, {logprob, old_logprob, advantages}, mask, p, with_grad, /*row_weight=*/false);
  return {a.loss, a.stats[0], a.stats[1], a.stats[2], a.grad};
}

template <class K>
std::tuple<Tensor, Tensor, Tensor> value_loss(const Tensor& values, const Tensor& old_values, const Tensor& returns,
                                              const Tensor& mask, double clip, c10::string_view mode,
                                              std::optional<double> global_tokens, std::optional<double> global_seqs,
                                              int64_t dp_size, std::optional<double> norm_len, bool with_grad) {
  const char* op = "value_loss";
  check_bt(values, op, "values");
  check_like(values, old_values, op, "values", "old_values");
  check_like(values, returns, op, "values", "returns");
  check_mask_of(values, mask, op, "values");
  TORCH_CHECK(clip >= 0.0, op, ": `clip` (value clip range) must be >= 0, got ", clip, "; pass inf for no clipping");
  VfLoss loss;
  loss.clip = clip;
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, values.size(1), op);
  const LossArgs a = run_loss<K>(loss, {values, old_values, returns}, mask, p, with_grad, /*row_weight=*/false);
  return {a.loss, a.stats[0], a.grad};
}

// Registers the loss ops of kernel policy K (in a TORCH_LIBRARY_IMPL block of its dispatch key).
template <class K>
void register_loss_ops(torch::Library& m) {
  m.impl("kl_penalty", &kl_penalty<K>);
  m.impl("kl_penalty_backward", &kl_penalty_backward<K>);
  m.impl("agg_loss", &agg_loss<K>);
  m.impl("agg_loss_backward", &agg_loss_backward<K>);
  m.impl("kl_loss", &kl_loss<K>);
  m.impl("policy_loss", &policy_loss<K>);
  m.impl("value_loss", &value_loss<K>);
}

}  // namespace rl
}  // namespace verl
