// CUDA kernels of the RL ops (same contract as csrc/cpu/rl.cpp; per-token math and aggregation weights
// from csrc/include/verl/rl.h, shared with the CPU kernels).
//
// Losses: one block per row reduces (loss sum, count, statistics) in double; a one-block finish kernel turns
// the B row results into row weights, the loss and the statistics on the device, so forward never
// synchronises with the host; backward is one grid-stride elementwise pass reading the grad scalar and the
// row weights from device memory. GAE: one thread per row runs the reverse scan (the recurrence is serial
// in T; B rows give the parallelism). Outcome advantages: block-per-row scores, atomics into per-group
// (sum, count, squares) slots indexed by at::_unique2's inverse, then one broadcast pass.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "verl/checks.h"
#include "verl/rl.h"

namespace verl {
namespace {

using namespace verl::rl;

constexpr int kThreads = 256;

int grid_for(int64_t n) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, sms * 8)));
}

// Sums N doubles over the block; the totals are valid in every thread on return.
template <int N>
__device__ __forceinline__ void block_sum(double (&v)[N]) {
  __shared__ double sh[N][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    for (int o = 16; o > 0; o >>= 1) v[k] += __shfl_down_sync(0xffffffffu, v[k], o);
    if (lane == 0) sh[k][warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    double x = lane < nwarps ? sh[k][lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) x += __shfl_down_sync(0xffffffffu, x, o);
    v[k] = x;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    if (threadIdx.x == 0) sh[k][0] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = sh[k][0];
  __syncthreads();
}

template <typename scalar_t>
__device__ __forceinline__ at::opmath_type<scalar_t> ld(const scalar_t* p, int64_t i) {
  return static_cast<at::opmath_type<scalar_t>>(p[i]);
}

// ------------------------------------------------------------------------------------------ GAE

// row_stats (optional, whitening): per row (count, mean, centred sum of squares) of the stored advantages.
template <typename scalar_t>
__global__ void gae_kernel(const scalar_t* __restrict__ r, const scalar_t* __restrict__ v, const bool* __restrict__ m,
                           int64_t B, int64_t T, double gamma, double lam, scalar_t* __restrict__ adv,
                           scalar_t* __restrict__ ret, unsigned long long* __restrict__ bad,
                           double* __restrict__ row_stats) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (b >= B) return;
  const acc_t g = static_cast<acc_t>(gamma), gl = static_cast<acc_t>(gamma * lam);
  acc_t next_v = 0, run = 0;
  double sn = 0.0, ss = 0.0, sq = 0.0;
  unsigned long long nbad = 0;
  for (int64_t t = T - 1; t >= 0; --t) {
    const int64_t i = b * T + t;
    if (!m[i]) {
      adv[i] = scalar_t(0);
      ret[i] = scalar_t(0);
      continue;
    }
    const acc_t rt = ld(r, i);
    const acc_t vt = v ? ld(v, i) : acc_t(0);
    nbad += (isfinite(rt) && isfinite(vt)) ? 0ull : 1ull;
    run = rt + g * next_v - vt + gl * run;
    next_v = vt;
    const scalar_t out = static_cast<scalar_t>(run);
    adv[i] = out;
    ret[i] = static_cast<scalar_t>(run + vt);
    const double o = static_cast<double>(out);
    sn += 1.0;
    ss += o;
    sq += o * o;
  }
  if (nbad) atomicAdd(bad, nbad);
  if (row_stats) {
    const double mean = sn > 0.0 ? ss / sn : 0.0;
    row_stats[3 * b] = sn;
    row_stats[3 * b + 1] = mean;
    row_stats[3 * b + 2] = sn > 0.0 ? fmax(0.0, sq - ss * mean) : 0.0;
  }
}

// One block: the rows' (count, mean, M2) merged exactly (total mean first, then M2 + n (mean_b - mean)^2), so
// rows with different means do not cancel; out = (mean, 1 / sqrt(unbiased var + eps)).
__global__ void whiten_stats_kernel(const double* __restrict__ rs, int64_t B, double eps, double* __restrict__ out) {
  double a[2] = {0.0, 0.0};
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
    a[0] += rs[3 * b];
    a[1] += rs[3 * b] * rs[3 * b + 1];
  }
  block_sum<2>(a);
  const double n = a[0], mean = n > 0.0 ? a[1] / n : 0.0;
  double c[1] = {0.0};
  for (int64_t b = threadIdx.x; b < B; b += blockDim.x) {
    const double d = rs[3 * b + 1] - mean;
    c[0] += rs[3 * b + 2] + rs[3 * b] * d * d;
  }
  block_sum<1>(c);
  if (threadIdx.x == 0) {
    const double var = n > 1.0 ? c[0] / (n - 1.0) : 0.0;
    out[0] = mean;
    out[1] = 1.0 / sqrt(var + eps);
  }
}

template <typename scalar_t>
__global__ void whiten_kernel(scalar_t* __restrict__ a, const bool* __restrict__ m, int64_t n,
                              const double* __restrict__ st) {
  using acc_t = at::opmath_type<scalar_t>;
  const acc_t mean = static_cast<acc_t>(st[0]), rstd = static_cast<acc_t>(st[1]);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    a[i] = m[i] ? static_cast<scalar_t>((static_cast<acc_t>(a[i]) - mean) * rstd) : scalar_t(0);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gae_common(const at::Tensor& rewards,
                                                          const std::optional<at::Tensor>& values,
                                                          const at::Tensor& mask, double gamma, double lam,
                                                          std::optional<double> whiten_eps, const char* op) {
  check_bt(rewards, op, "rewards");
  if (values) check_like(rewards, *values, op, "rewards", "values");
  check_mask_of(rewards, mask, op, "rewards");
  TORCH_CHECK(gamma >= 0.0 && gamma <= 1.0, op, ": `gamma` must be in [0, 1], got ", gamma);
  TORCH_CHECK(lam >= 0.0 && lam <= 1.0, op, ": `lam` must be in [0, 1], got ", lam);
  c10::cuda::CUDAGuard guard(rewards.device());
  const int64_t B = rewards.size(0), T = rewards.size(1);
  const at::Tensor r = rewards.contiguous();
  const at::Tensor v = values ? values->contiguous() : at::Tensor();
  const at::Tensor m = mask_as_bool(mask);
  at::Tensor adv = at::empty({B, T}, rewards.options());
  at::Tensor ret = at::empty({B, T}, rewards.options());
  at::Tensor bad = at::zeros({}, rewards.options().dtype(at::kLong));
  at::Tensor rs = at::empty({whiten_eps ? 3 * B : 0}, rewards.options().dtype(at::kDouble));
  at::Tensor st = at::empty({whiten_eps ? 2 : 0}, rewards.options().dtype(at::kDouble));
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "verl_gae", [&] {
    const int threads = 128;
    gae_kernel<scalar_t><<<(B + threads - 1) / threads, threads, 0, stream>>>(
        r.data_ptr<scalar_t>(), values ? v.data_ptr<scalar_t>() : nullptr, m.data_ptr<bool>(), B, T, gamma, lam,
        adv.data_ptr<scalar_t>(), ret.data_ptr<scalar_t>(),
        reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>()), whiten_eps ? rs.data_ptr<double>() : nullptr);
    if (whiten_eps) {
      whiten_stats_kernel<<<1, 1024, 0, stream>>>(rs.data_ptr<double>(), B, *whiten_eps, st.data_ptr<double>());
      whiten_kernel<scalar_t><<<grid_for(B * T), kThreads, 0, stream>>>(adv.data_ptr<scalar_t>(), m.data_ptr<bool>(),
                                                                        B * T, st.data_ptr<double>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {adv, ret, bad};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards,
                                                        const std::optional<at::Tensor>& values,
                                                        const at::Tensor& mask, double gamma, double lam) {
  return gae_common(rewards, values, mask, gamma, lam, std::nullopt, "gae");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gae_whitened_cuda(const at::Tensor& rewards,
                                                                 const std::optional<at::Tensor>& values,
                                                                 const at::Tensor& mask, double gamma, double lam,
                                                                 double eps) {
  TORCH_CHECK(eps >= 0.0, "gae_whitened: `eps` must be >= 0, got ", eps);
  return gae_common(rewards, values, mask, gamma, lam, eps, "gae_whitened");
}

// ------------------------------------------------------------------------------------------ outcome advantages

// score[b] = sum of valid rewards (- baseline[b]); bad += non-finite valid rewards (and baseline).
template <typename scalar_t>
__global__ void score_kernel(const scalar_t* __restrict__ r, const bool* __restrict__ m, int64_t T,
                             const double* __restrict__ base, double* __restrict__ score,
                             unsigned long long* __restrict__ bad) {
  const int64_t b = blockIdx.x;
  double v[2] = {0.0, 0.0};
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
    const int64_t i = b * T + t;
    if (!m[i]) continue;
    const double x = static_cast<double>(ld(r, i));
    v[0] += x;
    v[1] += isfinite(x) ? 0.0 : 1.0;
  }
  block_sum<2>(v);
  if (threadIdx.x == 0) {
    double s = v[0], nb = v[1];
    if (base) {
      nb += isfinite(base[b]) ? 0.0 : 1.0;
      s -= base[b];
    }
    score[b] = s;
    if (nb > 0.0) atomicAdd(bad, static_cast<unsigned long long>(nb));
  }
}

// ws layout: [0, B) sums, [B, 2B) counts, [2B, 3B) centered squares, indexed by the dense group id.
__global__ void group_sum_kernel(const double* __restrict__ score, const int64_t* __restrict__ gid, int64_t B,
                                 double* __restrict__ ws) {
  const int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (b >= B) return;
  atomicAdd(ws + gid[b], score[b]);
  atomicAdd(ws + B + gid[b], 1.0);
}

__global__ void group_sq_kernel(const double* __restrict__ score, const int64_t* __restrict__ gid, int64_t B,
                                double* __restrict__ ws) {
  const int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int64_t g = gid[b];
  const double d = score[b] - ws[g] / ws[B + g];
  atomicAdd(ws + 2 * B + g, d * d);
}

__global__ void group_adv_kernel(const double* __restrict__ score, const int64_t* __restrict__ gid, int64_t B,
                                 const double* __restrict__ ws, Outcome est, double eps, bool norm_by_std,
                                 double* __restrict__ adv_b) {
  const int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (b >= B) return;
  const int64_t g = gid[b];
  adv_b[b] = group_advantage(est, score[b], ws[g], ws[B + g], ws[2 * B + g], eps, norm_by_std);
}

template <typename scalar_t>
__global__ void broadcast_kernel(const double* __restrict__ adv_b, const bool* __restrict__ m, int64_t n, int64_t T,
                                 scalar_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = m[i] ? static_cast<scalar_t>(adv_b[i / T]) : scalar_t(0);
}

std::tuple<at::Tensor, at::Tensor> outcome_advantage_cuda(const at::Tensor& rewards, const at::Tensor& mask,
                                                          const at::Tensor& index, c10::string_view estimator,
                                                          double eps, bool norm_by_std,
                                                          const std::optional<at::Tensor>& baseline) {
  const char* op = "outcome_advantage";
  const Outcome est = parse_outcome(estimator, op);
  const at::Tensor base = check_outcome_inputs(rewards, mask, index, est, estimator, eps, baseline, op);
  const int64_t B = rewards.size(0), T = rewards.size(1);
  c10::cuda::CUDAGuard guard(rewards.device());
  const at::Tensor r = rewards.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  // Dense group ids 0..G-1 (G <= B) stay on the device: no host round trip for the group count.
  const at::Tensor gid = std::get<1>(at::_unique2(index.to(at::kLong), /*sorted=*/true, /*return_inverse=*/true,
                                                  /*return_counts=*/false)).contiguous();
  at::Tensor score = at::empty({B}, rewards.options().dtype(at::kDouble));
  at::Tensor adv_b = at::empty({B}, rewards.options().dtype(at::kDouble));
  at::Tensor ws = at::zeros({3 * B}, rewards.options().dtype(at::kDouble));
  at::Tensor bad = at::zeros({}, rewards.options().dtype(at::kLong));
  at::Tensor adv = at::empty({B, T}, rewards.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  auto* badp = reinterpret_cast<unsigned long long*>(bad.data_ptr<int64_t>());
  const int rb = static_cast<int>((B + kThreads - 1) / kThreads);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "verl_outcome", [&] {
    score_kernel<scalar_t><<<B, kThreads, 0, stream>>>(r.data_ptr<scalar_t>(), m.data_ptr<bool>(), T,
                                                       base.defined() ? base.data_ptr<double>() : nullptr,
                                                       score.data_ptr<double>(), badp);
    group_sum_kernel<<<rb, kThreads, 0, stream>>>(score.data_ptr<double>(), gid.data_ptr<int64_t>(), B,
                                                  ws.data_ptr<double>());
    group_sq_kernel<<<rb, kThreads, 0, stream>>>(score.data_ptr<double>(), gid.data_ptr<int64_t>(), B,
                                                 ws.data_ptr<double>());
    group_adv_kernel<<<rb, kThreads, 0, stream>>>(score.data_ptr<double>(), gid.data_ptr<int64_t>(), B,
                                                  ws.data_ptr<double>(), est, eps, norm_by_std,
                                                  adv_b.data_ptr<double>());
    broadcast_kernel<scalar_t><<<grid_for(B * T), kThreads, 0, stream>>>(adv_b.data_ptr<double>(), m.data_ptr<bool>(),
                                                                         B * T, T, adv.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {adv, bad};
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

at::Tensor kl_common(const at::Tensor* grad, const at::Tensor& logprob, const at::Tensor& ref_logprob,
                     c10::string_view kind, const char* op) {
  const Kl k = parse_kl(kind, op);
  check_floating(logprob, op, "logprob");
  check_like(logprob, ref_logprob, op, "logprob", "ref_logprob");
  if (grad) {
    check_same_shape(logprob, *grad, op, "logprob", "grad");
    check_same_device(logprob, *grad, op, "logprob", "grad");
  }
  c10::cuda::CUDAGuard guard(logprob.device());
  const at::Tensor a = logprob.contiguous(), b = ref_logprob.contiguous();
  const at::Tensor g = grad ? grad->to(logprob.scalar_type()).contiguous() : at::Tensor();
  at::Tensor out = at::empty(logprob.sizes(), logprob.options());
  const int64_t n = a.numel();
  if (n == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_kl", [&] {
    kl_kernel<scalar_t><<<grid_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), grad ? g.data_ptr<scalar_t>() : nullptr, n, k,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor kl_penalty_cuda(const at::Tensor& logprob, const at::Tensor& ref_logprob, c10::string_view kind) {
  return kl_common(nullptr, logprob, ref_logprob, kind, "kl_penalty");
}

at::Tensor kl_penalty_backward_cuda(const at::Tensor& grad, const at::Tensor& logprob, const at::Tensor& ref_logprob,
                                    c10::string_view kind) {
  return kl_common(&grad, logprob, ref_logprob, kind, "kl_penalty_backward");
}

// ------------------------------------------------------------------------------------------ losses

// Per-token functors: forward returns (loss, s0, s1, s2) for a valid token, backward d loss / d x.
struct TokStats {
  double loss, s0, s1, s2;
};

template <typename scalar_t>
struct AggTok {
  const scalar_t* x;
  __device__ TokStats operator()(int64_t i, int64_t) const { return {static_cast<double>(ld(x, i)), 0, 0, 0}; }
  __device__ at::opmath_type<scalar_t> grad(int64_t, int64_t) const { return 1; }
};

template <typename scalar_t>
struct KlTok {
  const scalar_t *a, *r;
  Kl kind;
  __device__ TokStats operator()(int64_t i, int64_t) const {
    return {static_cast<double>(kl_token(ld(a, i), ld(r, i), kind).value), 0, 0, 0};
  }
  __device__ at::opmath_type<scalar_t> grad(int64_t i, int64_t) const { return kl_token(ld(a, i), ld(r, i), kind).grad; }
};

template <typename scalar_t>
struct PgTok {
  const scalar_t *lp, *olp, *adv;
  const double* seq_lr;  // GSPO only: per-row sequence log-ratio
  PgParams p;
  __device__ PgToken<at::opmath_type<scalar_t>> eval(int64_t i, int64_t b) const {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t d = ld(lp, i) - ld(olp, i);
    return pg_token<acc_t>(p.type == Pg::Gspo ? static_cast<acc_t>(seq_lr[b]) : d, ld(adv, i), p);
  }
  __device__ TokStats operator()(int64_t i, int64_t b) const {
    using acc_t = at::opmath_type<scalar_t>;
    const PgToken<acc_t> k = eval(i, b);
    const acc_t d = ld(lp, i) - ld(olp, i);
    return {static_cast<double>(k.loss), static_cast<double>(k.clipped), static_cast<double>(k.lower),
            -static_cast<double>(clampv(d, acc_t(-20), acc_t(20)))};
  }
  __device__ at::opmath_type<scalar_t> grad(int64_t i, int64_t b) const { return eval(i, b).grad; }
};

template <typename scalar_t>
struct VfTok {
  const scalar_t *v, *ov, *ret;
  double clip;
  __device__ VfToken<at::opmath_type<scalar_t>> eval(int64_t i) const {
    using acc_t = at::opmath_type<scalar_t>;
    return vf_token<acc_t>(ld(v, i), ld(ov, i), ld(ret, i), static_cast<acc_t>(clip));
  }
  __device__ TokStats operator()(int64_t i, int64_t) const {
    const auto k = eval(i);
    return {static_cast<double>(k.loss), static_cast<double>(k.clipped), 0, 0};
  }
  __device__ at::opmath_type<scalar_t> grad(int64_t i, int64_t) const { return eval(i).grad; }
};

// acc[b * 5 + k] = (loss sum, count, s0, s1, s2) of row b. With grad (the *_with_grad ops; w = row weights from
// weights_kernel), grad[i] = mask ? w_b * d loss / d x : 0 is written in the same pass.
template <typename scalar_t, typename Tok>
__global__ void loss_rows_kernel(const bool* __restrict__ m, int64_t T, Tok tok, double* __restrict__ acc,
                                 const double* __restrict__ w, scalar_t* __restrict__ grad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t b = blockIdx.x;
  const acc_t wb = grad ? static_cast<acc_t>(w[b]) : acc_t(0);
  double v[5] = {0.0, 0.0, 0.0, 0.0, 0.0};
  for (int64_t t = threadIdx.x; t < T; t += blockDim.x) {
    const int64_t i = b * T + t;
    if (!m[i]) {
      if (grad) grad[i] = scalar_t(0);
      continue;
    }
    if (grad) grad[i] = static_cast<scalar_t>(wb * tok.grad(i, b));
    const TokStats s = tok(i, b);
    v[0] += s.loss;
    v[1] += 1.0;
    v[2] += s.s0;
    v[3] += s.s1;
    v[4] += s.s2;
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

// counts[b] = valid tokens of row b (the *_with_grad ops need the row weights before the token pass).
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

// One block: local counts -> normalisers -> row weights, loss and token-mean statistics.
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
    w[b] = wb;
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

template <typename scalar_t, typename Tok>
__global__ void loss_backward_kernel(const scalar_t* __restrict__ g, const double* __restrict__ w,
                                     const bool* __restrict__ m, int64_t n, int64_t T, Tok tok,
                                     scalar_t* __restrict__ out) {
  using acc_t = at::opmath_type<scalar_t>;
  const double gv = static_cast<double>(ld(g, 0));
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = i / T;
    const acc_t s = static_cast<acc_t>(gv * w[b]);
    out[i] = (m[i] && s != acc_t(0)) ? static_cast<scalar_t>(s * tok.grad(i, b)) : scalar_t(0);
  }
}

struct LossOut {
  at::Tensor loss, s0, s1, s2, row_weight, grad;
};

// Runs the row kernel and the finish kernel; `nstats` float32 statistics are produced (0..3). with_grad: the
// row weights come first (mask counts), and the row kernel also writes d loss / d x (LossOut::grad).
template <typename scalar_t, typename Tok>
LossOut run_loss(const at::Tensor& like, const at::Tensor& m, const AggParams& p, const Tok& tok, int nstats,
                 bool with_grad = false) {
  const int64_t B = like.size(0), T = like.size(1);
  auto stream = at::cuda::getCurrentCUDAStream();
  LossOut o;
  at::Tensor acc = at::empty({B * 5}, like.options().dtype(at::kDouble));
  o.row_weight = at::empty({B}, like.options().dtype(at::kDouble));
  o.loss = at::empty({}, like.options());
  at::Tensor st[3];
  for (int k = 0; k < nstats; ++k) st[k] = at::empty({}, like.options().dtype(at::kFloat));
  at::Tensor w;
  if (with_grad) {
    at::Tensor counts = at::empty({B}, like.options().dtype(at::kDouble));
    w = at::empty({B}, like.options().dtype(at::kDouble));
    o.grad = at::empty({B, T}, like.options());
    row_count_kernel<<<B, kThreads, 0, stream>>>(m.data_ptr<bool>(), T, counts.data_ptr<double>());
    weights_kernel<<<1, 1024, 0, stream>>>(counts.data_ptr<double>(), B, p, w.data_ptr<double>());
  }
  loss_rows_kernel<scalar_t, Tok><<<B, kThreads, 0, stream>>>(m.data_ptr<bool>(), T, tok, acc.data_ptr<double>(),
                                                              with_grad ? w.data_ptr<double>() : nullptr,
                                                              with_grad ? o.grad.data_ptr<scalar_t>() : nullptr);
  finish_kernel<scalar_t><<<1, 1024, 0, stream>>>(acc.data_ptr<double>(), B, p, o.row_weight.data_ptr<double>(),
                                                  o.loss.data_ptr<scalar_t>(),
                                                  nstats > 0 ? st[0].data_ptr<float>() : nullptr,
                                                  nstats > 1 ? st[1].data_ptr<float>() : nullptr,
                                                  nstats > 2 ? st[2].data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  o.s0 = st[0];
  o.s1 = st[1];
  o.s2 = st[2];
  return o;
}

template <typename scalar_t, typename Tok>
at::Tensor run_backward(const at::Tensor& grad, const at::Tensor& like, const at::Tensor& m,
                        const at::Tensor& row_weight, const Tok& tok) {
  TORCH_CHECK(grad.numel() == 1, "RL loss backward: `grad` must be the gradient of the scalar loss, got shape ",
              grad.sizes());
  const int64_t B = like.size(0), T = like.size(1);
  const at::Tensor g = grad.to(like.scalar_type()).contiguous();
  at::Tensor out = at::empty({B, T}, like.options());
  loss_backward_kernel<scalar_t, Tok><<<grid_for(B * T), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      g.data_ptr<scalar_t>(), row_weight.data_ptr<double>(), m.data_ptr<bool>(), B * T, T, tok,
      out.data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

std::tuple<at::Tensor, at::Tensor> agg_loss_cuda(const at::Tensor& loss, const at::Tensor& mask,
                                                 c10::string_view mode, std::optional<double> global_tokens,
                                                 std::optional<double> global_seqs, int64_t dp_size,
                                                 std::optional<double> norm_len) {
  const char* op = "agg_loss";
  check_bt(loss, op, "loss");
  check_mask_of(loss, mask, op, "loss");
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, loss.size(1), op);
  c10::cuda::CUDAGuard guard(loss.device());
  const at::Tensor x = loss.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  LossOut o;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, loss.scalar_type(), "verl_agg_loss", [&] {
    o = run_loss<scalar_t>(x, m, p, AggTok<scalar_t>{x.data_ptr<scalar_t>()}, 0);
  });
  return {o.loss, o.row_weight};
}

at::Tensor agg_loss_backward_cuda(const at::Tensor& grad, const at::Tensor& mask, const at::Tensor& row_weight) {
  const char* op = "agg_loss_backward";
  check_floating(grad, op, "grad");
  TORCH_CHECK(mask.dim() == 2, op, ": `mask` must be 2-D [B, T], got ", mask.sizes());
  check_row_weight(row_weight, mask.size(0), op);
  c10::cuda::CUDAGuard guard(mask.device());
  const at::Tensor m = mask_as_bool(mask);
  const at::Tensor like = at::empty(mask.sizes(), mask.options().dtype(grad.scalar_type()));
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "verl_agg_loss_backward", [&] {
    out = run_backward<scalar_t>(grad, like, m, row_weight, AggTok<scalar_t>{nullptr});
  });
  return out;
}

LossOut kl_loss_impl(const at::Tensor& logprob, const at::Tensor& ref_logprob, const at::Tensor& mask,
                     c10::string_view kind, c10::string_view mode, std::optional<double> global_tokens,
                     std::optional<double> global_seqs, int64_t dp_size, std::optional<double> norm_len,
                     bool with_grad, const char* op) {
  const Kl k = check_kl_inputs(logprob, ref_logprob, mask, kind, op);
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, logprob.size(1), op);
  c10::cuda::CUDAGuard guard(logprob.device());
  const at::Tensor a = logprob.contiguous(), r = ref_logprob.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  LossOut o;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_kl_loss", [&] {
    o = run_loss<scalar_t>(a, m, p, KlTok<scalar_t>{a.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), k}, 0,
                           with_grad);
  });
  return o;
}

std::tuple<at::Tensor, at::Tensor> kl_loss_cuda(const at::Tensor& logprob, const at::Tensor& ref_logprob,
                                                const at::Tensor& mask, c10::string_view kind, c10::string_view mode,
                                                std::optional<double> global_tokens, std::optional<double> global_seqs,
                                                int64_t dp_size, std::optional<double> norm_len) {
  const LossOut o = kl_loss_impl(logprob, ref_logprob, mask, kind, mode, global_tokens, global_seqs, dp_size,
                                 norm_len, false, "kl_loss");
  return {o.loss, o.row_weight};
}

std::tuple<at::Tensor, at::Tensor> kl_loss_with_grad_cuda(const at::Tensor& logprob, const at::Tensor& ref_logprob,
                                                          const at::Tensor& mask, c10::string_view kind,
                                                          c10::string_view mode, std::optional<double> global_tokens,
                                                          std::optional<double> global_seqs, int64_t dp_size,
                                                          std::optional<double> norm_len) {
  const LossOut o = kl_loss_impl(logprob, ref_logprob, mask, kind, mode, global_tokens, global_seqs, dp_size,
                                 norm_len, true, "kl_loss_with_grad");
  return {o.loss, o.grad};
}

at::Tensor kl_loss_backward_cuda(const at::Tensor& grad, const at::Tensor& logprob, const at::Tensor& ref_logprob,
                                 const at::Tensor& mask, const at::Tensor& row_weight, c10::string_view kind) {
  const char* op = "kl_loss_backward";
  const Kl k = check_kl_inputs(logprob, ref_logprob, mask, kind, op);
  check_row_weight(row_weight, logprob.size(0), op);
  c10::cuda::CUDAGuard guard(logprob.device());
  const at::Tensor a = logprob.contiguous(), r = ref_logprob.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_kl_loss_backward", [&] {
    out = run_backward<scalar_t>(grad, a, m, row_weight,
                                 KlTok<scalar_t>{a.data_ptr<scalar_t>(), r.data_ptr<scalar_t>(), k});
  });
  return out;
}

LossOut policy_loss_impl(const at::Tensor& logprob, const at::Tensor& old_logprob, const at::Tensor& advantages,
                         const at::Tensor& mask, c10::string_view loss_type, double clip_low, double clip_high,
                         double clip_c, c10::string_view mode, std::optional<double> global_tokens,
                         std::optional<double> global_seqs, int64_t dp_size, std::optional<double> norm_len,
                         bool with_grad, const char* op) {
  const PgParams pg = make_pg(loss_type, clip_low, clip_high, clip_c, op);
  check_pg_inputs(logprob, old_logprob, advantages, mask, op);
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, logprob.size(1), op);
  c10::cuda::CUDAGuard guard(logprob.device());
  const int64_t B = logprob.size(0), T = logprob.size(1);
  const at::Tensor lp = logprob.contiguous(), olp = old_logprob.contiguous(), ad = advantages.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  at::Tensor seq_lr = at::empty({pg.type == Pg::Gspo ? B : 0}, logprob.options().dtype(at::kDouble));
  LossOut o;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_policy_loss", [&] {
    if (pg.type == Pg::Gspo)
      seq_log_ratio_kernel<scalar_t><<<B, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          lp.data_ptr<scalar_t>(), olp.data_ptr<scalar_t>(), m.data_ptr<bool>(), T, seq_lr.data_ptr<double>());
    const PgTok<scalar_t> tok{lp.data_ptr<scalar_t>(), olp.data_ptr<scalar_t>(), ad.data_ptr<scalar_t>(),
                              pg.type == Pg::Gspo ? seq_lr.data_ptr<double>() : nullptr, pg};
    o = run_loss<scalar_t>(lp, m, p, tok, 3, with_grad);
  });
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_cuda(
    const at::Tensor& logprob, const at::Tensor& old_logprob, const at::Tensor& advantages, const at::Tensor& mask,
    c10::string_view loss_type, double clip_low, double clip_high, double clip_c, c10::string_view mode,
    std::optional<double> global_tokens, std::optional<double> global_seqs, int64_t dp_size,
    std::optional<double> norm_len) {
  const LossOut o = policy_loss_impl(logprob, old_logprob, advantages, mask, loss_type, clip_low, clip_high, clip_c,
                                     mode, global_tokens, global_seqs, dp_size, norm_len, false, "policy_loss");
  return {o.loss, o.s0, o.s1, o.s2, o.row_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss_with_grad_cuda(
    const at::Tensor& logprob, const at::Tensor& old_logprob, const at::Tensor& advantages, const at::Tensor& mask,
    c10::string_view loss_type, double clip_low, double clip_high, double clip_c, c10::string_view mode,
    std::optional<double> global_tokens, std::optional<double> global_seqs, int64_t dp_size,
    std::optional<double> norm_len) {
  const LossOut o = policy_loss_impl(logprob, old_logprob, advantages, mask, loss_type, clip_low, clip_high, clip_c,
                                     mode, global_tokens, global_seqs, dp_size, norm_len, true,
                                     "policy_loss_with_grad");
  return {o.loss, o.s0, o.s1, o.s2, o.grad};
}

at::Tensor policy_loss_backward_cuda(const at::Tensor& grad, const at::Tensor& logprob, const at::Tensor& old_logprob,
                                     const at::Tensor& advantages, const at::Tensor& mask,
                                     const at::Tensor& row_weight, c10::string_view loss_type, double clip_low,
                                     double clip_high, double clip_c) {
  const char* op = "policy_loss_backward";
  const PgParams pg = make_pg(loss_type, clip_low, clip_high, clip_c, op);
  check_pg_inputs(logprob, old_logprob, advantages, mask, op);
  check_row_weight(row_weight, logprob.size(0), op);
  c10::cuda::CUDAGuard guard(logprob.device());
  const int64_t B = logprob.size(0), T = logprob.size(1);
  const at::Tensor lp = logprob.contiguous(), olp = old_logprob.contiguous(), ad = advantages.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  at::Tensor seq_lr = at::empty({pg.type == Pg::Gspo ? B : 0}, logprob.options().dtype(at::kDouble));
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logprob.scalar_type(), "verl_policy_loss_backward", [&] {
    if (pg.type == Pg::Gspo)
      seq_log_ratio_kernel<scalar_t><<<B, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          lp.data_ptr<scalar_t>(), olp.data_ptr<scalar_t>(), m.data_ptr<bool>(), T, seq_lr.data_ptr<double>());
    const PgTok<scalar_t> tok{lp.data_ptr<scalar_t>(), olp.data_ptr<scalar_t>(), ad.data_ptr<scalar_t>(),
                              pg.type == Pg::Gspo ? seq_lr.data_ptr<double>() : nullptr, pg};
    out = run_backward<scalar_t>(grad, lp, m, row_weight, tok);
  });
  return out;
}

LossOut value_loss_impl(const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns,
                        const at::Tensor& mask, double clip, c10::string_view mode,
                        std::optional<double> global_tokens, std::optional<double> global_seqs, int64_t dp_size,
                        std::optional<double> norm_len, bool with_grad, const char* op) {
  check_vf_inputs(values, old_values, returns, mask, clip, op);
  const AggParams p = make_agg(mode, global_tokens, global_seqs, dp_size, norm_len, values.size(1), op);
  c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor v = values.contiguous(), ov = old_values.contiguous(), rt = returns.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  LossOut o;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "verl_value_loss", [&] {
    const VfTok<scalar_t> tok{v.data_ptr<scalar_t>(), ov.data_ptr<scalar_t>(), rt.data_ptr<scalar_t>(), clip};
    o = run_loss<scalar_t>(v, m, p, tok, 1, with_grad);
  });
  return o;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_cuda(
    const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns, const at::Tensor& mask,
    double clip, c10::string_view mode, std::optional<double> global_tokens, std::optional<double> global_seqs,
    int64_t dp_size, std::optional<double> norm_len) {
  const LossOut o = value_loss_impl(values, old_values, returns, mask, clip, mode, global_tokens, global_seqs,
                                    dp_size, norm_len, false, "value_loss");
  return {o.loss, o.s0, o.row_weight};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> value_loss_with_grad_cuda(
    const at::Tensor& values, const at::Tensor& old_values, const at::Tensor& returns, const at::Tensor& mask,
    double clip, c10::string_view mode, std::optional<double> global_tokens, std::optional<double> global_seqs,
    int64_t dp_size, std::optional<double> norm_len) {
  const LossOut o = value_loss_impl(values, old_values, returns, mask, clip, mode, global_tokens, global_seqs,
                                    dp_size, norm_len, true, "value_loss_with_grad");
  return {o.loss, o.s0, o.grad};
}

at::Tensor value_loss_backward_cuda(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& old_values,
                                    const at::Tensor& returns, const at::Tensor& mask, const at::Tensor& row_weight,
                                    double clip) {
  const char* op = "value_loss_backward";
  check_vf_inputs(values, old_values, returns, mask, clip, op);
  check_row_weight(row_weight, values.size(0), op);
  c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor v = values.contiguous(), ov = old_values.contiguous(), rt = returns.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "verl_value_loss_backward", [&] {
    const VfTok<scalar_t> tok{v.data_ptr<scalar_t>(), ov.data_ptr<scalar_t>(), rt.data_ptr<scalar_t>(), clip};
    out = run_backward<scalar_t>(grad, v, m, row_weight, tok);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CUDA, m) {
  m.impl("gae", &gae_cuda);
  m.impl("gae_whitened", &gae_whitened_cuda);
  m.impl("kl_loss_with_grad", &kl_loss_with_grad_cuda);
  m.impl("policy_loss_with_grad", &policy_loss_with_grad_cuda);
  m.impl("value_loss_with_grad", &value_loss_with_grad_cuda);
  m.impl("outcome_advantage", &outcome_advantage_cuda);
  m.impl("kl_penalty", &kl_penalty_cuda);
  m.impl("kl_penalty_backward", &kl_penalty_backward_cuda);
  m.impl("agg_loss", &agg_loss_cuda);
  m.impl("agg_loss_backward", &agg_loss_backward_cuda);
  m.impl("kl_loss", &kl_loss_cuda);
  m.impl("kl_loss_backward", &kl_loss_backward_cuda);
  m.impl("policy_loss", &policy_loss_cuda);
  m.impl("policy_loss_backward", &policy_loss_backward_cuda);
  m.impl("value_loss", &value_loss_cuda);
  m.impl("value_loss_backward", &value_loss_backward_cuda);
}

}  // namespace verl
