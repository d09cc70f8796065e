// CUDA kernel of the packed float32 linear (contract in csrc/include/verl/packed_linear.h).
//
// The fast decoder packs weights only on CPU (a GPU keeps cuBLAS through F.linear); this is the op's CUDA side
// for callers of verl.ops.packed_linear with CUDA tensors: one thread per output, a running sum over k in order
// (as on CPU, whatever the number of rows); the 16 threads of a panel read one 64-byte line per k.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "verl/packed_linear.h"

namespace verl {
namespace {

constexpr int kThreads = 256;

__global__ void packed_linear_kernel(const float* __restrict__ x, const float* __restrict__ w,
                                     const float* __restrict__ bias, float* __restrict__ out, int64_t M, int64_t N,
                                     int64_t K) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (item >= M * N) return;
  const int64_t m = item / N, n = item % N;
  const float* xr = x + m * K;
  const float* wp = w + (n / 16) * K * 16 + n % 16;
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc = fmaf(xr[k], wp[k * 16], acc);
  out[item] = acc + (bias ? bias[n] : 0.f);
}

at::Tensor packed_linear_cuda(const at::Tensor& x_in, const at::Tensor& packed_in,
                              const std::optional<at::Tensor>& bias_in, int64_t n) {
  check_packed_linear(x_in, packed_in, bias_in, n);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), packed = packed_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return out;
  const int64_t blocks = (M * n + kThreads - 1) / kThreads;
  packed_linear_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), packed.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr,
      out.data_ptr<float>(), M, n, K);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CUDA, m) {
  m.impl("packed_linear", &packed_linear_cuda);
}

}  // namespace verl
