// CUDA kernel of the int8 weight-only linear (contract in csrc/include/verl/int8_linear.h).
//
// One warp per output element: its lanes stride over K with 4-byte loads of the int8 row (4 weights each,
// when K and the row start allow it), accumulate in float32 and reduce with shuffles; the scale and bias are
// applied once. Decode shapes (a few rows x thousands of outputs) give enough warps to fill the GPU, and each
// weight byte is read once per activation row from L2 at worst. A GPU run with fp8 goes through vLLM's
// quantized loading instead (rollout.quantization=fp8); this kernel serves the torch engine's int8 on CUDA.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>

#include "verl/int8_linear.h"

namespace verl {
namespace {

constexpr int kWarps = 8;

__global__ void int8_linear_kernel(const float* __restrict__ x, const int8_t* __restrict__ w,
                                   const float* __restrict__ scale, const float* __restrict__ bias,
                                   float* __restrict__ out, int64_t M, int64_t N, int64_t K, bool vec4) {
  const int lane = threadIdx.x & 31;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (item >= M * N) return;
  const int64_t m = item / N, n = item % N;
  const float* xr = x + m * K;
  const int8_t* wr = w + n * K;
  float acc = 0.f;
  if (vec4) {
    const char4* w4 = reinterpret_cast<const char4*>(wr);
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    for (int64_t k = lane; k < K / 4; k += 32) {
      const char4 q = w4[k];
      const float4 v = x4[k];
      acc += v.x * q.x + v.y * q.y + v.z * q.z + v.w * q.w;
    }
  } else {
    for (int64_t k = lane; k < K; k += 32) acc += xr[k] * static_cast<float>(wr[k]);
  }
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if (lane == 0) out[m * N + n] = acc * scale[n] + (bias ? bias[n] : 0.f);
}

at::Tensor int8_linear_cuda(const at::Tensor& x_in, const at::Tensor& qweight_in, const at::Tensor& scale_in,
                            const std::optional<at::Tensor>& bias_in) {
  check_int8_linear(x_in, qweight_in, scale_in, bias_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), qweight = qweight_in.contiguous(), scale = scale_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // float4 / char4 loads need every row to start 16- / 4-byte aligned: K % 4 == 0 (contiguous, fresh storage)
  const bool vec4 = K % 4 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 4 == 0;
  const int64_t blocks = (M * N + kWarps - 1) / kWarps;
  int8_linear_kernel<<<static_cast<unsigned>(blocks), kWarps * 32, 0, at::cuda::getCurrentCUDAStream()>>>(
      x.data_ptr<float>(), qweight.data_ptr<int8_t>(), scale.data_ptr<float>(),
      bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr<float>(), M, N, K, vec4);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CUDA, m) {
  m.impl("int8_linear", &int8_linear_cuda);
}

}  // namespace verl
