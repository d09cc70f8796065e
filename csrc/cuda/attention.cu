// CUDA kernel of one decode step's attention (contract in csrc/include/verl/attention.h).
//
// The fast decoder keeps SDPA's fused kernels on a GPU; this is the op's CUDA side for callers of
// verl.ops.decode_attention with CUDA tensors: a scores pass (one warp per cached position and query: lanes over
// head_dim, shuffled sum; -inf where masked) into a [B * H * G, T] scratch, then one block per query row: the
// softmax with block reductions, and the output with threads over head_dim reading each valid value row
// coalesced. Masked positions are never read in the output pass, so NaN in padding columns changes nothing.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "verl/attention.h"

namespace verl {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 256;

struct Strides {
  int64_t kb, kh, kt, vb, vh, vt;
};

__global__ void scores_kernel(const float* __restrict__ q, const float* __restrict__ k,
                              const bool* __restrict__ mask, float* __restrict__ s, int64_t H, int64_t G,
                              int64_t d, int64_t T, Strides st, float scale) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x;  // (b, h, g)
  const int64_t t = static_cast<int64_t>(blockIdx.y) * kWarps + (threadIdx.x >> 5);
  if (t >= T) return;
  const int64_t b = row / (H * G), h = (row / G) % H;
  if (!mask[b * T + t]) {
    if (lane == 0) s[row * T + t] = -INFINITY;
    return;
  }
  const float* qr = q + row * d;
  const float* kr = k + b * st.kb + h * st.kh + t * st.kt;
  float acc = 0.f;
  for (int64_t c = lane; c < d; c += 32) acc += qr[c] * kr[c];
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if (lane == 0) s[row * T + t] = acc * scale;
}

// A block-wide reduction (max or sum) of one value per thread; every thread gets the result.
template <bool kMax>
__device__ float block_reduce(float v, float* shared) {
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_down_sync(0xffffffffu, v, off);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // `shared` may still be read by a previous reduction
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? shared[lane] : (kMax ? -INFINITY : 0.f);
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_down_sync(0xffffffffu, v, off);
    v = kMax ? fmaxf(v, o) : v + o;
  }
  return __shfl_sync(0xffffffffu, v, 0);
}

__global__ void softmax_output_kernel(float* __restrict__ s, const float* __restrict__ v,
                                      const bool* __restrict__ mask, float* __restrict__ out, int64_t H,
                                      int64_t G, int64_t d, int64_t T, Strides st) {
  __shared__ float shared[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int64_t b = row / (H * G), h = (row / G) % H;
  float* sr = s + row * T;
  float mx = -INFINITY;
  for (int64_t t = threadIdx.x; t < T; t += kThreads) mx = fmaxf(mx, sr[t]);
  mx = block_reduce<true>(mx, shared);
  float* o = out + row * d;
  if (mx == -INFINITY) {  // no valid position: zeros
    for (int64_t c = threadIdx.x; c < d; c += kThreads) o[c] = 0.f;
    return;
  }
  float sum = 0.f;
  for (int64_t t = threadIdx.x; t < T; t += kThreads) {
    const float p = mask[b * T + t] ? expf(sr[t] - mx) : 0.f;
    sr[t] = p;
    sum += p;
  }
  sum = block_reduce<false>(sum, shared);
  __syncthreads();  // every p written before any thread reads them
  const float inv = 1.f / sum;
  const float* vh = v + b * st.vb + h * st.vh;
  for (int64_t c = threadIdx.x; c < d; c += kThreads) {
    float acc = 0.f;
    for (int64_t t = 0; t < T; ++t)
      if (mask[b * T + t]) acc += sr[t] * vh[t * st.vt + c];
    o[c] = acc * inv;
  }
}

at::Tensor decode_attention_cuda(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& mask_in, double scale) {
  check_decode_attention(q_in, k, v, mask_in);
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = q_in.contiguous(), mask = mask_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), d = q.size(3), T = k.size(2);
  at::Tensor out = at::empty_like(q);
  if (q.numel() == 0) return out;
  if (T == 0) return out.zero_();
  at::Tensor s = at::empty({B * H * G, T}, q.options());
  const Strides st{k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)};
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(B * H * G), static_cast<unsigned>((T + kWarps - 1) / kWarps));
  scores_kernel<<<grid, kWarps * 32, 0, stream>>>(q.data_ptr<float>(), k.data_ptr<float>(), mask.data_ptr<bool>(),
                                                  s.data_ptr<float>(), H, G, d, T, st, static_cast<float>(scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  softmax_output_kernel<<<static_cast<unsigned>(B * H * G), kThreads, 0, stream>>>(
      s.data_ptr<float>(), v.data_ptr<float>(), mask.data_ptr<bool>(), out.data_ptr<float>(), H, G, d, T, st);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CUDA, m) {
  m.impl("decode_attention", &decode_attention_cuda);
}

}  // namespace verl
