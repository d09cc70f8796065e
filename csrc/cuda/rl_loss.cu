// CUDA kernels of the loss ops (the policy of verl/rl_loss.h's drivers; same contract as csrc/cpu/rl_loss.cpp).
//
// Losses: one block per row reduces (loss sum, count, statistics) in double; a one-block finish kernel turns
// the B row results into row weights, the loss and the statistics on the device, so nothing synchronises with
// the host. With with_grad, the row weights come first (a count kernel per row, then one block) and the row
// kernel writes d loss / d x in the same pass. KL penalty and agg_loss_backward: grid-stride elementwise passes.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "verl/rl_cuda.cuh"
#include "verl/rl_loss.h"

namespace verl {
namespace {

using namespace verl::rl;

template <typename T>
__device__ __forceinline__ ValGrad<T> kl_token(T logp, T ref, Kl kind) {
  return kl_switch(kind, [&](auto k) { return kl_token_t<decltype(k)::value, T>(logp, ref); });
}

// ------------------------------------------------------------------------------------------ KL penalty

template <typename scalar_t>
__global__ void kl_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                          const scalar_t* __restrict__ grad, int64_t n, Kl kind, scalar_t* __restrict__ out) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const ValGrad<acc_t> k = kl_token<acc_t>(ld(a, i), ld(b, i), kind);
    out[i] = static_cast<scalar_t>(grad ? ld(grad, i) * k.grad : k.value);
  }
}

// ------------------------------------------------------------------------------------------ losses

// Per-token functors: the loss's token (verl/rl_loss.h) at element i of row b, in the dtype's math type.
template <typename scalar_t>
struct AggTok {
  const scalar_t* x;
  __device__ TokOut<at::opmath_type<scalar_t>> operator()(int64_t i, int64_t) const {
    return SumLoss::token(ld(x, i));
  }
};

template <typename scalar_t>
struct KlTok {
  const scalar_t *a, *r;
  Kl kind;
  __device__ TokOut<at::opmath_type<scalar_t>> operator()(int64_t i, int64_t) const {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t x = ld(a, i), y = ld(r, i);
    return kl_switch(kind, [&](auto k) { return KlLoss::token<decltype(k)::value, acc_t>(x, y); });
  }
};

template <typename scalar_t>
struct PgTok {
  const scalar_t *lp, *olp, *adv;
  const double* seq_lr;  // GSPO only: per-row sequence log-ratio
  PgParams p;
  __device__ TokOut<at::opmath_type<scalar_t>> operator()(int64_t i, int64_t b) const {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t x = ld(lp, i), o = ld(olp, i), A = ld(adv, i);
    const acc_t s = seq_lr ? static_cast<acc_t>(seq_lr[b]) : acc_t(0);
    return pg_switch(p.type, [&](auto k) { return PgLoss::token<decltype(k)::value, acc_t>(x, o, A, s, p); });
  }
};

template <typename scalar_t>
struct VfTok {
  const scalar_t *v, *ov, *ret;
  double clip;
  __device__ TokOut<at::opmath_type<scalar_t>> operator()(int64_t i, int64_t) const {
    using acc_t = at::opmath_type<scalar_t>;
    return VfLoss::token<acc_t>(ld(v, i), ld(ov, i), ld(ret, i), static_cast<acc_t>(clip));
  }
};

// acc[b * 5 + k] = (loss sum, count, s0, s1, s2) of row b. With kGrad (w = row weights from weights_kernel),
// grad[i] = mask ? w_b * d loss / d x : 0 is written in the same pass.
template <typename scalar_t, typename Tok, bool kGrad>
__global__ void loss_rows_kernel(const bool* __restrict__ m, int64_t T, Tok tok, double* __restrict__ acc,
                                 const double* __restrict__ w, scalar_t* __restrict__ grad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t b = blockIdx.x;
  const acc_t wb = kGrad ? static_cast<acc_t>(w[b]) : acc_t(0);
  double v[5] = {0.0, 0.0, 0.0, 0.0, 0.0};
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
    const int64_t i = b * T + t;
    if (!m[i]) {
      if constexpr (kGrad) grad[i] = scalar_t(0);
      continue;
    }
    const TokOut<acc_t> k = tok(i, b);
    if constexpr (kGrad) grad[i] = static_cast<scalar_t>(wb * k.grad);
    v[0] += static_cast<double>(k.loss);
    v[1] += 1.0;
    v[2] += static_cast<double>(k.s0);
    v[3] += static_cast<double>(k.s1);
    v[4] += static_cast<double>(k.s2);
  }
  block_sum<5>(v);
  if (threadIdx.x == 0) {
#pragma unroll
    for (int k = 0; k < 5; ++k) acc[b * 5 + k] = v[k];
  }
}

// GSPO: seq_lr[b] = mean over valid tokens of (logp - old_logp).
template <typename scalar_t>
__global__ void seq_log_ratio_kernel(const scalar_t* __restrict__ lp, const scalar_t* __restrict__ olp,
                                     const bool* __restrict__ m, int64_t T, double* __restrict__ seq_lr) {
  const int64_t b = blockIdx.x;
  double v[2] = {0.0, 0.0};
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
    const int64_t i = b * T + t;
    if (!m[i]) continue;
    v[0] += static_cast<double>(ld(lp, i)) - static_cast<double>(ld(olp, i));
    v[1] += 1.0;
  }
  block_sum<2>(v);
  if (threadIdx.x == 0) seq_lr[b] = v[1] > 0.0 ? v[0] / v[1] : 0.0;
}

// counts[b] = valid tokens of row b (with_grad needs the row weights before the token pass).
__global__ void row_count_kernel(const bool* __restrict__ m, int64_t T, double* __restrict__ counts) {
  const int64_t b = blockIdx.x;
  double c[1] = {0.0};
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) c[0] += m[b * T + t] ? 1.0 : 0.0;
  block_sum<1>(c);
  if (threadIdx.x == 0) counts[b] = c[0];
}

// One block: w[b] = row_weight(p, counts[b]) with the local counts filled in (as finish_kernel does).
__global__ void weights_kernel(const double* __restrict__ counts, int64_t B, AggParams p, double* __restrict__ w) {
  double tot[2] = {0.0, 0.0};
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
    tot[0] += counts[b];
    tot[1] += counts[b] > 0.0 ? 1.0 : 0.0;
  }
  block_sum<2>(tot);
  fill_local_counts(p, tot[0], tot[1]);
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) w[b] = row_weight(p, counts[b]);
}

// One block: local counts -> normalisers -> row weights (into w, if given), loss and token-mean statistics.
template <typename scalar_t>
__global__ void finish_kernel(const double* __restrict__ acc, int64_t B, AggParams p, double* __restrict__ w,
                              scalar_t* __restrict__ loss, float* __restrict__ st0, float* __restrict__ st1,
                              float* __restrict__ st2) {
  double tot[5] = {0.0, 0.0, 0.0, 0.0, 0.0};  // tokens, seqs, s0, s1, s2
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
    const double c = acc[b * 5 + 1];
    tot[0] += c;
    tot[1] += c > 0.0 ? 1.0 : 0.0;
    tot[2] += acc[b * 5 + 2];
    tot[3] += acc[b * 5 + 3];
    tot[4] += acc[b * 5 + 4];
  }
  block_sum<5>(tot);
  fill_local_counts(p, tot[0], tot[1]);
  double l[1] = {0.0};
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
    const double wb = row_weight(p, acc[b * 5 + 1]);
    if (w) w[b] = wb;
    if (wb != 0.0) l[0] += wb * acc[b * 5];
  }
  block_sum<1>(l);
  if (threadIdx.x == 0) {
    loss[0] = static_cast<scalar_t>(l[0]);
    const double n = tot[0] > 0.0 ? tot[0] : 1.0;
    if (st0) st0[0] = static_cast<float>(tot[2] / n);
    if (st1) st1[0] = static_cast<float>(tot[3] / n);
    if (st2) st2[0] = static_cast<float>(tot[4] / n);
  }
}

// agg_loss_backward: out = mask ? grad * w_b : 0, grad read from device memory.
template <typename scalar_t>
__global__ void agg_backward_kernel(const scalar_t* __restrict__ g, const double* __restrict__ w,
                                    const bool* __restrict__ m, int64_t n, int64_t T, scalar_t* __restrict__ out) {
  using acc_t = at::opmath_type<scalar_t>;
  const double gv = static_cast<double>(ld(g, 0));
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const acc_t s = static_cast<acc_t>(gv * w[i / T]);
    out[i] = (m[i] && s != acc_t(0)) ? static_cast<scalar_t>(s) : scalar_t(0);
  }
}

template <typename scalar_t>
float* stat_ptr(const LossArgs& a, int k) {
  return a.stats[k].defined() ? a.stats[k].data_ptr<float>() : nullptr;
}

// Row weights (with_grad), the row kernel, then the finish kernel.
template <typename scalar_t, typename Tok>
void run_loss(const LossArgs& a, const Tok& tok) {
  const int64_t B = a.m.size(0), T = a.m.size(1);
  const auto dopts = a.in[0].options().dtype(at::kDouble);
  auto stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor acc = at::empty({B * 5}, dopts);
  const at::Tensor w = at::empty({a.with_grad ? B : 0}, dopts);
  if (a.with_grad) {
    const at::Tensor counts = at::empty({B}, dopts);
    row_count_kernel<<<B, kThreads, 0, stream>>>(a.m.data_ptr<bool>(), T, counts.data_ptr<double>());
    weights_kernel<<<1, 1024, 0, stream>>>(counts.data_ptr<double>(), B, a.agg, w.data_ptr<double>());
  }
  bool_switch(a.with_grad, [&](auto with_grad) {
    constexpr bool kGrad = decltype(with_grad)::value;
    loss_rows_kernel<scalar_t, Tok, kGrad><<<B, kThreads, 0, stream>>>(
        a.m.data_ptr<bool>(), T, tok, acc.data_ptr<double>(), kGrad ? w.data_ptr<double>() : nullptr,
        kGrad ? a.grad.data_ptr<scalar_t>() : nullptr);
  });
  finish_kernel<scalar_t><<<1, 1024, 0, stream>>>(
      acc.data_ptr<double>(), B, a.agg, a.row_weight.defined() ? a.row_weight.data_ptr<double>() : nullptr,
      a.loss.data_ptr<scalar_t>(), stat_ptr<scalar_t>(a, 0), stat_ptr<scalar_t>(a, 1), stat_ptr<scalar_t>(a, 2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ------------------------------------------------------------------------------------------ the policy

struct CudaLoss {
  using Guard = c10::cuda::CUDAGuard;

  template <typename scalar_t>
  static void kl_penalty(const KlArgs& a) {
    const int64_t n = a.out.numel();
    kl_kernel<scalar_t><<<grid_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        a.a.data_ptr<scalar_t>(), a.b.data_ptr<scalar_t>(), a.grad.defined() ? a.grad.data_ptr<scalar_t>() : nullptr,
        n, a.kind, a.out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename scalar_t>
  static void loss(const LossArgs& a, const SumLoss&) {
    run_loss<scalar_t>(a, AggTok<scalar_t>{a.in[0].data_ptr<scalar_t>()});
  }

  template <typename scalar_t>
  static void loss(const LossArgs& a, const KlLoss& l) {
    run_loss<scalar_t>(a, KlTok<scalar_t>{a.in[0].data_ptr<scalar_t>(), a.in[1].data_ptr<scalar_t>(), l.kind});
  }

  template <typename scalar_t>
  static void loss(const LossArgs& a, const PgLoss& l) {
    const int64_t B = a.m.size(0), T = a.m.size(1);
    const bool gspo = l.p.type == Pg::Gspo;
    const at::Tensor seq_lr = at::empty({gspo ? B : 0}, a.in[0].options().dtype(at::kDouble));
    if (gspo) {
      seq_log_ratio_kernel<scalar_t><<<B, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          a.in[0].data_ptr<scalar_t>(), a.in[1].data_ptr<scalar_t>(), a.m.data_ptr<bool>(), T,
          seq_lr.data_ptr<double>());
    }
    const PgTok<scalar_t> tok{a.in[0].data_ptr<scalar_t>(), a.in[1].data_ptr<scalar_t>(),
                              a.in[2].data_ptr<scalar_t>(), gspo ? seq_lr.data_ptr<double>() : nullptr, l.p};
    run_loss<scalar_t>(a, tok);
  }

  template <typename scalar_t>
  static void loss(const LossArgs& a, const VfLoss& l) {
    const VfTok<scalar_t> tok{a.in[0].data_ptr<scalar_t>(), a.in[1].data_ptr<scalar_t>(),
                              a.in[2].data_ptr<scalar_t>(), l.clip};
    run_loss<scalar_t>(a, tok);
  }

  template <typename scalar_t>
  static void agg_loss_backward(const AggBackwardArgs& a) {
    const int64_t B = a.m.size(0), T = a.m.size(1);
    const at::Tensor g = a.grad.contiguous();
    agg_backward_kernel<scalar_t><<<grid_for(B * T), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        g.data_ptr<scalar_t>(), a.row_weight.data_ptr<double>(), a.m.data_ptr<bool>(), B * T, T,
        a.out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

using K = CudaLoss;

}  // namespace

TORCH_LIBRARY_IMPL(verl, CUDA, m) { rl::register_loss_ops<K>(m); }

}  // namespace verl
