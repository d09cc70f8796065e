// CUDA kernels of the advantage ops (the policy of verl/rl_advantage.h's drivers; same contract as
// csrc/cpu/rl_advantage.cpp).
//
// GAE: one thread per row runs the reverse scan (the recurrence is serial in T; B rows give the parallelism);
// whitening merges the rows' statistics in one block and rewrites the advantages in one elementwise pass.
// Outcome advantages: block-per-row scores, atomics into per-group (sum, count, squares) slots indexed by
// at::_unique2's inverse, then one broadcast pass. Nothing synchronises with the host.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "verl/rl_advantage.h"
#include "verl/rl_cuda.cuh"

namespace verl {
namespace {

using namespace verl::rl;

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

struct CudaAdvantage {
  using Guard = c10::cuda::CUDAGuard;

  template <typename scalar_t>
  static void gae(const GaeArgs& a) {
    const int64_t B = a.r.size(0), T = a.r.size(1);
    const bool whiten = a.whiten_eps.has_value();
    const at::Tensor rs = at::empty({whiten ? 3 * B : 0}, a.r.options().dtype(at::kDouble));
    const at::Tensor st = at::empty({whiten ? 2 : 0}, a.r.options().dtype(at::kDouble));
    auto stream = at::cuda::getCurrentCUDAStream();
    const int threads = 128;
    gae_kernel<scalar_t><<<(B + threads - 1) / threads, threads, 0, stream>>>(
        a.r.data_ptr<scalar_t>(), a.v.defined() ? a.v.data_ptr<scalar_t>() : nullptr, a.m.data_ptr<bool>(), B, T,
        a.gamma, a.lam, a.adv.data_ptr<scalar_t>(), a.ret.data_ptr<scalar_t>(),
        reinterpret_cast<unsigned long long*>(a.bad.data_ptr<int64_t>()), whiten ? rs.data_ptr<double>() : nullptr);
    if (whiten) {
      whiten_stats_kernel<<<1, 1024, 0, stream>>>(rs.data_ptr<double>(), B, *a.whiten_eps, st.data_ptr<double>());
      whiten_kernel<scalar_t><<<grid_for(B * T), kThreads, 0, stream>>>(a.adv.data_ptr<scalar_t>(),
                                                                        a.m.data_ptr<bool>(), B * T,
                                                                        st.data_ptr<double>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  template <typename scalar_t>
  static void outcome(const OutcomeArgs& a) {
    const int64_t B = a.r.size(0), T = a.r.size(1);
    // Dense group ids 0..G-1 (G <= B) stay on the device: no host round trip for the group count.
    const at::Tensor gid = std::get<1>(at::_unique2(a.index.to(at::kLong), /*sorted=*/true, /*return_inverse=*/true,
                                                    /*return_counts=*/false)).contiguous();
    const at::Tensor score = at::empty({B}, a.r.options().dtype(at::kDouble));
    const at::Tensor adv_b = at::empty({B}, a.r.options().dtype(at::kDouble));
    const at::Tensor ws = at::zeros({3 * B}, a.r.options().dtype(at::kDouble));
    auto stream = at::cuda::getCurrentCUDAStream();
    const int rb = static_cast<int>((B + kThreads - 1) / kThreads);
    score_kernel<scalar_t><<<B, kThreads, 0, stream>>>(
        a.r.data_ptr<scalar_t>(), a.m.data_ptr<bool>(), T, a.base.defined() ? a.base.data_ptr<double>() : nullptr,
        score.data_ptr<double>(), reinterpret_cast<unsigned long long*>(a.bad.data_ptr<int64_t>()));
    group_sum_kernel<<<rb, kThreads, 0, stream>>>(score.data_ptr<double>(), gid.data_ptr<int64_t>(), B,
                                                  ws.data_ptr<double>());
    group_sq_kernel<<<rb, kThreads, 0, stream>>>(score.data_ptr<double>(), gid.data_ptr<int64_t>(), B,
                                                 ws.data_ptr<double>());
    group_adv_kernel<<<rb, kThreads, 0, stream>>>(score.data_ptr<double>(), gid.data_ptr<int64_t>(), B,
                                                  ws.data_ptr<double>(), a.est, a.eps, a.norm_by_std,
                                                  adv_b.data_ptr<double>());
    broadcast_kernel<scalar_t><<<grid_for(B * T), kThreads, 0, stream>>>(adv_b.data_ptr<double>(),
                                                                         a.m.data_ptr<bool>(), B * T, T,
                                                                         a.adv.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

using K = CudaAdvantage;

}  // namespace

TORCH_LIBRARY_IMPL(verl, CUDA, m) { rl::register_advantage_ops<K>(m); }

}  // namespace verl
