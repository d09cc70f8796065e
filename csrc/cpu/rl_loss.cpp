// CPU kernels of the loss ops (the policy of verl/rl_loss.h's drivers): per-token KL and the aggregated losses.
//
// Every loss is one chunk kernel per loss type, run over kChunk tokens of a row at a time: a pure map of the
// rl_loss.h token math with masked sums of (loss, statistics) and, with_grad, the token gradients
// grad[j] = mask ? w_b * d loss / d x : 0 in the same loop. The chunk kernels compute in float (float32 in
// place; bf16 / half converted chunk-wise through L1 buffers) or double, and are compiled twice, for AVX2+FMA
// and for baseline x86-64 (target_clones: the loader picks one per CPU). The row weights w_b come first, from
// a byte-count pass over the mask. Row sums are accumulated in double.
//
// FP operations here never rely on floating-point exception flags; telling GCC so (-fno-trapping-math for
// this file only) is what lets it turn the per-token selects into SIMD blends.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "verl/rl_cpu.h"
#include "verl/rl_loss.h"

namespace verl {
namespace {

using namespace verl::rl;

// Valid entries of a bool row: 8 mask bytes (each 0 or 1) at a time, summed by one multiply (byte sums <= 8
// cannot carry); ~7x faster than GCC's vectorised byte reduction here.
int64_t count_valid(const bool* m, int64_t n) {
  const uint8_t* m8 = reinterpret_cast<const uint8_t*>(m);
  int64_t total = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t w;
    std::memcpy(&w, m8 + j, sizeof(w));
    total += static_cast<int64_t>((w * 0x0101010101010101ull) >> 56);
  }
  for (; j < n; ++j) total += m8[j] != 0 ? 1 : 0;
  return total;
}

// ------------------------------------------------------------------------------------------ chunk kernels

template <typename T>
struct Sums {
  T loss = 0, s0 = 0, s1 = 0, s2 = 0;
};

// Bit masks of a compute type's width: all ones where valid, 0 where masked.
template <typename T>
using mask_bits_t = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;

// x where k is all ones, +0.0 where k is 0: a bitwise AND, so NaN/garbage under the mask never enters a sum or a
// gradient (a product with 0 would keep NaN), and no per-element branch or byte-width select is left for the
// vectoriser: with every operand 32 (64) bits wide, GCC uses full-width vectors without spilling.
template <typename T>
VERL_INLINE T sel(T x, mask_bits_t<T> k) {
  return std::bit_cast<T>(static_cast<mask_bits_t<T>>(std::bit_cast<mask_bits_t<T>>(x) & k));
}

// Masked sums of (loss, statistics) and, with kGrad, grad[j] = valid ? w * d loss / d x : 0, in one loop.
template <bool kGrad, typename T, typename Tok>
VERL_INLINE Sums<T> chunk_loop(int64_t n, const bool* m, T w, T* grad, const Tok& tok) {
  using K = mask_bits_t<T>;
  alignas(64) K mk[kChunk];
  const uint8_t* m8 = reinterpret_cast<const uint8_t*>(m);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) mk[j] = K(0) - static_cast<K>(m8[j] != 0);
  T sum = 0, s0 = 0, s1 = 0, s2 = 0;
#pragma omp simd reduction(+ : sum, s0, s1, s2)
  for (int64_t j = 0; j < n; ++j) {
    const TokOut<T> k = tok(j);
    const K keep = mk[j];
    sum += sel(k.loss, keep);
    s0 += sel(k.s0, keep);
    s1 += sel(k.s1, keep);
    s2 += sel(k.s2, keep);
    if constexpr (kGrad) grad[j] = sel(w * k.grad, keep);
  }
  return {sum, s0, s1, s2};
}

template <typename T, typename Tok>
VERL_INLINE Sums<T> chunk_any(int64_t n, const bool* m, T w, T* grad, const Tok& tok) {
  return grad ? chunk_loop<true, T>(n, m, w, grad, tok) : chunk_loop<false, T>(n, m, w, grad, tok);
}

// ---- per-loss chunk kernels (float: cloned per ISA; double: plain)
// ---- per-loss chunk kernels (float: cloned per ISA; double: plain)

template <Pg kType, typename T>
VERL_INLINE Sums<T> pg_chunk_t(const T* lp, const T* olp, const T* adv, T seq_lr, const bool* m, int64_t n,
                               const PgParams& p, T w, T* grad) {
  return chunk_any<T>(n, m, w, grad, [&](int64_t j) VERL_INLINE_LAMBDA {
    return PgLoss::token<kType, T>(lp[j], olp[j], adv[j], seq_lr, p);
  });
}

VERL_SIMD_CLONES Sums<float> pg_chunk(Pg type, const float* lp, const float* olp, const float* adv, float seq_lr,
                                      const bool* m, int64_t n, const PgParams& p, float w, float* grad) {
  return pg_switch(type, [&](auto k) VERL_INLINE_LAMBDA {
    return pg_chunk_t<decltype(k)::value, float>(lp, olp, adv, seq_lr, m, n, p, w, grad);
  });
}

Sums<double> pg_chunk(Pg type, const double* lp, const double* olp, const double* adv, double seq_lr, const bool* m,
                      int64_t n, const PgParams& p, double w, double* grad) {
  return pg_switch(type, [&](auto k) VERL_INLINE_LAMBDA {
    return pg_chunk_t<decltype(k)::value, double>(lp, olp, adv, seq_lr, m, n, p, w, grad);
  });
}

template <Kl kKind, typename T>
VERL_INLINE Sums<T> kl_chunk_t(const T* lp, const T* ref, const bool* m, int64_t n, T w, T* grad) {
  return chunk_any<T>(n, m, w, grad,
                      [&](int64_t j) VERL_INLINE_LAMBDA { return KlLoss::token<kKind, T>(lp[j], ref[j]); });
}

VERL_SIMD_CLONES Sums<float> kl_chunk(Kl kind, const float* lp, const float* ref, const bool* m, int64_t n, float w,
                                      float* grad) {
  return kl_switch(kind, [&](auto k) VERL_INLINE_LAMBDA {
    return kl_chunk_t<decltype(k)::value, float>(lp, ref, m, n, w, grad);
  });
}

Sums<double> kl_chunk(Kl kind, const double* lp, const double* ref, const bool* m, int64_t n, double w,
                      double* grad) {
  return kl_switch(kind, [&](auto k) VERL_INLINE_LAMBDA {
    return kl_chunk_t<decltype(k)::value, double>(lp, ref, m, n, w, grad);
  });
}

template <typename T>
VERL_INLINE Sums<T> vf_chunk_impl(const T* v, const T* ov, const T* ret, T clip, const bool* m, int64_t n, T w,
                                  T* grad) {
  return chunk_any<T>(n, m, w, grad,
                      [&](int64_t j) VERL_INLINE_LAMBDA { return VfLoss::token<T>(v[j], ov[j], ret[j], clip); });
}

VERL_SIMD_CLONES Sums<float> vf_chunk(const float* v, const float* ov, const float* ret, float clip, const bool* m,
                                      int64_t n, float w, float* grad) {
  return vf_chunk_impl<float>(v, ov, ret, clip, m, n, w, grad);
}

Sums<double> vf_chunk(const double* v, const double* ov, const double* ret, double clip, const bool* m, int64_t n,
                      double w, double* grad) {
  return vf_chunk_impl<double>(v, ov, ret, clip, m, n, w, grad);
}

template <typename T>
VERL_INLINE Sums<T> sum_chunk_impl(const T* x, const bool* m, int64_t n) {
  return chunk_loop<false, T>(n, m, T(0), nullptr,
                              [&](int64_t j) VERL_INLINE_LAMBDA { return SumLoss::token<T>(x[j]); });
}

VERL_SIMD_CLONES Sums<float> sum_chunk(const float* x, const bool* m, int64_t n) { return sum_chunk_impl(x, m, n); }
Sums<double> sum_chunk(const double* x, const bool* m, int64_t n) { return sum_chunk_impl(x, m, n); }

// ------------------------------------------------------------------------------------------ row driver

struct RowAcc {
  double sum = 0.0, s0 = 0.0, s1 = 0.0, s2 = 0.0;  // s*: per-op statistics
};

// Calls chunk(b, inputs as comp_t pointers, mask, n, w_b, grad or nullptr) over every row in kChunk pieces and
// returns per-row double sums. grad (may be null) receives the chunk kernel's gradients.
template <typename scalar_t, size_t kIn, typename Chunk>
std::vector<RowAcc> loss_pass(const std::array<const scalar_t*, kIn>& in, const bool* mp, int64_t B, int64_t T,
                              const double* w, scalar_t* grad, const Chunk& chunk) {
  using T_ = comp_t<scalar_t>;
  constexpr bool kSame = std::is_same_v<scalar_t, T_>;
  std::vector<RowAcc> acc(B);
  at::parallel_for(0, B, row_grain(T), [&](int64_t b0, int64_t b1) {
    T_ buf[kIn][kSame ? 1 : kChunk];
    T_ gbuf[kSame ? 1 : kChunk];
    for (int64_t b = b0; b < b1; ++b) {
      RowAcc a;
      const T_ wb = static_cast<T_>(w[b]);
      for (int64_t t0 = 0; t0 < T; t0 += kChunk) {
        const int64_t n = std::min<int64_t>(kChunk, T - t0), base = b * T + t0;
        std::array<const T_*, kIn> p;
        for (size_t k = 0; k < kIn; ++k) {
          if constexpr (kSame) {
            p[k] = in[k] + base;
          } else {
            load_chunk(in[k] + base, buf[k], n);
            p[k] = buf[k];
          }
        }
        T_* g = nullptr;
        if (grad) {
          if constexpr (kSame) g = grad + base;
          else g = gbuf;
        }
        const Sums<T_> s = chunk(b, p, mp + base, n, wb, g);
        if constexpr (!kSame) {
          if (grad) store_chunk(gbuf, grad + base, n);
        }
        a.sum += static_cast<double>(s.loss);
        a.s0 += static_cast<double>(s.s0);
        a.s1 += static_cast<double>(s.s1);
        a.s2 += static_cast<double>(s.s2);
      }
      acc[b] = a;
    }
  });
  return acc;
}

// Row weights from the mask alone (one pass over its bytes), so they are known before the token pass.
struct Weights {
  std::vector<double> count, w;
  double tokens = 0.0;  // this batch's valid tokens (the statistics' denominator)
};

Weights row_weights(const bool* mp, int64_t B, int64_t T, AggParams p) {
  Weights r;
  r.count.assign(B, 0.0);
  r.w.assign(B, 0.0);
  at::parallel_for(0, B, row_grain(T) * 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) r.count[b] = static_cast<double>(count_valid(mp + b * T, T));
  });
  double seqs = 0.0;
  for (double c : r.count) {
    r.tokens += c;
    seqs += c > 0.0 ? 1.0 : 0.0;
  }
  fill_local_counts(p, r.tokens, seqs);
  for (int64_t b = 0; b < B; ++b) r.w[b] = row_weight(p, r.count[b]);
  return r;
}

// The forward outputs: loss = sum_b w_b * row sum_b (in the loss dtype); statistics are token means (float32).
// The outputs: loss = sum_b w_b * row sum_b (in the loss dtype); statistics are token means (float32).
void finish(const std::vector<RowAcc>& acc, const Weights& wt, const LossArgs& a) {
  double loss = 0.0, s[3] = {0.0, 0.0, 0.0};
  for (size_t b = 0; b < acc.size(); ++b) {
    if (wt.w[b] != 0.0) loss += wt.w[b] * acc[b].sum;
    s[0] += acc[b].s0;
    s[1] += acc[b].s1;
    s[2] += acc[b].s2;
  }
  a.loss.fill_(loss);
  for (int k = 0; k < 3; ++k) {
    if (a.stats[k].defined()) a.stats[k].fill_(wt.tokens > 0.0 ? s[k] / wt.tokens : 0.0);
  }
  if (a.row_weight.defined()) std::copy(wt.w.begin(), wt.w.end(), a.row_weight.data_ptr<double>());
}

// Row weights, then one pass over the rows (writing d loss / d x with_grad), then the outputs.
template <typename scalar_t, size_t kIn, typename Chunk>
void reduce_rows(const LossArgs& a, const Chunk& chunk) {
  const int64_t B = a.m.size(0), T = a.m.size(1);
  const bool* mp = a.m.data_ptr<bool>();
  const Weights wt = row_weights(mp, B, T, a.agg);
  std::array<const scalar_t*, kIn> ptr;
  for (size_t k = 0; k < kIn; ++k) ptr[k] = a.in[k].data_ptr<scalar_t>();
  const auto acc = loss_pass<scalar_t, kIn>(ptr, mp, B, T, wt.w.data(),
                                            a.with_grad ? a.grad.data_ptr<scalar_t>() : nullptr, chunk);
  finish(acc, wt, a);
}

// GSPO's sequence log-ratio: the mean of (logp - old_logp) over the row's valid tokens (0 for other types).
template <typename scalar_t>
std::vector<double> seq_log_ratios(Pg type, const scalar_t* lp, const scalar_t* olp, const bool* mp, int64_t B,
                                   int64_t T) {
  std::vector<double> out(B, 0.0);
  if (type != Pg::Gspo) return out;
  at::parallel_for(0, B, row_grain(T), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      double s = 0.0, c = 0.0;
      for (int64_t t = b * T; t < (b + 1) * T; ++t) {
        if (!mp[t]) continue;
        s += static_cast<double>(lp[t]) - static_cast<double>(olp[t]);
        c += 1.0;
      }
      out[b] = c > 0.0 ? s / c : 0.0;
    }
  });
  return out;
}

// out[i] = f(i) over [0, n), vectorised and split across threads.
template <typename scalar_t, typename F>
void elementwise(int64_t n, scalar_t* out, const F& f) {
  at::parallel_for(0, n, kGrain, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) out[i] = static_cast<scalar_t>(f(i));
  });
}

// ------------------------------------------------------------------------------------------ the policy

struct CpuLoss {
  using Guard = NoGuard;

  template <typename scalar_t>
  static void kl_penalty(const KlArgs& a) {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* ap = a.a.data_ptr<scalar_t>();
    const scalar_t* bp = a.b.data_ptr<scalar_t>();
    const scalar_t* gp = a.grad.defined() ? a.grad.data_ptr<scalar_t>() : nullptr;
    scalar_t* out = a.out.data_ptr<scalar_t>();
    const int64_t n = a.out.numel();
    kl_switch(a.kind, [&](auto kind) {
      constexpr Kl kKind = decltype(kind)::value;
      if (gp) {
        elementwise(n, out, [=](int64_t i) {
          return static_cast<acc_t>(gp[i]) *
                 kl_token_t<kKind, acc_t>(static_cast<acc_t>(ap[i]), static_cast<acc_t>(bp[i])).grad;
        });
      } else {
        elementwise(n, out, [=](int64_t i) {
          return kl_token_t<kKind, acc_t>(static_cast<acc_t>(ap[i]), static_cast<acc_t>(bp[i])).value;
        });
      }
    });
  }

  template <typename scalar_t>
  static void loss(const LossArgs& a, const SumLoss&) {
    using T_ = comp_t<scalar_t>;
    reduce_rows<scalar_t, 1>(a, [](int64_t, const std::array<const T_*, 1>& q, const bool* mp, int64_t n, T_, T_*) {
      return sum_chunk(q[0], mp, n);
    });
  }

  template <typename scalar_t>
  static void loss(const LossArgs& a, const KlLoss& l) {
    using T_ = comp_t<scalar_t>;
    reduce_rows<scalar_t, 2>(a, [k = l.kind](int64_t, const std::array<const T_*, 2>& q, const bool* mp, int64_t n,
                                             T_ w, T_* g) { return kl_chunk(k, q[0], q[1], mp, n, w, g); });
  }

  template <typename scalar_t>
  static void loss(const LossArgs& a, const PgLoss& l) {
    using T_ = comp_t<scalar_t>;
    const std::vector<double> seq_lr = seq_log_ratios(l.p.type, a.in[0].data_ptr<scalar_t>(),
                                                      a.in[1].data_ptr<scalar_t>(), a.m.data_ptr<bool>(),
                                                      a.m.size(0), a.m.size(1));
    reduce_rows<scalar_t, 3>(a, [&](int64_t b, const std::array<const T_*, 3>& q, const bool* mp, int64_t n, T_ w,
                                    T_* g) {
      return pg_chunk(l.p.type, q[0], q[1], q[2], static_cast<T_>(seq_lr[b]), mp, n, l.p, w, g);
    });
  }

  template <typename scalar_t>
  static void loss(const LossArgs& a, const VfLoss& l) {
    using T_ = comp_t<scalar_t>;
    reduce_rows<scalar_t, 3>(a, [clip = l.clip](int64_t, const std::array<const T_*, 3>& q, const bool* mp, int64_t n,
                                                T_ w, T_* g) {
      return vf_chunk(q[0], q[1], q[2], static_cast<T_>(clip), mp, n, w, g);
    });
  }

  // d loss / d x = mask ? grad * w_b : 0.
  template <typename scalar_t>
  static void agg_loss_backward(const AggBackwardArgs& a) {
    const double g = a.grad.to(at::kDouble).item<double>();
    const double* w = a.row_weight.data_ptr<double>();
    fill_rows(a.m.data_ptr<bool>(), a.m.size(0), a.m.size(1), a.out.data_ptr<scalar_t>(),
              [&](int64_t b) { return g * w[b]; });
  }
};

using K = CpuLoss;

}  // namespace

// The backward of the loss ops' with_grad path: the saved d loss / d x times the incoming scalar gradient. One
// device-generic kernel (ATen's vectorised multiply) serves CPU and CUDA.
at::Tensor loss_grad_scale(const at::Tensor& grad, const at::Tensor& saved_grad) {
  TORCH_CHECK(grad.numel() == 1, "loss_grad_scale: `grad` must be the gradient of the scalar loss, got shape ",
              grad.sizes());
  return at::mul(saved_grad, grad.reshape({}).to(saved_grad.scalar_type()));
}

TORCH_LIBRARY_IMPL(verl, CompositeExplicitAutograd, m) { m.impl("loss_grad_scale", &loss_grad_scale); }

TORCH_LIBRARY_IMPL(verl, CPU, m) { rl::register_loss_ops<K>(m); }

// ------------------------------------------------------------------------------------------ agg_loss autograd (C++)
//
// agg_loss (e.g. the entropy bonus) is so cheap that the Python autograd wrapper of torch.library (~60 us of
// fixed cost per forward + backward) dominated it at training sizes; its autograd kernel is C++ instead. Same
// contract as the Python registrations of the other loss ops: saves (mask, row_weight), backward is
// agg_loss_backward. Registered for the Autograd key, so it serves every device.

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

class AggLossFunction : public torch::autograd::Function<AggLossFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& loss, const at::Tensor& mask,
                               const std::string& mode, std::optional<double> global_tokens,
                               std::optional<double> global_seqs, int64_t dp_size, std::optional<double> norm_len) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("verl::agg_loss", "")
                         .typed<std::tuple<at::Tensor, at::Tensor>(
                             const at::Tensor&, const at::Tensor&, c10::string_view, std::optional<double>,
                             std::optional<double>, int64_t, std::optional<double>)>();
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, rw] = op.call(loss, mask, mode, global_tokens, global_seqs, dp_size, norm_len);
    ctx->save_for_backward({mask, rw});
    ctx->mark_non_differentiable({rw});
    return {out, rw};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("verl::agg_loss_backward", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    const variable_list saved = ctx->get_saved_variables();
    at::Tensor g = grads[0].defined() ? op.call(grads[0], saved[0], saved[1]) : at::Tensor();
    return {g, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> agg_loss_autograd(const at::Tensor& loss, const at::Tensor& mask,
                                                     c10::string_view mode, std::optional<double> global_tokens,
                                                     std::optional<double> global_seqs, int64_t dp_size,
                                                     std::optional<double> norm_len) {
  variable_list out = AggLossFunction::apply(loss, mask, std::string(mode), global_tokens, global_seqs, dp_size,
                                             norm_len);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, Autograd, m) { m.impl("agg_loss", &agg_loss_autograd); }

}  // namespace verl
