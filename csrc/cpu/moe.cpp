// CPU kernels of the mixture-of-experts token dispatch (driver and conventions: csrc/include/verl/moe.h).
//
// route_index is a parallel stable counting sort: the tokens are cut into chunks, each chunk counts its
// (token, slot) pairs per expert, an exclusive scan over (expert, chunk) gives every chunk its first row per
// expert, and each chunk then places its pairs in token order. Rows are moved with memcpy (unscaled) or one
// multiply-add pass per row, parallel over destination rows, so every output row is written by one thread.
//
// The outputs are large (T*K rows of the hidden size) and written right after they are allocated, so the first
// touch of their pages is a good part of the cost: on Linux they are advised to transparent huge pages first,
// which turns 512 page faults into one (a 32 MiB buffer is written 3-4x faster where the system leaves THP to
// madvise, measured; PyTorch's own allocator does the same for every tensor when THP_MEM_ALLOC_ENABLE=1).
//
// float32 rows go through small row functions compiled for AVX2+FMA and baseline x86-64 (VERL_SIMD_CLONES):
// a scaled copy, a scaled add, and a dot product with four vector accumulators (a single running sum is one
// dependent add per element, which made the probs gradient compute-bound: moe_unpermute_backward took 123 ms
// with it and 79 ms with these at 16384 x 2048, top-2, one thread).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "verl/cpu_math.h"
#include "verl/moe.h"

namespace verl {
namespace {

// Pairs per chunk of the counting sort: large enough that a chunk's histogram row is cheap next to its pairs.
constexpr int64_t kPairsPerChunk = 1 << 14;

// Advises the whole 2 MiB pages inside `t`'s buffer to be backed by transparent huge pages (before first touch).
void advise_huge_pages(const at::Tensor& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t lo = (p + kHuge - 1) & ~(kHuge - 1), hi = (p + t.nbytes()) & ~(kHuge - 1);
  if (hi >= lo + 2 * kHuge) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // a hint: errors ignored
#else
  (void)t;
#endif
}

// Row helpers: o = s * x, o += s * x and <a, b>, computed in the accumulation type A (float for float / half /
// bfloat16 rows, double for double). The float32 overloads are the SIMD clones below.
template <typename O, typename X, typename A>
void scale_row(O* o, const X* x, A s, int64_t n) {
  for (int64_t h = 0; h < n; ++h) o[h] = static_cast<O>(s * static_cast<A>(x[h]));
}
template <typename A, typename X>
void add_scaled_row(A* o, const X* x, A s, int64_t n) {
  for (int64_t h = 0; h < n; ++h) o[h] += s * static_cast<A>(x[h]);
}
template <typename X, typename A = at::opmath_type<X>>
A dot_row(const X* a, const X* b, int64_t n) {
  A dot = 0;
  for (int64_t h = 0; h < n; ++h) dot += static_cast<A>(a[h]) * static_cast<A>(b[h]);
  return dot;
}

VERL_SIMD_CLONES void scale_row(float* o, const float* x, float s, int64_t n) {
  for (int64_t h = 0; h < n; ++h) o[h] = s * x[h];
}
VERL_SIMD_CLONES void add_scaled_row(float* o, const float* x, float s, int64_t n) {
  for (int64_t h = 0; h < n; ++h) o[h] += s * x[h];
}
// Four 8-lane accumulators, so consecutive adds do not wait on each other.
VERL_SIMD_CLONES float dot_row(const float* a, const float* b, int64_t n) {
  vf8 acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {}, va, vb;
  int64_t h = 0;
  for (; h + 32 <= n; h += 32) {
    load_vf8(va, a + h), load_vf8(vb, b + h), acc0 += va * vb;
    load_vf8(va, a + h + 8), load_vf8(vb, b + h + 8), acc1 += va * vb;
    load_vf8(va, a + h + 16), load_vf8(vb, b + h + 16), acc2 += va * vb;
    load_vf8(va, a + h + 24), load_vf8(vb, b + h + 24), acc3 += va * vb;
  }
  for (; h + 8 <= n; h += 8) load_vf8(va, a + h), load_vf8(vb, b + h), acc0 += va * vb;
  acc0 = (acc0 + acc1) + (acc2 + acc3);
  float dot = hsum(acc0);
  for (; h < n; ++h) dot += a[h] * b[h];
  return dot;
}

struct CpuKernels {
  static void route_index(const at::Tensor& ids_t, int64_t num_experts, at::Tensor& dst_t, at::Tensor& src_t,
                          at::Tensor& counts_t) {
    const int64_t T = ids_t.size(0), K = ids_t.size(1), E = num_experts;
    const int64_t* ids = ids_t.data_ptr<int64_t>();
    std::atomic<int64_t> bad{-1};
    const int64_t tok_per_chunk = std::max<int64_t>(1, kPairsPerChunk / std::max<int64_t>(K, 1));
    const int64_t chunks = (T + tok_per_chunk - 1) / tok_per_chunk;
    std::vector<int64_t> hist(static_cast<size_t>(chunks * E), 0);
    at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        int64_t* row = hist.data() + c * E;
        const int64_t end = std::min(T, (c + 1) * tok_per_chunk) * K;
        for (int64_t i = c * tok_per_chunk * K; i < end; ++i) {
          const int64_t x = ids[i];
          if (x < 0 || x >= E) {
            int64_t expected = -1;
            bad.compare_exchange_strong(expected, i);
            continue;
          }
          ++row[x];
        }
      }
    });
    const int64_t first_bad = bad.load();
    if (first_bad >= 0) {
      TORCH_CHECK(false, "moe_permute: `expert_ids`[", first_bad / K, ", ", first_bad % K, "] = ", ids[first_bad],
                  " is not an expert in [0, ", E, ")");
    }
    int64_t* counts = counts_t.data_ptr<int64_t>();
    int64_t run = 0;
    for (int64_t x = 0; x < E; ++x) {
      const int64_t start = run;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t n = hist[c * E + x];
        hist[c * E + x] = run;
        run += n;
      }
      counts[x] = run - start;
    }
    int64_t* dst = dst_t.data_ptr<int64_t>();
    int64_t* src = src_t.data_ptr<int64_t>();
    at::parallel_for(0, chunks, 1, [&](int64_t b, int64_t e) {
      for (int64_t c = b; c < e; ++c) {
        int64_t* cursor = hist.data() + c * E;
        const int64_t t_end = std::min(T, (c + 1) * tok_per_chunk);
        for (int64_t t = c * tok_per_chunk; t < t_end; ++t) {
          for (int64_t k = 0; k < K; ++k) {
            const int64_t p = cursor[ids[t * K + k]]++;
            dst[t * K + k] = p;
            src[p] = t;
          }
        }
      }
    });
  }

  static void gather_rows(const at::Tensor& x, const at::Tensor& src_t, const at::Tensor& scale, at::Tensor& out) {
    const int64_t n = out.size(0), H = out.size(1);
    const int64_t* src = src_t.data_ptr<int64_t>();
    const int64_t grain = std::max<int64_t>(1, 16384 / H);
    advise_huge_pages(out);
    if (!scale.defined()) {  // a byte copy per row: exact for every dtype
      const int64_t row_bytes = H * x.element_size();
      const char* xs = static_cast<const char*>(x.data_ptr());
      char* os = static_cast<char*>(out.data_ptr());
      at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
        for (int64_t p = b; p < e; ++p) std::memcpy(os + p * row_bytes, xs + src[p] * row_bytes, row_bytes);
      });
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_gather_rows", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* xs = x.data_ptr<scalar_t>();
      const acc_t* w = scale.data_ptr<acc_t>();
      scalar_t* os = out.data_ptr<scalar_t>();
      at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
        for (int64_t p = b; p < e; ++p) {
          scale_row(os + p * H, xs + src[p] * H, w[p], H);
        }
      });
    });
  }

  static void combine_rows(const at::Tensor& x, const at::Tensor& dst_t, const at::Tensor& weights, at::Tensor& out) {
    const int64_t T = out.size(0), H = out.size(1), K = dst_t.size(1);
    const int64_t* dst = dst_t.data_ptr<int64_t>();
    advise_huge_pages(out);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_combine_rows", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* xs = x.data_ptr<scalar_t>();
      const acc_t* w = weights.defined() ? weights.data_ptr<acc_t>() : nullptr;
      scalar_t* os = out.data_ptr<scalar_t>();
      constexpr bool kSame = std::is_same_v<scalar_t, acc_t>;  // then the sums go straight into the output row
      at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(H * K, 1)), [&](int64_t b, int64_t e) {
        std::vector<acc_t> buf(kSame ? 0 : static_cast<size_t>(H));
        for (int64_t t = b; t < e; ++t) {
          scalar_t* o = os + t * H;
          acc_t* acc = kSame ? reinterpret_cast<acc_t*>(o) : buf.data();
          if (K == 0) std::fill(acc, acc + H, acc_t(0));
          for (int64_t k = 0; k < K; ++k) {
            const scalar_t* in = xs + dst[t * K + k] * H;
            const acc_t s = w ? w[t * K + k] : acc_t(1);
            if (k == 0) scale_row(acc, in, s, H);
            else add_scaled_row(acc, in, s, H);
          }
          if (!kSame) for (int64_t h = 0; h < H; ++h) o[h] = static_cast<scalar_t>(acc[h]);
        }
      });
    });
  }

  static void combine_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& dst_t,
                               at::Tensor& grad_w) {
    const int64_t T = grad.size(0), H = grad.size(1), K = dst_t.size(1);
    const int64_t* dst = dst_t.data_ptr<int64_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "moe_combine_backward", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* g = grad.data_ptr<scalar_t>();
      const scalar_t* xs = x.data_ptr<scalar_t>();
      acc_t* gw = grad_w.data_ptr<acc_t>();
      at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(H * K, 1)), [&](int64_t b, int64_t e) {
        for (int64_t t = b; t < e; ++t) {
          const scalar_t* gt = g + t * H;
          for (int64_t k = 0; k < K; ++k) gw[t * K + k] = dot_row(gt, xs + dst[t * K + k] * H, H);
        }
      });
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(verl, CPU, m) {
  m.impl("moe_permute", &moe::permute<CpuKernels>);
  m.impl("moe_unpermute", &moe::unpermute<CpuKernels>);
  m.impl("moe_unpermute_backward", &moe::unpermute_backward<CpuKernels>);
}

}  // namespace verl
