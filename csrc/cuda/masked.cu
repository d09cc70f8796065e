// CUDA kernels of the masked reductions (same contract as csrc/cpu/masked.cpp).
//
// Full reductions are grid-stride loops whose blocks atomically add double partial sums into a small
// device workspace; the statistics (mean, variance) are then read by the next kernel straight from
// that workspace, so no host synchronisation happens anywhere in forward or backward.
// Row reductions (one dim) use one block per row.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "verl/checks.h"

namespace verl {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  return v;
}

// Sums (a, b) over the block; the result is valid in thread 0.
__device__ __forceinline__ void block_sum2(double& a, double& b) {
  __shared__ double sa[32], sb[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  a = warp_sum(a);
  b = warp_sum(b);
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  a = threadIdx.x < nwarps ? sa[lane] : 0.0;
  b = threadIdx.x < nwarps ? sb[lane] : 0.0;
  if (warp == 0) {
    a = warp_sum(a);
    b = warp_sum(b);
  }
  __syncthreads();  // the shared slots may be reused by a following call
}

int grid_for(int64_t n) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, sms * 8)));
}

// ws[0] += sum m*x, ws[1] += sum m.
template <typename scalar_t>
__global__ void sum_count_kernel(const scalar_t* __restrict__ x, const bool* __restrict__ m, int64_t n,
                                 double* __restrict__ ws) {
  double s = 0.0, c = 0.0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    if (m[i]) {
      s += static_cast<double>(static_cast<float>(x[i]));
      c += 1.0;
    }
  }
  block_sum2(s, c);
  if (threadIdx.x == 0) {
    atomicAdd(ws, s);
    atomicAdd(ws + 1, c);
  }
}

__device__ __forceinline__ double ws_mean(const double* ws) { return ws[1] > 0.0 ? ws[0] / ws[1] : 0.0; }

// ws[2] += sum m*(x - mean)^2, mean from ws[0..1].
template <typename scalar_t>
__global__ void centered_sq_kernel(const scalar_t* __restrict__ x, const bool* __restrict__ m, int64_t n,
                                   double* __restrict__ ws) {
  const double mean = ws_mean(ws);
  double s = 0.0, unused = 0.0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    if (m[i]) {
      const double d = static_cast<double>(static_cast<float>(x[i])) - mean;
      s += d * d;
    }
  }
  block_sum2(s, unused);
  if (threadIdx.x == 0) atomicAdd(ws + 2, s);
}

__device__ __forceinline__ double ws_var(const double* ws, bool unbiased) {
  const double denom = unbiased ? ws[1] - 1.0 : ws[1];
  return denom > 0.0 ? ws[2] / denom : 0.0;
}

template <typename scalar_t>
__global__ void finish_reduce_kernel(const double* ws, bool mean, scalar_t* out) {
  out[0] = static_cast<scalar_t>(mean ? ws_mean(ws) : ws[0]);
}

template <typename scalar_t>
__global__ void finish_var_kernel(const double* ws, bool unbiased, scalar_t* out) {
  out[0] = static_cast<scalar_t>(ws_var(ws, unbiased));
}

template <typename scalar_t>
__global__ void row_reduce_kernel(const scalar_t* __restrict__ x, const bool* __restrict__ m, int64_t cols, bool mean,
                                  scalar_t* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const scalar_t* xr = x + r * cols;
  const bool* mr = m + r * cols;
  double s = 0.0, c = 0.0;
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    if (mr[j]) {
      s += static_cast<double>(static_cast<float>(xr[j]));
      c += 1.0;
    }
  }
  block_sum2(s, c);
  if (threadIdx.x == 0) out[r] = static_cast<scalar_t>(mean ? (c > 0.0 ? s / c : 0.0) : s);
}

// Full-reduction backward: out_i = m_i * g (/ count). ws[1] holds the count when `mean`.
template <typename scalar_t>
__global__ void reduce_backward_global_kernel(const scalar_t* __restrict__ g, const bool* __restrict__ m, int64_t n,
                                              const double* __restrict__ ws, bool mean, scalar_t* __restrict__ out) {
  double scale = static_cast<double>(static_cast<float>(g[0]));
  if (mean) scale = ws[1] > 0.0 ? scale / ws[1] : 0.0;
  const scalar_t s = static_cast<scalar_t>(scale);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = m[i] ? s : scalar_t(0);
}

template <typename scalar_t>
__global__ void reduce_backward_row_kernel(const scalar_t* __restrict__ g, const bool* __restrict__ m, int64_t cols,
                                           bool mean, scalar_t* __restrict__ out) {
  __shared__ double scale_sh;
  const int64_t r = blockIdx.x;
  const bool* mr = m + r * cols;
  if (mean) {
    double c = 0.0, unused = 0.0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) c += mr[j] ? 1.0 : 0.0;
    block_sum2(c, unused);
    if (threadIdx.x == 0) scale_sh = c > 0.0 ? static_cast<double>(static_cast<float>(g[r])) / c : 0.0;
  } else if (threadIdx.x == 0) {
    scale_sh = static_cast<double>(static_cast<float>(g[r]));
  }
  __syncthreads();
  const scalar_t s = static_cast<scalar_t>(scale_sh);
  for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) out[r * cols + j] = mr[j] ? s : scalar_t(0);
}

template <typename scalar_t>
__global__ void var_backward_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ x,
                                    const bool* __restrict__ m, int64_t n, const double* __restrict__ ws, bool unbiased,
                                    scalar_t* __restrict__ out) {
  const double denom = unbiased ? ws[1] - 1.0 : ws[1];
  const double scale = denom > 0.0 ? 2.0 * static_cast<double>(static_cast<float>(g[0])) / denom : 0.0;
  const double mean = ws_mean(ws);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = m[i] ? static_cast<scalar_t>(scale * (static_cast<double>(static_cast<float>(x[i])) - mean))
                  : scalar_t(0);
}

template <typename scalar_t>
__global__ void whiten_kernel(const scalar_t* __restrict__ x, const bool* __restrict__ m, int64_t n,
                              const double* __restrict__ ws, bool shift_mean, double eps, scalar_t* __restrict__ out) {
  const double mean = ws_mean(ws);
  const double r = rsqrt(ws_var(ws, true) + eps);
  const double add = shift_mean ? 0.0 : mean;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    out[i] = m[i] ? static_cast<scalar_t>((static_cast<double>(static_cast<float>(x[i])) - mean) * r + add)
                  : scalar_t(0);
}

// ws[3] += sum m*g, ws[4] += sum m*g*(x - mean).
template <typename scalar_t>
__global__ void whiten_grad_sums_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ x,
                                        const bool* __restrict__ m, int64_t n, double* __restrict__ ws) {
  const double mean = ws_mean(ws);
  double sg = 0.0, sgx = 0.0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    if (m[i]) {
      const double gi = static_cast<double>(static_cast<float>(g[i]));
      sg += gi;
      sgx += gi * (static_cast<double>(static_cast<float>(x[i])) - mean);
    }
  }
  block_sum2(sg, sgx);
  if (threadIdx.x == 0) {
    atomicAdd(ws + 3, sg);
    atomicAdd(ws + 4, sgx);
  }
}

template <typename scalar_t>
__global__ void whiten_backward_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ x,
                                       const bool* __restrict__ m, int64_t n, const double* __restrict__ ws,
                                       bool shift_mean, double eps, scalar_t* __restrict__ out) {
  const double mean = ws_mean(ws);
  const double denom = ws[1] - 1.0;
  const double r = rsqrt(ws_var(ws, true) + eps);
  const double mean_g = ws[1] > 0.0 ? ws[3] / ws[1] : 0.0;
  const double k = denom > 0.0 ? r * r * r * ws[4] / denom : 0.0;
  const double add = shift_mean ? 0.0 : mean_g;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const double xi = static_cast<double>(static_cast<float>(x[i])) - mean;
    out[i] = m[i] ? static_cast<scalar_t>(r * (static_cast<double>(static_cast<float>(g[i])) - mean_g) - k * xi + add)
                  : scalar_t(0);
  }
}

std::vector<int64_t> reduced_shape(c10::IntArrayRef sizes, int64_t d) {
  std::vector<int64_t> shape = sizes.vec();
  if (d >= 0) shape.erase(shape.begin() + d);
  else shape.clear();
  return shape;
}

at::Tensor workspace(const at::Tensor& like) { return at::zeros({5}, like.options().dtype(at::kDouble)); }

at::Tensor masked_reduce_cuda(const at::Tensor& values, const at::Tensor& mask, std::optional<int64_t> dim, bool mean,
                              const char* op) {
  check_floating(values, op, "values");
  check_mask(values, mask, op);
  c10::cuda::CUDAGuard guard(values.device());
  const int64_t d = normalize_dim(dim, values.dim(), op);
  const at::Tensor x = d < 0 ? values.contiguous() : values.movedim(d, -1).contiguous();
  const at::Tensor m = d < 0 ? mask_as_bool(mask) : mask_as_bool(mask.movedim(d, -1));
  at::Tensor out = at::empty(reduced_shape(values.sizes(), d), values.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "verl_masked", [&] {
    if (d < 0) {
      at::Tensor ws = workspace(values);
      const int64_t n = x.numel();
      if (n > 0)
        sum_count_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), m.data_ptr<bool>(),
                                                                          n, ws.data_ptr<double>());
      finish_reduce_kernel<scalar_t><<<1, 1, 0, stream>>>(ws.data_ptr<double>(), mean, out.data_ptr<scalar_t>());
    } else if (out.numel() > 0) {
      row_reduce_kernel<scalar_t><<<out.numel(), kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), m.data_ptr<bool>(), values.size(d), mean, out.data_ptr<scalar_t>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor masked_sum_cuda(const at::Tensor& values, const at::Tensor& mask, std::optional<int64_t> dim) {
  return masked_reduce_cuda(values, mask, dim, false, "masked_sum");
}

at::Tensor masked_mean_cuda(const at::Tensor& values, const at::Tensor& mask, std::optional<int64_t> dim) {
  return masked_reduce_cuda(values, mask, dim, true, "masked_mean");
}

at::Tensor masked_reduce_backward_cuda(const at::Tensor& grad, const at::Tensor& mask, std::optional<int64_t> dim,
                                       bool mean) {
  const char* op = "masked_reduce_backward";
  check_floating(grad, op, "grad");
  check_same_device(grad, mask, op, "grad", "mask");
  c10::cuda::CUDAGuard guard(grad.device());
  const int64_t d = normalize_dim(dim, mask.dim(), op);
  const at::Tensor m = d < 0 ? mask_as_bool(mask) : mask_as_bool(mask.movedim(d, -1));
  const at::Tensor g = grad.contiguous();
  const int64_t rows = d < 0 ? 1 : c10::multiply_integers(reduced_shape(mask.sizes(), d));
  TORCH_CHECK(g.numel() == rows, op, ": `grad` has ", g.numel(), " elements, but reducing `mask` ", mask.sizes(),
              " gives ", rows);
  at::Tensor out = at::empty(m.sizes(), grad.options());
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, grad.scalar_type(), "verl_masked", [&] {
    const int64_t n = m.numel();
    if (n == 0) return;
    if (d < 0) {
      at::Tensor ws = workspace(grad);
      if (mean) {
        // Counting reuses the sum kernel on the mask itself (x = 1 where valid).
        const at::Tensor ones = m.to(grad.scalar_type());
        sum_count_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(ones.data_ptr<scalar_t>(),
                                                                          m.data_ptr<bool>(), n, ws.data_ptr<double>());
      }
      reduce_backward_global_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(
          g.data_ptr<scalar_t>(), m.data_ptr<bool>(), n, ws.data_ptr<double>(), mean, out.data_ptr<scalar_t>());
    } else {
      reduce_backward_row_kernel<scalar_t><<<rows, kThreads, 0, stream>>>(g.data_ptr<scalar_t>(), m.data_ptr<bool>(),
                                                                          mask.size(d), mean, out.data_ptr<scalar_t>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return d < 0 ? out : out.movedim(-1, d).contiguous();
}

// Fills ws[0..2] with (sum, count, centered sum of squares) of the masked values.
template <typename scalar_t>
void launch_stats(const at::Tensor& x, const at::Tensor& m, const at::Tensor& ws, cudaStream_t stream) {
  const int64_t n = x.numel();
  if (n == 0) return;
  sum_count_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), m.data_ptr<bool>(), n,
                                                                    ws.data_ptr<double>());
  centered_sq_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), m.data_ptr<bool>(), n,
                                                                      ws.data_ptr<double>());
}

at::Tensor masked_var_cuda(const at::Tensor& values, const at::Tensor& mask, bool unbiased) {
  check_floating(values, "masked_var", "values");
  check_mask(values, mask, "masked_var");
  c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor x = values.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  at::Tensor out = at::empty({}, values.options());
  at::Tensor ws = workspace(values);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "masked_var", [&] {
    launch_stats<scalar_t>(x, m, ws, stream);
    finish_var_kernel<scalar_t><<<1, 1, 0, stream>>>(ws.data_ptr<double>(), unbiased, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor masked_var_backward_cuda(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& mask,
                                    bool unbiased) {
  const char* op = "masked_var_backward";
  check_floating(values, op, "values");
  check_mask(values, mask, op);
  TORCH_CHECK(grad.numel() == 1, op, ": `grad` must have one element, got ", grad.sizes());
  c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor x = values.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  const at::Tensor g = grad.to(values.scalar_type()).contiguous();
  at::Tensor out = at::empty(values.sizes(), values.options());
  at::Tensor ws = workspace(values);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "verl_masked", [&] {
    const int64_t n = x.numel();
    if (n == 0) return;
    sum_count_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), m.data_ptr<bool>(), n,
                                                                      ws.data_ptr<double>());
    var_backward_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(
        g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), m.data_ptr<bool>(), n, ws.data_ptr<double>(), unbiased,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor masked_whiten_cuda(const at::Tensor& values, const at::Tensor& mask, bool shift_mean, double eps) {
  TORCH_CHECK(eps >= 0.0, "masked_whiten: `eps` must be >= 0, got ", eps);
  check_floating(values, "masked_whiten", "values");
  check_mask(values, mask, "masked_whiten");
  c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor x = values.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  at::Tensor out = at::empty(values.sizes(), values.options());
  at::Tensor ws = workspace(values);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "masked_whiten", [&] {
    const int64_t n = x.numel();
    if (n == 0) return;
    launch_stats<scalar_t>(x, m, ws, stream);
    whiten_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(x.data_ptr<scalar_t>(), m.data_ptr<bool>(), n,
                                                                   ws.data_ptr<double>(), shift_mean, eps,
                                                                   out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor masked_whiten_backward_cuda(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& mask,
                                       bool shift_mean, double eps) {
  const char* op = "masked_whiten_backward";
  check_floating(values, op, "values");
  check_mask(values, mask, op);
  check_same_shape(values, grad, op, "values", "grad");
  c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor x = values.contiguous();
  const at::Tensor m = mask_as_bool(mask);
  const at::Tensor g = grad.to(values.scalar_type()).contiguous();
  at::Tensor out = at::empty(values.sizes(), values.options());
  at::Tensor ws = workspace(values);
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "verl_masked", [&] {
    const int64_t n = x.numel();
    if (n == 0) return;
    launch_stats<scalar_t>(x, m, ws, stream);
    whiten_grad_sums_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(
        g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), m.data_ptr<bool>(), n, ws.data_ptr<double>());
    whiten_backward_kernel<scalar_t><<<grid_for(n), kThreads, 0, stream>>>(
        g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), m.data_ptr<bool>(), n, ws.data_ptr<double>(), shift_mean, eps,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CUDA, m) {
  m.impl("masked_sum", &masked_sum_cuda);
  m.impl("masked_mean", &masked_mean_cuda);
  m.impl("masked_var", &masked_var_cuda);
  m.impl("masked_whiten", &masked_whiten_cuda);
  m.impl("masked_reduce_backward", &masked_reduce_backward_cuda);
  m.impl("masked_var_backward", &masked_var_backward_cuda);
  m.impl("masked_whiten_backward", &masked_whiten_backward_cuda);
}

}  // namespace verl
