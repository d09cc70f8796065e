// CUDA kernels of the mixture-of-experts token dispatch (driver and conventions: csrc/include/verl/moe.h).
//
// route_index is a stable counting sort in three launches, with no host synchronisation:
//   1. per tile of kTile (token, slot) pairs: each pair's rank among the tile's earlier pairs of the same expert
//      (read from shared memory) and the tile's count per expert;
//   2. one block turns the [tiles, E] counts into each tile's first row per expert: expert-major totals, an
//      exclusive scan over experts, then a running sum over tiles;
//   3. every pair's row = its tile's first row of its expert + its rank: dst_of and src_of.
// Moving rows: one block per destination row, threads along the hidden dim (16-byte words for unscaled copies of
// aligned rows); combining: one block per token summing its K rows; the weight gradient: one block per pair.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "verl/moe.h"

namespace verl {
namespace {

constexpr int kTile = 256;
constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

__global__ void tile_count_kernel(const int64_t* __restrict__ ids, int64_t n, int64_t num_experts,
                                  int32_t* __restrict__ rank, int64_t* __restrict__ tile_counts) {
  extern __shared__ int shared[];  // [kTile] ids of the tile, then [num_experts] counts
  int* tile_ids = shared;
  int* counts = shared + kTile;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kTile;
  const int i = threadIdx.x;
  for (int64_t e = i; e < num_experts; e += blockDim.x) counts[e] = 0;
  int id = -1;
  if (base + i < n) {
    const int64_t x = ids[base + i];
    CUDA_KERNEL_ASSERT(x >= 0 && x < num_experts && "moe_permute: an expert id is outside [0, num_experts)");
    id = static_cast<int>(x);
  }
  tile_ids[i] = id;
  __syncthreads();
  if (id >= 0) {
    int r = 0;
    for (int j = 0; j < i; ++j) r += tile_ids[j] == id;
    rank[base + i] = r;
    atomicAdd(&counts[id], 1);
  }
  __syncthreads();
  for (int64_t e = i; e < num_experts; e += blockDim.x) tile_counts[blockIdx.x * num_experts + e] = counts[e];
}

// One block: tile_counts [tiles, E] -> each tile's first row per expert (in place); counts [E] = totals.
__global__ void tile_offsets_kernel(int64_t* __restrict__ tile_counts, int64_t tiles, int64_t num_experts,
                                    int64_t* __restrict__ counts) {
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int64_t total = 0;
    for (int64_t t = 0; t < tiles; ++t) total += tile_counts[t * num_experts + e];
    counts[e] = total;
  }
  __syncthreads();
  __shared__ int64_t first_of_chunk[kThreads];
  // exclusive scan of the totals over experts: thread c sums its contiguous chunk of experts
  const int64_t chunk = (num_experts + blockDim.x - 1) / blockDim.x;
  const int64_t e0 = threadIdx.x * chunk, e1 = min(num_experts, e0 + chunk);
  int64_t local = 0;
  for (int64_t e = e0; e < e1; ++e) local += counts[e];
  first_of_chunk[threadIdx.x] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t run = 0;
    for (int c = 0; c < static_cast<int>(blockDim.x); ++c) {
      const int64_t v = first_of_chunk[c];
      first_of_chunk[c] = run;
      run += v;
    }
  }
  __syncthreads();
  int64_t run = first_of_chunk[threadIdx.x];
  for (int64_t e = e0; e < e1; ++e) {
    const int64_t start = run;
    run += counts[e];
    int64_t r = start;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t c = tile_counts[t * num_experts + e];
      tile_counts[t * num_experts + e] = r;
      r += c;
    }
  }
}

__global__ void assign_kernel(const int64_t* __restrict__ ids, const int32_t* __restrict__ rank, int64_t n,
                              int64_t top_k, int64_t num_experts, const int64_t* __restrict__ tile_first,
                              int64_t* __restrict__ dst, int64_t* __restrict__ src) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kTile + threadIdx.x;
  if (i >= n) return;
  const int64_t p = tile_first[blockIdx.x * num_experts + ids[i]] + rank[i];
  dst[i] = p;
  src[p] = i / top_k;
}

__global__ void copy_rows_kernel(const char* __restrict__ x, const int64_t* __restrict__ src, int64_t rows,
                                 int64_t row_bytes, char* __restrict__ out) {
  const bool vec = ((reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out) |
                     static_cast<uintptr_t>(row_bytes)) & 15) == 0;
  for (int64_t p = blockIdx.x; p < rows; p += gridDim.x) {
    const char* in = x + src[p] * row_bytes;
    char* o = out + p * row_bytes;
    if (vec) {
      const uint4* s = reinterpret_cast<const uint4*>(in);
      uint4* d = reinterpret_cast<uint4*>(o);
      for (int64_t w = threadIdx.x; w < row_bytes / 16; w += blockDim.x) d[w] = s[w];
    } else {
      for (int64_t b = threadIdx.x; b < row_bytes; b += blockDim.x) o[b] = in[b];
    }
  }
}

template <typename scalar_t, typename acc_t>
__global__ void scale_rows_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ src,
                                  const acc_t* __restrict__ scale, int64_t rows, int64_t H,
                                  scalar_t* __restrict__ out) {
  for (int64_t p = blockIdx.x; p < rows; p += gridDim.x) {
    const scalar_t* in = x + src[p] * H;
    const acc_t s = scale[p];
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      out[p * H + h] = static_cast<scalar_t>(s * static_cast<acc_t>(in[h]));
    }
  }
}

template <typename scalar_t, typename acc_t>
__global__ void combine_rows_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ dst,
                                    const acc_t* __restrict__ w, int64_t T, int64_t K, int64_t H,
                                    scalar_t* __restrict__ out) {
  for (int64_t t = blockIdx.x; t < T; t += gridDim.x) {
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) {
      acc_t acc = 0;
      for (int64_t k = 0; k < K; ++k) {
        const acc_t s = w == nullptr ? acc_t(1) : w[t * K + k];
        acc += s * static_cast<acc_t>(x[dst[t * K + k] * H + h]);
      }
      out[t * H + h] = static_cast<scalar_t>(acc);
    }
  }
}

template <typename acc_t>
__device__ acc_t block_sum(acc_t v) {
  __shared__ acc_t warps[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warps[warp] = v;
  __syncthreads();
  v = threadIdx.x < (blockDim.x + 31) / 32 ? warps[lane] : acc_t(0);
  if (warp == 0) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  __syncthreads();
  return v;
}

template <typename scalar_t, typename acc_t>
__global__ void combine_backward_kernel(const scalar_t* __restrict__ g, const scalar_t* __restrict__ x,
                                        const int64_t* __restrict__ dst, int64_t pairs, int64_t K, int64_t H,
                                        acc_t* __restrict__ gw) {
  for (int64_t i = blockIdx.x; i < pairs; i += gridDim.x) {
    const scalar_t* gt = g + (i / K) * H;
    const scalar_t* in = x + dst[i] * H;
    acc_t dot = 0;
    for (int64_t h = threadIdx.x; h < H; h += blockDim.x) dot += static_cast<acc_t>(gt[h]) * static_cast<acc_t>(in[h]);
    dot = block_sum(dot);
    if (threadIdx.x == 0) gw[i] = dot;
  }
}

unsigned grid_for(int64_t n) { return static_cast<unsigned>(std::max<int64_t>(1, std::min(n, kMaxBlocks))); }

struct CudaKernels {
  static void route_index(const at::Tensor& ids, int64_t num_experts, at::Tensor& dst, at::Tensor& src,
                          at::Tensor& counts) {
    const c10::cuda::CUDAGuard guard(ids.device());
    auto stream = at::cuda::getCurrentCUDAStream();
    const int64_t n = ids.numel(), tiles = (n + kTile - 1) / kTile;
    TORCH_CHECK(tiles <= INT32_MAX, "moe_permute: too many (token, slot) pairs for one launch: ", n);
    at::Tensor rank = at::empty({n}, ids.options().dtype(at::kInt));
    at::Tensor tile_counts = at::empty({tiles, num_experts}, ids.options());
    const size_t shared = (kTile + num_experts) * sizeof(int);
    TORCH_CHECK(shared <= 48 * 1024, "moe_permute: ", num_experts, " experts need more shared memory per block than ",
                "the kernel takes (at most ", 48 * 1024 / sizeof(int) - kTile, " experts)");
    tile_count_kernel<<<static_cast<unsigned>(tiles), kTile, shared, stream>>>(
        ids.data_ptr<int64_t>(), n, num_experts, rank.data_ptr<int32_t>(), tile_counts.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    tile_offsets_kernel<<<1, kThreads, 0, stream>>>(tile_counts.data_ptr<int64_t>(), tiles, num_experts,
                                                    counts.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    assign_kernel<<<static_cast<unsigned>(tiles), kTile, 0, stream>>>(
        ids.data_ptr<int64_t>(), rank.data_ptr<int32_t>(), n, ids.size(1), num_experts,
        tile_counts.data_ptr<int64_t>(), dst.data_ptr<int64_t>(), src.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  static void gather_rows(const at::Tensor& x, const at::Tensor& src, const at::Tensor& scale, at::Tensor& out) {
    const c10::cuda::CUDAGuard guard(x.device());
    auto stream = at::cuda::getCurrentCUDAStream();
    const int64_t rows = out.size(0), H = out.size(1);
    if (!scale.defined()) {
      copy_rows_kernel<<<grid_for(rows), kThreads, 0, stream>>>(static_cast<const char*>(x.data_ptr()),
                                                               src.data_ptr<int64_t>(), rows, H * x.element_size(),
                                                               static_cast<char*>(out.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_gather_rows", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      scale_rows_kernel<scalar_t, acc_t><<<grid_for(rows), kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), src.data_ptr<int64_t>(), scale.data_ptr<acc_t>(), rows, H, out.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  static void combine_rows(const at::Tensor& x, const at::Tensor& dst, const at::Tensor& w, at::Tensor& out) {
    const c10::cuda::CUDAGuard guard(x.device());
    auto stream = at::cuda::getCurrentCUDAStream();
    const int64_t T = out.size(0), H = out.size(1), K = dst.size(1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_combine_rows", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      combine_rows_kernel<scalar_t, acc_t><<<grid_for(T), kThreads, 0, stream>>>(
          x.data_ptr<scalar_t>(), dst.data_ptr<int64_t>(), w.defined() ? w.data_ptr<acc_t>() : nullptr, T, K, H,
          out.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  static void combine_backward(const at::Tensor& g, const at::Tensor& x, const at::Tensor& dst, at::Tensor& gw) {
    const c10::cuda::CUDAGuard guard(x.device());
    auto stream = at::cuda::getCurrentCUDAStream();
    const int64_t pairs = dst.numel(), K = dst.size(1), H = g.size(1);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_combine_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      combine_backward_kernel<scalar_t, acc_t><<<grid_for(pairs), kThreads, 0, stream>>>(
          g.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), dst.data_ptr<int64_t>(), pairs, K, H, gw.data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(verl, CUDA, m) {
  m.impl("moe_permute", &moe::permute<CudaKernels>);
  m.impl("moe_unpermute", &moe::unpermute<CudaKernels>);
  m.impl("moe_unpermute_backward", &moe::unpermute_backward<CudaKernels>);
}

}  // namespace verl
