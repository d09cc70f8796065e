// CUDA kernels of the log-prob / entropy ops (same contract as csrc/cpu/logprob.cpp; the chunking, cuBLAS
// GEMMs through at::mm and argument checks are shared in verl/logprob.h).
//
// stats: one block per row. Each thread folds its strided elements into an online (max, S, T) triple,
// the block merges the triples with warp shuffles, and thread 0 folds the result into the row's double
// state, so a row of any length is read exactly once. grad: one block per row, elementwise.
// Arithmetic is in at::opmath_type (float for 16-bit and float32 inputs, double for float64).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "verl/logprob.h"
#include "verl/rl_head.h"

namespace verl {
namespace {

constexpr int kThreads = 256;

template <typename acc_t>
__device__ __forceinline__ acc_t min_exp_arg();
template <>
__device__ __forceinline__ float min_exp_arg<float>() { return -87.0f; }
template <>
__device__ __forceinline__ double min_exp_arg<double>() { return -708.0; }

__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }

// Online state (m, S, T): S = sum exp(z - m), T = sum exp(z - m) (z - m). See verl/logprob.h.
template <typename acc_t>
struct Online {
  acc_t m, s, t;
};

template <typename acc_t>
__device__ __forceinline__ void merge(Online<acc_t>& a, const Online<acc_t>& b) {
  if (isnan(a.s) || isnan(b.s)) {  // a poisoned state stays NaN (see "Non-finite logits" in logprob.h)
    a.m = a.s = a.t = acc_t(NAN);
    return;
  }
  if (!(b.s > acc_t(0))) return;
  if (!(a.s > acc_t(0))) {
    a = b;
    return;
  }
  if (b.m > a.m) {
    const acc_t f = exp_acc(a.m - b.m);
    a.t = f * (a.t + a.s * (a.m - b.m)) + b.t;
    a.s = f * a.s + b.s;
    a.m = b.m;
  } else {
    const acc_t f = exp_acc(b.m - a.m);
    a.t += f * (b.t + b.s * (b.m - a.m));
    a.s += f * b.s;
  }
}

template <typename acc_t>
__device__ __forceinline__ void add_one(Online<acc_t>& a, acc_t z) {
  if (z == -std::numeric_limits<acc_t>::infinity()) return;  // -inf (masked vocab) adds exactly 0
  if (!(z < std::numeric_limits<acc_t>::infinity())) {      // NaN or +inf: the row's result is NaN
    a.m = a.s = a.t = acc_t(NAN);
    return;
  }
  if (z > a.m) {
    if (a.s > acc_t(0)) {
      const acc_t f = exp_acc(a.m - z);
      a.t = f * (a.t + a.s * (a.m - z));
      a.s *= f;
    }
    a.m = z;
  }
  const acc_t d = z - a.m;
  const acc_t e = exp_acc(d);
  a.s += e;
  a.t += e * d;
}

template <typename acc_t>
__device__ __forceinline__ Online<acc_t> shfl_down(const Online<acc_t>& a, int offset) {
  return {__shfl_down_sync(0xffffffffu, a.m, offset), __shfl_down_sync(0xffffffffu, a.s, offset),
          __shfl_down_sync(0xffffffffu, a.t, offset)};
}

// Merges every thread's state; the result is valid in thread 0.
template <typename acc_t>
__device__ Online<acc_t> block_merge(Online<acc_t> a) {
  __shared__ Online<acc_t> warps[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int o = 16; o > 0; o >>= 1) {
    const Online<acc_t> b = shfl_down(a, o);
    merge(a, b);
  }
  if (lane == 0) warps[warp] = a;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  if (warp == 0) {
    a = lane < nwarps ? warps[lane] : Online<acc_t>{-std::numeric_limits<acc_t>::infinity(), acc_t(0), acc_t(0)};
    for (int o = 16; o > 0; o >>= 1) {
      const Online<acc_t> b = shfl_down(a, o);
      merge(a, b);
    }
  }
  return a;
}

template <typename scalar_t>
__global__ void stats_kernel(const scalar_t* __restrict__ x, int64_t ld, int64_t cols,
                             const int64_t* __restrict__ labels, int64_t col0, int64_t vocab_start,
                             int64_t ignore_index, double inv_t, double* __restrict__ m, double* __restrict__ S,
                             double* __restrict__ T, double* __restrict__ target) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t r = blockIdx.x;
  const int64_t y = labels[r];
  if (y == ignore_index) return;  // uniform across the block
  const scalar_t* xr = x + r * ld;
  const acc_t scale = static_cast<acc_t>(inv_t);
  Online<acc_t> st{-std::numeric_limits<acc_t>::infinity(), acc_t(0), acc_t(0)};
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) add_one(st, static_cast<acc_t>(xr[j]) * scale);
  st = block_merge(st);
  if (threadIdx.x == 0) {
    Online<double> row{m[r], S[r], T[r]};
    merge(row, Online<double>{static_cast<double>(st.m), static_cast<double>(st.s), static_cast<double>(st.t)});
    m[r] = row.m, S[r] = row.s, T[r] = row.t;
    const int64_t local = y - vocab_start - col0;
    if (local >= 0 && local < cols) target[r] = static_cast<double>(static_cast<acc_t>(xr[local])) * inv_t;
  }
}

// out may alias x: each element is read and then written by the same thread.
template <typename scalar_t>
__global__ void grad_kernel(const scalar_t* x, int64_t ldx, scalar_t* out, int64_t ldo, int64_t cols,
                            const int64_t* __restrict__ labels, int64_t col0, int64_t vocab_start,
                            int64_t ignore_index, double inv_t, const double* __restrict__ lse,
                            const double* __restrict__ ent, const double* __restrict__ c,
                            const double* __restrict__ gh, const double* __restrict__ glp) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t r = blockIdx.x;
  const int64_t y = labels[r];
  scalar_t* orow = out + r * ldo;
  if (y == ignore_index) {
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) orow[j] = scalar_t(0);
    return;
  }
  const scalar_t* xr = x + r * ldx;
  const acc_t scale = static_cast<acc_t>(inv_t), rl = static_cast<acc_t>(lse[r]), rh = static_cast<acc_t>(ent[r]),
              rc = static_cast<acc_t>(c[r]), rg = static_cast<acc_t>(gh[r]), rt = scale * static_cast<acc_t>(glp[r]);
  const int64_t local = y - vocab_start - col0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const acc_t d = max(static_cast<acc_t>(xr[j]) * scale - rl, min_exp_arg<acc_t>());
    acc_t g = scale * exp_acc(d) * (rc - rg * (d + rh));
    if (j == local) g += rt;
    orow[j] = static_cast<scalar_t>(g);
  }
}

struct CudaKernels {
  // Fused RL loss head (verl/rl_head.h): about 2^28 logits per chunk (512 MiB in bfloat16) and at least 1024 rows,
  // so each chunk's GEMMs are large enough for cuBLAS and grad_W's per-chunk traffic stays small next to them at
  // HBM speed.
  static int64_t rl_head_chunk_rows(int64_t v) { return std::clamp<int64_t>((int64_t{1} << 28) / v, 1024, 16384); }

  static void stats_update(const at::Tensor& x, const at::Tensor& labels, int64_t col0, int64_t vocab_start,
                           int64_t ignore_index, double inv_t, at::Tensor& m, at::Tensor& S, at::Tensor& T,
                           at::Tensor& target) {
    const int64_t rows = x.size(0);
    if (rows == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "verl_logprob_stats_cuda", [&] {
      stats_kernel<scalar_t><<<rows, kThreads, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), x.stride(0), x.size(1), labels.const_data_ptr<int64_t>(), col0, vocab_start,
          ignore_index, inv_t, m.data_ptr<double>(), S.data_ptr<double>(), T.data_ptr<double>(),
          target.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  static void grad_chunk(const at::Tensor& x, at::Tensor& out, const at::Tensor& labels, int64_t col0,
                         int64_t vocab_start, int64_t ignore_index, double inv_t, const at::Tensor& lse,
                         const at::Tensor& ent, const at::Tensor& c, const at::Tensor& gh, const at::Tensor& glp) {
    const int64_t rows = x.size(0);
    if (rows == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    auto stream = at::cuda::getCurrentCUDAStream();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "verl_logprob_grad_cuda", [&] {
      grad_kernel<scalar_t><<<rows, kThreads, 0, stream>>>(
          x.const_data_ptr<scalar_t>(), x.stride(0), out.data_ptr<scalar_t>(), out.stride(0), x.size(1),
          labels.const_data_ptr<int64_t>(), col0, vocab_start, ignore_index, inv_t, lse.const_data_ptr<double>(),
          ent.const_data_ptr<double>(), c.const_data_ptr<double>(), gh.const_data_ptr<double>(),
          glp.const_data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
};

using K = CudaKernels;

}  // namespace

TORCH_LIBRARY_IMPL(verl, CUDA, m) {
  m.impl("logprob_entropy", &logprob::logprob_entropy<K>);
  m.impl("logprob_entropy_shard", &logprob::logprob_entropy_shard<K>);
  m.impl("logprob_entropy_backward", &logprob::logprob_entropy_backward<K>);
  m.impl("linear_logprob_entropy", &logprob::linear_logprob_entropy<K>);
  m.impl("linear_logprob_entropy_shard", &logprob::linear_logprob_entropy_shard<K>);
  m.impl("linear_logprob_entropy_backward", &logprob::linear_logprob_entropy_backward<K>);
  m.impl("linear_rl_loss", &rl_head::linear_rl_loss<K>);
}

}  // namespace verl
