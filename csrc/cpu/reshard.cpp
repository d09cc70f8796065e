// CPU kernels of the reshard copies: bucket pack / unpack and the gather-and-permute of weight blocks.
//
// Every op is lowered to byte runs (csrc/include/verl/reshard.h) and the runs are copied in parallel with
// memcpy: the copies are bit-exact for any dtype, and the large runs of a weight bucket keep each thread
// on long sequential streams. Non-contiguous inputs of reshard_pack go through ATen's strided copy
// straight into the bucket (no temporary).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "verl/reshard.h"

namespace verl {
namespace {

// Runs are split into chunks of at most this many bytes so that one huge run still spreads over threads.
constexpr int64_t kChunkBytes = 1 << 20;

void copy_runs(const std::vector<ByteRun>& runs) {
  std::vector<ByteRun> chunks;
  chunks.reserve(runs.size());
  for (const auto& r : runs) {
    for (int64_t off = 0; off < r.nbytes; off += kChunkBytes) {
      chunks.push_back({r.src + off, r.dst + off, std::min(kChunkBytes, r.nbytes - off)});
    }
  }
  const int64_t n = static_cast<int64_t>(chunks.size());
  // A chunk is ~1 MiB of memcpy: one chunk per task is already coarse enough to amortise the scheduling.
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(chunks[i].dst, chunks[i].src, chunks[i].nbytes);
  });
}

at::Tensor pack_cpu(at::TensorList tensors) {
  check_same_dtype_device(tensors, "reshard_pack", "tensors");
  at::Tensor flat;
  copy_runs(pack_runs(tensors, flat));
  return flat;
}

std::vector<at::Tensor> unpack_cpu(const at::Tensor& flat_in, at::IntArrayRef shapes, at::IntArrayRef ndims) {
  auto out_shapes = unpack_shapes(flat_in, shapes, ndims);
  at::Tensor flat = flat_in.contiguous();
  std::vector<at::Tensor> outs;
  copy_runs(unpack_runs(flat, out_shapes, outs));
  return outs;
}

at::Tensor gather_cpu(at::TensorList sources, const at::Tensor& plan, int64_t dim, at::IntArrayRef out_shape) {
  auto g = check_gather(sources, plan, dim, out_shape);
  std::vector<at::Tensor> srcs;
  srcs.reserve(sources.size());
  for (const auto& s : sources) srcs.push_back(s.contiguous());
  at::Tensor out = at::empty(out_shape, sources[0].options());
  if (out.numel() == 0) return out;
  copy_runs(gather_runs(srcs, plan, dim, g, out));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(verl, CPU, m) {
  m.impl("reshard_pack", &pack_cpu);
  m.impl("reshard_unpack", &unpack_cpu);
  m.impl("reshard_gather", &gather_cpu);
}

}  // namespace verl
