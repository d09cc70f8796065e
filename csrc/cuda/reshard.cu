// CUDA kernels of the reshard copies: bucket pack / unpack and the gather-and-permute of weight blocks.
//
// Each op is lowered on the host to a table of byte runs (csrc/include/verl/reshard.h); ONE kernel launch
// then copies every run: blockIdx.y walks the runs, the threads of blockIdx.x stride over the bytes with
// 16-byte vector loads when source, destination and length allow it (every bf16/fp32 weight row of a
// real model does), bytes otherwise. One launch per bucket instead of one cudaMemcpy per slice is what
// keeps a layer's hundreds of QKV/gate-up blocks from being launch-bound.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "verl/reshard.h"

namespace verl {
namespace {

struct DeviceRun {
  const char* src;
  char* dst;
  long long nbytes;
};

__global__ void copy_runs_kernel(const DeviceRun* __restrict__ runs, int64_t n_runs) {
  for (int64_t r = blockIdx.y; r < n_runs; r += gridDim.y) {
    const DeviceRun run = runs[r];
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    const bool vec = ((reinterpret_cast<uintptr_t>(run.src) | reinterpret_cast<uintptr_t>(run.dst) |
                       static_cast<uintptr_t>(run.nbytes)) & 15) == 0;
    if (vec) {
      const uint4* s = reinterpret_cast<const uint4*>(run.src);
      uint4* d = reinterpret_cast<uint4*>(run.dst);
      const long long n = run.nbytes / 16;
      for (long long i = tid; i < n; i += stride) d[i] = s[i];
    } else {
      for (long long i = tid; i < run.nbytes; i += stride) run.dst[i] = run.src[i];
    }
  }
}

void copy_runs(const std::vector<ByteRun>& runs, const at::Device& device) {
  if (runs.empty()) return;
  const int64_t n = static_cast<int64_t>(runs.size());
  at::Tensor host = at::empty({n * 3}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = host.data_ptr<int64_t>();
  long long max_bytes = 0;
  for (int64_t i = 0; i < n; ++i) {
    h[3 * i] = reinterpret_cast<int64_t>(runs[i].src);
    h[3 * i + 1] = reinterpret_cast<int64_t>(runs[i].dst);
    h[3 * i + 2] = runs[i].nbytes;
    max_bytes = std::max<long long>(max_bytes, runs[i].nbytes);
  }
  at::Tensor table = host.to(device, /*non_blocking=*/true);
  auto stream = at::cuda::getCurrentCUDAStream();
  constexpr int kThreads = 256;
  const long long words = (max_bytes + 15) / 16;
  const unsigned gx = static_cast<unsigned>(std::min<long long>((words + kThreads - 1) / kThreads, 1024));
  const unsigned gy = static_cast<unsigned>(std::min<int64_t>(n, 65535));
  copy_runs_kernel<<<dim3(std::max(gx, 1u), gy), kThreads, 0, stream>>>(
      reinterpret_cast<const DeviceRun*>(table.data_ptr<int64_t>()), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // `host` may be freed now: the pinned allocator keeps it alive until the non-blocking copy is done, and
  // `table` returns to the caching allocator stream-ordered, after the kernel.
}

at::Tensor pack_cuda(at::TensorList tensors) {
  check_same_dtype_device(tensors, "reshard_pack", "tensors");
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  at::Tensor flat;
  copy_runs(pack_runs(tensors, flat), tensors[0].device());
  return flat;
}

std::vector<at::Tensor> unpack_cuda(const at::Tensor& flat_in, at::IntArrayRef shapes, at::IntArrayRef ndims) {
  auto out_shapes = unpack_shapes(flat_in, shapes, ndims);
  const c10::cuda::CUDAGuard guard(flat_in.device());
  at::Tensor flat = flat_in.contiguous();
  std::vector<at::Tensor> outs;
  copy_runs(unpack_runs(flat, out_shapes, outs), flat.device());
  return outs;
}

at::Tensor gather_cuda(at::TensorList sources, const at::Tensor& plan, int64_t dim, at::IntArrayRef out_shape) {
  auto g = check_gather(sources, plan, dim, out_shape);
  const c10::cuda::CUDAGuard guard(sources[0].device());
  std::vector<at::Tensor> srcs;
  srcs.reserve(sources.size());
  for (const auto& s : sources) srcs.push_back(s.contiguous());
  at::Tensor out = at::empty(out_shape, sources[0].options());
  if (out.numel() == 0) return out;
  copy_runs(gather_runs(srcs, plan, dim, g, out), out.device());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CUDA, m) {
  m.impl("reshard_pack", &pack_cuda);
  m.impl("reshard_unpack", &unpack_cuda);
  m.impl("reshard_gather", &gather_cuda);
}

}  // namespace verl
