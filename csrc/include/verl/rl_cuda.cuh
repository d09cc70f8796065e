// CUDA helpers of the RL kernel policies (csrc/cuda/rl_advantage.cu, csrc/cuda/rl_loss.cu): launch sizes, the
// block-wide double sum, and loads in the dtype's math type.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

namespace verl {
namespace rl {

constexpr int kThreads = 256;

// Blocks of a grid-stride loop over n elements: enough to fill every SM several times, no more.
inline int grid_for(int64_t n) {
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

}  // namespace rl
}  // namespace verl
